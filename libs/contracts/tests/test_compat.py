"""The schema compatibility gate: the real schemas pass; deliberate breaks on a temporary copy fail; compatible
changes pass and fastavro really reads old data with the new schema (and new data with the old one)."""

from __future__ import annotations

import io
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import fastavro
import pytest
from fastavro.read import SchemaResolutionError

from tether_contracts import compat
from tether_contracts.avro import load_tree, parse_standalone, standalone
from tether_contracts.codegen import SCHEMA_ROOT, released_dirs, schema_files
from tether_contracts.samples import sample_datum

CURRENT = "tether/v1"


@pytest.fixture
def schemas(tmp_path: Path) -> Path:
    """A private copy of schemas/ (current + released); the real files are never edited."""
    root = tmp_path / "schemas"
    shutil.copytree(SCHEMA_ROOT, root)
    return root


def edit(root: Path, rel: str, change: Callable[[dict], None]) -> None:
    path = root / CURRENT / rel
    schema = json.loads(path.read_text())
    change(schema)
    path.write_text(json.dumps(schema, indent=2))


def field(schema: dict, name: str) -> dict:
    return next(f for f in schema["fields"] if f["name"] == name)


def problems_of(root: Path) -> list[compat.Incompatibility]:
    return compat.check(root)


# -- the real schemas ----------------------------------------------------------------------


def test_every_current_schema_is_compatible_with_every_release():
    assert released_dirs(SCHEMA_ROOT / "released"), "no released snapshot: run python -m tether_contracts.compat --release"
    assert compat.check(SCHEMA_ROOT) == []


def test_every_released_record_still_exists():
    current = load_tree(SCHEMA_ROOT, schema_files(SCHEMA_ROOT))
    for release in released_dirs(SCHEMA_ROOT / "released"):
        old = load_tree(release, schema_files(release))
        assert set(old.records()) <= set(current.named), release.name


def test_cli_exit_codes(schemas: Path, capsys):
    assert compat.main(["--schemas", str(schemas)]) == 0
    edit(schemas, "types/Caps.avsc", lambda s: s["fields"].append(
        {"name": "max_children", "type": "int", "doc": "New cap without a default."}))
    assert compat.main(["--schemas", str(schemas)]) == 1
    assert "tether.v1.Caps.max_children" in capsys.readouterr().err


# -- breaks are rejected, naming record and field -------------------------------------------


def test_new_field_without_default_is_a_backward_break(schemas: Path):
    edit(schemas, "types/Caps.avsc", lambda s: s["fields"].append(
        {"name": "max_children", "type": "int", "doc": "New cap without a default."}))
    problems = problems_of(schemas)
    assert [(p.direction, p.location) for p in problems] == [("backward", "tether.v1.Caps.max_children")]
    assert "no default" in problems[0].message
    assert "release v1" in str(problems[0])


def test_removed_field_without_default_is_a_forward_break(schemas: Path):
    edit(schemas, "events/ApprovalDecided.avsc", lambda s: s["fields"].remove(field(s, "args_hash")))
    problems = problems_of(schemas)
    assert {(p.direction, p.location) for p in problems} == {("forward", "tether.v1.ApprovalDecided.args_hash")}


def test_string_to_int_is_a_break_both_ways(schemas: Path):
    edit(schemas, "commands/DecideApproval.avsc", lambda s: field(s, "approval_id").update(type="int"))
    problems = problems_of(schemas)
    assert {(p.direction, p.location) for p in problems} == {
        ("backward", "tether.v1.DecideApproval.approval_id"),
        ("forward", "tether.v1.DecideApproval.approval_id"),
    }
    assert all("string" in p.message and "int" in p.message for p in problems)


def test_removed_enum_symbol_is_a_break(schemas: Path):
    def drop_expired(s: dict) -> None:
        field(s, "outcome")["type"]["symbols"].remove("EXPIRED")

    edit(schemas, "events/ApprovalDecided.avsc", drop_expired)
    problems = problems_of(schemas)
    assert [(p.direction, p.location) for p in problems] == [("backward", "tether.v1.ApprovalDecided.outcome")]
    assert "EXPIRED" in problems[0].message


def test_added_enum_symbol_breaks_old_readers_unless_the_enum_has_a_default(schemas: Path):
    edit(schemas, "events/ApprovalDecided.avsc",
         lambda s: field(s, "outcome")["type"]["symbols"].append("ESCALATED"))
    problems = problems_of(schemas)
    assert [(p.direction, p.location) for p in problems] == [("forward", "tether.v1.ApprovalDecided.outcome")]


