"""A tool's result is redacted as canonical JSON text and stays JSON, whatever the redactor's spans cross."""

from __future__ import annotations

import json

import pytest

from tether_contracts.records import RiskClass, ToolSpec
from tether_messaging.blobstore import InMemoryBlobStore
from tether_security import Redactor
from tether_security.testing import canary_secrets
from tether_tool_gateway.domain.canonical import canonical_json, idem_key_for, sha256_hex
from tether_tool_gateway.execution import Completed, ToolRunner, redact_result, tool_spec_json
from tether_tool_gateway.ledger import Intent, Owner
from tether_tool_gateway.testing import InMemoryLedger

CANARIES = canary_secrets()
PEM = CANARIES["pem_private_key"]
PEM_WITHOUT_END = PEM.split("-----END")[0]


def redacted(value, redactor: Redactor | None = None):
    text = redact_result(redactor or Redactor(), canonical_json(value))
    return text, json.loads(text)


def test_a_number_under_a_credential_key_becomes_a_marker_string():
    text, value = redacted({"token": 12345678, "x": 1})
    assert value == {"token": "[REDACTED:credential]", "x": 1}
    assert "12345678" not in text


def test_a_private_key_without_its_end_line_does_not_swallow_the_rest_of_the_result():
    text, value = redacted({"a": PEM_WITHOUT_END, "b": [1, 2, 3]})
    assert value == {"a": "[REDACTED:private_key]", "b": [1, 2, 3]}
    assert PEM_WITHOUT_END.splitlines()[1] not in text


def test_ordinary_results_are_unchanged():
    result = {"status": 200, "headers": {"content-type": "text/html"}, "body": "<p>tokens: 3 of 10</p>",
              "items": [1, 2.5, True, None, "x"], "token_count": 5, "password_reset": False}
    assert redact_result(Redactor(), canonical_json(result)) == canonical_json(result)


def test_a_redaction_inside_strings_keeps_the_text_pass():
    result = {"body": f"you sent Bearer {CANARIES['github_classic']}", "n": 1}
    text, value = redacted(result)
    assert text == Redactor().redact(canonical_json(result))
    assert value == {"body": "you sent Bearer [REDACTED:github_token]", "n": 1}


def placements(secret: str) -> list:
    """Results holding `secret` where the text pass can cut across JSON: beside numbers under
    credential keys and a private key without its END line, as a value, a list item, a key."""
    return [
        {"token": 12345678, "value": secret, "tail": [1, 2, 3]},
        {"a": PEM_WITHOUT_END, "b": secret, "c": {"password": 987654321}},
        [{"api_key": 55555555}, secret, {secret: 1}],
        {"nested": {"secret": True, "list": [secret, 42]}, "k": PEM_WITHOUT_END},
        secret,
    ]


@pytest.mark.parametrize("name", sorted(CANARIES))
def test_no_known_secret_survives_and_the_result_stays_json(name):
    redactor = Redactor()
    redactor.add_secrets(CANARIES.values())
    for result in placements(CANARIES[name]):
        text, _ = redacted(result, redactor)  # parses
        assert CANARIES[name] not in text and json.dumps(CANARIES[name])[1:-1] not in text
        assert PEM_WITHOUT_END.splitlines()[1] not in text
        assert "12345678" not in text and "987654321" not in text and "55555555" not in text


@pytest.mark.parametrize("name", ["aws_access_key_id", "github_classic", "stripe_live", "jwt", "google_api_key",
                                  "sendgrid", "npm", "openai_project", "slack_bot", "github_fine_grained"])
def test_secret_shaped_strings_do_not_survive_without_being_registered(name):
    for result in placements(CANARIES[name]):
        text, _ = redacted(result)
        assert CANARIES[name] not in text


class AcrossEntries:
    """A redactor whose one finding spans two entries: seen only in the whole text."""

    def redact(self, text: str) -> str:
        return text.replace('"a":1,"b":2', "[REDACTED:pair")


def test_a_finding_across_entries_that_entry_by_entry_redaction_cannot_place_withholds_the_result():
    assert redact_result(AcrossEntries(), canonical_json({"a": 1, "b": 2})) == '"[REDACTED:result]"'


class Returns:
    def __init__(self, value) -> None:
        self.value = value

    def execute(self, request, secrets):
        return self.value


def test_the_runner_records_a_redacted_result_as_json():
    tool = ToolSpec(name="lookup", version=1, description="d", args_schema_json="{}", risk_class=RiskClass.READ_ONLY,
                    idempotent=True, untrusted_source=True, executor_kind="returns")
    result = {"token": 12345678, "key": PEM_WITHOUT_END, "rows": [1, 2, 3]}
    ledger = InMemoryLedger()
    runner = ToolRunner(ledger=ledger, executors={"returns": Returns(result)}, blobs=InMemoryBlobStore(),
                        owner=Owner("gw-0", "b"), redactor=Redactor())
    try:
        args_json = canonical_json({})
        key = idem_key_for("run-1", 1, 0)
        intent = Intent(key, "run-1", "t1", 0, 1, "1.0", tool.name, args_json, sha256_hex(args_json),
                        tool_spec_json(tool), True)
        outcome = runner.run(intent, tool)
    finally:
        runner.close()
    assert isinstance(outcome, Completed)
    assert json.loads(outcome.result_json) == {"token": "[REDACTED:credential]", "key": "[REDACTED:private_key]",
                                               "rows": [1, 2, 3]}
    assert ledger.get(key).resolution.result_json == outcome.result_json
