"""Rules of the monorepo that a quick look can check: lock-step versions, one-way
dependencies, the namespace, torch only in the adapters."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p for p in (REPO / "packages").iterdir() if (p / "pyproject.toml").is_file())
LAYERS = {"formats": 0, "core": 1, "writers": 2, "readers": 2, "samplers": 2, "adapters": 3, "cli": 4}


def area(pkg: Path) -> str:
    return pkg.name.removeprefix("zerobatch-")


def version(pkg: Path) -> str:
    text = (pkg / "src" / "zerobatch" / area(pkg) / "_version.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def test_seven_distributions():
    assert [area(p) for p in PACKAGES] == sorted(LAYERS)


def test_versions_move_in_lock_step_and_siblings_are_pinned():
    versions = {version(p) for p in PACKAGES}
    assert len(versions) == 1
    (v,) = versions
    for pkg in PACKAGES:
        meta = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
        assert meta["name"] == pkg.name
        for dep in meta.get("dependencies", []):
            if dep.startswith("zerobatch-"):
                assert dep.endswith(f"=={v}"), (pkg.name, dep)


def test_no_distribution_ships_the_namespace_init():
    assert not list(REPO.glob("packages/*/src/zerobatch/__init__.py"))


def test_dependencies_run_one_way():
    for pkg in PACKAGES:
        mine = LAYERS[area(pkg)]
        declared = {d.split("==")[0].removeprefix("zerobatch-")
                    for d in tomllib.loads((pkg / "pyproject.toml").read_text())["project"].get("dependencies", [])
                    if d.startswith("zerobatch-")}
        for other in declared:
            assert LAYERS[other] < mine, (pkg.name, other)
        for src in (pkg / "src").rglob("*.py*"):
            if src.suffix not in (".py", ".pyx", ".pxd"):
                continue
            for m in re.finditer(r"^\s*(?:from|import|cimport)\s+zerobatch\.(\w+)", src.read_text(), re.M):
                used = m.group(1)
                if used in LAYERS and used != area(pkg):
                    assert used in declared, (str(src), used)


def test_torch_is_imported_only_in_the_adapters():
    pattern = re.compile(r"^\s*(import torch|from torch)", re.M)
    for pkg in PACKAGES:
        if area(pkg) in ("adapters", "cli"):
            continue
        for src in (pkg / "src").rglob("*.py"):
            assert not pattern.search(src.read_text()), src