def test_narrowing_long_to_int_is_a_backward_break(schemas: Path):
    edit(schemas, "types/BlobRef.avsc", lambda s: field(s, "size").update(type="int"))
    problems = problems_of(schemas)
    assert {(p.direction, p.location) for p in problems} == {("backward", "tether.v1.BlobRef.size")}


def test_a_break_in_a_shared_type_is_found_through_the_records_using_it(schemas: Path):
    edit(schemas, "types/Usage.avsc", lambda s: field(s, "input_tokens").update(type="boolean", default=False))
    problems = problems_of(schemas)
    # Reported once per direction, although RunCompleted, ModelCallCompleted, ... all embed Usage.
    assert sorted((p.direction, p.location) for p in problems) == [
        ("backward", "tether.v1.Usage.input_tokens"), ("forward", "tether.v1.Usage.input_tokens")]


def test_a_break_inside_an_embedded_record_names_the_path(schemas: Path):
    released = load_tree(_released(schemas), schema_files(_released(schemas)))
    edit(schemas, "types/Usage.avsc", lambda s: field(s, "input_tokens").update(type="boolean", default=False))
    current = load_tree(schemas, schema_files(schemas))
    del released.top_level["tether/v1/types/Usage.avsc"]  # compare only the records that embed it
    paths = {p.path for p in compat.compare(released, current, "v1")}
    assert "tether.v1.ModelCallCompleted.usage.input_tokens" in paths


def test_removed_record_is_a_break_and_a_new_record_is_fine(schemas: Path):
    (schemas / CURRENT / "commands/CancelRun.avsc").unlink()
    (schemas / CURRENT / "commands/PauseRun.avsc").write_text(json.dumps({
        "type": "record", "name": "PauseRun", "namespace": "tether.v1", "doc": "Command: pause a run.",
        "fields": [{"name": "principal_id", "type": "string", "doc": "Who asks."}],
    }))
    problems = problems_of(schemas)
    assert [(p.record, p.message) for p in problems] == [("tether.v1.CancelRun", "record removed")]


def test_renamed_record_with_alias_is_backward_compatible_only(schemas: Path):
    path = schemas / CURRENT / "commands/CancelRun.avsc"
    schema = json.loads(path.read_text())
    schema.update(name="StopRun", aliases=["tether.v1.CancelRun"])
    path.unlink()
    (schemas / CURRENT / "commands/StopRun.avsc").write_text(json.dumps(schema))
    # New readers know the old name through the alias; aliases are reader-side, so readers of
    # the released schema cannot read a record named StopRun (STYLE: a break is a new record).
    assert [(p.direction, p.location) for p in problems_of(schemas)] == [("forward", "tether.v1.CancelRun")]


def test_renamed_field_with_alias_is_backward_compatible_only(schemas: Path):
    def rename(s: dict) -> None:
        f = field(s, "reason")
        f.update(name="why", aliases=["reason"])

    edit(schemas, "commands/CancelRun.avsc", rename)
    # New readers find 'reason' through the alias; old readers fall back on reason's default.
    assert problems_of(schemas) == []


def test_union_narrowing_is_a_break(schemas: Path):
    edit(schemas, "events/StepGranted.avsc", lambda s: field(s, "loop_warning").update(type="string", default=""))
    problems = problems_of(schemas)
    assert {(p.direction, p.location) for p in problems} == {("backward", "tether.v1.StepGranted.loop_warning")}
    assert "null" in problems[0].message


def test_invalid_default_is_rejected(schemas: Path):
    edit(schemas, "types/Caps.avsc", lambda s: s["fields"].append(
        {"name": "max_children", "type": "int", "default": "many", "doc": "Bad default."}))
    problems = problems_of(schemas)
    assert {p.location for p in problems} == {"tether.v1.Caps.max_children"}
    assert {p.direction for p in problems} >= {"lint"}


def test_missing_doc_is_rejected(schemas: Path):
    edit(schemas, "types/Caps.avsc", lambda s: s["fields"].append(
        {"name": "max_children", "type": "int", "default": 3}))
    assert [(p.direction, p.location) for p in problems_of(schemas)] == [("lint", "tether.v1.Caps.max_children")]


