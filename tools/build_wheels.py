#!/usr/bin/env python3
"""Build one wheel per zerobatch distribution (and the umbrella) into a folder.

Each package under ``packages/`` is built on its own (``pip wheel --no-deps``); the umbrella
wheel ``zerobatch`` is built with ``ZEROBATCH_UMBRELLA_PINNED=1`` so it requires its siblings
by name and exact version. The folder then installs without any index::

    python tools/build_wheels.py --out dist
    pip install --no-index --find-links dist zerobatch-readers   # and what it needs

Usage::

    python tools/build_wheels.py [--out dist] [--no-build-isolation] [--only NAME ...]
    python tools/build_wheels.py --install-from dist    # reinstall every wheel there, no index

The second form is asv's install command (``asv_bench/asv.conf.json``): it force-reinstalls
every wheel of the folder without touching their dependencies, which the benchmark
environment already holds.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def packages() -> list[pathlib.Path]:
    """Every distribution folder under packages/, in dependency order."""
    order = ["formats", "core", "writers", "readers", "samplers", "prepare", "adapters", "cli"]
    found = {p.name.removeprefix("zerobatch-"): p for p in (ROOT / "packages").iterdir()
             if (p / "pyproject.toml").is_file()}
    return [found[a] for a in order if a in found] + [found[a] for a in sorted(found) if a not in order]


def clean(src: pathlib.Path) -> None:
    """Remove what earlier in-tree builds left (pip builds local folders in place, and
    setuptools never deletes a module from build/lib once its source is gone)."""
    for stale in [src / "build", *src.glob("*.egg-info"), *src.glob("src/*.egg-info")]:
        if stale.is_dir():
            shutil.rmtree(stale)


#: What a package's copy for building leaves out: earlier builds' outputs and in-place extensions.
_NOT_SOURCES = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "*.so", "*.pyc")


def build(src: pathlib.Path, out: pathlib.Path, *, isolation: bool, env: dict[str, str] | None = None) -> None:
    """Build ``src``'s wheel into ``out``. A package is built from a fresh copy of its sources,
    so that builds running at once (tests on several workers, a developer's build) never share
    a ``build/`` folder, and nothing a developer built in place reaches the wheel; the
    umbrella (``src`` the repository) holds no sources and is built where it is."""
    with tempfile.TemporaryDirectory(prefix="zb-wheel-") as tmp:
        if src != ROOT:
            src = pathlib.Path(shutil.copytree(src, pathlib.Path(tmp) / src.name, ignore=_NOT_SOURCES))
        else:
            clean(src)
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(src)]
        if not isolation:
            cmd.insert(4, "--no-build-isolation")
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "dist"), help="wheel folder (default: dist/)")
    ap.add_argument("--no-build-isolation", action="store_true",
                    help="build with the current environment's setuptools and Cython")
    ap.add_argument("--only", nargs="*", help="build only these distributions (e.g. zerobatch-core)")
    ap.add_argument("--no-umbrella", action="store_true", help="skip the zerobatch umbrella wheel")
    ap.add_argument("--install-from", metavar="DIR",
                    help="instead of building, force-reinstall every wheel in DIR (no index, no dependencies)")
    args = ap.parse_args(argv)
    if args.install_from:
        found = sorted(str(w) for w in pathlib.Path(args.install_from).glob("*.whl"))
        if not found:
            raise SystemExit(f"no wheels in {args.install_from}")
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--force-reinstall", *found]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        return 0
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for pkg in packages():
        if args.only and pkg.name not in args.only:
            continue
        build(pkg, out, isolation=not args.no_build_isolation)
    if not args.no_umbrella and not args.only:
        build(ROOT, out, isolation=not args.no_build_isolation, env={"ZEROBATCH_UMBRELLA_PINNED": "1"})
    print(f"wheels in {out}:")
    for whl in sorted(out.glob("*.whl")):
        print("  ", whl.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
