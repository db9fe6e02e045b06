"""Schema compatibility gate: each current schema must resolve both ways against its released versions.

`python -m tether_contracts.compat` checks schemas/ against every snapshot in schemas/released/
(the run event log is kept forever, so a new reader must read data of every release, and a
reader of any release must read new data) and exits 1 on a break. `--release` snapshots the
current schemas as the next release, after a passing check.

The rules are Avro's "Schema Resolution" (specification, section of that name): records
match fields by name (or a reader field's aliases), a reader field missing from the writer
needs a default, writer-only fields are skipped; int→long→float→double and string↔bytes are
promotions; a writer enum symbol unknown to the reader needs the reader's enum default;
arrays/maps resolve item/value types; the writer's union branch resolves against the first
matching reader branch; named types match on unqualified name or a reader alias; fixed sizes
must be equal. BACKWARD = new reader, old data; FORWARD = old reader, new data.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether_contracts import codegen
from tether_contracts.avro import PRIMITIVES, SchemaTree, load_tree, short_name
from tether_contracts.codegen import RELEASED_DIR, SCHEMA_ROOT, released_dirs, schema_files

BACKWARD = "backward"
FORWARD = "forward"
LINT = "lint"

_MEANING = {
    BACKWARD: "new readers cannot read data written with the released schema",
    FORWARD: "readers of the released schema cannot read data written with the new schema",
    LINT: "the current schema is invalid or undocumented",
}

# Avro spec, Schema Resolution: "the writer's schema may be promoted to the reader's".
PROMOTIONS: dict[str, frozenset[str]] = {
    "int": frozenset({"long", "float", "double"}),
    "long": frozenset({"float", "double"}),
    "float": frozenset({"double"}),
    "string": frozenset({"bytes"}),
    "bytes": frozenset({"string"}),
}

_INT_RANGE = {"int": (-(2**31), 2**31 - 1), "long": (-(2**63), 2**63 - 1)}


class CompatibilityError(Exception):
    """The current schemas break compatibility with a release; `problems` lists every break."""

    def __init__(self, problems: list[Incompatibility]) -> None:
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


@dataclass(frozen=True)
class Incompatibility:
    """One break: which direction, against which release, in which record and field, and why."""

    direction: str
    release: str
    record: str  # the top-level record being compared
    location: str  # '<record full name>.<field>' where resolution fails (or the record name)
    message: str
    path: str  # from the top-level record down to the failing node

    def __str__(self) -> str:
        against = f" vs release {self.release}" if self.release else ""
        return (
            f"{self.direction.upper()}{against}: {self.location}: {self.message} "
            f"(via {self.path}; {_MEANING[self.direction]})"
        )


@dataclass(frozen=True)
class _Loc:
    record: str
    field: str | None
    path: tuple[str, ...]

    def into_field(self, record: str, field: str) -> _Loc:
        return _Loc(record, field, self.path + (field,))

    def into(self, step: str) -> _Loc:
        return _Loc(self.record, self.field, self.path + (step,))

    @property
    def location(self) -> str:
        return f"{self.record}.{self.field}" if self.field else self.record


def _kind(node: Any) -> str:
    if isinstance(node, str):
        return node
    if isinstance(node, list):
        return "union"
    kind = node["type"]
    return "record" if kind == "error" else kind


def describe(node: Any) -> str:
    """A short human name of a schema node."""
    if isinstance(node, str):
        return node
    if isinstance(node, list):
        return "union[" + ", ".join(describe(b) for b in node) + "]"
    kind = _kind(node)
    if kind in ("record", "enum", "fixed"):
        return f"{kind} {node['name']}"
    if kind == "array":
        return f"array<{describe(node['items'])}>"
    if kind == "map":
        return f"map<{describe(node['values'])}>"
    return kind


class _Resolution:
    """Whether a reader with schema tree `reader` can read data written with tree `writer`."""

    def __init__(self, writer: SchemaTree, reader: SchemaTree) -> None:
        self.writer = writer
        self.reader = reader
        self.in_progress: set[tuple[str, str]] = set()
        self.problems: list[tuple[_Loc, str]] = []

    def _fail(self, loc: _Loc, message: str) -> bool:
        self.problems.append((loc, message))
        return False

    def names_match(self, w: dict[str, Any], r: dict[str, Any]) -> bool:
        if short_name(w["name"]) == short_name(r["name"]):
            return True
        aliases = r.get("aliases", ())
        return w["name"] in aliases or short_name(w["name"]) in {short_name(a) for a in aliases}

    def matches(self, w: Any, r: Any) -> bool:
        """The spec's shallow "match" of two non-union schemas (no recursion)."""
        wk, rk = _kind(w), _kind(r)
        if wk in PRIMITIVES and rk in PRIMITIVES:
            return wk == rk or rk in PROMOTIONS.get(wk, ())
        if wk != rk:
            return False
        if wk in ("record", "enum"):
            return self.names_match(w, r)
        if wk == "fixed":
            return self.names_match(w, r) and w["size"] == r["size"]
        return wk in ("array", "map")

    def resolve(self, w: Any, r: Any, loc: _Loc) -> bool:
        w = self.writer.resolve(w)
        r = self.reader.resolve(r)
        if isinstance(w, list):
            # Data may have been written with any branch: each must resolve.
            ok = True
            for branch in w:
                ok = self.resolve(branch, r, loc) and ok
            return ok
        if isinstance(r, list):
            for branch in r:
                if self.matches(w, self.reader.resolve(branch)):
                    return self.resolve(w, branch, loc)
            return self._fail(loc, f"writer type {describe(w)} matches no branch of the reader's {describe(r)}")
        if not self.matches(w, r):
            return self._fail(loc, f"type changed: writer {describe(w)} cannot be read as {describe(r)}")
        kind = _kind(w)
        if kind == "record":
            return self._record(w, r, loc)
        if kind == "enum":
            return self._enum(w, r, loc)
        if kind == "array":
            return self.resolve(w["items"], r["items"], loc.into("[]"))
        if kind == "map":
            return self.resolve(w["values"], r["values"], loc.into("{}"))
        return True

    def _record(self, w: dict[str, Any], r: dict[str, Any], loc: _Loc) -> bool:
        key = (w["name"], r["name"])
        if key in self.in_progress:
            return True  # recursive type: already being resolved further up
        self.in_progress.add(key)
        try:
            writer_fields = {f["name"]: f for f in w["fields"]}
            ok = True
            for rf in r["fields"]:
                floc = loc.into_field(r["name"], rf["name"])
                wf = writer_fields.get(rf["name"])
                if wf is None:
                    wf = next((writer_fields[a] for a in rf.get("aliases", ()) if a in writer_fields), None)
                if wf is not None:
                    ok = self.resolve(wf["type"], rf["type"], floc) and ok
                elif "default" not in rf:
                    ok = self._fail(
                        floc,
                        f"field {rf['name']!r} is not in the writer's schema and has no default in the reader's",
                    )
                else:
                    error = default_error(rf["default"], rf["type"], self.reader)
                    if error:
                        ok = self._fail(floc, f"field {rf['name']!r} default is unusable: {error}")
            return ok
        finally:
            self.in_progress.discard(key)

    def _enum(self, w: dict[str, Any], r: dict[str, Any], loc: _Loc) -> bool:
        missing = [s for s in w["symbols"] if s not in r["symbols"]]
        if missing and r.get("default") not in r["symbols"]:
            return self._fail(
                loc,
                f"enum {r['name']}: writer symbols {missing} are unknown to the reader, which has no default",
            )
        return True