def test_release_refuses_a_break_and_snapshots_a_compatible_change(schemas: Path):
    edit(schemas, "types/Caps.avsc", lambda s: s["fields"].append(
        {"name": "max_children", "type": "int", "doc": "No default."}))
    with pytest.raises(compat.CompatibilityError) as err:
        compat.release(schemas)
    assert "tether.v1.Caps.max_children" in str(err.value)
    edit(schemas, "types/Caps.avsc", lambda s: field(s, "max_children").update(default=4))
    target = compat.release(schemas)
    assert target.name == "v2"
    assert json.loads((target / CURRENT / "types/Caps.avsc").read_text())["fields"][-1]["default"] == 4
    assert compat.release(schemas) == target  # nothing changed since v2: no v3


# -- compatible changes pass, and fastavro agrees --------------------------------------------


def _roundtrip(writer_root: Path, reader_root: Path, name: str, seed: int) -> tuple[dict, dict]:
    """Write a random datum with writer_root's schema for `name`, read it with reader_root's."""
    writer = load_tree(writer_root, schema_files(writer_root))
    reader = load_tree(reader_root, schema_files(reader_root))
    datum = sample_datum(name, writer.named, random.Random(seed))
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parse_standalone(standalone(name, writer)), datum)
    buf.seek(0)
    return datum, fastavro.schemaless_reader(buf, parse_standalone(standalone(name, writer)),
                                             parse_standalone(standalone(name, reader)))


def _released(root: Path) -> Path:
    return released_dirs(root / "released")[-1]


def test_new_field_with_default_passes_and_old_data_reads_with_the_default(schemas: Path):
    edit(schemas, "types/Caps.avsc", lambda s: s["fields"].append(
        {"name": "max_children", "type": "int", "default": 4, "doc": "Child runs allowed."}))
    assert problems_of(schemas) == []
    for seed in range(30):
        old, read = _roundtrip(_released(schemas), schemas, "tether.v1.SubmitRun", seed)
        assert read["caps"]["max_children"] == 4
        assert {k: v for k, v in read["caps"].items() if k != "max_children"} == old["caps"]
        new, read_old = _roundtrip(schemas, _released(schemas), "tether.v1.SubmitRun", seed)
        assert "max_children" not in read_old["caps"]


def test_promotions_pass_and_fastavro_promotes(schemas: Path):
    edit(schemas, "types/Remaining.avsc", lambda s: field(s, "steps").update(type="long"))
    edit(schemas, "types/AgentSpec.avsc", lambda s: field(s, "compaction_threshold").update(type="double"))
    backward_only = {(p.direction, p.location) for p in problems_of(schemas)}
    # Widening is backward compatible; old readers cannot narrow a long/double back.
    assert backward_only == {("forward", "tether.v1.Remaining.steps"),
                             ("forward", "tether.v1.AgentSpec.compaction_threshold")}
    for seed in range(30):
        old, read = _roundtrip(_released(schemas), schemas, "tether.v1.StepGranted", seed)
        assert read["remaining"]["steps"] == old["remaining"]["steps"]


def test_string_to_bytes_is_compatible_both_ways(schemas: Path):
    edit(schemas, "events/RunRejected.avsc", lambda s: field(s, "detail").update(type="bytes"))
    assert problems_of(schemas) == []
    old, read = _roundtrip(_released(schemas), schemas, "tether.v1.RunRejected", 7)
    assert read["detail"] == old["detail"].encode()


def test_enum_symbol_added_with_enum_default_is_compatible(schemas: Path):
    def add(s: dict) -> None:
        enum = field(s, "outcome")["type"]
        enum["symbols"].append("ESCALATED")
        enum["default"] = "REJECTED"

    edit(schemas, "events/ApprovalDecided.avsc", add)
    # The released readers have no enum default: an ESCALATED written now is unreadable to them.
    assert [(p.direction, p.location) for p in problems_of(schemas)] == [
        ("forward", "tether.v1.ApprovalDecided.outcome")]


def test_checker_agrees_with_fastavro_on_a_rejected_change(schemas: Path):
    edit(schemas, "types/Caps.avsc", lambda s: s["fields"].append(
        {"name": "max_children", "type": "int", "doc": "No default."}))
    assert problems_of(schemas)
    with pytest.raises(SchemaResolutionError):
        _roundtrip(_released(schemas), schemas, "tether.v1.Caps", 1)


def test_widening_to_a_union_is_backward_compatible_and_fastavro_reads_it(schemas: Path):
    edit(schemas, "events/RunCompleted.avsc", lambda s: field(s, "answer").update(type=["string", "null"]))
    assert {(p.direction, p.location) for p in problems_of(schemas)} == {
        ("forward", "tether.v1.RunCompleted.answer")}
    for seed in range(10):
        old, read = _roundtrip(_released(schemas), schemas, "tether.v1.RunCompleted", seed)
        assert read["answer"] == old["answer"]
