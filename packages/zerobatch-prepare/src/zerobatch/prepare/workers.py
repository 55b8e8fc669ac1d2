"""Worker processes for ``convert`` (tokenizing text, rendering chat) that fail instead of hanging.

``multiprocessing.Pool`` hangs in two ways a long conversion can meet. First, a worker killed
mid-task (the kernel's OOM killer, a crash in a native tokenizer) loses its task, and
``get()`` waits for it forever. Second, an initializer that raises makes the pool respawn
workers without end. :class:`WorkerPool` runs on ``concurrent.futures.ProcessPoolExecutor``,
which marks the pool broken when a worker dies, so the run fails with a
:class:`~zerobatch.formats.errors.ConfigError` that names ``--workers``. It also keeps an
initializer's error and raises it from the first task, so the run fails with the real error
(a missing tokenizer, say), not a stream of respawns.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from zerobatch.formats.errors import ConfigError

__all__ = ["WorkerPool"]

_INIT_ERROR: list[BaseException] = []


def _guarded_init(init: Callable[..., None], args: tuple[Any, ...]) -> None:
    try:
        init(*args)
    except BaseException as exc:   # noqa: BLE001 - raised again by every task of this process
        _INIT_ERROR.append(exc)


def _guarded_call(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    if _INIT_ERROR:
        raise _INIT_ERROR[0]
    return fn(*args)


class WorkerPool:
    """``workers`` processes (forkserver; spawn on Windows), each set up by
    ``initializer(*initargs)``.

    Use it as a context manager. On leaving, tasks not yet started are cancelled and the
    pool waits for the running ones (at most one per worker).
    """

    def __init__(self, workers: int, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
        ctx = mp.get_context("forkserver" if sys.platform != "win32" else "spawn")
        self._pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_guarded_init,
                                         initargs=(initializer, initargs))

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(*args)`` on a worker; ``fn`` must be importable (a module-level function)."""
        try:
            return self._pool.submit(_guarded_call, fn, args)
        except BrokenProcessPool:
            raise _died() from None

    @staticmethod
    def result(future: Future) -> Any:
        """The task's result; its exception, raised again here; or, when a worker died, a
        :class:`~zerobatch.formats.errors.ConfigError`."""
        try:
            return future.result()
        except BrokenProcessPool:
            raise _died() from None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _died() -> ConfigError:
    return ConfigError("--workers: a worker process died (killed by the system, out of memory?); run again with "
                       "fewer --workers, or smaller groups (--docs-per-shard)", field="workers")
