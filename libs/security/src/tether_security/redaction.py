"""Scrub secrets from text and JSON-like values: known values in their common encodings, and secret-shaped strings."""

from __future__ import annotations

import base64
import json
import math
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, quote_plus

MIN_SECRET_LENGTH = 6
# Base64 text shorter than this, cut from a longer base64 string, matches too much by chance.
_MIN_FORM_LENGTH = 8

# Line breaks (with the indentation around them) a value may have been wrapped at: PEM bodies,
# base64 wrapped at 64/76 columns, a long token split over log lines. Also as JSON escapes: the
# gateway redacts a tool's result as canonical JSON text, where a line break is the two characters \n.
_BREAK = re.compile(r"[ \t]*(?:\r?\n|(?:\\r)?\\n)[ \t]*")

SECRET = "secret"


def marker(kind: str) -> str:
    """The text that replaces a redacted span."""
    return f"[REDACTED:{kind}]"


# -- derived forms of a known value ---------------------------------------------------------------

def _b64_cores(raw: bytes, alphabet: bytes | None) -> set[str]:
    """Base64 text of `raw` as it appears inside longer base64 text, at each of the 3 byte alignments.

    With k unknown bytes before the value, base64 characters that mix bits of the neighbours are
    dropped; the characters fully determined by the value's own bits remain.
    """
    cores = set()
    for k in range(3):
        encoded = base64.b64encode(b"\0" * k + raw, altchars=alphabet).decode().rstrip("=")
        first = math.ceil(8 * k / 6)
        last = (8 * (k + len(raw))) // 6
        core = encoded[first:last]
        if len(core) >= _MIN_FORM_LENGTH:
            cores.add(core)
    return cores


def _lower_percent(s: str) -> str:
    return re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), s)


# Characters JSON encoders write as \u00XX although JSON does not require it, one set per encoder
# style: Go's encoding/json (& < >) and Gson (also = '), both HTML-safe by default; PHP with
# JSON_HEX_TAG|AMP|APOS|QUOT (& < > ' ", upper-case hex while its non-ASCII escapes are lower-case);
# .NET System.Text.Json's default encoder (also + and `, upper-case hex); and all of them at once.
# Each style in lower- and upper-case hex, with "/" as is and as "\/" (PHP's default), and with
# non-ASCII characters raw or escaped in either case: one form per combination, never the power set
# of the characters (at most 72, 24 for an ASCII value), and none for an ASCII value without any of
# these characters.
_JSON_ESCAPE_STYLES = ("&<>", "&<>='", "&<>'\"", "&<>'+`\"", "&<>'=+`\"")
_JSON_ESCAPED_CHARS = frozenset("/" + "".join(_JSON_ESCAPE_STYLES))


def _json_text(value: str, *, non_ascii: str, escape: str, upper: bool, slash: bool) -> str:
    """`value` as the inside of a JSON string, the characters in `escape` written as \\u00XX.

    `non_ascii` is "raw", "lower" or "upper": non-ASCII characters as is or as \\uXXXX escapes.
    """
    out = []
    for ch in value:
        if ch in escape:
            out.append(f"\\u{ord(ch):04X}" if upper else f"\\u{ord(ch):04x}")
        elif ch == "/" and slash:
            out.append("\\/")
        elif ch.isascii() or non_ascii == "raw":
            out.append(json.dumps(ch, ensure_ascii=False)[1:-1])
        else:
            escaped = json.dumps(ch)[1:-1]  # \\uXXXX, a surrogate pair beyond the BMP
            out.append(escaped.upper().replace("\\U", "\\u") if non_ascii == "upper" else escaped)
    return "".join(out)


def _json_escape_variants(value: str) -> set[str]:
    """The JSON forms of `value` by encoders that escape more than JSON requires (none for most values)."""
    ascii_value = value.isascii()
    if ascii_value and _JSON_ESCAPED_CHARS.isdisjoint(value):
        return set()
    return {_json_text(value, non_ascii=non_ascii, escape=escape, upper=upper, slash=slash)
            for non_ascii in (("raw",) if ascii_value else ("raw", "lower", "upper"))
            for escape in ("", *_JSON_ESCAPE_STYLES) for upper in (False, True) for slash in (False, True)}


