"""Unit tests of the Redactor: each encoding, wrapped and embedded forms, patterns, structures, log sinks."""

from __future__ import annotations

import base64
import io
import json
import logging
import re
from urllib.parse import quote, quote_plus

import pytest
import structlog

from tether_security.logs import RedactingFilter, RedactingProcessor
from tether_security.redaction import Redactor, derived_forms, shannon_entropy

SECRET = "s3cr3t-Valu3/with+symbols&more=Ω"


@pytest.fixture
def redactor() -> Redactor:
    r = Redactor()
    assert r.add_secret(SECRET)
    return r


@pytest.mark.parametrize("encode", [
    lambda v: v,
    lambda v: json.dumps(v)[1:-1],
    lambda v: json.dumps(v, ensure_ascii=False)[1:-1],
    lambda v: quote(v, safe=""),
    lambda v: quote_plus(v),
    lambda v: re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), quote(v, safe="")),
    lambda v: v.encode().hex(),
    lambda v: v.encode().hex().upper(),
    lambda v: base64.b64encode(v.encode()).decode(),
    lambda v: base64.b64encode(v.encode()).decode().rstrip("="),
    lambda v: base64.urlsafe_b64encode(v.encode()).decode(),
    lambda v: base64.urlsafe_b64encode(v.encode()).decode().rstrip("="),
], ids=["raw", "json", "json_utf8", "url", "url_plus", "url_lower", "hex", "HEX", "b64", "b64_nopad",
        "b64url", "b64url_nopad"])
def test_every_encoding_of_a_known_secret_is_redacted(redactor: Redactor, encode) -> None:
    encoded = encode(SECRET)
    out = redactor.redact(f"before {encoded} after")
    assert encoded not in out
    assert out.startswith("before ") and out.endswith(" after")
    assert "[REDACTED:secret]" in out


# Encoders that escape more than JSON requires (what a tool service may echo back in an error body).
ESCAPABLE = "Zq9/xT4+mW2&pL<8v>B7'nK3=\"`Ω"


def _hex_escapes(text: str, chars: str, upper: bool) -> str:
    for ch in chars:
        text = text.replace(ch, f"\\u{ord(ch):04X}" if upper else f"\\u{ord(ch):04x}")
    return text


def _go(v: str) -> str:  # encoding/json: & < > escaped, lower-case hex, non-ASCII raw
    return _hex_escapes(json.dumps(v, ensure_ascii=False)[1:-1], "&<>", upper=False)


def _gson(v: str) -> str:  # Gson's HTML-safe default: also = and '
    return _hex_escapes(json.dumps(v, ensure_ascii=False)[1:-1], "&<>='", upper=False)


def _php(v: str) -> str:  # json_encode's default: "/" as "\/", non-ASCII as lower-case \uXXXX
    return json.dumps(v)[1:-1].replace("/", "\\/")


def _php_hex(v: str) -> str:  # JSON_HEX_TAG|AMP|APOS|QUOT: those upper-case, non-ASCII still lower-case
    return _hex_escapes(_php(v).replace('\\"', '"'), "&<>'\"", upper=True)


def _dotnet(v: str) -> str:  # System.Text.Json's default encoder: upper-case hex, also + ` " and non-ASCII
    text = re.sub(r"\\u([0-9a-f]{4})", lambda m: "\\u" + m.group(1).upper(), json.dumps(v)[1:-1])
    return _hex_escapes(text.replace('\\"', '"'), "&<>'+`\"", upper=True)


@pytest.mark.parametrize("encode", [_go, _gson, _php, _php_hex, _dotnet], ids=["go", "gson", "php", "php_hex", "dotnet"])
def test_json_encoders_escaping_more_than_needed_do_not_hide_a_known_secret(encode) -> None:
    r = Redactor(patterns=False, entropy=False)
    assert r.add_secret(ESCAPABLE)
    encoded = encode(ESCAPABLE)
    assert encoded != json.dumps(ESCAPABLE)[1:-1] and encoded != ESCAPABLE
    out = r.redact(f'{{"status": 401, "detail": "invalid key \\"{encoded}\\" for /v1/charges"}}')
    assert out == '{"status": 401, "detail": "invalid key \\"[REDACTED:secret]\\" for /v1/charges"}'


@pytest.mark.parametrize("char", list("/&<>'=+"))
@pytest.mark.parametrize("upper", [False, True], ids=["lower", "upper"])
def test_each_escaped_character_alone_is_still_the_secret(char: str, upper: bool) -> None:
    secret = f"Ab3xK9{char}Qw7Zt2"
    r = Redactor(patterns=False, entropy=False)
    assert r.add_secret(secret)
    escaped = "\\/" if char == "/" else f"\\u{ord(char):04X}" if upper else f"\\u{ord(char):04x}"
    form = secret.replace(char, escaped)
    assert r.redact(f"tool said: {form}, retrying") == "tool said: [REDACTED:secret], retrying"


