"""Shared worker pools for GIL-free gathers, safe across fork and interpreter exit.

:func:`shared_pool` hands out one :class:`TaskPool` per thread count for the whole process,
so several loaders share threads instead of each starting its own. Every pool made here is
stopped (its queued tasks finished, its threads joined) before ``fork``: no zerobatch
thread exists while the child is created, so the child never inherits a lock held by a
thread that does not exist there (the reason OpenMP pools hang in forked DataLoader
workers). The parent's pools restart right after the fork; a child's restart on first use.
At interpreter exit every pool is stopped before the interpreter tears down.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref

from zerobatch.core._kernels import load

__all__ = ["TaskPool", "shared_pool", "track"]

TaskPool = load("pool").TaskPool

_pools: weakref.WeakSet[TaskPool] = weakref.WeakSet()
_shared: dict[int, TaskPool] = {}
_lock = threading.Lock()
_paused: list[TaskPool] = []


def shared_pool(num_threads: int) -> TaskPool:
    """The process-wide pool with ``num_threads`` workers (created on first use)."""
    with _lock:
        pool = _shared.get(num_threads)
        if pool is None:
            pool = _shared[num_threads] = track(TaskPool(num_threads))
        return pool


def track(pool: TaskPool) -> TaskPool:
    """Register a pool for the fork and exit handling above; returns it."""
    _pools.add(pool)
    return pool


def _before_fork() -> None:
    _lock.acquire()
    _paused.clear()
    for pool in list(_pools):
        if pool.threads:
            pool.stop()
            _paused.append(pool)


def _after_fork_parent() -> None:
    for pool in _paused:
        pool.start()
    _paused.clear()
    _lock.release()


def _after_fork_child() -> None:
    global _lock
    for pool in list(_pools):
        pool.reinit_after_fork()
    _paused.clear()
    _lock = threading.Lock()


def _stop_all() -> None:
    for pool in list(_pools):
        pool.stop()


atexit.register(_stop_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                        after_in_child=_after_fork_child)
