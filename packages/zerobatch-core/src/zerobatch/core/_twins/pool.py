"""The task pool: the twin of ``_pool.pyx`` with no threads. A compiled task (a gather twin)
runs when queued; a Python callable runs when its :class:`Call` is waited for (the caller-runs
rule of the compiled pool, with no worker ever free)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zerobatch.formats.errors import ConfigError, StateError

__all__ = ["Call", "TaskPool"]


class TaskPool:
    """Twin of the compiled ``TaskPool``: no threads."""

    def __init__(self, num_threads: int = 2, capacity: int = 256, name: str = "zerobatch-pool") -> None:
        if not 1 <= num_threads <= 256:
            raise ConfigError(f"num_threads must be between 1 and 256, got {num_threads}", field="num_threads")
        if not 1 <= capacity <= 1 << 20:
            raise ConfigError(f"capacity must be between 1 and 2**20, got {capacity}", field="capacity")
        self.num_threads = num_threads
        self.name = name
        self.threads: list[Any] = []
        self.pending = 0
        self.users = 0

    def call(self, fn: Callable[[], Any], *, caller_runs: bool = True) -> Call:
        if not callable(fn):
            raise ConfigError("call: fn must be callable", field="fn")
        return Call(fn)

    def attach(self) -> None:
        self.users += 1

    def detach(self) -> None:
        self.users = max(0, self.users - 1)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def reinit_after_fork(self) -> None:
        self.users = 0


class Call:
    """Twin of the compiled ``Call``: the callable runs on the first :meth:`wait`."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn: Callable[[], Any] | None = fn
        self._result: Any = None
        self._error: BaseException | None = None
        self._cancelled = False
        self._done = False

    def wait(self) -> Any:
        if self._cancelled:
            raise StateError("the call was cancelled before it ran", field="call")
        if not self._done:
            fn, self._fn = self._fn, None
            try:
                self._result = fn()  # type: ignore[misc]
            except BaseException as exc:  # noqa: BLE001 - raised to the waiting thread
                self._error = exc
            self._done = True
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self, wait: bool = True) -> bool:
        dropped = not self._done and not self._cancelled
        if dropped:
            self._cancelled = True
            self._fn = None
        self._result = self._error = None
        return dropped

    def done(self) -> bool:
        return self._done or self._cancelled