def test_a_401_echoing_the_header_with_escaped_slashes_is_redacted() -> None:
    r = Redactor()
    r.add_secret("Zq9/xT4+mW2pL8vB7nK3")
    detail = 'HTTP 401: {"error": "invalid api key \\"Zq9\\/xT4+mW2pL8vB7nK3\\""}'
    out = r.redact(detail)
    assert "mW2pL8vB7nK3" not in out and "Zq9" not in out
    assert out == 'HTTP 401: {"error": "invalid api key \\"[REDACTED:secret]\\""}'


def test_escape_forms_are_bounded_and_only_for_values_that_need_them() -> None:
    assert not any("\\" in f for f in derived_forms("Zq9xT4mW2pL8vB7nK3"))
    assert {f for f in derived_forms("Zq9/xT4mW2pL8vB7nK3") if "\\" in f} == {"Zq9\\/xT4mW2pL8vB7nK3"}
    # One form per encoder style and case, not one per subset of the escapable characters.
    assert len({f for f in derived_forms("a&b<c>d'e=f+g/h") if "\\" in f}) <= 24


@pytest.mark.parametrize("prefix_len", [0, 1, 2, 3, 4, 5])
def test_secret_inside_longer_base64_is_redacted_at_every_alignment(redactor: Redactor, prefix_len: int) -> None:
    blob = b"x" * prefix_len + json.dumps({"auth": SECRET}).encode() + b" trailing bytes"
    encoded = base64.b64encode(blob).decode()
    out = redactor.redact(f"payload={encoded}")
    assert encoded not in out
    # Whatever base64 survives must no longer decode to the secret at any alignment.
    survivors = out.replace("[REDACTED:secret]", " ").split()
    for word in survivors:
        for cut in range(4):
            chunk = word[cut:]
            chunk = chunk[: len(chunk) - len(chunk) % 4]
            try:
                assert SECRET.encode() not in base64.b64decode(chunk)
            except ValueError:
                pass


def test_secret_wrapped_across_lines_is_redacted_whole(redactor: Redactor) -> None:
    b64 = base64.b64encode((SECRET * 3).encode()).decode()
    wrapped = "\n".join(b64[i:i + 20] for i in range(0, len(b64), 20))
    out = redactor.redact(f"begin\n{wrapped}\nend")
    assert out.startswith("begin\n") and out.endswith("\nend")
    assert all(len(line) < 8 or line not in out for line in wrapped.splitlines()[1:-1])
    raw_split = SECRET[:10] + "\n" + SECRET[10:20] + "\n   " + SECRET[20:]
    out = redactor.redact("value:\n" + raw_split + "\ndone")
    assert SECRET[10:20] not in out and out.endswith("\ndone")


def test_short_values_are_refused_not_registered() -> None:
    r = Redactor()
    assert not r.add_secret("abc")
    assert r.secret_count == 0
    assert r.redact("abc is a word") == "abc is a word"


def test_multiline_secret_value_matches_when_logged_as_is() -> None:
    r = Redactor(patterns=False, entropy=False)
    pem = "-----BEGIN KEY-----\nAAAAbbbbCCCCdddd\nEEEEffff\n-----END KEY-----"
    r.add_secret(pem)
    assert r.redact(f"key:\n{pem}\n") == "key:\n[REDACTED:secret]\n"
    assert "AAAAbbbb" not in r.redact(json.dumps({"k": pem}))


@pytest.mark.parametrize(("text", "kind"), [
    ("id AKIAIOSFODNN7EXAMPLE used", "aws_access_key_id"),
    ("ghp_" + "a1B2c3D4e5" * 3 + "a1B2c3", "github_token"),
    ("github_pat_" + "11ABCDEFG0" * 4 + "_x", "github_token"),
    ("gho_" + "Z9y8X7w6V5" * 3 + "Z9y8X7", "github_token"),
    ("xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx", "slack_token"),
    ("sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc", "stripe_key"),
    ("rk_test_" + "4eC39HqLyjWDarjtT1zdp7dc", "stripe_key"),
    ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U", "jwt"),
    ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----", "private_key"),
    ("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC (truncated output", "private_key"),
    ("AIzaSyA-1234567890abcdefghijklmnopqrstu", "google_api_key"),
    ("curl -H 'Authorization: Bearer abcDEF123456.ghiJKL-789'", "bearer_token"),
    ("postgresql://app:hunter2hunter2@db:5432/app", "url_password"),
    ("DB_PASSWORD=correcthorse", "credential"),
    ('{"client_secret": "q8N2mZ7xL0pV"}', "credential"),
    ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "credential"),
    ("material 9b74c9897bac770ffc029102a200c5de9b74c9897bac770ffc029102a200c5de7f2a", "high_entropy_hex"),
    ("key material kJ8f2Lm9Qx4Zr7Tw1Yp3Vn6Bc0Hd5Gs2Ae8Uo4Ik", "high_entropy_base64"),
])
def test_secret_shaped_strings_are_redacted_by_kind(text: str, kind: str) -> None:
    out = Redactor().redact(text)
    assert f"[REDACTED:{kind}]" in out, out


