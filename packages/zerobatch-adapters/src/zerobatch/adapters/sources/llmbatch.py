"""LLMBATCH as a loader source: the file's pre-formed ``[batch_size, seq_len]`` batches."""

from __future__ import annotations

from typing import Any

import numpy as np

from zerobatch.adapters.sources._base import CHUNK_BYTES, Array, ReadTicket, Source, open_reader
from zerobatch.core.checks import check_count
from zerobatch.samplers import BlockShuffleOrder, IndexOrder

__all__ = ["LLMBatchSource"]


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

    def __init__(self, path: Any, *, block_size: int = 256, verify: bool = True) -> None:
        super().__init__()
        from zerobatch.readers.llmbatch import BatchFileReader
        self.reader = open_reader(path, BatchFileReader, verify=verify)
        self.block_size = check_count(block_size, "block_size", minimum=1)
        self.num_items = self.reader.num_batches
        self.fingerprint = self.reader.fingerprint
        self.rows_per_item = self.reader.batch_size
        self._shape = (self.reader.batch_size, self.reader.seq_len)
        self._advised: set[int] = set()

    def default_order(self, shuffle: bool, seed: int) -> IndexOrder:
        """The seed's block shuffle (:class:`~zerobatch.samplers.BlockShuffleOrder`)."""
        return BlockShuffleOrder(self.num_items, self.block_size, seed=seed, shuffle=shuffle)

    def chunk_steps(self, items_per_step: int) -> int:
        per_step = items_per_step * self._shape[0] * self._shape[1] * 8
        return max(1, CHUNK_BYTES // per_step)

    def inline(self, dtype: np.dtype, items_per_step: int) -> bool:
        return dtype == np.int32 and items_per_step == 1

    def prepare(self, items: np.ndarray) -> None:
        """A file at a URL: these batches fetched in the background, steps ahead of their
        read. A local file: ``madvise(WILLNEED)`` each block of the file the first time a read
        reaches it."""
        if self.reader.remote:
            self.reader.prefetch(items.reshape(-1))
            return
        bs = self.block_size
        first, last = int(items.flat[0]) // bs, int(items.flat[-1]) // bs
        blocks = (first,) if first == last else np.unique(items // bs).tolist()
        for b in blocks:
            if b not in self._advised:
                self._advised.add(b)
                self.reader.advise(b * bs, (b + 1) * bs)

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any] | list[dict[str, Any]]:
        steps, per = items.shape
        if self.inline(dtype, per):       # int32 views of the mapped file: no copy at all
            view = self.reader.read_batch_numpy
            return [{"tokens": view(int(i), dtype=np.int32)} for i in items[:, 0].tolist()]
        out = self._buffer((steps * per, *self._shape), dtype)
        self.reader.read_into(items, out)
        return {"tokens": out.reshape(steps, per * self._shape[0], self._shape[1])}

    def read_async(self, pool: Any, items: np.ndarray, dtype: np.dtype) -> Any:
        """The read queued on ``pool`` as one compiled task (the reader's
        :meth:`~zerobatch.readers.llmbatch.BatchFileReader.read_async`: checks and
        conversion run without the GIL from start to finish)."""
        steps, per = items.shape
        out = self._buffer((steps * per, *self._shape), dtype)
        ticket = self.reader.read_async(pool, items, out)
        return ReadTicket(ticket, {"tokens": out.reshape(steps, per * self._shape[0], self._shape[1])})

    def close(self) -> None:
        self.reader.close()

    def __getstate__(self) -> dict[str, Any]:
        d = super().__getstate__()
        d["_advised"] = set()
        return d

