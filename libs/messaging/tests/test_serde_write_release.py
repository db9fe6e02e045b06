"""Rolling upgrades: a pinned write release (TETHER_SCHEMA_WRITE_RELEASE) makes upgraded producers write
what pods of that release read.

Bundled v1 lacks four record types added since (RunQueued, ...), so v1 itself cannot be pinned
with today's schemas; `upgrade_root` builds the schema tree of a release that has them (the real v1
snapshot plus the record files added since, unchanged), in which RunAccepted and ModelCallCompleted
still lack the fields they gained. The old consumer is built from the real v1 snapshot alone.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tether_contracts.records import Envelope, ModelCallCompleted, RunAccepted
from tether_contracts.samples import collect_named, sample_datum
from tether_contracts.schemas import BUNDLED, SchemaSet, load_schema_set, schema_set
from tether_messaging.chain import GENESIS_HASH, seal, verify_chain
from tether_messaging.envelopes import headers_for, make_envelope
from tether_messaging.registry import RegistryCodec, SchemaRegistryClient
from tether_messaging.serde import (
    WRITE_RELEASE_ENV,
    SingleObjectCodec,
    UnknownFingerprint,
    WriteReleaseRefused,
    decode,
    decode_as,
    encode,
    write_pin,
)

V1 = BUNDLED / "released" / "v1"


def upgrade_root(tmp_path: Path, envelope_without: str | None = None) -> Path:
    """Current schemas plus a release 'v1' = the real v1 snapshot and the files added since."""
    root = tmp_path / "avsc"
    shutil.copytree(BUNDLED / "tether", root / "tether")
    release = root / "released" / "v1"
    shutil.copytree(V1 / "tether", release / "tether")
    for current in (BUNDLED / "tether").rglob("*.avsc"):
        target = release / current.relative_to(BUNDLED)
        if not target.exists():
            shutil.copyfile(current, target)
    if envelope_without:
        (path,) = (release / "tether").rglob("Envelope.avsc")
        schema = json.loads(path.read_text())
        schema["fields"] = [f for f in schema["fields"] if f["name"] != envelope_without]
        path.write_text(json.dumps(schema))
    return root


def old_consumer() -> SchemaSet:
    """What a pod of release v1 knows: the v1 snapshot as its current schemas, nothing newer."""
    return load_schema_set(V1)


def sample(record_type, schemas: SchemaSet, **update):
    schema = schemas.standalone[record_type.AVRO_NAME]
    datum = sample_datum(schema, collect_named(schema), random.Random(7))
    return record_type.from_avro(datum).model_copy(update=update)


def test_a_pinned_record_carries_the_released_fingerprint_and_both_releases_read_it(tmp_path):
    schemas = load_schema_set(upgrade_root(tmp_path))
    pin = write_pin("v1", schemas)
    old = old_consumer()
    accepted = sample(RunAccepted, schemas, loop_guard_version=3)
    completed = sample(ModelCallCompleted, schemas, usage_estimated=True)

    for record, new_field, default in ((accepted, "loop_guard_version", None), (completed, "usage_estimated", False)):
        data = encode(record, schemas, pin)
        name = record.AVRO_NAME
        assert data[2:10] == old.fingerprint_of(name) != schemas.fingerprint_of(name)
        assert schemas.writers[data[2:10]].release == "v1"
        seen_by_new = decode(data, schemas)  # an upgraded pod: the new field at its default
        assert getattr(record, new_field) != default and getattr(seen_by_new, new_field) == default
        assert encode(seen_by_new, schemas, pin) == data  # it read everything that was written
        seen_by_old = decode(data, old)  # a pod still on v1 reads it, every field written included
        assert type(seen_by_old) is type(record)
        assert encode(seen_by_old, old, None) == data
        kept = [f["name"] for f in old.standalone[name]["fields"][:2]]
        assert {k: getattr(seen_by_old, k) for k in kept} == {k: getattr(record, k) for k in kept}

        with pytest.raises(UnknownFingerprint):  # unpinned, the v1 pod dead-letters it
            decode(encode(record, schemas, None), old)


def test_a_record_unchanged_since_the_release_is_written_as_today(tmp_path):
    schemas = load_schema_set(upgrade_root(tmp_path))
    envelope = sample(Envelope, schemas)
    assert encode(envelope, schemas, write_pin("v1", schemas)) == encode(envelope, schemas, None)


def test_the_real_v1_cannot_be_pinned_because_it_lacks_record_types_added_since():
    with pytest.raises(WriteReleaseRefused) as refused:
        write_pin("v1", schema_set())
    assert refused.value.release == "v1"
    assert any(p.startswith("tether.v1.RunQueued: not in release v1") for p in refused.value.problems)
    assert not any("TenantLimits" in p for p in refused.value.problems)  # a nested type: never written alone
    with pytest.raises(WriteReleaseRefused, match="no released snapshot named 'v9'"):
        write_pin("v9", schema_set())


def test_a_release_a_current_record_does_not_resolve_against_is_refused(tmp_path):
    root = upgrade_root(tmp_path)
    (path,) = (root / "released" / "v1" / "tether").rglob("RunAccepted.avsc")
    schema = json.loads(path.read_text())
    schema["fields"].append({"name": "gone", "type": "string", "doc": "A field the current schema dropped."})
    path.write_text(json.dumps(schema))
    with pytest.raises(WriteReleaseRefused, match=r"tether\.v1\.RunAccepted\.gone"):
        write_pin("v1", load_schema_set(root))


def test_the_registry_codec_registers_and_writes_the_released_envelope_schema(tmp_path, schema_registry):
    url, state = schema_registry
    schemas = load_schema_set(upgrade_root(tmp_path, envelope_without="traceparent"))
    release_envelope = schemas.writers[schemas.releases["v1"]["tether.v1.Envelope"]]
    assert release_envelope.release == "v1"
    payload = sample(RunAccepted, schemas, loop_guard_version=3)
    envelope = sample(Envelope, schemas, traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01",
                      payload=encode(payload, schemas, write_pin("v1", schemas)))

    data = RegistryCodec(SchemaRegistryClient(url), schemas, write_pin("v1", schemas)).encode_value(envelope, "t")
    schema_id = int.from_bytes(data[1:5], "big")
    assert json.loads(state.schemas[schema_id]) == release_envelope.standalone
    assert "traceparent" not in state.schemas[schema_id]

    read = RegistryCodec(SchemaRegistryClient(url), schemas, None).decode_value(data)
    assert read == envelope.model_copy(update={"traceparent": None})
    assert decode(read.payload, old_consumer()).avro_datum()["principal_id"] == payload.principal_id


def _run(env_release: str | None, code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != WRITE_RELEASE_ENV}
    if env_release is not None:
        env[WRITE_RELEASE_ENV] = env_release
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_the_process_pin_comes_from_the_environment_and_refuses_at_codec_start_up(tmp_path):
    refused = _run("v1", "from tether_messaging.registry import envelope_codec; envelope_codec(None)")
    assert refused.returncode != 0
    assert "WriteReleaseRefused: TETHER_SCHEMA_WRITE_RELEASE=v1 refused" in refused.stderr
    assert "tether.v1.RunQueued: not in release v1" in refused.stderr

    root = upgrade_root(tmp_path)
    code = f"""
