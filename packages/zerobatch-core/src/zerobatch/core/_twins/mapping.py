"""Read-only file mappings: the twin of ``_mapping.pyx``, a subclass of ``mmap.mmap`` (so the
buffer protocol works on every Python, 3.10 included). From Python 3.13 it holds no descriptor
(``trackfd=False``), as the compiled mapping; before, an ``mmap`` keeps a duplicate of the
descriptor: fine for debugging, not for thousands of shards under a small ``RLIMIT_NOFILE``."""

from __future__ import annotations

import mmap
import sys
from typing import Any

import numpy as np

from zerobatch.formats.errors import ConfigError

__all__ = ["FileMapping"]

_ADVICE = ("random", "sequential", "willneed", "normal")
#: A mapping that keeps no duplicate of the descriptor (Python 3.13+).
_NO_FD = {"trackfd": False} if sys.version_info >= (3, 13) else {}


class FileMapping(mmap.mmap):
    """Twin of :class:`zerobatch.core._mapping.FileMapping`.

    A mapping of 0 bytes is an anonymous page of which no byte is part of the mapping
    (``len()`` is 0; ``mmap`` cannot map an empty range of a file).
    """

    def __new__(cls, fd: int, size: int, path: Any = None) -> FileMapping:
        if size < 0:
            raise ConfigError(f"size must be >= 0, got {size}", field="size")
        if size == 0:
            m = super().__new__(cls, -1, 1, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20),
                                prot=mmap.PROT_READ)
        else:
            m = super().__new__(cls, fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, **_NO_FD)
        m.size, m.path = size, path
        return m

    def __init__(self, fd: int, size: int, path: Any = None) -> None:
        pass

    @property
    def address(self) -> int:
        if self.size == 0:
            return 0
        return np.frombuffer(self, dtype=np.uint8).ctypes.data

    def advise(self, advice: str) -> None:
        if advice not in _ADVICE:
            raise ConfigError(f"advice must be random, sequential, willneed or normal, got {advice!r}",
                              field="advice")
        flag = getattr(mmap, f"MADV_{advice.upper()}", None)
        if flag is not None and self.size:
            try:
                self.madvise(flag)
            except OSError:
                pass  # advisory

    def __len__(self) -> int:
        return self.size
