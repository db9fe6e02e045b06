"""A tool's argument JSON Schema (draft 2020-12): the shape the model's untrusted arguments are checked against."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from jsonschema import Draft202012Validator, FormatChecker
from jsonschema_specifications import REGISTRY as SPECIFICATIONS
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from tether_security.argument_formats import FORMAT_CHECKS

if TYPE_CHECKING:
    from referencing._core import Resolver

#: Keywords a root `$ref` may stand beside and still be replaced by its target: the definitions it
#: points into and annotations, none of which validates.
_BESIDE_A_REPLACEABLE_REF = frozenset({"$schema", "$defs", "definitions", "$comment", "title", "description"})
#: What moves the base URI or names a place: a target holding one would mean something else at the root.
_PLACE_KEYWORDS = frozenset({"$id", "$anchor", "$dynamicAnchor", "$schema", "$defs", "definitions"})
#: How deep references and applicators are followed when asking whether a schema can match an object.
_MAX_DEPTH = 32


#: What a $ref that resolves to nothing raises while arguments are validated (jsonschema wraps it lazily).
SchemaReferenceUnresolvable = Unresolvable


#: The `format` values that can be asserted (`argument_formats.FORMAT_CHECKS`); any other stays an annotation.
ASSERTABLE_FORMATS = frozenset(FORMAT_CHECKS)


def _strings_only(check: Callable[[str], bool]) -> Callable[[object], bool]:
    # A format constrains strings only: a number under "format": "email" is the `type` keyword's business.
    return lambda value: not isinstance(value, str) or check(value)


def check_assertable(formats: list[str]) -> list[str]:
    """`formats` unchanged if each can be asserted (ASSERTABLE_FORMATS), else ValueError naming the
    others: the check of every setting or document that lists formats to assert."""
    unknown = sorted(set(formats) - ASSERTABLE_FORMATS)
    if unknown:
        raise ValueError(f"cannot assert format(s) {unknown}; assertable: {', '.join(sorted(ASSERTABLE_FORMATS))}")
    return formats


def format_checker(formats: Iterable[str]) -> FormatChecker:
    """A FormatChecker asserting exactly `formats` with this package's own checks (never jsonschema's,
    whose set depends on optional packages); raises ValueError for a format it cannot assert."""
    checker = FormatChecker(formats=())
    for name in formats:
        if name not in FORMAT_CHECKS:
            raise ValueError(f"cannot assert format {name!r}; assertable: {', '.join(sorted(FORMAT_CHECKS))}")
        checker.checks(name)(_strings_only(FORMAT_CHECKS[name]))
    return checker


def argument_validator(schema: Mapping[str, Any], formats: Iterable[str] = ()) -> Draft202012Validator:
    """A draft 2020-12 validator of arguments against `schema` that never fetches a document and
    asserts `format` for exactly `formats` (each in ASSERTABLE_FORMATS; none by default, as
    jsonschema does: `format` is an annotation unless asserted).

    jsonschema's default registry retrieves any `$ref` to another document over the network (with
    a deprecation warning): a tool's schema, which an MCP server writes, would make whoever checks a
    call fetch a URL of the server's choosing, and make the verdict depend on what it answered then.
    Here a `$ref` resolves only within `schema` and the JSON Schema meta-schemas (bundled); any other
    raises SchemaReferenceUnresolvable from `iter_errors`/`is_valid`, which the caller must treat as
    an unusable schema. A value breaking an asserted format is a validation error like any other
    ("'x' is not a 'email'"). Does not check the schema itself (`Draft202012Validator.check_schema`)."""
    formats = tuple(formats)
    return Draft202012Validator(schema, registry=SPECIFICATIONS,
                                format_checker=format_checker(formats) if formats else None)


class NotAnObjectSchema(ValueError):
    """A tool's input schema matches no JSON object, so it cannot describe tool arguments (always an object)."""