def derived_forms(value: str) -> set[str]:
    """Every text form of `value` the redactor looks for: raw, JSON-escaped, URL-encoded, hex, base64."""
    raw = value.encode()
    forms = {
        value,
        json.dumps(value)[1:-1],
        json.dumps(value, ensure_ascii=False)[1:-1],
        *_json_escape_variants(value),
        quote(value, safe=""),
        quote(value),
        quote_plus(value, safe=""),
        _lower_percent(quote(value, safe="")),
        raw.hex(),
        raw.hex().upper(),
    }
    for alphabet in (None, b"-_"):
        full = base64.b64encode(raw, altchars=alphabet).decode()
        forms.add(full)
        forms.add(full.rstrip("="))
        forms |= _b64_cores(raw, alphabet)
        # A value inside a JSON document that was then base64-encoded (tokens, cookies, payloads).
        escaped = json.dumps(value)[1:-1].encode()
        if escaped != raw:
            forms |= _b64_cores(escaped, alphabet)
    normalised = {_BREAK.sub("", f) for f in forms}
    return {f for f in normalised if len(f) >= min(len(value), _MIN_FORM_LENGTH)}


def _trie_pattern(words: Iterable[str]) -> re.Pattern[str] | None:
    """One regex matching any of `words`, longest first, that branches like a trie (fast on many words)."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}
    if not trie:
        return None

    def build(node: dict[str, Any]) -> str:
        alternatives = []
        for ch in sorted(k for k in node if k):
            chain = [ch]
            child = node[ch]
            # Follow single-child chains iteratively: recursion only at branch points.
            while len(child) == 1 and "" not in child:
                (nxt, child), = child.items()
                chain.append(nxt)
            alternatives.append(re.escape("".join(chain)) + build(child))
        if not alternatives:
            return ""
        body = alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"
        if "" in node:
            return "(?:" + body + ")?"
        return body

    return re.compile(build(trie))


# -- secret-shaped strings -------------------------------------------------------------------------

_CREDENTIAL_WORDS = (
    r"api[_-]?key|apikey|access[_-]?key(?:[_-]?secret)?|secret[_-]?(?:access[_-]?)?key|client[_-]?secret|"
    r"secret|password|passwd|passphrase|token|access[_-]?token|refresh[_-]?token|auth[_-]?token|"
    r"id[_-]?token|session[_-]?token|bearer[_-]?token|private[_-]?key|signing[_-]?key|credentials?|"
    r"authorization|cookie|set-cookie|x-api-key"
)
# A key that *is* a credential name, e.g. for dict keys in structured logs: `password`, `API_KEY`.
_CREDENTIAL_KEY = re.compile(rf"^[\w.-]*?(?:{_CREDENTIAL_WORDS})$", re.IGNORECASE)
# Values that are placeholders or references, not secrets.
_PLACEHOLDER = re.compile(
    r"^(?:null|none|nil|true|false|undefined|empty|redacted|masked|hidden|changeme|example|required|optional|"
    r"string|str|bytes|int|bool|bearer|basic|digest|negotiate|"
    r"\*+|x{3,}|\.{3}|<[^>]*>|\$\{[^}]*\}|\$[A-Z_][A-Z0-9_]*|\{\{.*\}\}|%\(\w+\)s|"
    r"secret://\S*|\[REDACTED[^\]]*\]?.*)$",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class _Rule:
    kind: str
    pattern: re.Pattern[str]
    group: int | str = 0  # the part of the match that is the secret


_RULES: tuple[_Rule, ...] = (
    _Rule("private_key", re.compile(
        r"-----BEGIN[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
        r"(?:-----END[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|\Z)")),
    _Rule("jwt", re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*")),
    _Rule("aws_access_key_id", re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])[A-Z0-9]{16}\b")),
    _Rule("github_token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})\b")),
    _Rule("slack_token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,250}")),
    _Rule("slack_webhook",
          re.compile(r"https://hooks\.slack\.com/services/T[A-Za-z0-9_]+/B[A-Za-z0-9_]+/[A-Za-z0-9_]+")),
    _Rule("stripe_key", re.compile(r"\b(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{10,247}\b")),
    _Rule("google_api_key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b")),
    _Rule("npm_token", re.compile(r"\bnpm_[A-Za-z0-9]{36}\b")),
    _Rule("sendgrid_key", re.compile(r"\bSG\.[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]{43}\b")),
    _Rule("twilio_key", re.compile(r"\bSK[0-9a-fA-F]{32}\b")),
    _Rule("api_key", re.compile(r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_-]{20,}")),
    _Rule("url_password", re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@'\"]*:(?P<v>[^\s@/'\"]+)@"), "v"),
    _Rule("bearer_token", re.compile(r"(?i)\bbearer\s+(?P<v>[A-Za-z0-9\-._~+/]{8,}=*)"), "v"),
    _Rule("basic_auth",
          re.compile(r"(?i)\bauthorization[\"']?\s*[:=]\s*[\"']?basic\s+(?P<v>[A-Za-z0-9+/]{4,}=*)"), "v"),
    # `api_key=...`, `"password": "..."`, `X-Api-Key: ...`: only the value is redacted.
    _Rule("credential", re.compile(
        rf"(?i)(?:{_CREDENTIAL_WORDS})(?![\w])[\"']?\s*(?:=>|:=|=|:(?!//))\s*"
        r"(?:\"(?P<dq>(?:[^\"\\\n]|\\.){1,512})\"|'(?P<sq>[^'\n]{1,512})'|"
        r"(?P<bare>\$\{[^}\s]*\}|[^\s,;&'\"<>()\[\]{}]{1,512}))"),
        "value"),
)

# Runs of base64/hex characters long enough to be keys.
_TOKEN = re.compile(r"[A-Za-z0-9+/_-]{20,}={0,2}")
_HEX = re.compile(r"^[0-9a-fA-F]+$")
_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
# A digest or id is logged on purpose (event ids, args hashes, commits): a hex string right after
# such a key is not treated as a secret by the entropy rule (a known secret is still redacted).
_IDENTIFIER_CONTEXT = re.compile(
    r"(?i)(?:(?P<key>[A-Za-z_][\w.-]*)[\"']?\s*[:=]\s*[\"']?|\b(?P<word>commit|revision|rev|sha\d*|digest|hash|"
    r"checksum|fingerprint|etag|object|blob|tree|id)[\s:=#@-]+)$"
)
_IDENTIFIER_KEY_TAIL = re.compile(
    r"(?i)(?:^|[_.-])(?:id|ids|uid|hash|sha\d*|digest|checksum|fingerprint|etag|commit|revision|rev|key_id|"
    r"idem_key|offset|trace|span|parent|ref|oid|version|nonce|cursor|seq|chain|prev|head|tail)$"
)


# Hex runs of these lengths on a line that talks about hashes are digests (md5, sha1, sha256, sha512).
_DIGEST_LENGTHS = frozenset({32, 40, 56, 64, 96, 128})
_DIGEST_WORDS = re.compile(r"(?i)\b(?:sha\d*|md5|hash\w*|digest|checksum|commit|etag|fingerprint|integrity)\b")


def shannon_entropy(s: str) -> float:
    """Bits per character of `s`, as detect-secrets computes it."""
    if not s:
        return 0.0
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


@dataclass(frozen=True)
class Finding:
    """One redacted span of the input: where it was and what kind of secret it looked like."""

    start: int
    end: int
    kind: str


class Redactor:
    """Replaces secrets in text with `[REDACTED:<kind>]`.

    Two layers: (1) exact values registered with `add_secret`, in every form `derived_forms`
    produces, also when wrapped across lines (kind "secret"); (2) secret-shaped strings: vendor
    token formats, JWTs, PEM private keys, credential assignments, bearer/basic auth, URL
    passwords, and high-entropy base64 (> `base64_limit` bits/char) or hex (> `hex_limit`) runs.
    Redaction is best effort by nature (GitHub's wording: "not guaranteed"); it is defence in depth
    behind keeping secrets out of prompts and the sandbox. Thread-safe: `add_secret` swaps an
    immutable matcher.
    """

    def __init__(self, *, patterns: bool = True, entropy: bool = True, base64_limit: float = 4.5,
                 hex_limit: float = 3.0, min_secret_length: int = MIN_SECRET_LENGTH) -> None:
        self._patterns = patterns
        self._entropy = entropy
        self._base64_limit = base64_limit
        self._hex_limit = hex_limit
        self._min_secret_length = min_secret_length
        self._lock = threading.Lock()
        self._values: frozenset[str] = frozenset()
        self._forms: frozenset[str] = frozenset()
        self._known: re.Pattern[str] | None = None

    @property
    def secret_count(self) -> int:
        """How many distinct secret values are registered."""
        return len(self._values)

    @property
    def min_secret_length(self) -> int:
        """The shortest value (after stripping surrounding whitespace) `add_secret` accepts."""
        return self._min_secret_length

    def accepts(self, value: str) -> bool:
        """Whether `add_secret` would register `value` (it is long enough to redact)."""
        return len(value.strip()) >= self._min_secret_length

    def add_secret(self, value: str) -> bool:
        """Register a secret value and its derived forms. False (and nothing registered) if it is too short.

        Values shorter than `min_secret_length` would redact ordinary words; keep such secrets out
        of logs by other means.
        """
        return self.add_secrets([value]) == 1

    def add_secrets(self, values: Iterable[str]) -> int:
        """Register several secret values at once (one matcher rebuild); returns how many were accepted."""
        accepted = []
        for value in values:
            if not isinstance(value, str):
                raise TypeError("secret values are str")
            if self.accepts(value):
                accepted.append(value)
        with self._lock:
            new = [v for v in accepted if v not in self._values]
            if new:
                forms = set(self._forms)
                for v in new:
                    forms |= derived_forms(v)
                self._known = _trie_pattern(forms)
                self._forms = frozenset(forms)
                self._values = self._values | frozenset(new)
        return len(accepted)

    def findings(self, text: str) -> list[Finding]:
        """The spans `redact` would replace, merged and in order."""
        spans: list[Finding] = []
        known = self._known
        if known is not None:
            spans += self._known_spans(known, text)
        if self._patterns:
            for rule in _RULES:
                for m in rule.pattern.finditer(text):
                    found = self._rule_span(rule, m)
                    if found is not None:
                        spans.append(found)
        if self._entropy:
            spans += self._entropy_spans(text)
        return _merge(spans)

    def redact(self, text: str) -> str:
        """`text` with every finding replaced by its marker."""
        if not text:
            return text
        found = self.findings(text)
        if not found:
            return text
        out = []
        pos = 0
        for f in found:
            out.append(text[pos:f.start])
            out.append(marker(f.kind))
            pos = f.end
        out.append(text[pos:])
        return "".join(out)

    def redact_value(self, value: Any) -> Any:
        """A copy of a JSON-like value (dict/list/tuple/str) with strings redacted.

        A dict entry whose key names a credential (`password`, `api_key`, `authorization`, ...)
        has its whole scalar value replaced, unless it is a placeholder or a `secret://` handle.
        """
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                if isinstance(k, str) and _CREDENTIAL_KEY.match(k) and _is_sensitive_scalar(v):
                    out[k] = marker("credential")
                else:
                    out[k] = self.redact_value(v)
            return out
        if isinstance(value, list):
            return [self.redact_value(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.redact_value(v) for v in value)
        return value

    # -- internals ---------------------------------------------------------------------------------

    def _known_spans(self, known: re.Pattern[str], text: str) -> list[Finding]:
        if "\n" not in text and "\\n" not in text:
            return [Finding(m.start(), m.end(), SECRET) for m in known.finditer(text)]
        # Search the text with line breaks removed, then map each hit back to the original span.
        kept: list[str] = []
        index: list[int] = []
        pos = 0
        for brk in _BREAK.finditer(text):
            kept.append(text[pos:brk.start()])
            index.extend(range(pos, brk.start()))
            pos = brk.end()
        kept.append(text[pos:])
        index.extend(range(pos, len(text)))
        joined = "".join(kept)
        return [Finding(index[m.start()], index[m.end() - 1] + 1, SECRET)
                for m in known.finditer(joined) if m.end() > m.start()]

    @staticmethod
    def _rule_span(rule: _Rule, m: re.Match[str]) -> Finding | None:
        if rule.group == "value":
            for g in ("dq", "sq", "bare"):
                if m.group(g) is not None:
                    value = m.group(g)
                    if _PLACEHOLDER.match(value) or (value.isdigit() and len(value) < 6):
                        return None
                    return Finding(m.start(g), m.end(g), rule.kind)
            return None
        start, end = m.span(rule.group)
        value = m.group(rule.group)
        if not value or _PLACEHOLDER.match(value):
            return None
        return Finding(start, end, rule.kind)

    def _entropy_spans(self, text: str) -> list[Finding]:
        spans = []
        for m in _TOKEN.finditer(text):
            token = m.group(0).rstrip("=")
            if _UUID.match(token):
                continue
            if _HEX.match(token):
                if len(token) < 32 or shannon_entropy(token) <= self._hex_limit:
                    continue
                line_start = text.rfind("\n", 0, m.start()) + 1
                if _identifier_context(text[max(line_start, m.start() - 80):m.start()]):
                    continue
                if len(token) in _DIGEST_LENGTHS and _DIGEST_WORDS.search(text[line_start:m.start()]):
                    continue
                spans.append(Finding(m.start(), m.end(), "high_entropy_hex"))
            elif (shannon_entropy(token) > self._base64_limit and any(c.isdigit() for c in token)
                  and any(c.isalpha() for c in token)):
                decoded = _decode_text(token)
                if decoded is None:
                    spans.append(Finding(m.start(), m.end(), "high_entropy_base64"))
                elif self._patterns and any(self._rule_span(rule, hit) for rule in _RULES
                                            for hit in rule.pattern.finditer(decoded)):
                    # Base64 of readable text is data, not key material, unless the text holds a secret.
                    spans.append(Finding(m.start(), m.end(), "encoded_secret"))
        return spans


def _decode_text(token: str) -> str | None:
    """The text a base64 token encodes, if it decodes to (almost all) printable UTF-8; else None."""
    padded = token + "=" * (-len(token) % 4)
    for alt in (b"+/", b"-_"):
        try:
            raw = base64.b64decode(padded, altchars=alt, validate=True)
            text = raw.decode("utf-8")
        except ValueError:
            continue
        printable = sum(ch.isprintable() or ch in "\t\r\n" for ch in text)
        if text and printable / len(text) >= 0.95:
            return text
    return None


def _identifier_context(prefix: str) -> bool:
    m = _IDENTIFIER_CONTEXT.search(prefix)
    if m is None:
        return False
    if m.group("word"):
        return True
    return bool(_IDENTIFIER_KEY_TAIL.search(m.group("key")))


def _is_sensitive_scalar(v: Any) -> bool:
    if isinstance(v, bool) or v is None:
        return False
    if isinstance(v, (int, float)):
        return True
    if isinstance(v, (str, bytes)):
        text = v.decode(errors="replace") if isinstance(v, bytes) else v
        return bool(text) and not _PLACEHOLDER.match(text)
    return False


# Known values outrank vendor formats, which outrank the entropy guess, when spans overlap.
_PRIORITY = {SECRET: 0, "high_entropy_hex": 3, "high_entropy_base64": 3, "credential": 2}


def _merge(spans: list[Finding]) -> list[Finding]:
    """Union of overlapping spans; the merged span keeps the most specific kind."""
    if not spans:
        return []
    spans.sort(key=lambda f: (f.start, -f.end))
    merged = [spans[0]]
    for f in spans[1:]:
        last = merged[-1]
        if f.start < last.end:
            kind = min((last.kind, f.kind), key=lambda k: _PRIORITY.get(k, 1))
            merged[-1] = Finding(last.start, max(last.end, f.end), kind)
        else:
            merged.append(f)
    return merged
