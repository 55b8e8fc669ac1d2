"""Argument checks shared by the kernels and every sampler: seeds, epochs, ranks, sizes, index arrays.

Each check refuses ``bool`` (an ``int`` in Python, never a count or a seed here), floats
(``1.5``, ``NaN``, ``inf``), negative values and values past the stated bound, with a
:class:`~zerobatch.formats.errors.ConfigError` naming the parameter.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from zerobatch.formats.errors import ConfigError, OutOfRangeError

__all__ = ["as_positions", "check_bitmap", "check_count", "check_out", "check_position", "check_rank", "check_seed", "positions_and_out"]


def check_count(value: Any, name: str, *, minimum: int = 0, maximum: int = 2**63 - 1) -> int:
    """``value`` as an int in ``[minimum, maximum]``.

    Raises:
        ConfigError: not an integer (``bool`` and floats included) or out of range.
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ConfigError(f"{name} must be an integer, got {value!r}", field=name)
    v = value.__index__()
    if v < minimum or v > maximum:
        raise ConfigError(f"{name} must be between {minimum} and {maximum}, got {v}", field=name)
    return v


def check_seed(seed: Any, name: str = "seed") -> int:
    """A seed: an integer in ``[0, 2**64)``.

    Raises:
        ConfigError: ``bool``, float (``NaN`` and ``inf`` included), negative, or at least 2**64.
    """
    return check_count(seed, name, minimum=0, maximum=2**64 - 1)


def check_rank(rank: Any, world_size: Any) -> tuple[int, int]:
    """``(rank, world_size)`` with ``world_size >= 1`` and ``0 <= rank < world_size``.

    Raises:
        ConfigError: either is not an integer, ``world_size < 1`` or ``rank`` outside
            ``[0, world_size)``.
    """
    w = check_count(world_size, "world_size", minimum=1)
    if isinstance(rank, bool) or not hasattr(rank, "__index__"):
        raise ConfigError(f"rank must be an integer, got {rank!r}", field="rank")
    r = rank.__index__()
    if not 0 <= r < w:
        raise ConfigError(f"rank must be between 0 and world_size-1 = {w - 1}, got {r}", field="rank")
    return r, w


def as_positions(positions: Any, name: str = "positions") -> np.ndarray:
    """``positions`` as a flat C-contiguous ``int64`` array, refusing non-integer dtypes.

    A float array (``1.5``, ``NaN``) is a caller's bug, never silently truncated; ``uint64``
    values past ``2**63 - 1`` cannot be positions in any range zerobatch permutes.

    Raises:
        ConfigError: a non-integer dtype.
        IndexError: an unsigned value above ``2**63 - 1``.
    """
    arr = np.asarray(positions)
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.empty(0, dtype=np.int64)
        raise ConfigError(f"{name} must be integers, got dtype {arr.dtype}", field=name)
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(arr.max()) > 2**63 - 1:
        raise OutOfRangeError(f"{name}: {int(arr.max())} is out of range")
    return np.ascontiguousarray(arr, dtype=np.int64).reshape(-1)


def check_out(out: Any, count: int, name: str = "out") -> np.ndarray:
    """A caller's output buffer: writable C-contiguous ``int64`` with ``count`` elements.

    Raises:
        ConfigError: wrong type, dtype, layout, size, or read-only.
    """
    if not isinstance(out, np.ndarray) or out.dtype != np.int64 or not out.flags.c_contiguous:
        raise ConfigError(f"{name} must be a C-contiguous int64 numpy array", field=name)
    if not out.flags.writeable:
        raise ConfigError(f"{name} is read-only", field=name)
    if out.size != count:
        raise ConfigError(f"{name} holds {out.size} elements, expected {count}", field=name)
    return out


def positions_and_out(positions: Any, out: Any, name: str = "positions") -> tuple[np.ndarray, np.ndarray]:
    """``(flat int64 positions, output array)`` for a bulk call: ``out`` is checked when
    given, else a new ``int64`` array shaped like ``positions``.

    Raises:
        ConfigError: non-integer positions or an unfit ``out``.
        IndexError: an unsigned position above ``2**63 - 1``.
    """
    shape = np.shape(positions)
    pos = as_positions(positions, name)
    if out is None:
        return pos, np.empty(shape, dtype=np.int64)
    return pos, check_out(out, pos.size)


def check_position(i: Any, n: int, name: str = "position") -> int:
    """A scalar position in ``[0, n)``.

    Raises:
        IndexError: not an integer (``bool`` and floats included) or out of range.
    """
    if isinstance(i, bool):
        raise OutOfRangeError(f"{name} must be an integer, got {i!r}")
    try:
        v = operator.index(i)
    except TypeError:
        raise OutOfRangeError(f"{name} must be an integer, got {type(i).__name__}") from None
    if v < 0 or v >= n:
        raise OutOfRangeError(f"{name} {v} is out of range [0, {n})")
    return v


def check_bitmap(given: Any, nbytes: int, name: str) -> np.ndarray:
    """A caller's byte-per-item bitmap (a writable C-contiguous ``uint8`` array of at least
    ``nbytes``), or a fresh zeroed one when ``given`` is None.

    Raises:
        ConfigError: an unfit array.
    """
    if given is None:
        return np.zeros(nbytes, dtype=np.uint8)
    if not isinstance(given, np.ndarray) or given.dtype != np.uint8 or given.size < nbytes \
            or not given.flags.c_contiguous or not given.flags.writeable:
        raise ConfigError(f"{name} must be a writable uint8 array of {nbytes} bytes", field=name)
    return given