def object_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """`schema` with `"type": "object"` at its root, accepting exactly the objects it accepts.

    Tool arguments are always a JSON object, and run-api registers only a schema whose root says so,
    but an MCP server may declare its input schema otherwise: zod's named output is a root `$ref`
    into `definitions` (or `$defs`), others put `allOf`/`anyOf` at the root or leave out `type`. A
    root that is only a `$ref` to `#/$defs/<name>` or `#/definitions/<name>` (besides those
    definitions and annotations) is replaced by the definition it names, the definitions kept beside
    it so every reference still resolves. Then `"type": "object"` is added: draft 2020-12 applies it
    together with every other keyword at the root (a `$ref` included), so an object is valid exactly
    when it was before. Raises NotAnObjectSchema, saying why, when no object can be valid: the root
    (or an `allOf` member, a `$ref` target, every `anyOf`/`oneOf` branch) says `false`, a `type`
    without "object", a `const` or `enum` without an object, or `not` of every object; or a `$ref`
    on the way resolves to nothing (the gateway never fetches another document)."""
    if not isinstance(schema, Mapping):
        raise NotAnObjectSchema("is not a JSON object")
    declared = dict(schema)
    why = _why_no_object(declared, _resolver(declared), "", 0)
    if why is not None:
        raise NotAnObjectSchema(f"matches no JSON object (tool arguments are one): {why}")
    return {**_ref_replaced(declared), "type": "object"}


def _ref_replaced(schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if not isinstance(ref, str) or set(schema) - {"$ref"} - _BESIDE_A_REPLACEABLE_REF:
        return schema
    tokens = ref.split("/")
    if len(tokens) != 3 or tokens[0] != "#" or tokens[1] not in ("$defs", "definitions"):
        return schema
    definitions = schema.get(tokens[1])
    name = tokens[2].replace("~1", "/").replace("~0", "~")
    target = definitions.get(name) if isinstance(definitions, dict) else None
    if not isinstance(target, dict) or set(target) & (_PLACE_KEYWORDS | set(schema)):
        return schema
    return {**{k: v for k, v in schema.items() if k != "$ref"}, **target}


def _resolver(schema: dict[str, Any]) -> Resolver[Any]:
    # An empty registry: a reference to another document is unresolvable, never fetched.
    return Registry().resolver_with_root(DRAFT202012.create_resource(schema))


def _at(where: str, key: str | int) -> str:
    return f"{where}/{str(key).replace('~', '~0').replace('/', '~1')}"


def _why_no_object(schema: Any, resolver: Resolver[Any], where: str, depth: int) -> str | None:
    """Why `schema` matches no JSON object, as far as its own keywords tell; None if one may match."""
    if schema is False:
        return f"{where or '(root)'} is false"
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None
    if isinstance(schema.get("$id"), str):
        resolver = resolver.in_subresource(DRAFT202012.create_resource(schema))
    at = where or "(root)"
    declared = schema.get("type")
    if (isinstance(declared, str) and declared != "object") or (isinstance(declared, list) and "object" not in declared):
        return f'{at} has "type" {declared!r}'
    if "const" in schema and not isinstance(schema["const"], dict):
        return f'{at} has a "const" that is not an object'
    if isinstance(schema.get("enum"), list) and not any(isinstance(v, dict) for v in schema["enum"]):
        return f'{at} has an "enum" without an object'
    if schema.get("not") in (True, {}, {"type": "object"}):
        return f'{at} has "not" of every object'
    for i, member in enumerate(schema.get("allOf") or ()):
        why = _why_no_object(member, resolver, _at(f"{where}/allOf", i), depth + 1)
        if why is not None:
            return why
    for keyword in ("anyOf", "oneOf"):
        branches = schema.get(keyword)
        if isinstance(branches, list) and branches:
            whys = [_why_no_object(b, resolver, _at(f"{where}/{keyword}", i), depth + 1)
                    for i, b in enumerate(branches)]
            if all(w is not None for w in whys):
                return f"no {keyword} branch matches an object ({'; '.join(str(w) for w in whys)})"
    ref = schema.get("$ref")
    if isinstance(ref, str):
        try:
            resolved = resolver.lookup(ref)
        except Unresolvable:
            return f"the $ref {ref!r} at {at} refers to nothing in the schema (another document is never fetched)"
        return _why_no_object(resolved.contents, resolved.resolver, f"{where}/$ref", depth + 1)
    return None
