"""Random but valid Avro datums for any schema, for property-style tests and fixtures (pure, seeded)."""

from __future__ import annotations

import random
import string
from collections.abc import Mapping
from typing import Any

from tether_contracts.avro import NAMED_KINDS, PRIMITIVES

# Exact in float32, so a float field survives a write/read round trip unchanged.
_FLOATS = (0.0, 0.5, -1.25, 3.0, 1024.0, -0.0078125)
_TEXT = string.ascii_letters + string.digits + " _-.:/" + "éü中🙂"
_INT_EDGES = {"int": (-(2**31), 2**31 - 1), "long": (-(2**63), 2**63 - 1)}


def collect_named(schema: Any, found: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Named type definitions of a self-contained schema with full names (see tether_contracts.avro.standalone)."""
    found = {} if found is None else found
    if isinstance(schema, list):
        for branch in schema:
            collect_named(branch, found)
    elif isinstance(schema, dict):
        if schema.get("type") in NAMED_KINDS:
            if schema["name"] in found:
                return found
            found[schema["name"]] = schema
        for key in ("items", "values"):
            if key in schema:
                collect_named(schema[key], found)
        for f in schema.get("fields", ()):
            collect_named(f["type"], found)
    return found


def sample_datum(schema: Any, named: Mapping[str, dict[str, Any]], rng: random.Random, depth: int = 0) -> Any:
    """A datum valid for `schema`; named references resolve through `named` (full name -> definition)."""
    if isinstance(schema, str) and schema not in PRIMITIVES:
        schema = named[schema]
    if isinstance(schema, list):
        branches = schema
        if depth > 4 and "null" in branches:
            return None  # keeps recursive types finite
        return sample_datum(rng.choice(branches), named, rng, depth + 1)
    kind = schema if isinstance(schema, str) else schema["type"]
    if kind == "null":
        return None
    if kind == "boolean":
        return rng.random() < 0.5
    if kind in ("int", "long"):
        lo, hi = _INT_EDGES[kind]
        return rng.choice((0, 1, -1, lo, hi, rng.randint(lo, hi), rng.randint(-1000, 1000)))
    if kind == "float":
        return rng.choice(_FLOATS)
    if kind == "double":
        return rng.choice((*_FLOATS, rng.uniform(-1e12, 1e12)))
    if kind == "string":
        return "".join(rng.choice(_TEXT) for _ in range(rng.randint(0, 12)))
    if kind == "bytes":
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 12)))
    if kind == "enum":
        return rng.choice(schema["symbols"])
    if kind == "fixed":
        return bytes(rng.randrange(256) for _ in range(schema["size"]))
    if kind == "array":
        return [sample_datum(schema["items"], named, rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "map":
        return {
            f"k{i}-{rng.randrange(1000)}": sample_datum(schema["values"], named, rng, depth + 1)
            for i in range(rng.randint(0, 3))
        }
    if kind in ("record", "error"):
        return {f["name"]: sample_datum(f["type"], named, rng, depth + 1) for f in schema["fields"]}
    raise ValueError(f"cannot sample schema {schema!r}")
