"""The bundled Avro schemas, parsed, with their CRC-64-AVRO fingerprints (pure, no I/O beyond package data)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from tether_contracts.codegen import schema_files

BUNDLED = Path(__file__).resolve().parent / "avsc"


@dataclass
class SchemaSet:
    """Every record schema by full name, and the reverse map from fingerprint to name."""

    parsed: dict[str, Any] = field(default_factory=dict)
    fingerprints: dict[str, bytes] = field(default_factory=dict)
    by_fingerprint: dict[bytes, str] = field(default_factory=dict)

    def fingerprint_of(self, name: str) -> bytes:
        """The 8-byte little-endian CRC-64-AVRO fingerprint of a record's schema."""
        return self.fingerprints[name]


def load_schema_set(root: Path = BUNDLED) -> SchemaSet:
    """Parse every schema under root; shared named types resolve across files."""
    named: dict[str, Any] = {}
    result = SchemaSet()
    for path in schema_files(root):
        raw = json.loads(path.read_text())
        parsed = fastavro.parse_schema(raw, named)
        full = parsed["name"]
        canonical = to_parsing_canonical_form(parsed)
        fp = bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))
        result.parsed[full] = parsed
        result.fingerprints[full] = fp
        result.by_fingerprint[fp] = full
    return result


@cache
def schema_set() -> SchemaSet:
    """The bundled schemas, parsed once per process."""
    return load_schema_set()