import random
from pathlib import Path
from tether_contracts.records import Envelope, RunAccepted
from tether_contracts.samples import collect_named, sample_datum
from tether_contracts.schemas import load_schema_set
from tether_messaging.serde import SingleObjectCodec, encode
schemas = load_schema_set(Path({str(root)!r}))
schema = schemas.standalone[RunAccepted.AVRO_NAME]
record = RunAccepted.from_avro(sample_datum(schema, collect_named(schema), random.Random(7)))
codec = SingleObjectCodec(schemas)
print(codec.pin.release if codec.pin else None, encode(record, schemas)[2:10].hex())
"""
    schemas = load_schema_set(root)
    pinned, unpinned = _run("v1", code), _run(None, code)
    assert pinned.returncode == 0, pinned.stderr
    assert pinned.stdout.split() == ["v1", old_consumer().fingerprint_of(RunAccepted.AVRO_NAME).hex()]
    assert unpinned.stdout.split() == ["None", schemas.fingerprint_of(RunAccepted.AVRO_NAME).hex()]


def test_an_envelope_codec_with_the_pin_round_trips_through_the_old_consumer(tmp_path):
    schemas = load_schema_set(upgrade_root(tmp_path))
    envelope = sample(Envelope, schemas)
    data = SingleObjectCodec(schemas, write_pin("v1", schemas)).encode_value(envelope, "t")
    assert decode_as(data, Envelope, old_consumer()).avro_datum() == envelope.avro_datum()


# -- the envelope names the schema its payload was written with ------------------------------------------
def _sealed_log(schemas: SchemaSet, pin) -> list[Envelope]:
    """A run's first two events, enveloped with `pin` and sealed into a chain."""
    records = (sample(RunAccepted, schemas, loop_guard_version=3), sample(ModelCallCompleted, schemas,
                                                                         usage_estimated=True))
    log, prev = [], GENESIS_HASH
    for seq, record in enumerate(records, start=1):
        env = seal(make_envelope(record, run_id="r1", tenant_id="t1", event_id=f"e{seq}", producer="budget",
                                 recorded_at_ms=1000 + seq, schemas=schemas, pin=pin), seq, prev)
        log.append(env)
        prev = env.hash
    return log


