"""Avro schema files as a tree of named types with full names, and self-contained schemas for fingerprints.

The `.avsc` files refer to each other's named types by full name (`tether.v1.Caps`). Readers
outside this repo (a schema registry, another language) need each record's schema to stand
alone, and the Parsing Canonical Form (hence the CRC-64-AVRO fingerprint) must cover every
type a record uses, so `standalone` inlines each named type at its first use.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
NAMED_KINDS = frozenset({"record", "error", "enum", "fixed"})


class SchemaTreeError(ValueError):
    """A schema file set is malformed: duplicate or unknown names, bad JSON."""


def full_name(name: str, namespace: str | None) -> str:
    """Full name of a named type per the Avro spec (a dotted name is already full)."""
    if "." in name or not namespace:
        return name
    return f"{namespace}.{name}"


def namespace_of(full: str) -> str:
    return full.rsplit(".", 1)[0] if "." in full else ""


def short_name(full: str) -> str:
    return full.rsplit(".", 1)[-1]


@dataclass
class SchemaTree:
    """Every named type of a schema file set, by full name, and each file's top-level record."""

    named: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Full name of the top-level type of each file, by path relative to the root.
    top_level: dict[str, str] = field(default_factory=dict)

    def resolve(self, node: Any) -> Any:
        """The definition behind a reference (a full-name string); other nodes unchanged."""
        if isinstance(node, str) and node not in PRIMITIVES:
            try:
                return self.named[node]
            except KeyError:
                raise SchemaTreeError(f"unknown type {node!r}") from None
        return node

    def records(self) -> dict[str, dict[str, Any]]:
        """The top-level types by full name."""
        return {name: self.named[name] for name in self.top_level.values()}


def _normalize(node: Any, namespace: str, tree: SchemaTree, where: str) -> Any:
    """Rewrite a schema node so every name is full, references are full-name strings and every
    named definition is registered in `tree.named` (the returned node keeps docs and defaults)."""
    if isinstance(node, str):
        return node if node in PRIMITIVES else full_name(node, namespace)
    if isinstance(node, list):
        return [_normalize(item, namespace, tree, where) for item in node]
    if not isinstance(node, dict) or "type" not in node:
        raise SchemaTreeError(f"{where}: not a schema: {node!r}")
    kind = node["type"]
    if isinstance(kind, (list, dict)) or (kind not in PRIMITIVES and kind not in NAMED_KINDS
                                          and kind not in ("array", "map")):
        # {"type": <schema>} wrapping, or {"type": "Name"} reference.
        return _normalize(kind, namespace, tree, where)
    if kind in PRIMITIVES:
        extra = {k: v for k, v in node.items() if k != "type"}
        return {"type": kind, **extra} if "logicalType" in extra else kind
    if kind == "array":
        out = {k: v for k, v in node.items() if k != "items"}
        out["items"] = _normalize(node["items"], namespace, tree, where)
        return out
    if kind == "map":
        out = {k: v for k, v in node.items() if k != "values"}
        out["values"] = _normalize(node["values"], namespace, tree, where)
        return out
    name = full_name(node["name"], node.get("namespace", namespace))
    if name in tree.named:
        raise SchemaTreeError(f"{where}: {name} is defined twice")
    inner_ns = namespace_of(name)
    out = {k: v for k, v in node.items() if k not in ("namespace", "fields")}
    out["name"] = name
    if "aliases" in node:
        out["aliases"] = [full_name(a, inner_ns) for a in node["aliases"]]
    tree.named[name] = out  # registered before the fields, so recursive references resolve
    if kind in ("record", "error"):
        out["fields"] = [
            {**f, "type": _normalize(f["type"], inner_ns, tree, f"{where}: {name}.{f['name']}")}
            for f in node["fields"]
        ]
    return out


def load_tree(root: Path, files: Iterable[Path]) -> SchemaTree:
    """Load schema files (each one top-level named type) into one tree of named types."""
    tree = SchemaTree()
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise SchemaTreeError(f"{rel}: invalid JSON: {exc}") from exc
        top = _normalize(raw, "", tree, rel)
        if not isinstance(top, dict) or "name" not in top:
            raise SchemaTreeError(f"{rel}: the top-level schema must be a named type")
        tree.top_level[rel] = top["name"]
    for name, definition in tree.named.items():
        _check_references(definition, tree, name)
    return tree


def _check_references(node: Any, tree: SchemaTree, where: str) -> None:
    if isinstance(node, str):
        if node not in PRIMITIVES and node not in tree.named:
            raise SchemaTreeError(f"{where}: unknown type {node!r}")
    elif isinstance(node, list):
        for item in node:
            _check_references(item, tree, where)
    elif isinstance(node, dict):
        if node.get("type") in NAMED_KINDS and node.get("name") != where:
            return  # a nested definition is checked under its own name
        for key in ("items", "values"):
            if key in node:
                _check_references(node[key], tree, where)
        for f in node.get("fields", ()):
            _check_references(f["type"], tree, f"{where}.{f['name']}")


def standalone(name: str, tree: SchemaTree) -> dict[str, Any]:
    """The named type `name` as one self-contained schema: every named type it uses is defined
    inline at its first use (depth-first, left to right) and referenced by full name after."""
    defined: set[str] = set()

    def walk(node: Any) -> Any:
        if isinstance(node, str):
            if node in PRIMITIVES or node in defined:
                return node
            return walk(tree.named[node])
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        kind = node.get("type")
        if kind in NAMED_KINDS:
            if node["name"] in defined:
                return node["name"]
            defined.add(node["name"])
            out = copy.deepcopy({k: v for k, v in node.items() if k != "fields"})
            if "fields" in node:
                out["fields"] = [{**f, "type": walk(f["type"])} for f in node["fields"]]
            return out
        out = dict(node)
        for key in ("items", "values"):
            if key in node:
                out[key] = walk(node[key])
        return out

    return walk(name)


def parse_standalone(schema: dict[str, Any]) -> dict[str, Any]:
    """Parse a self-contained schema with fastavro, in its own name space."""
    return fastavro.parse_schema(schema, {})


def canonical_form(schema: dict[str, Any]) -> str:
    """Parsing Canonical Form (Avro spec) of a self-contained schema."""
    return to_parsing_canonical_form(parse_standalone(schema))


def crc64_fingerprint(schema: dict[str, Any]) -> bytes:
    """CRC-64-AVRO fingerprint of a self-contained schema, as 8 little-endian bytes (the byte
    order single-object encoding writes; fastavro returns the same order as hex)."""
    return bytes.fromhex(fingerprint(canonical_form(schema), "CRC-64-AVRO"))
