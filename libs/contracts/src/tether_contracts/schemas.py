"""The bundled Avro schemas, parsed, with their CRC-64-AVRO fingerprints (pure, no I/O beyond package data).

Besides the current schemas, the set knows the writer schemas of every released snapshot
(`avsc/released/<release>/`, copied from `schemas/released/` by codegen), so a record written
by an older producer is still decoded: its fingerprint names the old writer schema, and Avro
schema resolution reads it into the current type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from tether_contracts.avro import (
    SchemaTree,
    crc64_fingerprint,
    load_tree,
    parse_standalone,
    short_name,
    standalone,
)
from tether_contracts.codegen import released_dirs, schema_files

BUNDLED = Path(__file__).resolve().parent / "avsc"


@dataclass(frozen=True)
class WriterSchema:
    """A schema some producer wrote with: the current record it reads into, and from which release."""

    name: str
    parsed: Any
    release: str | None = None  # None for the current schema
    #: Its self-contained JSON (what a schema registry is given for it).
    standalone: Any = None


@dataclass
class SchemaSet:
    """Every record schema by full name, and the reverse map from fingerprint to name."""

    parsed: dict[str, Any] = field(default_factory=dict)
    fingerprints: dict[str, bytes] = field(default_factory=dict)
    by_fingerprint: dict[bytes, str] = field(default_factory=dict)
    #: Self-contained JSON schema of each record (what a schema registry is given).
    standalone: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Every known writer schema by fingerprint: the current ones and those of released snapshots.
    writers: dict[bytes, WriterSchema] = field(default_factory=dict)
    #: Per release, the fingerprint its writer schema has for each current record it holds
    #: (unchanged records included: their fingerprint is the current one).
    releases: dict[str, dict[str, bytes]] = field(default_factory=dict)
    #: The parsed trees, for the compatibility checks of a pinned write release
    #: (`current_tree`, and each release's by name).
    current_tree: SchemaTree | None = None
    release_trees: dict[str, SchemaTree] = field(default_factory=dict)

    def fingerprint_of(self, name: str) -> bytes:
        """The 8-byte little-endian CRC-64-AVRO fingerprint of a record's schema."""
        return self.fingerprints[name]

    def reader_name_for(self, writer_name: str, writer_aliases: list[str] | tuple[str, ...] = ()) -> str | None:
        """The current record that reads data written with a schema named `writer_name`:
        the same full name, or a current record whose aliases list it (a renamed record)."""
        if writer_name in self.parsed:
            return writer_name
        for name, schema in self.standalone.items():
            aliases = schema.get("aliases", ())
            if writer_name in aliases or short_name(writer_name) in {short_name(a) for a in aliases}:
                return name
        return None


def _add_current(result: SchemaSet, tree: SchemaTree) -> None:
    for name in tree.top_level.values():
        schema = standalone(name, tree)
        parsed = parse_standalone(schema)
        fp = crc64_fingerprint(schema)
        result.standalone[name] = schema
        result.parsed[name] = parsed
        result.fingerprints[name] = fp
        result.by_fingerprint[fp] = name
        result.writers[fp] = WriterSchema(name, parsed, standalone=schema)
    result.current_tree = tree


def _add_release(result: SchemaSet, release: str, tree: SchemaTree) -> None:
    result.release_trees[release] = tree
    written = result.releases.setdefault(release, {})
    for name in tree.top_level.values():
        schema = standalone(name, tree)
        fp = crc64_fingerprint(schema)
        reader = result.reader_name_for(name)
        if reader is None:
            continue  # the record was removed; the compatibility gate forbids that for released records
        written[reader] = fp
        if fp in result.writers:
            continue  # unchanged since that release
        result.writers[fp] = WriterSchema(reader, parse_standalone(schema), release, schema)
        result.by_fingerprint[fp] = reader


def load_schema_set(root: Path = BUNDLED) -> SchemaSet:
    """Parse every schema under root; shared named types resolve across files.

    Released snapshots under `root/released/<release>/` add the writer schemas of older producers.
    """
    result = SchemaSet()
    _add_current(result, load_tree(root, schema_files(root)))
    for release_dir in reversed(released_dirs(root / "released")):
        _add_release(result, release_dir.name, load_tree(release_dir, schema_files(release_dir)))
    return result


@cache
def schema_set() -> SchemaSet:
    """The bundled schemas, parsed once per process."""
    return load_schema_set()
