"""The door every reader offers the loaders' sources: one batch read, and its queued twin.

A source (``zerobatch.adapters.sources``) reads a step's items through a reader's public
methods only, never its fields: :meth:`BatchReader.read_into` fills a caller's buffer with
the items (a format's natural unit: batches, records, windows), whatever the buffer's dtype,
and :meth:`BatchReader.read_async` queues that read on a :class:`~zerobatch.core.pool.TaskPool`
and returns a ticket (``wait()`` returns what ``read_into`` returns or raises its error;
``cancel()`` drops it if it has not started, else waits for it). A reader with a compiled
read that needs no GIL from start to finish (LLMBATCH) queues that instead of a Python call.

Every reader also declares its :class:`Access`: what reaching its bytes costs (mapped local
files, or sparse copies fetched from object storage). Sources and the loader plan reads by
it (hints ahead, exact ranges, zero-copy views, queued compiled reads, worker start method)
and never ask where the data lives.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["FETCHED", "MAPPED", "Access", "BatchReader", "Documents", "OpensOnFirstUse", "Ticket"]


@dataclass(frozen=True)
class Access:
    """What reaching a reader's bytes costs, declared by the reader's storage.

    Attributes:
        fetched: the bytes are fetched into a local copy before a read (object storage):
            a read of bytes not held yet waits for requests.
        exact: a read costs the bytes it touches: read exactly the ranges wanted, never
            an overrun past them (over a mapping an overrun is free).
        views: reads may hand out views of the file's own bytes (zero copies).
        tasks: reads may be queued as compiled, GIL-free tasks (``ranges_async``...).
        fork_safe: a forked worker process may go on using the reader's storage (obstore's
            runtime does not survive a fork: workers then start from a fresh interpreter).
        hint_groups: how far ahead of the reads in flight the reader wants to hear of
            steps (``prefetch``), in groups of the loader's ``prefetch`` steps, each group one
            hint (neighbouring steps' ranges then go out as one request); 0: each read is
            hinted as it is planned.
        hint_bytes: at most this many bytes hinted ahead of the reads in flight, of the
            hints whose bytes the source knows (0: no bound but ``hint_groups``): deep enough
            for a sequential read to fill the link, bounded for large steps.
        first_alone: the first read is fetched alone, before any read-ahead's requests
            (the first batch is what the training loop waits for).
    """

    fetched: bool = False
    exact: bool = False
    views: bool = True
    tasks: bool = True
    fork_safe: bool = True
    hint_groups: int = 0
    hint_bytes: int = 0
    first_alone: bool = False

    @staticmethod
    def of_all(accesses: Iterable[Access]) -> Access:
        """The access of a read over several readers (a mixture): each cost if any has it,
        each capability if all have it."""
        a = list(accesses) or [MAPPED]
        return Access(fetched=any(x.fetched for x in a), exact=any(x.exact for x in a),
                      views=all(x.views for x in a), tasks=all(x.tasks for x in a),
                      fork_safe=all(x.fork_safe for x in a), hint_groups=max(x.hint_groups for x in a),
                      hint_bytes=max(x.hint_bytes for x in a),
                      first_alone=any(x.first_alone for x in a))


#: Local files (mapped or read by descriptor): every capability, no hints needed.
MAPPED = Access()
#: Sparse local copies of objects, fetched by byte ranges as reads need them. Hints go up
#: to 16 groups of ``prefetch`` steps and 16 MiB ahead: windows shuffled within shards are
#: one request per group, and a link with 20 ms a request needs several MiB in flight
#: (tools/bench_remote_peers.py: 28 M tokens/s at 4 groups, 36 at 16, 37 at 32, 100 MB/s
#: link); the hinted bytes go to the cache on disk, not to memory.
FETCHED = Access(fetched=True, exact=True, views=False, tasks=False, fork_safe=False, hint_groups=16,
                 hint_bytes=16 << 20,
                 first_alone=True)


class Ticket(Protocol):
    """A queued read."""

    def wait(self) -> Any: ...

    def cancel(self, wait: bool = True) -> bool: ...


class Documents(Protocol):
    """A numbered list of documents and flat reads of token ranges: what packing
    (``PackedDocuments``, ``FlatDocuments``) reads through. A TOKSTREAM reader is one; an
    LLMCHNK file's records are one through
    :meth:`~zerobatch.readers.llmchnk.LLMChunkReader.documents`. Token positions count across
    the documents in order; a range lies within one document.
    """

    path: str

    @property
    def build_id(self) -> str:
        """The data's identity (recorded in a loader's state)."""

    @property
    def access(self) -> Access:
        """What reaching the bytes costs (:class:`Access`)."""

    @property
    def num_documents(self) -> int:
        """Documents in the list."""

    def document_spans(self, indices: Any) -> tuple[Any, Any]:
        """``(starts, stops)``: the token positions of documents ``indices``."""

    def ranges(self, starts: Any, stops: Any, *, dtype: Any = ..., out: Any = None, position_ids: Any = None,
               labels: Any = None, ignore_id: int = -100) -> Any:
        """Tokens ``[starts[k], stops[k])`` back to back (into ``out`` when given), and, when
        given, each range's positions from 0 and its next-token labels (``ignore_id`` at each
        range's last token)."""

    def prefetch(self, starts: Any = None, length: int | None = None, stops: Any = None, *,
                 documents: Any = None) -> None:
        """Read-ahead hint for ranges ``[starts, stops)`` (storage that fetches: see :class:`Access`)."""

    def close(self) -> None:
        """Let the files go."""


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
