"""Where this process stands in a distributed job, with no communication.

``rank`` / ``world_size`` come from, in order: the caller; ``torch.distributed`` when it is
initialized; the ``RANK`` / ``WORLD_SIZE`` environment variables that ``torchrun`` sets;
otherwise a single process.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from zerobatch.formats.errors import ConfigError
from zerobatch.core.checks import check_rank

__all__ = ["resolve_rank"]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: environment variable must be an integer, got {value!r}", field=name) from exc


def resolve_rank(rank: Any = None, world_size: Any = None) -> tuple[int, int]:
    """``(rank, world_size)`` for this process.

    Raises:
        ConfigError: only one of the two given, or values out of range.
    """
    if (rank is None) != (world_size is None):
        raise ConfigError("pass both rank and world_size, or neither", field="rank")
    if rank is None:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            env_rank, env_world = _env_int("RANK"), _env_int("WORLD_SIZE")
            if env_world is not None:
                rank, world_size = (env_rank or 0), env_world
            else:
                rank, world_size = 0, 1
    return check_rank(rank, world_size)
