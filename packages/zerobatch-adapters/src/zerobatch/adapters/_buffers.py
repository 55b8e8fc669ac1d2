"""Output buffers for read-ahead, reused once the training loop has let go of them."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["BufferPool"]


class BufferPool:
    """Output arrays reused once nothing references them any more.

    A freshly allocated output costs page faults and zeroing by the kernel, which for
    1 MiB chunks costs more than filling them; a pool keeps a few arrays and hands one out
    again only when its reference count shows that the pool is its sole owner (every tensor
    or view made from it holds a reference, so a batch the training loop still holds is
    never overwritten). When none is free a new array is allocated.

    Args:
        shape: shape of each array.
        dtype: element type.
        max_buffers: arrays kept for reuse.
        allocate: makes a new array (default ``numpy.empty``; a loader that copies to a
            CUDA device gives page-locked memory: the ring its copies start from).
    """

    def __init__(self, shape: tuple[int, ...], dtype: Any, max_buffers: int,
                 allocate: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None = None) -> None:
        self.allocate = allocate or np.empty
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.max_buffers = max(0, int(max_buffers))
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.allocated = 0
        self.reused = 0

    def acquire(self) -> np.ndarray:
        """An array of ``shape`` that nobody else references.

        Buffers are handed out most-recently-used first: the buffer released last is the one
        most likely still in the CPU caches, so writing it again is cheapest.
        """
        buffers = self._buffers
        with self._lock:
            for i in range(len(buffers) - 1, -1, -1):
                # References: the list, and getrefcount's own argument.
                if sys.getrefcount(buffers[i]) == 2:
                    arr = buffers.pop(i)
                    buffers.append(arr)
                    self.reused += 1
                    return arr
            arr = self.allocate(self.shape, self.dtype)
            self.allocated += 1
            buffers.append(arr)
            if len(buffers) > self.max_buffers:
                buffers.pop(0)
            return arr
