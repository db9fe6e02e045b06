"""The image the helm chart deploys: what can be checked without a container engine.

The Dockerfile installs the workspace with `uv sync --frozen --no-dev`; these tests check that this
install holds every module the chart starts (`python -m <module>`) and that each imports without a
dev-only distribution, that the image runs as the chart's user with a writable HOME/TMPDIR under /tmp
(the chart's read-only root filesystem), and that `make image` names what it lacks. The image build
itself is not run here (no docker/podman daemon on the test machines).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from packaging.markers import Marker
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
CHART = ROOT / "deploy" / "helm" / "tether"


def _instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (KEYWORD, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, args = line.partition(" ")
            found.append((keyword.upper(), args.strip()))
    return found


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for keyword, args in _instructions():
        if keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword, args))
    return stages


def _chart_modules() -> set[str]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return {svc["module"] for svc in values["services"].values()}


def _sync_command() -> list[str]:
    runs = [args for keyword, args in _instructions() if keyword == "RUN" and "uv sync" in args]
    assert len(runs) == 1, runs
    return runs[0].split()


def _no_dev_install() -> set[str]:
    """The distributions `uv sync --frozen --no-dev` installs: the closure of the root project's
    dependencies (with the extras they name) in uv.lock, for this platform's markers."""
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    packages = {p["name"]: p for p in lock["package"]}
    root = next(p for p in lock["package"] if p.get("source", {}).get("virtual") == ".")
    env = {"extra": ""}
    wanted, todo = set(), [root["name"]]
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted.add(name)
        pkg = packages[name]
        deps = list(pkg.get("dependencies", []))
        for dep in deps:
            if "marker" in dep and not Marker(dep["marker"]).evaluate(env):
                continue
            todo.append(dep["name"])
            for extra in dep.get("extra", []):
                deps.extend(packages[dep["name"]].get("optional-dependencies", {}).get(extra, []))
    return wanted


def test_the_dockerfile_installs_the_locked_workspace_without_dev_tools():
    sync = _sync_command()
    assert sync[:2] == ["uv", "sync"] and "--frozen" in sync and "--no-dev" in sync, sync
    # no editable install: the runtime stage gets the venv only, not the sources
    assert "--no-editable" in sync, sync
    stages = _stages()
    assert len(stages) >= 2, "multi-stage: build tools stay out of the runtime image"
    build = " ".join(args for _kw, args in stages[0])
    # the uv deploy/local/setup.sh pins, from PyPI
    pinned = re.search(r"^UV_VERSION=(\S+)$", (ROOT / "deploy/local/setup.sh").read_text(), re.M).group(1)
    assert f"UV_VERSION={pinned}" in build and "pip install" in build and "uv==${UV_VERSION}" in build
    # every workspace member (and the lock) is copied in before the sync
    members = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]["members"]
    copied = {args.split()[0] for kw, args in stages[0] if kw == "COPY"}
    assert {"pyproject.toml", "uv.lock"} <= set(" ".join(a for k, a in stages[0] if k == "COPY").split())
    assert {m.split("/")[0] for m in members} <= copied | {"pyproject.toml"}, (members, copied)


def test_the_runtime_stage_runs_as_the_charts_user_with_a_writable_home_under_tmp():
    runtime = _stages()[-1]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    user = [args for kw, args in runtime if kw == "USER"]
    assert user and user[-1].split(":")[0] == str(values["podSecurityContext"]["runAsUser"])
    env = " ".join(args for kw, args in runtime if kw == "ENV")
    # the chart mounts its only writable emptyDir at /tmp (readOnlyRootFilesystem)
    assert "HOME=/tmp" in env and "TMPDIR=/tmp" in env and "PYTHONDONTWRITEBYTECODE=1" in env
    venv = re.search(r"PATH=(\S+?)/bin:\$PATH", env)
    assert venv, env  # `python` of the chart's args is the venv's
    assert any(kw == "COPY" and "--from=" in args and venv.group(1) in args for kw, args in runtime)
    assert venv.group(1) in " ".join(a for k, a in _stages()[0] if k == "ENV")  # the venv synced at that path


def test_every_module_the_chart_runs_is_a_workspace_entry_module_in_the_no_dev_install():
    entry = {p.parent.name: canonicalize_name(_dist_of(p)) for p in ROOT.glob("services/*/src/*/__main__.py")}
    assert _chart_modules() == set(entry), "the chart runs exactly the services' entry modules"
    installed = _no_dev_install()
    for module, dist in entry.items():
        assert dist in installed, (module, dist)


def _dist_of(main: Path) -> str:
    project = main.parents[2] / "pyproject.toml"
    return tomllib.loads(project.read_text())["project"]["name"]


_IMPORT_WITHOUT = """
import importlib, importlib.abc, json, sys
blocked = set(json.loads(sys.argv[1]))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"{name} is not in the image (a dev-only distribution)")
        return None
sys.meta_path.insert(0, Block())
for module in sys.argv[2:]:
    importlib.import_module(module)
    importlib.import_module(module + ".__main__")  # main() runs only as __main__
print("ok")
"""


def test_the_charts_modules_import_without_dev_only_distributions():
    """Each module, and its __main__, imports in this venv with every distribution that the no-dev
    install leaves out made unimportable: the image's venv holds all that `python -m` needs."""
    installed = _no_dev_install()
    tops: dict[str, set[str]] = {}
    for top, dists in importlib.metadata.packages_distributions().items():
        tops[top] = {canonicalize_name(d) for d in dists}
    # a top-level name is gone from the image only if no installed distribution provides it
    blocked = sorted(top for top, dists in tops.items() if not dists & installed)
    assert "helm_python" in blocked and "promql_parser" in blocked, blocked  # the dev tools are left out
    modules = sorted(_chart_modules())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run([sys.executable, "-c", _IMPORT_WITHOUT, json.dumps(blocked), *modules],
                          cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_make_image_builds_the_charts_image_or_names_what_is_missing():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    printed = subprocess.run(["make", "-s", "-C", str(ROOT), "-n", "image", "CONTAINER_ENGINE=docker"],
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    image = f"{values['image']['repository']}:{values['image']['tag']}"
    assert f"docker build -f Dockerfile -t {image} ." in printed.stdout, printed.stdout
    missing = subprocess.run(["make", "-s", "-C", str(ROOT), "image", "CONTAINER_ENGINE="],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "no container engine" in missing.stderr, missing.stderr
