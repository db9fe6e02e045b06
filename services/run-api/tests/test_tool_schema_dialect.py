"""A tool's argument schema is registered only in the dialect the gateway validates arguments in (draft 2020-12)."""

from __future__ import annotations

import json

import pytest

from tether_contracts.records import RiskClass, ToolSpec
from tether_run_api.domain.catalog import CatalogLimits, ToolDraft, validate_tool
from tether_run_api.domain.errors import InvalidArgument
from tether_tool_gateway.domain.policy import validate_args

DRAFT_07 = "http://json-schema.org/draft-07/schema#"
PAY = {"type": "object", "properties": {"account": {"type": "string"}, "amount": {"type": "number"}}}


def draft(schema: dict | str) -> ToolDraft:
    return ToolDraft(name="pay", description="Pay an invoice.",
                     args_schema_json=schema if isinstance(schema, str) else json.dumps(schema),
                     risk_class="WRITE", executor_kind="http",
                     executor_config_json='{"url": "https://pay.example/call"}')


@pytest.mark.parametrize("declared", [
    DRAFT_07,
    "http://json-schema.org/draft-04/schema#",
    "https://json-schema.org/draft/2019-09/schema",
    "https://example.com/my-dialect",
    7,
])
def test_a_schema_declaring_another_dialect_is_refused_with_a_field_violation(declared):
    # Registered as draft-07, `dependencies` would be silently unenforced by the gateway (which
    # validates as 2020-12): a payment without its approval code would pass.
    with pytest.raises(InvalidArgument) as err:
        validate_tool(draft({**PAY, "$schema": declared, "dependencies": {"amount": ["approval_code"]}}),
                      CatalogLimits())
    (violation,) = err.value.violations
    assert violation.field == "tool.args_schema_json"
    assert "$schema" in violation.description and "2020-12" in violation.description


def test_a_draft_07_tuple_schema_that_the_gateway_cannot_use_is_refused():
    schema = {**PAY, "$schema": DRAFT_07,
              "properties": {"lines": {"type": "array", "items": [{"type": "string"}], "additionalItems": False}}}
    with pytest.raises(InvalidArgument) as err:
        validate_tool(draft(schema), CatalogLimits())
    assert "$schema" in err.value.violations[0].description


@pytest.mark.parametrize("declared", [None, "https://json-schema.org/draft/2020-12/schema",
                                      "https://json-schema.org/draft/2020-12/schema#"])
def test_a_2020_12_schema_is_registered_and_the_gateway_enforces_what_it_says(declared):
    schema = {**PAY, "dependentRequired": {"amount": ["approval_code"]}}
    if declared is not None:
        schema["$schema"] = declared
    spec = validate_tool(draft(schema), CatalogLimits())
    tool = ToolSpec(name=spec.name, version=1, description=spec.description, args_schema_json=spec.args_schema_json,
                    risk_class=RiskClass.WRITE, idempotent=True, untrusted_source=False, executor_kind="http")
    assert "approval_code" in (validate_args(tool, json.dumps({"account": "x", "amount": 5})) or "")
    assert validate_args(tool, json.dumps({"account": "x", "amount": 5, "approval_code": "A1"})) is None
