"""The one thread pool of zerobatch: shared worker pools for GIL-free gathers and read-ahead,
safe across fork and interpreter exit.

A :class:`TaskPool` runs two kinds of task on the same threads: compiled tasks that release
the GIL from start to finish (a gather split over threads, a queued LLMBATCH read) and
Python callables (:meth:`TaskPool.call`: a source's read that calls several kernels). A thread
that waits for a task runs it itself if no worker has started it, and otherwise sleeps: it
never starts a task queued for a later step.

:func:`shared_pool` hands out one pool per ``(num_threads, name)`` for the whole process, so
loaders and readers share threads instead of each starting their own (the loaders' read-ahead
threads are named ``zerobatch-loader-*``, the readers' ``zerobatch-pool-*``). Every pool is
stopped (each worker finishes the task in its hands, then exits) before ``fork``: no zerobatch
thread exists while the child is created, so the child never inherits a lock held by a thread
that does not exist there (the reason OpenMP pools hang in forked DataLoader workers). The
parent's pools resume right after the fork; in the child the queued tasks stay queued (their
memory was copied with everything else, so an iterator copied into the child goes on) and
threads start on first use. At interpreter exit every pool is stopped.

The other pools of zerobatch, and why each is not this one (the only places threads or
processes are made):

- **I/O threads** (:func:`io_executor`, :func:`run_io`): requests to object storage and
  uploads block on the network, not the CPU; on a :class:`TaskPool` they would hold the
  threads compiled reads need. A remote reader keeps two (``readers.remote.Fetcher``): the
  request pool, and the read-ahead pool whose tasks wait on it (never the other way round,
  so a full pool cannot wait on itself); writers and commits upload on a short-lived one.
- **Compression threads** of the ZRECORD writer (an :func:`io_executor`): long tasks fed
  through a bounded queue while the caller appends; zlib releases the GIL.
- **Processes** for tokenization (``zerobatch.prepare.workers``): Python tokenizers and
  chat templates hold the GIL, so only processes run them in parallel.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from zerobatch.core._kernels import load

__all__ = ["Call", "TaskPool", "io_executor", "run_io", "shared_pool", "track"]

_pool_module = load("pool")
TaskPool = _pool_module.TaskPool
Call = _pool_module.Call

_pools: weakref.WeakSet[TaskPool] = weakref.WeakSet()
_shared: dict[tuple[int, str], TaskPool] = {}
_lock = threading.Lock()
_paused: list[TaskPool] = []


def shared_pool(num_threads: int, name: str = "zerobatch-pool") -> TaskPool:
    """The process-wide pool of ``num_threads`` workers named ``name-*`` (made on first use)."""
    with _lock:
        pool = _shared.get((num_threads, name))
        if pool is None:
            pool = _shared[(num_threads, name)] = track(TaskPool(num_threads, name=name))
        return pool


def io_executor(threads: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``threads`` threads named ``name-*`` for blocking I/O (requests, uploads,
    compression): see the module documentation for why it is not a :class:`TaskPool`."""
    return ThreadPoolExecutor(max(1, threads), thread_name_prefix=name)


def run_io(fn: Callable[[Any], Any], items: Iterable[Any], threads: int, name: str) -> list[Any]:
    """``[fn(item) for item in items]`` on a short-lived I/O pool of at most ``threads``
    threads (inline for one item); every call finishes before the first error is raised."""
    items = list(items)
    if len(items) <= 1:
        return [fn(it) for it in items]
    out: list[Any] = []
    first: BaseException | None = None
    with io_executor(min(threads, len(items)), name) as pool:
        for f in [pool.submit(fn, it) for it in items]:
            try:
                out.append(f.result())
            except BaseException as exc:     # noqa: BLE001 - raised below, once all finished
                first = first or exc
    if first is not None:
        raise first
    return out


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
        pool.resume()
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
