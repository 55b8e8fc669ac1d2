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
LAYERS = {"formats": 0, "core": 1, "writers": 2, "readers": 2, "samplers": 2, "adapters": 3, "prepare": 3, "cli": 4}


def area(pkg: Path) -> str:
    return pkg.name.removeprefix("zerobatch-")


def version(pkg: Path) -> str:
    text = (pkg / "src" / "zerobatch" / area(pkg) / "_version.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def test_eight_distributions():
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
        declared = {d.split("==")[0].split("[")[0].removeprefix("zerobatch-")
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


#: each trainer's packages, and the one adapters module that may import them
TRAINERS = {
    "hf.py": ("transformers", "accelerate", "trl", "datasets"),
    "lightning.py": ("lightning", "pytorch_lightning"),
    "grain.py": ("grain",),
    "torchtitan.py": ("torchtitan",),
    "megatron.py": ("megatron",),
    "olmo.py": ("olmo_core",),
}


def test_each_trainer_is_imported_only_by_its_own_module():
    """A trainer integration is a small module importing its trainer there alone: nothing new
    is imported for users who do not use it (and the rest imports without it)."""
    for module, names in TRAINERS.items():
        pattern = re.compile(rf"^\s*(?:import|from)\s+(?:{'|'.join(names)})\b", re.M)
        for pkg in PACKAGES:
            for src in (pkg / "src").rglob("*.py"):
                if pattern.search(src.read_text()):
                    assert src.name == module and area(pkg) == "adapters", (str(src), names)


def test_preparation_loads_neither_a_trainer_nor_the_command_line(tmp_path):
    """zerobatch.prepare is the library under ``zerobatch convert``: a conversion through it
    imports no torch, no adapters and nothing of zerobatch.cli (the registry names each
    format's target in zerobatch.prepare.formats)."""
    import subprocess
    code = ("import sys, numpy as np\n"
            "from zerobatch.prepare import convert\n"
            "np.save('t.npy', np.arange(60, dtype=np.uint16).reshape(6, 10))\n"
            "for to, dst in (('tokstream', 't.ts'), ('llmchnk', 't.chunk'), ('zrecord', 't.zr'), ('megatron', 't')):\n"
            "    convert('t.npy', dst, to=to, quiet=True, log=lambda *_: None)\n"
            "convert('t.ts', 'n.bin', to='nanogpt', quiet=True, log=lambda *_: None)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('zerobatch.cli', "
            "'zerobatch.adapters', 'zerobatch.samplers'))))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def _modules() -> dict[str, Path]:
    """Every module of every distribution, by dotted name (packages by their ``__init__``)."""
    found = {}
    for pkg in PACKAGES:
        root = pkg / "src"
        for src in root.rglob("*"):
            if src.suffix not in (".py", ".pyx") or "build" in src.relative_to(root).parts:
                continue
            parts = list(src.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = src
    return found


_IMPORT = re.compile(r"^[ \t]*(?:from\s+(zerobatch[\w.]*)\s+c?import\s+(\([\w\s,*]+\)|[\w \t,*]+)"
                     r"|c?import\s+(zerobatch[\w.]*))", re.M)


def _imports(src: Path, modules: dict[str, Path]) -> set[str]:
    """The zerobatch modules ``src`` imports, anywhere in it (a function's lazy import too)."""
    out = set()
    for m in _IMPORT.finditer(src.read_text()):
        if m.group(3):
            name = m.group(3)
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            out.add(name)
            continue
        base = m.group(1)
        for item in re.split(r"[\s,]+", m.group(2).strip("() \t\n")):
            item = item.split(" as ")[0].strip()
            if not item or item == "as":
                continue
            sub = f"{base}.{item}"
            out.add(sub if sub in modules else base)
    return {n for n in out if n in modules}


def test_no_import_cycles():
    """No module imports (at import time or lazily) a module that imports it back, through
    any chain: every layer and every package's modules form a one-way graph."""
    modules = _modules()
    graph = {name: _imports(src, modules) - {name} for name, src in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_benchmarks_read_lower_as_better():
    """asv's regression gate reads every benchmark as lower-is-better: a ``track_*`` benchmark
    reports a time per unit of work or a ratio, never a rate (``.../s``)."""
    for bench in (REPO / "asv_bench" / "benchmarks").glob("bench_*.py"):
        for m in re.finditer(r"^\s*(track_\w+)\.unit\s*=\s*\"([^\"]+)\"", bench.read_text(), re.M):
            assert not m.group(2).endswith("/s"), (bench.name, m.group(1), m.group(2))


def test_every_source_is_visible_to_type_checkers():
    """``zerobatch.adapters.sources`` fills its namespace at import time (one module per
    format, no shared edit); its ``TYPE_CHECKING`` block spells the same names out for mypy
    and IDEs, each imported from the module that defines it. They must not drift apart."""
    import ast
    import importlib

    from zerobatch.adapters import sources
    path = Path(sources.__file__)
    tree = ast.parse(path.read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    declared = next(ast.literal_eval(n.value) for n in block.body if isinstance(n, ast.Assign)
                    and ast.unparse(n.targets[0]) == "__all__")
    assert sorted(declared) == sorted(sources.__all__)
    imported = {a.asname or a.name: n.module for n in block.body if isinstance(n, ast.ImportFrom)
                for a in n.names}
    for name in sources.__all__:
        obj = getattr(sources, name)
        if name in imported:
            assert importlib.import_module(imported[name]).__dict__[name] is obj, name
        else:      # the base names, imported from _base or defined in the package
            assert name in ("CHUNK_BYTES", "IGNORE_INDEX", "Array", "Source", "Value", "build", "open_source"), name
    # the loaders re-export every source
    import zerobatch.adapters.torch as zt
    assert set(sources.__all__) <= set(zt.__all__)


#: the packages mypy finds no error in (pyproject.toml's [tool.mypy]); each joins as it is cleaned
TYPE_CLEAN = ["packages/zerobatch-prepare/src/zerobatch/prepare"]


def test_mypy_sees_the_sources_and_their_signatures_and_the_clean_packages_stay_clean(tmp_path):
    """The reproduction: ``from zerobatch.adapters.torch import TokenWindows`` was
    ``Module has no attribute`` and a wrong argument type passed unchecked. The same run
    (one analysis of numpy and torch, most of its time) checks each package of
    :data:`TYPE_CLEAN` (from the repository root: its config names the namespace's roots, so
    a folder's modules are named as ``-p`` names them, and the untyped optional dependencies)."""
    import pytest
    pytest.importorskip("mypy")
    import subprocess
    import sys
    snippet = tmp_path / "user.py"
    snippet.write_text("from zerobatch.adapters.torch import TokenWindows, PackedDocuments, FlatDocuments\n"
                       "from zerobatch.adapters.sources import Mixture\n"
                       "TokenWindows('corpus/', '128')\n"
                       "reveal_type(FlatDocuments('corpus/'))\n")
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent",
                        "--python-executable", sys.executable, *TYPE_CLEAN, str(snippet)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert "has no attribute" not in out, out
    assert 'Argument 2 to "TokenWindows" has incompatible type "str"; expected "int"' in out, out
    assert 'Revealed type is "zerobatch.adapters.sources.packed.FlatDocuments"' in out, out
    others = [line for line in out.splitlines() if ": error:" in line and not line.startswith(str(snippet))]
    assert not others, out
    assert "Found 1 error in 1 file" in out, out


def test_the_umbrella_offers_every_extra_of_every_package():
    """``pip install '.[remote,chat]'`` asks each package for the extras it has, through the
    very requirement (URL) the umbrella installs it by: one URL per package, so pip resolves
    (asking ``./packages/zerobatch-cli[remote]`` beside ``.`` was ResolutionImpossible)."""
    import os
    from distutils.core import run_setup   # setuptools' shim

    here = os.getcwd()
    try:
        os.chdir(REPO)
        dist = run_setup(str(REPO / "setup.py"), stop_after="init")
    finally:
        os.chdir(here)
    base = {r.split(" @ ")[0]: r.split(" @ ")[1] for r in dist.install_requires}
    extras = dist.extras_require
    wanted: dict[str, set[str]] = {}
    for pkg in sorted((REPO / "packages").iterdir()):
        if not (pkg / "pyproject.toml").is_file():
            continue
        opts = tomllib.loads((pkg / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
        for extra in opts:
            wanted.setdefault(extra, set()).add(f"{pkg.name}[{extra}]")
    assert {"remote", "torch", "jax", "chat", "parquet", "plot", "tiktoken", "sentencepiece", "datatrove",
            "ray"} <= set(wanted)
    for extra, names in wanted.items():
        got = {r.split(" @ ")[0] for r in extras[extra]}
        assert got == names, extra
        for r in extras[extra]:
            name, url = r.split(" @ ")
            assert url == base[name.split("[")[0]], r
    assert {r.split(" @ ")[0] for r in extras["all"]} == set().union(*wanted.values())
