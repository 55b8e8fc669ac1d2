"""Read-ahead threads for the loaders: a small process-wide pool of Python threads whose jobs
call compiled, GIL-releasing reads, safe across ``fork`` and interpreter exit.

A job is claimed exactly once: by a worker, or by the thread that waits for it (a training
thread that would otherwise sit idle reads the batch itself). Before ``fork`` every worker
finishes its current job and exits, so the child never inherits a thread that holds a lock;
queued jobs stay queued. The parent's workers restart right after the fork, a child's on its
first job (the fork and exit handling is :mod:`zerobatch.core.pool`'s, shared with the
compiled pools). A thread waiting for a job runs other queued jobs meanwhile. The threads
also stop when the last pass using them ends (the end of an iteration, ``close()``) and
start again with the next job.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from zerobatch.core.pool import track

__all__ = ["Job", "Workers", "shared_workers"]

_PENDING, _RUNNING, _DONE, _CANCELLED = range(4)


class Job:
    """A call to run on a worker thread; :meth:`wait` returns its result (or raises its error)."""

    __slots__ = ("_fn", "_state", "_result", "_error", "_done", "_lock")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn: Callable[[], Any] | None = fn
        self._state = _PENDING
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> bool:
        """Run the job here if nobody has claimed it; False if it was already claimed."""
        with self._lock:
            if self._state != _PENDING:
                return False
            self._state = _RUNNING
            fn = self._fn
            self._fn = None
        try:
            self._result = fn()  # type: ignore[misc]
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self._error = exc
        with self._lock:
            self._state = _DONE
        self._done.set()
        return True

    def wait(self) -> Any:
        """The job's result; runs it on this thread if no worker has started it yet."""
        if not self.run():
            self._done.wait()
        if self._state == _CANCELLED:
            raise RuntimeError("the read was cancelled")
        if self._error is not None:
            raise self._error
        return self._result

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Drop the job if it has not started; else wait for it to finish (so nothing it reads
        is released under it) and drop its result. Never raises."""
        with self._lock:
            if self._state == _PENDING:
                self._state = _CANCELLED
                self._fn = None
                self._done.set()
        self._done.wait()
        self._result = self._error = None


class Workers:
    """``num_threads`` daemon threads running :class:`Job` s in submission order."""

    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._users = 0
        self._users_lock = threading.Lock()
        track(self)                 # stopped before fork and at exit, like the compiled pools

    @property
    def threads(self) -> list[threading.Thread]:
        return list(self._threads)

    def attach(self) -> None:
        """A pass starts using the threads."""
        with self._users_lock:
            self._users += 1

    def detach(self) -> None:
        """A pass is over; the last one out stops the threads (they restart with the next job)."""
        with self._users_lock:
            self._users -= 1
            last = self._users == 0
        if last:
            with self._cv:
                live = [job for job in self._queue if job._state == _PENDING]
                self._queue.clear()
                self._queue.extend(live)
                if self._users or live:
                    return
            self.stop()

    def submit(self, fn: Callable[[], Any]) -> Job:
        job = Job(fn)
        with self._cv:
            self._queue.append(job)
            if not self._threads:
                self._start_locked()
            self._cv.notify()
        return job

    def wait(self, job: Job) -> Any:
        """``job.wait()``, but the waiting thread runs queued jobs (oldest first) while ``job``
        is still running on a worker: a training thread that would sit idle reads ahead."""
        while not job.done():
            other = None
            with self._cv:
                queue = self._queue
                while queue:
                    candidate = queue.popleft()
                    if candidate._state == _PENDING:
                        other = candidate
                        break
            if other is None:
                break
            other.run()
        return job.wait()

    def _start_locked(self) -> None:
        self._stopping = False
        for i in range(self.num_threads):
            t = threading.Thread(target=self._run, name=f"zerobatch-loader-{i}", daemon=True)
            self._threads.append(t)
            t.start()

    def _run(self) -> None:
        queue, cv = self._queue, self._cv
        while True:
            with cv:
                while not queue and not self._stopping:
                    cv.wait()
                if self._stopping:
                    return
                job = queue.popleft()
            job.run()

    def stop(self) -> None:
        """Let every worker finish its current job and exit (queued jobs stay queued)."""
        with self._cv:
            self._stopping = True
            threads, self._threads = self._threads, []
            self._cv.notify_all()
        for t in threads:
            if t is not threading.current_thread():
                t.join()

    def start(self) -> None:
        """Start the threads again (after a fork) if a pass still uses them."""
        with self._cv:
            if not self._threads and (self._queue or self._users):
                self._start_locked()

    def reinit_after_fork(self) -> None:
        """In a forked child: fresh locks, no threads (they start with the next job)."""
        self._cv = threading.Condition()
        self._threads = []
        self._stopping = False


_shared: dict[int, Workers] = {}
_lock = threading.Lock()


def shared_workers(num_threads: int) -> Workers:
    """The process-wide pool of ``num_threads`` read-ahead threads (made on first use)."""
    with _lock:
        w = _shared.get(num_threads)
        if w is None:
            w = _shared[num_threads] = Workers(num_threads)
        return w
