"""The door every reader offers the loaders' sources: one batch read, and its queued twin.

A source (``zerobatch.adapters.sources``) reads a step's items through a reader's public
methods only, never its fields: :meth:`BatchReader.read_into` fills a caller's buffer with
the items (a format's natural unit: batches, records, windows), whatever the buffer's dtype,
and :meth:`BatchReader.read_async` queues that read on a :class:`~zerobatch.core.pool.TaskPool`
and returns a ticket (``wait()`` returns what ``read_into`` returns or raises its error;
``cancel()`` drops it if it has not started, else waits for it). A reader with a compiled
read that needs no GIL from start to finish (LLMBATCH) queues that instead of a Python call.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Any, Protocol

__all__ = ["BatchReader", "Ticket"]


class Ticket(Protocol):
    """A queued read."""

    def wait(self) -> Any: ...

    def cancel(self, wait: bool = True) -> bool: ...


class BatchReader(ABC):
    """The batch read of a reader (see the module documentation)."""

    @abstractmethod
    def read_into(self, items: Any, out: Any, **options: Any) -> Any:
        """Read ``items`` into ``out`` (the format's unit and options: see the reader)."""

    def read_async(self, pool: Any, items: Any, out: Any, **options: Any) -> Ticket:
        """:meth:`read_into` queued on ``pool``'s threads; returns its ticket."""
        return pool.call(functools.partial(self.read_into, items, out, **options))
