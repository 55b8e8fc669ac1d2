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
import threading
from abc import ABC, abstractmethod
from typing import Any, Protocol

__all__ = ["BatchReader", "OpensOnFirstUse", "Ticket"]


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


class OpensOnFirstUse:
    """Readers that travel to other processes (spawned DataLoader workers) as their
    arguments and open there on first use, not while being unpickled: a dataset deleted or
    replaced since is then a typed error raised by the read that found it, which reaches the
    training loop, instead of a worker dying inside unpickling.

    A reader defines ``__getstate__`` (its arguments and its dataset's identity),
    :meth:`_unpickled_attributes` (what may be set at once: the path, options) and
    :meth:`_reopen` (open, and refuse another dataset than the one pickled). Until the first
    access to anything else, the reader holds no file.
    """

    _reopen_lock = threading.RLock()

    def _unpickled_attributes(self, state: dict[str, Any]) -> dict[str, Any]:
        return {}

    #: ``_reopen(state)``: open the dataset the state names, refusing another one (each
    #: reader defines it).
    _reopen: Any

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(self._unpickled_attributes(state))
        self.__dict__["_unpickled"] = state

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes not set yet: those the first open sets
        if name.startswith("__") or "_unpickled" not in self.__dict__:
            raise AttributeError(name)
        with OpensOnFirstUse._reopen_lock:      # other threads wait here for the open to finish
            state = self.__dict__.get("_unpickled")
            if state is not None:
                if self.__dict__.get("_reopening"):
                    raise AttributeError(name)  # asked for by the open itself, before it set it
                self.__dict__["_reopening"] = True
                try:
                    self._reopen(state)         # on failure the state stays: the next use raises again
                    self.__dict__.pop("_unpickled", None)
                finally:
                    self.__dict__.pop("_reopening", None)
        return object.__getattribute__(self, name)
