"""The kernel table: every compiled module of ``zerobatch.core`` and its pure-Python twin.

Each kernel module ``zerobatch.core._<name>`` (Cython) has a twin ``zerobatch.core._twins.<name>``
with the same ``__all__``, the same arguments, results and exceptions, written for clarity
rather than speed: the oracle the tests check the kernels against, and what
``ZEROBATCH_PUREPYTHON=1`` selects instead of the compiled code (slow; for debugging and for
platforms without a compiler).

The table is the twins folder itself: a kernel module added with its twin is exported by
``zerobatch.core`` without editing any shared file.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from types import ModuleType
from typing import Any

__all__ = ["PURE_PYTHON", "compiled", "exports", "kernel_names", "load", "twin"]

#: Whether ``ZEROBATCH_PUREPYTHON=1`` selected the twins.
PURE_PYTHON = os.environ.get("ZEROBATCH_PUREPYTHON") == "1"


def kernel_names() -> list[str]:
    """The kernel modules, by twin name (``hash``, ``gather``, ``tokstream``...), sorted."""
    from zerobatch.core import _twins

    return sorted(m.name for m in pkgutil.iter_modules(_twins.__path__) if not m.name.startswith("_"))


def twin(name: str) -> ModuleType:
    """The pure-Python twin of kernel ``name``."""
    return importlib.import_module(f"zerobatch.core._twins.{name}")


def compiled(name: str) -> ModuleType:
    """The compiled module of kernel ``name``.

    Raises:
        ImportError: the extension is missing or broken, with the command that rebuilds it.
    """
    try:
        return importlib.import_module(f"zerobatch.core._{name}")
    except ImportError as exc:  # pragma: no cover - exercised by a broken install only
        raise ImportError(
            f"zerobatch.core: the compiled extension _{name} is missing or broken ({exc}). Reinstall it "
            "with: python -m pip install --force-reinstall --no-deps zerobatch-core (or set "
            "ZEROBATCH_PUREPYTHON=1 for the slow pure-Python kernels)") from exc


def load(name: str) -> ModuleType:
    """Kernel ``name`` as selected: the twin under ``ZEROBATCH_PUREPYTHON=1``, else compiled."""
    return twin(name) if PURE_PYTHON else compiled(name)


def exports() -> dict[str, Any]:
    """Every name every selected kernel module exports (its ``__all__``).

    Raises:
        ImportError: two kernels export the same name.
    """
    out: dict[str, Any] = {}
    for name in kernel_names():
        mod = load(name)
        for n in mod.__all__:
            if n in out:
                raise ImportError(f"zerobatch.core: {n} is exported by two kernel modules")
            out[n] = getattr(mod, n)
    return out
