"""LLMBATCH as a loader source: the file's pre-formed ``[batch_size, seq_len]`` batches."""

from __future__ import annotations

from typing import Any

import numpy as np

from zerobatch.adapters.sources._base import (CHUNK_BYTES, Access, Array, ReadTicket, Source, StackedRuns,
                                              check_dataset, open_reader)
from zerobatch.core.checks import check_count
from zerobatch.samplers import BlockShuffleOrder, IndexOrder

__all__ = ["LLMBatchSource"]


class _Rows:
    """The rows of an LLMBATCH file numbered as documents of ``length`` tokens each (the
    file records no document boundaries)."""

    def __init__(self, reader: Any, num_rows: int, length: int) -> None:
        self.reader, self.num_documents, self.length = reader, num_rows, length
        self.num_tokens = num_rows * length

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the rows laid end to end."""
        rows_per_batch = self.reader.batch_size
        first, last = start // self.length, (start + length - 1) // self.length
        rows = [self.reader.read_batch(r // rows_per_batch)[r % rows_per_batch] for r in range(first, last + 1)]
        flat = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
        at = start - first * self.length
        return flat[at:at + length]

    def documents_at(self, positions: Any) -> np.ndarray:
        return np.asarray(positions, np.int64) // self.length

    def document_spans(self, documents: Any) -> tuple[np.ndarray, np.ndarray]:
        d = np.asarray(documents, np.int64)
        return d * self.length, (d + 1) * self.length

    def windows_metadata(self, starts: Any, length: int) -> None:
        return None


class LLMBatchSource(Source):
    """The pre-formed batches of an LLMBATCH file (``batch_size`` rows each).

    Args:
        path: the ``.batch`` file, or an open :class:`~zerobatch.readers.llmbatch.BatchFileReader`.
        block_size: batches per super-block of the default block-shuffle order.
        verify: check each batch's checksum the first time it is read.

    A step is the tokens, ``[rows, seq_len]`` (one or several file batches stacked).
    """

    kind = "llmbatch"
    output = Array("tokens")
    item_name = "batches"

    def __init__(self, path: Any, *, block_size: int = 256, verify: bool = True) -> None:
        super().__init__()
        from zerobatch.readers.llmbatch import BatchFileReader
        check_dataset(path, "LLMBatchSource", ("llmbatch",))
        self.reader = open_reader(path, BatchFileReader, verify=verify)
        self.block_size = check_count(block_size, "block_size", minimum=1)
        self.num_items = self.reader.num_batches
        self.fingerprint = self.reader.fingerprint
        self.rows_per_item = self.reader.batch_size
        self._shape = (self.reader.batch_size, self.reader.seq_len)
        self._advised: set[int] = set()
        self._to_advise: list[int] = []
        self._started = False


    @property
    def access(self) -> Access:
        return self.reader.access
    def geometry(self) -> dict[str, Any]:
        """The file's batch shape (a file rebuilt with another one is another file)."""
        return {"batch_size": self._shape[0], "seq_len": self._shape[1]}

    def units(self) -> Any:
        """An LLMBATCH file keeps no document boundaries: its documents are its rows."""
        return _Rows(self.reader, self.reader.num_batches * self._shape[0], self._shape[1])

    def token_spans(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        flat = np.asarray(items, np.int64).reshape(-1)
        rows, length = self._shape
        row = (flat[:, None] * rows + np.arange(rows, dtype=np.int64)[None, :]).reshape(-1)
        return np.repeat(np.arange(flat.size, dtype=np.int64), rows), row * length, (row + 1) * length

    def items_at(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        from zerobatch.adapters.sources.tokstream import _runs
        rows, length = self._shape
        a, b = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
        return _runs(a // (rows * length), np.where(b > a, (b - 1) // (rows * length) + 1, a // (rows * length)))

    def default_order(self, shuffle: bool, seed: int) -> IndexOrder:
        """The seed's block shuffle (:class:`~zerobatch.samplers.BlockShuffleOrder`)."""
        return BlockShuffleOrder(self.num_items, self.block_size, seed=seed, shuffle=shuffle)

    def chunk_steps(self, items_per_step: int) -> int:
        per_step = items_per_step * self._shape[0] * self._shape[1] * 8
        return max(1, CHUNK_BYTES // per_step)

    def zero_copy(self, dtype: np.dtype, items_per_step: int) -> bool:
        """int32 views of the mapped file (one file batch a step): no copy at all (each batch
        checked once, on the pool)."""
        return self._views(dtype, items_per_step) and self.reader.access.views

    def _views(self, dtype: np.dtype, items_per_step: int) -> bool:
        return dtype == np.int32 and items_per_step == 1

    def prepare(self, items: np.ndarray) -> None:
        """A file at a URL: these batches fetched in the background, steps ahead of their
        read. A local file: ``madvise(WILLNEED)`` each block of the file the first time a read
        reaches it (issued after the read that reaches it has started, and from the second
        read on: the first batch waits for no hint, the rest of its block gets one)."""
        if self.reader.access.fetched:
            self.reader.prefetch(items.reshape(-1))
            return
        bs = self.block_size
        first, last = int(items.flat[0]) // bs, int(items.flat[-1]) // bs
        blocks = (first,) if first == last else sorted(set((items // bs).ravel().tolist()))
        for b in blocks:
            if b not in self._advised:
                self._advised.add(b)
                self._to_advise.append(b)

    def _advise(self) -> None:
        if not self._started:
            self._started = True           # the very first read: its batch needs no hint
            return
        bs = self.block_size
        while self._to_advise:
            b = self._to_advise.pop()
            self.reader.advise(b * bs, (b + 1) * bs)

    def _out(self, steps: int, per: int, dtype: np.dtype) -> np.ndarray:
        """The output of a read of ``steps`` steps: the first rows of a pooled buffer of the
        longest read (reads grow 1, 2, 4... steps: one buffer size serves them all)."""
        rows = max(steps, self.chunk_steps(per)) * per
        return self._buffer((rows, *self._shape), dtype)[:steps * per]

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any] | list[dict[str, Any]]:
        steps, per = items.shape
        if self._views(dtype, per):       # int32 views of the mapped file: no copy at all
            view = self.reader.read_batch_numpy
            out = [{"tokens": view(int(i), dtype=np.int32)} for i in items[:, 0].tolist()]
            self._advise()
            return out
        out = self._out(steps, per, dtype)
        self.reader.read_into(items, out)
        self._advise()
        return {"tokens": out.reshape(steps, per * self._shape[0], self._shape[1])}

    def read_async(self, pool: Any, items: np.ndarray, dtype: np.dtype) -> Any:
        """The read queued on ``pool`` as one compiled task (the reader's
        :meth:`~zerobatch.readers.llmbatch.BatchFileReader.read_async`: checks and
        conversion run without the GIL from start to finish)."""
        steps, per = items.shape
        if self._views(dtype, per):
            # zero-copy int32 views, made now and handed out once the batches are checked (the
            # hashing runs on the pool, not on the training thread)
            ticket: Any = _ViewTicket(self.reader.views_async(pool, items[:, 0]))
        else:
            out = self._out(steps, per, dtype)
            ticket = ReadTicket(self.reader.read_async(pool, items, out),
                                {"tokens": out.reshape(steps, per * self._shape[0], self._shape[1])})
        self._advise()
        return ticket

    def close(self) -> None:
        self.reader.close()

    def __getstate__(self) -> dict[str, Any]:
        d = super().__getstate__()
        d["_advised"] = set()
        d["_to_advise"] = []
        d["_started"] = False
        return d


class _ViewTicket:
    """A read of int32 views: stacked (one ``[steps, rows, seq_len]`` view), or in runs of
    evenly spaced batches (:class:`StackedRuns`; a file read from a URL: one run a step)."""

    __slots__ = ("ticket",)

    def __init__(self, ticket: Any) -> None:
        self.ticket = ticket

    def wait(self) -> Any:
        views = self.ticket.wait()
        if isinstance(views, list):
            return StackedRuns({"tokens": v} for v in views)
        return {"tokens": views}

    def cancel(self, wait: bool = True) -> None:
        self.ticket.cancel() if wait else self.ticket.cancel(False)