def test_under_a_pin_the_envelope_names_the_released_schema_its_payload_was_written_with(tmp_path):
    # The envelope named the current schema while the payload was written with the release's: the
    # chain hash covered a fingerprint that decodes nothing the payload holds, and the
    # tether-schema-fingerprint header told consumers of the old release a schema they do not know.
    schemas = load_schema_set(upgrade_root(tmp_path))
    old = old_consumer()
    log = _sealed_log(schemas, write_pin("v1", schemas))
    for env in log:
        name = env.event_type
        assert env.schema_fingerprint == bytes(env.payload[2:10]).hex() == old.fingerprint_of(name).hex()
        assert env.schema_fingerprint != schemas.fingerprint_of(name).hex()
        assert schemas.writers[bytes.fromhex(env.schema_fingerprint)].release == "v1"
        assert dict(headers_for(env))["tether-schema-fingerprint"] == env.schema_fingerprint.encode()
        assert type(decode(bytes(env.payload), old)).AVRO_NAME == name  # the old release reads what it names
    assert verify_chain(log) == []
    seen_by_old = [decode_as(SingleObjectCodec(old, None).encode_value(env, "t"), Envelope, old) for env in log]
    assert verify_chain(seen_by_old) == []  # and its auditor verifies the chain


def test_without_a_pin_the_envelope_names_the_current_schema_as_before(tmp_path):
    schemas = load_schema_set(upgrade_root(tmp_path))
    log = _sealed_log(schemas, None)
    for env in log:
        assert env.schema_fingerprint == schemas.fingerprint_of(env.event_type).hex() == bytes(env.payload[2:10]).hex()
    assert verify_chain(log) == []
    # The bundled schemas, the process's (absent) pin: what every service writes today.
    env = make_envelope(sample(RunAccepted, schema_set()), run_id="r", tenant_id="t", event_id="e", producer="p",
                        recorded_at_ms=0)
    assert env.schema_fingerprint == schema_set().fingerprint_of(RunAccepted.AVRO_NAME).hex()


def test_the_process_pin_reaches_the_envelope(tmp_path):
    root = upgrade_root(tmp_path)
    code = f"""
import random
from pathlib import Path
from tether_contracts.records import RunAccepted
from tether_contracts.samples import collect_named, sample_datum
from tether_contracts.schemas import load_schema_set
from tether_messaging.envelopes import make_envelope
schemas = load_schema_set(Path({str(root)!r}))
schema = schemas.standalone[RunAccepted.AVRO_NAME]
record = RunAccepted.from_avro(sample_datum(schema, collect_named(schema), random.Random(7)))
env = make_envelope(record.model_copy(update={{"loop_guard_version": 3}}), run_id="r", tenant_id="t", event_id="e",
                    producer="budget", recorded_at_ms=0, schemas=schemas)
print(env.schema_fingerprint, bytes(env.payload[2:10]).hex())
"""
    pinned, unpinned = _run("v1", code), _run(None, code)
    assert pinned.returncode == 0, pinned.stderr
    released = old_consumer().fingerprint_of(RunAccepted.AVRO_NAME).hex()
    assert pinned.stdout.split() == [released, released]
    current = load_schema_set(root).fingerprint_of(RunAccepted.AVRO_NAME).hex()
    assert unpinned.stdout.split() == [current, current]
