"""Argument checks shared by every sampler: seeds, epochs, ranks, sizes.

Each check refuses ``bool`` (an ``int`` in Python, never a count or a seed here), floats
(``1.5``, ``NaN``, ``inf``), negative values and values past the stated bound, with a
:class:`~zerobatch.formats.errors.ConfigError` naming the parameter.
"""

from __future__ import annotations

from typing import Any

from zerobatch.formats.errors import ConfigError

__all__ = ["check_count", "check_rank", "check_seed"]


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
