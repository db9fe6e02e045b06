"""A tool's argument schema: `object_schema` puts "type": "object" at the root without changing which objects are valid."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from jsonschema import Draft202012Validator

from tether_security.argument_schema import (
    NotAnObjectSchema,
    SchemaReferenceUnresolvable,
    argument_validator,
    object_schema,
)

#: zod-to-json-schema's named output (`zodToJsonSchema(schema, "Ticket")`), as the MCP TypeScript SDK declares it.
ZOD_NAMED = {
    "$ref": "#/definitions/Ticket",
    "definitions": {"Ticket": {
        "type": "object",
        "properties": {"title": {"type": "string", "minLength": 1},
                       "parent": {"$ref": "#/definitions/Ticket"},
                       "labels": {"type": "array", "items": {"type": "string"}}},
        "required": ["title"],
        "additionalProperties": False,
    }},
    "$schema": "https://json-schema.org/draft/2020-12/schema",
}
#: The same in 2020-12 words, with a keyword beside the $ref (applied with it in 2020-12).
DEFS_WITH_SIBLING = {
    "$ref": "#/$defs/Refund",
    "$defs": {"Refund": {"type": "object", "properties": {"amount": {"type": "number", "maximum": 100}},
                         "required": ["amount"]}},
    "required": ["reason"],
}
ALL_OF = {"allOf": [{"properties": {"to": {"type": "string", "pattern": "@"}}, "required": ["to"]},
                    {"properties": {"cc": {"type": "array"}}}]}
ANY_OF = {"anyOf": [{"type": "object", "required": ["id"]}, {"type": "object", "required": ["email"]}]}
NO_TYPE = {"properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
NULLABLE = {"type": ["object", "null"], "properties": {"n": {"type": "integer"}}}

OBJECTS = [
    {}, {"title": "t"}, {"title": ""}, {"title": "t", "parent": {"title": "p"}}, {"title": "t", "parent": {}},
    {"title": "t", "labels": ["a", 1]}, {"title": "t", "extra": 1}, {"amount": 5}, {"amount": 500, "reason": "r"},
    {"amount": 5, "reason": "r"}, {"to": "a@b"}, {"to": "ab"}, {"to": "a@b", "cc": 3}, {"id": 1}, {"email": "e"},
    {"n": 1}, {"n": "1"}, {"n": 1, "m": 2},
]


@pytest.mark.parametrize("declared", [ZOD_NAMED, DEFS_WITH_SIBLING, ALL_OF, ANY_OF, NO_TYPE, NULLABLE],
                         ids=["zod-named", "defs-with-sibling", "allOf", "anyOf", "no-type", "nullable"])
def test_the_object_schema_accepts_exactly_the_objects_the_declared_one_does(declared):
    # Before, any such schema became {"type": "object"}: every object passed, whatever the server declared.
    schema = object_schema(declared)
    assert schema["type"] == "object"
    Draft202012Validator.check_schema(schema)
    verdicts = [Draft202012Validator(schema).is_valid(o) for o in OBJECTS]
    assert verdicts == [Draft202012Validator(declared).is_valid(o) for o in OBJECTS]
    assert not all(verdicts)  # the schema still refuses something
    for not_an_object in ([], "x", 1, None):
        assert not Draft202012Validator(schema).is_valid(not_an_object)


def test_a_root_that_only_refers_to_a_definition_is_replaced_by_it_with_the_definitions_kept():
    # The model and the policy (taint.follow_links reads the root's properties) see a plain object schema.
    schema = object_schema(ZOD_NAMED)
    assert "$ref" not in schema and schema["properties"] == ZOD_NAMED["definitions"]["Ticket"]["properties"]
    assert schema["definitions"] == ZOD_NAMED["definitions"]  # the nested $ref still resolves
    assert schema["required"] == ["title"] and schema["additionalProperties"] is False
    # With a keyword beside the $ref (or a definition naming a place) the $ref stays, validated with the rest.
    assert object_schema(DEFS_WITH_SIBLING)["$ref"] == "#/$defs/Refund"


def test_a_schema_that_already_describes_an_object_is_unchanged():
    declared = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    assert object_schema(declared) == declared


@pytest.mark.parametrize(("declared", "why"), [
    ({"type": "string"}, "(root) has \"type\" 'string'"),
    ({"type": ["array", "null"]}, "(root) has \"type\" ['array', 'null']"),
    ({"$ref": "#/$defs/S", "$defs": {"S": {"type": "string"}}}, "/$ref has \"type\" 'string'"),
    ({"allOf": [{"type": "object"}, False]}, "/allOf/1 is false"),
    ({"anyOf": [{"type": "string"}, {"enum": [1, 2]}]}, "no anyOf branch matches an object"),
    ({"const": "x"}, "a \"const\" that is not an object"),
    ({"not": {}}, "\"not\" of every object"),
    ({"$ref": "#/$defs/missing"}, "refers to nothing in the schema"),
    ({"$ref": "https://schemas.example/args.json"}, "another document is never fetched"),
])
def test_a_schema_no_object_can_match_is_refused_saying_why(declared, why):
    with pytest.raises(NotAnObjectSchema, match="matches no JSON object") as refused:
        object_schema(declared)
    assert why in str(refused.value)


def test_a_reference_cycle_is_not_followed_for_ever():
    looping = {"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}}
    assert object_schema(looping)["type"] == "object"


# -- argument_validator: a $ref is resolved within the schema only -----------------------------------
@contextmanager
def schema_host() -> Iterator[tuple[list[str], str]]:
    """A loopback server answering any GET with an open object schema; yields the paths asked for and its URL."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            asked.append(self.path)
            body = json.dumps({"type": "object"}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield asked, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_ref_to_another_document_is_never_fetched():
    # A server's schema pointing at a URL of its choosing made the gateway and the planner fetch it
    # (jsonschema's default registry retrieves remote refs), and the verdict depend on the answer.
    with schema_host() as (asked, base):
        schema = {"type": "object", "properties": {"to": {"$ref": f"{base}/args.json"}}}
        with pytest.warns(DeprecationWarning):
            assert Draft202012Validator(schema).is_valid({"to": {}})  # the default fetches it
        assert asked == ["/args.json"]
        with pytest.raises(SchemaReferenceUnresolvable):
            argument_validator(schema).is_valid({"to": {}})
        assert asked == ["/args.json"]  # not asked again


def test_refs_within_the_schema_and_to_the_meta_schema_still_resolve():
    schema = {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}, "s": {
        "$ref": "https://json-schema.org/draft/2020-12/schema"}}, "$defs": {"n": {"type": "integer"}}}
    validator = argument_validator(schema)
    assert validator.is_valid({"n": 1, "s": {"type": "string"}})
    assert not validator.is_valid({"n": "1"}) and not validator.is_valid({"s": {"type": 5}})
    with pytest.raises(SchemaReferenceUnresolvable):
        argument_validator({"$ref": "#/$defs/missing"}).is_valid({})
