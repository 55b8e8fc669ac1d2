"""The task pool: the twin of ``_pool.pyx``. Python callables (:meth:`TaskPool.call`) run on
Python threads with the same rules (caller runs a call no worker has started, unless made
with ``caller_runs=False``; a waiter never starts another call; stop lets workers finish the
call in their hands); the compiled tasks of the kernels' twins run where they are queued."""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable
from typing import Any

from zerobatch.formats.errors import ConfigError, StateError

__all__ = ["Call", "TaskPool"]

_QUEUED, _RUNNING, _DONE = range(3)


class TaskPool:
    """Twin of the compiled ``TaskPool``."""

    def __init__(self, num_threads: int = 2, capacity: int = 256, name: str = "zerobatch-pool") -> None:
        if not 1 <= num_threads <= 256:
            raise ConfigError(f"num_threads must be between 1 and 256, got {num_threads}", field="num_threads")
        if not 1 <= capacity <= 1 << 20:
            raise ConfigError(f"capacity must be between 1 and 2**20, got {capacity}", field="capacity")
        self._num_threads = num_threads
        self.name = name
        self.threads: list[threading.Thread] = []
        self.users = 0
        self._queue: collections.deque[Call] = collections.deque()
        self._cv = threading.Condition()
        self._stop = False

    @property
    def num_threads(self) -> int:
        return self._num_threads

    @property
    def pending(self) -> int:
        return len(self._queue)

    def call(self, fn: Callable[[], Any], *, caller_runs: bool = True) -> Call:
        if not callable(fn):
            raise ConfigError("call: fn must be callable", field="fn")
        c = Call(self, fn, caller_runs)
        if not self.threads:
            self.start()
        with self._cv:
            self._queue.append(c)
            self._cv.notify()
        return c

    def _claim(self, c: Call) -> bool:
        """Take ``c`` off the queue and mark it running (the caller holds the condition)."""
        if c._state != _QUEUED:
            return False
        try:
            self._queue.remove(c)
        except ValueError:
            return False
        c._state = _RUNNING
        return True

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                c = self._queue.popleft()
                c._state = _RUNNING
            c._run()

    def attach(self) -> None:
        self.users += 1

    def detach(self) -> None:
        self.users = max(0, self.users - 1)
        if self.users == 0 and not self._queue:
            self.stop()

    def start(self) -> None:
        if self.threads:
            return
        with self._cv:
            self._stop = False
        self.threads = [threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                        for i in range(self._num_threads)]
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        if not self.threads:
            return
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join()
        self.threads = []

    def resume(self) -> None:
        if not self.threads and (self._queue or self.users):
            self.start()

    def reinit_after_fork(self) -> None:
        self._cv = threading.Condition()
        self._stop = False
        self.threads = []


class Call:
    """Twin of the compiled ``Call``."""

    def __init__(self, pool: TaskPool, fn: Callable[[], Any], caller_runs: bool) -> None:
        self._pool = pool
        self._fn: Callable[[], Any] | None = fn
        self._caller_runs = caller_runs
        self._state = _QUEUED
        self._result: Any = None
        self._error: BaseException | None = None
        self._cancelled = False
        self._done = threading.Event()

    #: Kept on the class: at exit the module's globals (``sys`` too) may already be cleared.
    _finalizing = staticmethod(sys.is_finalizing)

    def _run(self) -> None:
        fn, self._fn = self._fn, None
        try:
            self._result = fn()  # type: ignore[misc]
        except BaseException as exc:  # noqa: BLE001 - raised to the waiting thread
            self._error = exc
        with self._pool._cv:
            self._state = _DONE
        self._done.set()

    def wait(self) -> Any:
        if not self._done.is_set():
            pool = self._pool
            if not pool.threads and pool._queue:
                pool.start()
            run = False
            if self._caller_runs:
                with pool._cv:
                    run = pool._claim(self)
            if run:
                self._run()
            else:
                self._done.wait()
        if self._cancelled:
            raise StateError("the call was cancelled before it ran", field="call")
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self, wait: bool = True) -> bool:
        with self._pool._cv:
            dropped = self._pool._claim(self)
        if dropped:
            self._cancelled = True
            self._fn = None
            self._state = _DONE
            self._done.set()
        elif wait:
            # at interpreter exit the workers may already be gone (daemon threads stop when
            # they next need the GIL): a started call may then never finish, so stop waiting
            while not self._done.wait(0.05):
                if self._finalizing():
                    break
        self._result = self._error = None
        return dropped

    def done(self) -> bool:
        return self._done.is_set()
