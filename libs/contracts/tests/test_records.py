"""Every generated record type round-trips through its Avro schema for many random samples."""

from __future__ import annotations

import io
import json
import random
import shutil
from enum import Enum

import fastavro
import pytest

from tether_contracts import codegen, records
from tether_contracts.avro import canonical_form
from tether_contracts.records import RECORD_TYPES
from tether_contracts.samples import collect_named, sample_datum
from tether_contracts.schemas import load_schema_set, schema_set

SAMPLES = 25


def test_every_schema_has_a_generated_type():
    assert set(RECORD_TYPES) == set(schema_set().parsed)


@pytest.mark.parametrize("name", sorted(RECORD_TYPES))
def test_record_round_trips(name: str):
    schemas = schema_set()
    record_type = RECORD_TYPES[name]
    named = collect_named(schemas.standalone[name])
    for seed in range(SAMPLES):
        datum = sample_datum(name, named, random.Random(f"{name}:{seed}"))
        record = record_type.from_avro(datum)
        assert record.to_avro() == datum
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, schemas.parsed[name], record.to_avro())
        buf.seek(0)
        assert record_type.from_avro(fastavro.schemaless_reader(buf, schemas.parsed[name], None)) == record


@pytest.mark.parametrize("name", sorted(RECORD_TYPES))
def test_the_serdes_datum_writes_the_same_bytes_as_to_avro(name: str):
    schemas = schema_set()
    record_type = RECORD_TYPES[name]
    named = collect_named(schemas.standalone[name])
    for seed in range(SAMPLES):
        record = record_type.from_avro(sample_datum(name, named, random.Random(f"{name}:{seed}")))
        written = []
        for datum in (record.to_avro(), record.avro_datum()):
            buf = io.BytesIO()
            fastavro.schemaless_writer(buf, schemas.parsed[name], datum)
            written.append(buf.getvalue())
        assert written[0] == written[1]


def test_generated_enums_are_str_enums():
    # avro_datum() hands enum members to fastavro, which writes a str enum member by its value.
    enums = [v for v in vars(records).values() if isinstance(v, type) and issubclass(v, Enum) and v is not Enum]
    assert enums and all(issubclass(e, str) for e in enums)


def test_fingerprint_covers_the_named_types_a_record_uses():
    schemas = schema_set()
    # The canonical form of SubmitRun must define Caps inline, or a change to Caps would keep
    # SubmitRun's fingerprint and old data would be misread under it.
    form = canonical_form(schemas.standalone["tether.v1.SubmitRun"])
    assert '{"name":"tether.v1.Caps","type":"record","fields":[' in form
    assert form.count('"name":"tether.v1.ModelRef","type":"record"') == 1  # defined once, then referenced


def test_fingerprints_are_unique_and_every_released_writer_schema_is_known():
    schemas = schema_set()
    assert len(set(schemas.fingerprints.values())) == len(schemas.fingerprints)
    for fp, writer in schemas.writers.items():
        assert schemas.by_fingerprint[fp] == writer.name
    assert {w.name for w in schemas.writers.values()} == set(schemas.parsed)


def test_released_writer_schemas_of_a_changed_record_are_kept(tmp_path):
    schemas_root = tmp_path / "schemas"
    shutil.copytree(codegen.SCHEMA_ROOT, schemas_root)
    path = schemas_root / "tether/v1/types/Caps.avsc"
    schema = json.loads(path.read_text())
    schema["fields"].append({"name": "max_children", "type": "int", "default": 4, "doc": "Child runs allowed."})
    path.write_text(json.dumps(schema))
    package = tmp_path / "pkg"
    package.mkdir()
    codegen.write(schemas_root, package)

    loaded = load_schema_set(package / "avsc")
    # SubmitRun as last released (the current schema may already differ compatibly from it).
    old_fp = next(fp for fp, w in schema_set().writers.items() if w.name == "tether.v1.SubmitRun" and w.release == "v1")
    assert loaded.fingerprint_of("tether.v1.SubmitRun") != old_fp  # Caps changed, so SubmitRun did
    assert loaded.writers[old_fp].name == "tether.v1.SubmitRun"
    assert loaded.writers[old_fp].release == "v1"
