"""Generated code is current, staleness is detected on a temporary copy, and regeneration fixes it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tether_contracts import codegen


def test_generated_code_is_current():
    assert codegen.stale() == []


def test_check_command_passes():
    done = subprocess.run([sys.executable, "-m", "tether_contracts.codegen", "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def copies(tmp_path: Path) -> tuple[Path, Path]:
    """Private copies of schemas/ and of the generated artefacts (records.py, avsc/)."""
    schemas = tmp_path / "schemas"
    shutil.copytree(codegen.SCHEMA_ROOT, schemas)
    package = tmp_path / "pkg"
    package.mkdir()
    shutil.copyfile(codegen.GENERATED_MODULE, package / codegen.GENERATED_MODULE.name)
    shutil.copytree(codegen.BUNDLED_SCHEMAS, package / codegen.BUNDLED_SCHEMAS.name)
    return schemas, package


def test_edited_schema_makes_generated_code_stale_until_regenerated(copies):
    schemas, package = copies
    assert codegen.stale(schemas, package) == []
    path = schemas / "tether/v1/types/Caps.avsc"
    schema = json.loads(path.read_text())
    schema["fields"].append({"name": "max_children", "type": "int", "default": 4, "doc": "Child runs allowed."})
    path.write_text(json.dumps(schema, indent=2))

    problems = codegen.stale(schemas, package)
    assert [Path(p).name for p in problems] == ["records.py", "avsc"]

    codegen.write(schemas, package)
    assert codegen.stale(schemas, package) == []
    source = (package / "records.py").read_text()
    assert 'max_children: int = Field(4, description="Child runs allowed.")' in source
    compile(source, "records.py", "exec")


def test_a_new_release_snapshot_makes_the_bundle_stale(copies):
    schemas, package = copies
    release = schemas / "released" / "v99"
    shutil.copytree(schemas / "tether", release / "tether")
    assert [Path(p).name for p in codegen.stale(schemas, package)] == ["avsc"]
    codegen.write(schemas, package)
    assert (package / "avsc/released/v99/tether/v1/types/Caps.avsc").exists()
    assert codegen.stale(schemas, package) == []


def test_released_snapshots_are_not_current_schemas():
    names = {p.relative_to(codegen.SCHEMA_ROOT).parts[0] for p in codegen.schema_files()}
    assert names == {"tether"}


def test_check_command_fails_on_a_stale_copy(copies, capsys):
    schemas, package = copies
    (schemas / "tether/v1/commands/CancelRun.avsc").unlink()
    assert codegen.stale(schemas, package)
    # main() checks the real package against the given schemas: stale by construction here.
    assert codegen.main(["--check", "--schemas", str(schemas)]) == 1
    assert "stale:" in capsys.readouterr().err
