"""The SEC canary corpus: 20 canary secrets × 8 encodings among ~2,000 benign log records; recall must be 100 %."""

from __future__ import annotations

import re

from tether_security.redaction import Redactor
from tether_security.secrets import SecretRegistry, StaticSecretProvider
from tether_security.testing import ENCODINGS, build_corpus

_BREAKS = re.compile(r"[ \t]*\r?\n[ \t]*")


def _registered_redactor(secrets: dict[str, str]) -> Redactor:
    redactor = Redactor()
    registry = SecretRegistry(StaticSecretProvider(secrets), redactor)
    registry.preload(secrets)  # resolution registers every value's derived forms
    return redactor


def test_canary_recall_is_total_and_false_redactions_are_rare() -> None:
    secrets, benign, planted = build_corpus()
    assert len(secrets) == 20 and len(ENCODINGS) == 8 and len(planted) == 160 and len(benign) == 2000
    redactor = _registered_redactor(secrets)

    missed = []
    for p in planted:
        out = redactor.redact(p.record)
        flat = _BREAKS.sub("", out)
        leaked = p.encoded in out or _BREAKS.sub("", p.encoded) in flat or secrets[p.secret_name] in out
        # For wrapped values, no fragment of the value may survive either.
        if p.encoding == "split_lines":
            leaked = leaked or any(len(part) >= 4 and part in out for part in p.encoded.split("\n"))
        if leaked:
            missed.append((p.secret_name, p.encoding))
    recall = 1 - len(missed) / len(planted)
    print(f"\ncanary recall: {recall:.2%} ({len(planted) - len(missed)}/{len(planted)})")
    assert missed == [], f"secrets survived redaction: {missed}"

    changed = [line for line in benign if redactor.redact(line) != line]
    rate = len(changed) / len(benign)
    print(f"false redactions on benign lines: {rate:.2%} ({len(changed)}/{len(benign)})")
    for line in changed[:5]:
        print("  e.g.", redactor.redact(line))
    assert rate <= 0.01


def test_pattern_layer_alone_catches_raw_vendor_formats() -> None:
    # Without registration (a secret the platform never saw), raw vendor-format tokens still go.
    secrets, _, planted = build_corpus()
    redactor = Redactor()
    shaped = {"aws_access_key_id", "github_classic", "github_fine_grained", "github_oauth", "slack_bot",
              "stripe_live", "stripe_test", "jwt", "pem_private_key", "google_api_key", "sendgrid", "npm",
              "openai_project", "random_base64_32", "random_hex_32", "aws_secret_access_key"}
    for p in planted:
        if p.encoding == "raw" and p.secret_name in shaped:
            assert secrets[p.secret_name] not in redactor.redact(p.record), p.secret_name
