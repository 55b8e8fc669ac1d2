"""The kernel table (zerobatch.core._kernels): every compiled module has a twin exporting the
same names, its .pxd and its .pyi, and zerobatch.core exports exactly the table's names."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import zerobatch.core as core
from zerobatch.core import _kernels

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PACKAGE = Path(__file__).resolve().parents[2] / "packages" / "zerobatch-core"
SRC = PACKAGE / "src" / "zerobatch" / "core"


def test_every_compiled_module_exports_what_its_twin_exports():
    names = _kernels.kernel_names()
    assert {"hash", "header", "gather", "pool", "tokstream", "zrecord", "llmchnk", "features"} <= set(names)
    for name in names:
        assert sorted(_kernels.compiled(name).__all__) == sorted(_kernels.twin(name).__all__), name


def test_the_package_exports_the_table():
    table = _kernels.exports()
    for n, obj in table.items():
        assert getattr(core, n) is obj
        assert n in core.__all__


def _stub_names(stub: Path) -> set[str]:
    names = set()
    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_every_kernel_has_its_declarations_and_its_stubs():
    """Each ``_<kernel>.pyx`` comes with ``_<kernel>.pxd`` (its C-level kernels, for other
    kernels to cimport) and ``_<kernel>.pyi`` (the typed signatures of every name it exports)."""
    kernels = sorted(p.stem for p in SRC.glob("_*.pyx"))
    assert kernels == [f"_{n}" for n in _kernels.kernel_names()]
    for stem in kernels:
        assert (SRC / f"{stem}.pxd").is_file(), f"{stem}.pyx has no {stem}.pxd"
        assert (SRC / f"{stem}.pyi").is_file(), f"{stem}.pyx has no {stem}.pyi"
        missing = set(_kernels.compiled(stem[1:]).__all__) - _stub_names(SRC / f"{stem}.pyi")
        assert not missing, f"{stem}.pyi lacks {sorted(missing)}"


def test_the_distribution_ships_the_declarations_and_the_stubs():
    data = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert {"py.typed", "*.pyi", "*.pxd", "*.h"} <= set(data["zerobatch.core"])
    manifest = (PACKAGE / "MANIFEST.in").read_text().split()
    assert {"*.pyx", "*.pxd", "*.pyi", "*.h", "py.typed"} <= set(manifest)
