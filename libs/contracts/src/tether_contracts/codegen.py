"""Generates pydantic record types from schemas/**.avsc, so no record is written twice by hand.

Run `python -m tether_contracts.codegen` after editing a schema; `--check` exits non-zero when
the committed output is stale (the tests run it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[4]
SCHEMA_ROOT = REPO_ROOT / "schemas"
PACKAGE_DIR = Path(__file__).resolve().parent
GENERATED_MODULE = PACKAGE_DIR / "records.py"
BUNDLED_SCHEMAS = PACKAGE_DIR / "avsc"
#: Directory (under a schema root) holding released snapshots: released/<release>/<same tree>.
RELEASED_DIR = "released"

# Shared named types must be defined before the records that use them.
_KIND_ORDER = {"types": 0, "envelope": 1, "commands": 2, "events": 3}

_PRIMITIVES = {
    "string": "str",
    "int": "int",
    "long": "int",
    "float": "float",
    "double": "float",
    "boolean": "bool",
    "bytes": "bytes",
    "null": "None",
}


def _references(node, found: set[str]) -> set[str]:
    """Full names a schema refers to (strings that are not primitives)."""
    if isinstance(node, str):
        if node not in _PRIMITIVES and "." in node:
            found.add(node)
    elif isinstance(node, list):
        for item in node:
            _references(item, found)
    elif isinstance(node, dict):
        for key in ("type", "items", "values", "fields"):
            if key in node:
                _references(node[key], found)
    return found


def _defined(node, found: set[str], namespace: str = "") -> set[str]:
    """Full names a schema defines (records and enums, nested ones included)."""
    if isinstance(node, list):
        for item in node:
            _defined(item, found, namespace)
    elif isinstance(node, dict):
        if node.get("type") in ("record", "enum", "fixed") and "name" in node:
            ns = node.get("namespace", namespace)
            found.add(f"{ns}.{node['name']}" if ns and "." not in node["name"] else node["name"])
            namespace = ns
        for key in ("type", "items", "values", "fields"):
            if key in node:
                _defined(node[key], found, namespace)
    return found


def schema_files(root: Path = SCHEMA_ROOT) -> list[Path]:
    """The current schema files, each after the files defining the names it uses.

    Released snapshots (`released/` under the root) are excluded: the compatibility gate and the
    bundled writer schemas read them separately.
    """
    files = sorted(
        (p for p in root.rglob("*.avsc") if RELEASED_DIR not in p.relative_to(root).parts),
        key=lambda p: (_KIND_ORDER.get(p.parent.name, 9), p.as_posix()),
    )
    info = {}
    for p in files:
        raw = json.loads(p.read_text())
        info[p] = (_defined(raw, set()), _references(raw, set()))
    ordered: list[Path] = []
    known: set[str] = set()
    pending = list(files)
    while pending:
        progress = False
        for p in list(pending):
            defines, refs = info[p]
            if refs <= known | defines:
                ordered.append(p)
                known |= defines
                pending.remove(p)
                progress = True
        if not progress:
            missing = {str(p): sorted(info[p][1] - known - info[p][0]) for p in pending}
            raise ValueError(f"unresolvable schema references: {missing}")
    return ordered


def _release_number(path: Path) -> tuple[int, str]:
    digits = path.name.lstrip("v")
    return (int(digits), path.name) if digits.isdigit() else (-1, path.name)


def released_dirs(released_root: Path) -> list[Path]:
    """Released snapshot directories (`v1`, `v2`, ...), oldest first."""
    if not released_root.is_dir():
        return []
    return sorted((p for p in released_root.iterdir() if p.is_dir()), key=_release_number)


class _Generator:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.enums: dict[str, list[str]] = {}
        self.records: dict[str, str] = {}

    def py_type(self, t) -> str:
        if isinstance(t, str):
            if t in _PRIMITIVES:
                return _PRIMITIVES[t]
            return self._short(t)
        if isinstance(t, list):
            non_null = [x for x in t if x != "null"]
            inner = " | ".join(self.py_type(x) for x in non_null)
            return f"{inner} | None" if "null" in t else inner
        kind = t["type"]
        if kind == "array":
            return f"list[{self.py_type(t['items'])}]"
        if kind == "map":
            return f"dict[str, {self.py_type(t['values'])}]"
        if kind == "enum":
            self._emit_enum(t)
            return self._short(t["name"])
        if kind == "record":
            raise ValueError(f"inline records are not supported; declare {t['name']} in types/")
        if kind in _PRIMITIVES:
            return _PRIMITIVES[kind]
        raise ValueError(f"unsupported Avro type: {t!r}")

    @staticmethod
    def _short(name: str) -> str:
        return name.rsplit(".", 1)[-1]

    def _emit_enum(self, t: dict) -> None:
        name = self._short(t["name"])
        if name in self.enums:
            return
        self.enums[name] = t["symbols"]
        self.lines.append(f"\n\nclass {name}(str, Enum):")
        self.lines.append(f'    """{t.get("doc", name)}"""\n')
        for s in t["symbols"]:
            self.lines.append(f'    {s} = "{s}"')

    def emit_record(self, schema: dict, kind: str) -> None:
        full = f'{schema.get("namespace", "")}.{schema["name"]}'.strip(".")
        name = schema["name"]
        fields = []
        for f in schema["fields"]:
            fields.append((f, self.py_type(f["type"])))
        self.lines.append(f"\n\nclass {name}(AvroRecord):")
        self.lines.append(f'    """{schema["doc"]}"""\n')
        self.lines.append(f'    AVRO_NAME: ClassVar[str] = "{full}"')
        self.lines.append(f'    KIND: ClassVar[str] = "{kind}"')
        for f, py in fields:
            desc = json.dumps(f["doc"])
            if "default" in f:
                default = f["default"]
                if isinstance(default, (list, dict)):
                    val = f"Field(default_factory=lambda: {default!r}, description={desc})"
                elif isinstance(f["type"], dict) and f["type"].get("type") == "enum":
                    val = f"Field({self._short(f['type']['name'])}.{default}, description={desc})"
                else:
                    val = f"Field({default!r}, description={desc})"
            else:
                val = f"Field(description={desc})"
            self.lines.append(f"    {f['name']}: {py} = {val}")
        self.records[full] = name


def generate(root: Path = SCHEMA_ROOT) -> str:
    """The source of records.py for the schemas under root."""
    gen = _Generator()
    for path in schema_files(root):
        schema = json.loads(path.read_text())
        gen.emit_record(schema, path.parent.name)
    header = [
        '"""Record types generated from schemas/ by tether_contracts.codegen. Do not edit."""',
        "",
        "from __future__ import annotations",
        "",
        "from enum import Enum",
        "from typing import ClassVar",
        "",
        "from pydantic import Field",
        "",
        "from tether_contracts.base import AvroRecord",
    ]
    registry = ["", "", "RECORD_TYPES: dict[str, type[AvroRecord]] = {"]
    for full, name in gen.records.items():
        registry.append(f'    "{full}": {name},')
    registry.append("}")
    return "\n".join(header + gen.lines + registry) + "\n"


def _bundle_plan(root: Path) -> dict[str, str]:
    """What the package bundles: the current schemas, and every released snapshot under released/."""
    plan = {p.relative_to(root).as_posix(): p.read_text() for p in schema_files(root)}
    for release in released_dirs(root / RELEASED_DIR):
        for p in schema_files(release):
            plan[f"{RELEASED_DIR}/{release.name}/{p.relative_to(release).as_posix()}"] = p.read_text()
    return plan


def write(root: Path = SCHEMA_ROOT, package_dir: Path = PACKAGE_DIR) -> None:
    """Regenerate records.py and the bundled schemas of the package at `package_dir`."""
    (package_dir / GENERATED_MODULE.name).write_text(generate(root))
    bundled = package_dir / BUNDLED_SCHEMAS.name
    if bundled.exists():
        shutil.rmtree(bundled)
    for rel, text in _bundle_plan(root).items():
        target = bundled / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def stale(root: Path = SCHEMA_ROOT, package_dir: Path = PACKAGE_DIR) -> list[str]:
    """Names of generated artefacts that differ from what the schemas produce now."""
    problems = []
    module = package_dir / GENERATED_MODULE.name
    if not module.exists() or module.read_text() != generate(root):
        problems.append(_display(module))
    bundled_dir = package_dir / BUNDLED_SCHEMAS.name
    bundled = {
        p.relative_to(bundled_dir).as_posix(): p.read_text()
        for p in bundled_dir.rglob("*.avsc")
    } if bundled_dir.exists() else {}
    if bundled != _bundle_plan(root):
        problems.append(_display(bundled_dir))
    return problems


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    parser.add_argument("--schemas", type=Path, default=SCHEMA_ROOT, help="schema root (default: schemas/)")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale(args.schemas)
        for p in problems:
            print(f"stale: {p} (run python -m tether_contracts.codegen)", file=sys.stderr)
        return 1 if problems else 0
    write(args.schemas)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
