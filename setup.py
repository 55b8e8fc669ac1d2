"""The zerobatch umbrella: ``pip install .`` installs every distribution under packages/.

Each package under ``packages/`` is its own distribution with its own ``pyproject.toml``;
this file lists none of their files or extensions. It only declares the umbrella
distribution ``zerobatch``, which depends on every package found under ``packages/``:

- by default through a ``file://`` URL to the package's folder, so ``pip install .`` builds
  and installs all of them in one step on a machine where no package index holds zerobatch;
- with ``ZEROBATCH_UMBRELLA_PINNED=1`` (set by ``tools/build_wheels.py``) by name and exact
  version, so the umbrella wheel installs from a folder of wheels
  (``pip install --no-index --find-links dist zerobatch``).
"""

import hashlib
import os
import pathlib
import re

from setuptools import setup

ROOT = pathlib.Path(__file__).parent.resolve()
PACKAGES = sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())


def _version(pkg: pathlib.Path) -> str:
    area = pkg.name.removeprefix("zerobatch-")
    text = (pkg / "src" / "zerobatch" / area / "_version.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


VERSIONS = {p.name: _version(p) for p in PACKAGES}
if len(set(VERSIONS.values())) != 1:
    raise SystemExit(f"zerobatch packages must share one version (lock-step), found {VERSIONS}")
VERSION = next(iter(VERSIONS.values()))

_BUILD_OUTPUTS = {"build", "dist", "__pycache__"}


def _digest(pkg: pathlib.Path) -> str:
    """A hash of a package's sources.

    pip caches wheels built from a folder whose name looks like ``name-version``, as
    ``zerobatch-core`` does, and would reinstall a stale wheel after the sources changed;
    the digest in the URL's query makes every change a new URL (the query is not part of
    the folder's path).
    """
    h = hashlib.sha256()
    for f in sorted(pkg.rglob("*")):
        rel = f.relative_to(pkg)
        if not f.is_file() or _BUILD_OUTPUTS & set(rel.parts) or f.suffix in (".so", ".c", ".pyc") \
                or any(part.endswith(".egg-info") for part in rel.parts):
            continue
        h.update(str(rel).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _extras(pkg: pathlib.Path) -> list[str]:
    """The names of a package's extras (``[project.optional-dependencies]``)."""
    try:
        import tomllib
    except ImportError:            # Python 3.10: tomli, a build requirement there
        import tomli as tomllib
    with open(pkg / "pyproject.toml", "rb") as f:
        return sorted(tomllib.load(f).get("project", {}).get("optional-dependencies", {}))


def _requirement(pkg: pathlib.Path, extra: str | None = None) -> str:
    name = f"{pkg.name}[{extra}]" if extra else pkg.name
    if os.environ.get("ZEROBATCH_UMBRELLA_PINNED") == "1":
        return f"{name}=={VERSION}"
    return f"{name} @ {pkg.as_uri()}?src={_digest(pkg)}"


requires = [_requirement(p) for p in PACKAGES]
# The umbrella's extras: each extra of any package (remote, torch, jax, chat, parquet, plot,
# tiktoken, sentencepiece, datatrove, ray, ...) under its own name, asking every package that
# has it (``pip install '.[remote,chat]'``: the remote extra of core, readers, writers,
# adapters and the CLI at once), and ``all``. The requirement strings are those of
# install_requires plus the extra, so pip sees one URL per package.
extras: dict[str, list[str]] = {}
for _pkg in PACKAGES:
    for _extra in _extras(_pkg):
        extras.setdefault(_extra, []).append(_requirement(_pkg, _extra))
extras["all"] = sorted({r for reqs in extras.values() for r in reqs})

setup(
    name="zerobatch",
    version=VERSION,
    description="Pre-tokenized LLM training data at the speed of memory: every zerobatch package",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[],
    install_requires=requires,
    extras_require=extras,
)
