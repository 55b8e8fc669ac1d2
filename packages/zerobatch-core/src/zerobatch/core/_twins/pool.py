"""The task pool: the twin of ``_pool.pyx`` (no threads; tasks run when queued)."""

from __future__ import annotations

from typing import Any

from zerobatch.formats.errors import ConfigError

__all__ = ["TaskPool"]


class TaskPool:
    """Twin of the compiled ``TaskPool``: no threads, gathers run when queued."""

    def __init__(self, num_threads: int = 2, capacity: int = 256) -> None:
        if not 1 <= num_threads <= 256:
            raise ConfigError(f"num_threads must be between 1 and 256, got {num_threads}", field="num_threads")
        self.num_threads = num_threads
        self.threads: list[Any] = []
        self.pending = 0

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def reinit_after_fork(self) -> None:
        pass
