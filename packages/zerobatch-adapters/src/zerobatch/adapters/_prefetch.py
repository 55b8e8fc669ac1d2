"""Ordered prefetch on threads: run jobs ahead of the consumer, hand results back in order.

The jobs zerobatch runs here are compiled gathers that release the GIL, so worker threads
convert the next batches on other cores while the training step runs. Results come back
in submission order; a job's exception is raised to the consumer when it reaches that job.

Threads stop cleanly on :meth:`OrderedPrefetcher.close`, when the job iterator is exhausted,
when the prefetcher is garbage-collected, at interpreter exit, and around ``fork``: every
live prefetcher joins its threads before a fork (so no zerobatch thread holds a lock the
child would inherit) and restarts them afterwards in the parent and, lazily, in the child.
"""

from __future__ import annotations

import atexit
import collections
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["OrderedPrefetcher"]

_STOP = object()
_live: weakref.WeakSet[OrderedPrefetcher] = weakref.WeakSet()
_live_lock = threading.Lock()


class _Job:
    __slots__ = ("done", "error", "fn", "result")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()


class OrderedPrefetcher:
    """Iterate over the results of ``jobs``, computed up to ``depth`` ahead on threads.

    Args:
        jobs: an iterator of zero-argument callables; each is called on a worker thread.
        depth: jobs submitted ahead of the consumer (at least 1).
        num_threads: worker threads (at least 1).
        name: thread name prefix, for debugging.
    """

    def __init__(self, jobs: Iterator[Callable[[], Any]], *, depth: int = 4, num_threads: int = 2,
                 name: str = "zerobatch-prefetch") -> None:
        self._jobs = jobs
        self._depth = max(1, int(depth))
        self._num_threads = max(1, int(num_threads))
        self._name = name
        self._queue: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._pending: collections.deque[_Job] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._exhausted = False
        self._closed = False
        self._pid = os.getpid()
        with _live_lock:
            _live.add(self)
        self._start_threads()
        self._fill()

    # worker side -----------------------------------------------------------------------------

    def _start_threads(self) -> None:
        self._threads = [
            threading.Thread(target=_worker, args=(self._queue, self._cond), daemon=True,
                             name=f"{self._name}-{i}")
            for i in range(self._num_threads)
        ]
        for t in self._threads:
            t.start()

    def _stop_threads(self) -> None:
        with self._cond:
            for _ in self._threads:
                self._queue.appendleft(_STOP)
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
        self._threads = []

    # consumer side ---------------------------------------------------------------------------

    def _fill(self) -> None:
        while not self._exhausted and len(self._pending) < self._depth:
            try:
                fn = next(self._jobs)
            except StopIteration:
                self._exhausted = True
                break
            job = _Job(fn)
            self._pending.append(job)
            with self._cond:
                self._queue.append(job)
                self._cond.notify()

    def __iter__(self) -> OrderedPrefetcher:
        return self

    def __next__(self) -> Any:
        if not self._pending:
            self._fill()
            if not self._pending:
                self.close()
                raise StopIteration
        job = self._pending.popleft()
        if not job.done.is_set():
            if not self._threads:
                self._start_threads()  # first use in a forked child
            job.done.wait()
        self._fill()
        if job.error is not None:
            self.close()
            raise job.error
        return job.result

    def close(self) -> None:
        """Stop the worker threads and drop queued jobs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._exhausted = True
        with self._cond:
            self._queue.clear()
        self._pending.clear()
        self._stop_threads()
        with _live_lock:
            _live.discard(self)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # fork ------------------------------------------------------------------------------------

    def _before_fork(self) -> None:
        if not self._closed and self._threads:
            self._stop_threads()

    def _after_fork_parent(self) -> None:
        if not self._closed and not self._threads:
            self._start_threads()

    def _after_fork_child(self) -> None:
        # Locks may have been copied in any state; make fresh ones. Threads restart lazily.
        self._cond = threading.Condition(threading.Lock())
        self._threads = []
        self._pid = os.getpid()


def _worker(queue: collections.deque[Any], cond: threading.Condition) -> None:
    while True:
        with cond:
            while not queue:
                cond.wait()
            job = queue.popleft()
        if job is _STOP:
            return
        try:
            job.result = job.fn()
        except BaseException as exc:  # handed to the consumer
            job.error = exc
        job.fn = None
        job.done.set()


def _before_fork() -> None:
    with _live_lock:
        live = list(_live)
    for p in live:
        p._before_fork()


def _after_fork_parent() -> None:
    for p in list(_live):
        p._after_fork_parent()


def _after_fork_child() -> None:
    global _live_lock
    _live_lock = threading.Lock()
    for p in list(_live):
        p._after_fork_child()


def _close_all() -> None:
    """At interpreter exit: join every worker before the interpreter tears down (a daemon
    thread still inside a kernel at that point would be killed mid-call)."""
    with _live_lock:
        live = list(_live)
    for p in live:
        p.close()


atexit.register(_close_all)

if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                        after_in_child=_after_fork_child)