def default_error(value: Any, schema: Any, tree: SchemaTree) -> str | None:
    """Why `value` is not a valid default for `schema` (None if it is).

    A union's default must match its first branch: the rule every Avro implementation accepts.
    """
    schema = tree.resolve(schema)
    kind = _kind(schema)
    if kind == "union":
        return default_error(value, schema[0], tree)
    if kind == "null":
        return None if value is None else f"{value!r} is not null"
    if kind == "boolean":
        return None if isinstance(value, bool) else f"{value!r} is not a boolean"
    if kind in ("int", "long"):
        lo, hi = _INT_RANGE[kind]
        ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
        return None if ok else f"{value!r} is not a valid {kind}"
    if kind in ("float", "double"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"{value!r} is not a number"
    if kind in ("string", "bytes"):
        return None if isinstance(value, str) else f"{value!r} is not a JSON string"
    if kind == "enum":
        return None if value in schema["symbols"] else f"{value!r} is not a symbol of {schema['name']}"
    if kind == "fixed":
        ok = isinstance(value, str) and len(value) == schema["size"]
        return None if ok else f"{value!r} is not {schema['size']} bytes"
    if kind == "array":
        if not isinstance(value, list):
            return f"{value!r} is not an array"
        return next((e for e in (default_error(v, schema["items"], tree) for v in value) if e), None)
    if kind == "map":
        if not isinstance(value, dict):
            return f"{value!r} is not a map"
        return next((e for e in (default_error(v, schema["values"], tree) for v in value.values()) if e), None)
    if kind == "record":
        if not isinstance(value, dict):
            return f"{value!r} is not a record"
        for f in schema["fields"]:
            if f["name"] in value:
                error = default_error(value[f["name"]], f["type"], tree)
            elif "default" in f:
                error = None
            else:
                error = f"field {f['name']!r} of {schema['name']} is missing"
            if error:
                return error
        return None
    return f"unsupported type {describe(schema)}"


def _find_current(name: str, current: SchemaTree) -> str | None:
    if name in current.named:
        return name
    for candidate, definition in current.named.items():
        if name in definition.get("aliases", ()):
            return candidate
    return None


def _resolution_problems(
    direction: str, release: str, record: str, writer: SchemaTree, w: Any, reader: SchemaTree, r: Any
) -> list[Incompatibility]:
    res = _Resolution(writer, reader)
    res.resolve(w, r, _Loc(record, None, (record,)))
    return [
        Incompatibility(direction, release, record, loc.location, message, ".".join(loc.path))
        for loc, message in res.problems
    ]


def compare(released: SchemaTree, current: SchemaTree, release: str = "") -> list[Incompatibility]:
    """Breaks between one released snapshot and the current schemas (both directions).

    Every released top-level record must still exist (by name or a current alias); new
    records are fine.
    """
    problems: list[Incompatibility] = []
    for name, old in released.records().items():
        new_name = _find_current(name, current)
        if new_name is None:
            problems.append(
                Incompatibility(BACKWARD, release, name, name, "record removed", name)
            )
            continue
        new = current.named[new_name]
        problems += _resolution_problems(BACKWARD, release, name, released, old, current, new)
        problems += _resolution_problems(FORWARD, release, name, current, new, released, old)
    return _dedupe(problems)


def _dedupe(problems: list[Incompatibility]) -> list[Incompatibility]:
    # A shared type (Usage, Caps) reached through several records reports its break once.
    seen: set[tuple[str, str, str, str]] = set()
    out = []
    for p in problems:
        key = (p.direction, p.release, p.location, p.message)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def lint(current: SchemaTree) -> list[Incompatibility]:
    """Rules the current schemas must follow: every named type and field has a doc, every default is valid."""
    problems = []
    for name, definition in current.named.items():
        if not definition.get("doc"):
            problems.append(Incompatibility(LINT, "", name, name, "no doc", name))
        for f in definition.get("fields", ()):
            location = f"{name}.{f['name']}"
            if not f.get("doc"):
                problems.append(Incompatibility(LINT, "", name, location, "field has no doc", location))
            if "default" in f:
                error = default_error(f["default"], f["type"], current)
                if error:
                    problems.append(Incompatibility(LINT, "", name, location, f"invalid default: {error}", location))
    return problems


def load_current(schema_root: Path) -> SchemaTree:
    """The current schemas under `schema_root` (released snapshots excluded)."""
    return load_tree(schema_root, schema_files(schema_root))


def check(schema_root: Path = SCHEMA_ROOT, *, latest_only: bool = False) -> list[Incompatibility]:
    """Every break of the current schemas under `schema_root` against its released snapshots."""
    current = load_current(schema_root)
    problems = lint(current)
    releases = released_dirs(schema_root / RELEASED_DIR)
    if latest_only:
        releases = releases[-1:]
    for release_dir in releases:
        released = load_tree(release_dir, schema_files(release_dir))
        problems += compare(released, current, release_dir.name)
    return problems


def _same_files(a: Path, b: Path) -> bool:
    files_a = {p.relative_to(a).as_posix() for p in schema_files(a)}
    files_b = {p.relative_to(b).as_posix() for p in schema_files(b)}
    if files_a != files_b:
        return False
    return all(filecmp.cmp(a / rel, b / rel, shallow=False) for rel in files_a)


def release(schema_root: Path = SCHEMA_ROOT) -> Path:
    """Snapshot the current schemas as the next release (`released/v<n+1>/`) and return its directory.

    Refuses (CompatibilityError) when the check fails; returns the latest release unchanged
    when nothing changed since it.
    """
    problems = check(schema_root)
    if problems:
        raise CompatibilityError(problems)
    existing = released_dirs(schema_root / RELEASED_DIR)
    if existing and _same_files(schema_root, existing[-1]):
        return existing[-1]
    numbers = [int(p.name[1:]) for p in existing if p.name[1:].isdigit()]
    target = schema_root / RELEASED_DIR / f"v{max(numbers, default=0) + 1}"
    for path in schema_files(schema_root):
        dest = target / path.relative_to(schema_root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemas", type=Path, default=SCHEMA_ROOT, help="schema root (default: schemas/)")
    parser.add_argument("--release", action="store_true", help="snapshot the current schemas as the next release")
    parser.add_argument("--latest-only", action="store_true", help="compare with the latest release only")
    args = parser.parse_args(argv)
    if args.release:
        try:
            target = release(args.schemas)
        except CompatibilityError as exc:
            for p in exc.problems:
                print(p, file=sys.stderr)
            return 1
        print(f"released: {target}")
        if args.schemas.resolve() == SCHEMA_ROOT.resolve():
            codegen.write(args.schemas)  # the package bundles released writer schemas too
        return 0
    problems = check(args.schemas, latest_only=args.latest_only)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        return 1
    releases = [p.name for p in released_dirs(args.schemas / RELEASED_DIR)]
    print(f"compatible: {len(load_current(args.schemas).top_level)} schemas vs releases {releases or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