@pytest.mark.parametrize(("text", "expected"), [
    ("redis://:pw@host:6379/0", "redis://:[REDACTED:url_password]@host:6379/0"),
    ("rediss://:pw@h", "rediss://:[REDACTED:url_password]@h"),
    ("REDIS_URL=redis://:s3cr3tpw@cache.internal:6380/2 ok",
     "REDIS_URL=redis://:[REDACTED:url_password]@cache.internal:6380/2 ok"),
    ("postgresql://app:hunter2@db:5432/app", "postgresql://app:[REDACTED:url_password]@db:5432/app"),
    ("amqp://guest:pa55w0rd@mq/vhost", "amqp://guest:[REDACTED:url_password]@mq/vhost"),
])
def test_url_passwords_are_redacted_with_or_without_a_user_name(text: str, expected: str) -> None:
    assert Redactor(entropy=False).redact(text) == expected


@pytest.mark.parametrize("text", [
    "event_id=9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "image@sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "checksum mismatch: expected 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "run 3fa85f64-5717-4562-b3fc-2c963f66afa6 started",
    "api_key=secret://openai/prod",
    "password: ${DB_PASSWORD}",
    "token: 512",
    "max_tokens=4096 input_tokens=1200",
    "password reset email sent",
    "cursor=" + base64.urlsafe_b64encode(b'{"after": "3fa85f64-5717-4562-b3fc-2c963f66afa6", "n": 50}').decode(),
    "/work/main/libs/security/src/tether_security/redaction.py",
])
def test_ordinary_log_content_is_left_alone(text: str) -> None:
    assert Redactor().redact(text) == text


def test_base64_of_text_holding_a_secret_is_redacted() -> None:
    encoded = base64.b64encode(b'{"user": "bob", "password": "Zq8mN2pX7vL0"}').decode()
    assert Redactor().redact(f"body={encoded}") == "body=[REDACTED:encoded_secret]"


def test_nested_structures_are_redacted_without_mutation(redactor: Redactor) -> None:
    event = {
        "event": f"called with {SECRET}",
        "headers": {"Authorization": "Bearer abcdefgh12345678", "X-Api-Key": "k-12345678", "Accept": "json"},
        "items": [SECRET, ("tuple", SECRET), 3, None, True],
        "password": "hunter22",
        "api_key": "secret://stripe/test",
        "token_count": 5,
    }
    snapshot = json.dumps(event, sort_keys=True)
    out = redactor.redact_value(event)
    assert json.dumps(event, sort_keys=True) == snapshot
    assert SECRET not in json.dumps(out, ensure_ascii=False)
    assert out["headers"]["Authorization"] == "[REDACTED:credential]"
    assert out["headers"]["X-Api-Key"] == "[REDACTED:credential]"
    assert out["headers"]["Accept"] == "json"
    assert out["password"] == "[REDACTED:credential]"
    assert out["api_key"] == "secret://stripe/test"  # a handle is not a secret
    assert out["token_count"] == 5
    assert out["items"][2:] == [3, None, True] and isinstance(out["items"][1], tuple)


def test_structlog_processor_redacts_every_event(redactor: Redactor) -> None:
    buf = io.StringIO()
    structlog.configure(
        processors=[structlog.processors.format_exc_info, RedactingProcessor(redactor),
                    structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(buf),
        cache_logger_on_first_use=False,
    )
    try:
        log = structlog.get_logger()
        log.info("tool output", stdout=f"key={SECRET}", nested={"list": [base64.b64encode(SECRET.encode()).decode()]})
        try:
            raise RuntimeError(f"failed with {SECRET}")
        except RuntimeError:
            log.exception("boom")
    finally:
        structlog.reset_defaults()
    text = buf.getvalue()
    assert SECRET not in text and base64.b64encode(SECRET.encode()).decode() not in text
    assert text.count("[REDACTED:secret]") >= 3


def test_logging_filter_redacts_message_args_extra_and_traceback(redactor: Redactor) -> None:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("%(message)s %(detail)s"))
    handler.addFilter(RedactingFilter(redactor))
    logger = logging.getLogger("tether-security-test")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        logger.warning("value %s", SECRET, extra={"detail": {"password": "pw-123456", "x": SECRET}})
        try:
            raise ValueError(quote(SECRET, safe=""))
        except ValueError:
            logger.exception("failed", extra={"detail": "-"})
    finally:
        logger.removeHandler(handler)
    text = buf.getvalue()
    assert SECRET not in text and quote(SECRET, safe="") not in text and "pw-123456" not in text
    assert "Traceback" in text and "[REDACTED:secret]" in text


def test_entropy_matches_detect_secrets_definition() -> None:
    assert shannon_entropy("aaaa") == 0
    assert shannon_entropy("ab") == 1
    assert round(shannon_entropy("0123456789abcdef"), 6) == 4


def test_derived_forms_include_the_base64_cores() -> None:
    forms = derived_forms("0123456789abcdef")
    for k in range(3):
        enc = base64.b64encode(b"\0" * k + b"0123456789abcdef").decode()
        assert any(f in enc for f in forms if len(f) >= 16)
