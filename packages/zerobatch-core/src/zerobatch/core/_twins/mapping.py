"""Read-only file mappings: the twin of ``_mapping.pyx`` on ``mmap.mmap``."""

from __future__ import annotations

from typing import Any

import numpy as np
from zerobatch.formats.errors import ConfigError

__all__ = ["FileMapping"]


class FileMapping:
    """Twin of :class:`zerobatch.core._mapping.FileMapping` on ``mmap.mmap`` (which keeps a
    duplicate of the descriptor: fine for debugging, not for thousands of shards)."""

    def __init__(self, fd: int, size: int, path: Any = None) -> None:
        import mmap

        if size < 0:
            raise ConfigError(f"size must be >= 0, got {size}", field="size")
        self.size, self.path = size, path
        self._m = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None

    @property
    def address(self) -> int:
        if self._m is None:
            return 0
        return np.frombuffer(self._m, dtype=np.uint8).ctypes.data

    @property
    def closed(self) -> bool:
        return self._m is not None and self._m.closed

    def advise(self, advice: str) -> None:
        if advice not in ("random", "sequential", "willneed", "normal"):
            raise ConfigError(f"advice must be random, sequential, willneed or normal, got {advice!r}",
                              field="advice")

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self._m if self._m is not None else b"")

    def close(self) -> None:
        if self._m is not None:
            self._m.close()

    def __len__(self) -> int:
        return self.size
