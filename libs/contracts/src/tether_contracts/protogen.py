"""Generates the gRPC stubs (package `tether_api`) from proto/tether/v1/*.proto with grpc_tools.

Run `python -m tether_contracts.protogen` after editing a .proto; `--check` exits non-zero when
the committed stubs are stale (the tests run it).

protoc names Python modules after the .proto paths (`tether/v1/x.proto` → `tether.v1.x_pb2`),
but `tether` is not a Python package here, so the generated imports are rewritten to the
installed package `tether_api.v1`. The descriptors keep their proto names (`tether/v1/x.proto`,
package `tether.v1`), which is what clients, server reflection and buf see.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[4]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_PACKAGE_DIR = Path("tether") / "v1"
OUTPUT_ROOT = Path(__file__).resolve().parents[1]  # libs/contracts/src
OUTPUT_PACKAGE = "tether_api"
OUTPUT_DIR = OUTPUT_ROOT / OUTPUT_PACKAGE

_PACKAGE_INIT = '"""gRPC stubs generated from proto/ by tether_contracts.protogen. Do not edit."""\n'
_IMPORT = re.compile(r"^(from|import) tether\.v1(\b)", re.MULTILINE)
_MODULE_NAME = re.compile(r"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, )'tether\.v1\.")


class ProtocFailed(RuntimeError):
    """protoc rejected the .proto files; the message carries its diagnostics."""


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """The .proto files of the public API, relative to `root`."""
    return sorted(p.relative_to(root) for p in (root / PROTO_PACKAGE_DIR).glob("*.proto"))


def _include_dirs() -> list[str]:
    # The well-known types ship with grpc_tools; google/api/*.proto with googleapis-common-protos.
    import google.api.field_behavior_pb2 as field_behavior
    import grpc_tools

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    googleapis = Path(field_behavior.__file__).resolve().parents[2]
    return [str(well_known), str(googleapis)]


def _rewrite(text: str) -> str:
    text = _IMPORT.sub(lambda m: f"{m.group(1)} {OUTPUT_PACKAGE}.v1{m.group(2)}", text)
    # The Python module name the classes report as __module__ (pickling, repr, tracebacks).
    return _MODULE_NAME.sub(lambda m: f"{m.group(1)}'{OUTPUT_PACKAGE}.v1.", text)


def generate(root: Path = PROTO_ROOT) -> dict[str, str]:
    """The generated package as {relative path: text}, without touching the output directory."""
    from grpc_tools import protoc

    files = proto_files(root)
    if not files:
        raise ProtocFailed(f"no .proto files under {root / PROTO_PACKAGE_DIR}")
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            *(f"-I{d}" for d in _include_dirs()),
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(f.as_posix() for f in files),
        ]
        code = protoc.main(args)
        if code != 0:
            raise ProtocFailed(f"protoc exited with {code} (see its messages above)")
        out: dict[str, str] = {
            "__init__.py": _PACKAGE_INIT,
            "v1/__init__.py": _PACKAGE_INIT,
        }
        generated = Path(tmp) / PROTO_PACKAGE_DIR
        for path in sorted(generated.iterdir()):
            if path.suffix in (".py", ".pyi"):
                out[f"v1/{path.name}"] = _rewrite(path.read_text())
    return out


def _current(output_dir: Path) -> dict[str, str]:
    if not output_dir.exists():
        return {}
    return {
        p.relative_to(output_dir).as_posix(): p.read_text()
        for p in output_dir.rglob("*")
        if p.is_file() and p.suffix in (".py", ".pyi")
    }


def write(root: Path = PROTO_ROOT, output_dir: Path = OUTPUT_DIR) -> list[str]:
    """Regenerate the package in place (removing stubs of deleted .proto files); returns the paths written."""
    plan = generate(root)
    for rel in set(_current(output_dir)) - set(plan):
        (output_dir / rel).unlink()
    for rel, text in plan.items():
        target = output_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return sorted(plan)


def stale(root: Path = PROTO_ROOT, output_dir: Path = OUTPUT_DIR) -> list[str]:
    """Generated files that are missing, extra or differ from what the .proto files produce now."""
    plan = generate(root)
    current = _current(output_dir)
    names = set(plan) | set(current)
    return sorted(rel for rel in names if plan.get(rel) != current.get(rel))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the generated stubs are stale")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for rel in problems:
            print(f"stale: {OUTPUT_DIR.relative_to(REPO_ROOT) / rel} (run python -m tether_contracts.protogen)",
                  file=sys.stderr)
        return 1 if problems else 0
    for rel in write():
        print(OUTPUT_DIR.relative_to(REPO_ROOT) / rel)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
