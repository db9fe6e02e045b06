"""A known secret split over lines is found in JSON text too, where the break is the escape \\n."""

from __future__ import annotations

import json

from tether_security.redaction import Redactor

SECRET = "sk_live_abcdefghijklmnop1234"


def test_a_secret_split_at_a_json_escaped_line_break_is_redacted():
    r = Redactor(patterns=False, entropy=False)
    r.add_secret(SECRET)
    for brk in ("\n", "\r\n", "\n   "):
        text = json.dumps({"body": f"x {SECRET[:10]}{brk}{SECRET[10:]} y"}, separators=(",", ":"))
        assert SECRET[:10] not in r.redact(text), text
        assert r.redact(text) == '{"body":"x [REDACTED:secret] y"}'


def test_other_json_text_is_left_alone():
    r = Redactor(patterns=False, entropy=False)
    r.add_secret(SECRET)
    text = json.dumps({"path": "C:\\new", "note": "line one\nline two"})
    assert r.redact(text) == text
