"""PyTorch adapters: loaders that yield torch tensors from zerobatch files.

:class:`BatchNativeLoader` streams an LLMBATCH file in block-shuffle order (the seed's
design), sharded over ranks with no communication, with an exact-resume state and threaded
read-ahead: worker threads verify and convert the next batches with the GIL released while
the training step runs, and ``madvise(WILLNEED)`` asks the kernel to read the next block
ahead.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from zerobatch.samplers._dist import resolve_rank
from zerobatch.adapters._buffers import BufferPool
from zerobatch.core.pool import shared_pool
from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.readers.llmbatch import BatchFileReader
from zerobatch.samplers import BlockShuffleOrder, OrderState, RankShard, check_count

__all__ = ["BatchNativeLoader"]

#: Bytes of int64 output each read-ahead job converts (amortizes the hand-off between threads).
CHUNK_BYTES = 1 << 20

_KIND = "llmbatch/block-shuffle"


class BatchNativeLoader:
    """Iterate over the batches of an LLMBATCH file as ``[batch_size, seq_len]`` tensors.

    Block-shuffle order, exactly as the seed describes it: the file's batches are cut into
    super-blocks of ``block_size`` consecutive batches, each epoch visits the blocks in the
    order ``numpy.random.default_rng(seed ^ epoch).permutation(num_blocks)`` and the batches
    of a block in ascending order (see :class:`zerobatch.samplers.BlockShuffleOrder`).

    With ``world_size`` ranks, global step ``s`` gives rank ``r`` the batch at position
    ``s * world_size + r`` of that order: every rank gets ``len(loader)`` batches per epoch,
    the ranks' batches are disjoint, and no rank talks to another. The tail that does not
    fill a step on every rank is dropped (``drop_last=True``) or padded by wrapping to the
    start of the epoch.

    Args:
        path: the ``.batch`` file, or an open :class:`BatchFileReader`.
        block_size: batches per super-block (default 256, as the seed).
        shuffle: shuffle the block order (``False``: the file's order).
        seed: integer in ``[0, 2**64)`` for the block order.
        epoch: the starting epoch.
        rank: this process's rank; default from ``torch.distributed``, else ``RANK``.
        world_size: number of ranks; default from ``torch.distributed``, else ``WORLD_SIZE``, else 1.
        drop_last: drop the tail of fewer than ``world_size`` batches (else pad it).
        dtype: ``torch.int64`` (default, as the seed) or ``torch.int32`` (views of the mapped
            file: no copy, no threads; refused when a token id is 2**31 or more).
        num_threads: read-ahead worker threads (default: one fewer than the CPUs, at least 1;
            0 converts on the calling thread). The training thread helps with queued reads
            whenever it would otherwise wait, so ``cpus - 1`` workers keep every core busy.
        prefetch: batches queued ahead of the training loop (default 64: 8 MiB of int64
            for 32 x 512 batches).
        verify: check each batch's checksum the first time it is read.

    Example::

        loader = BatchNativeLoader("data/dataset.batch", seed=42)
        for epoch in range(num_epochs):
            loader.set_epoch(epoch)
            for batch in loader:          # torch.int64, (batch_size, seq_len)
                ...
            state = loader.state_dict()   # JSON-able; load_state_dict(state) resumes exactly
    """

    def __init__(self, path: str | os.PathLike[str] | BatchFileReader, block_size: int = 256,
                 shuffle: bool = True, seed: int = 42, epoch: int = 0, *, rank: int | None = None,
                 world_size: int | None = None, drop_last: bool = True, dtype: Any = torch.int64,
                 num_threads: int | None = None, prefetch: int = 64, verify: bool = True) -> None:
        self.reader = path if isinstance(path, BatchFileReader) else BatchFileReader(path, verify=verify)
        self.order = BlockShuffleOrder(self.reader.num_batches, block_size, seed=seed, shuffle=shuffle)
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.drop_last = bool(drop_last)
        if dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"dtype must be torch.int64 or torch.int32, got {dtype!r}", field="dtype")
        self.dtype = dtype
        if num_threads is None:
            num_threads = max(1, (os.cpu_count() or 2) - 1)
        self.num_threads = check_count(num_threads, "num_threads", maximum=256)
        self.prefetch = check_count(prefetch, "prefetch", minimum=1, maximum=1 << 20)
        self.epoch = check_count(epoch, "epoch")
        self._consumed = 0          # global positions of this epoch delivered to the loop
        self._completed = False     # an iterator ran this epoch to its end in this process
        self._active: _LoaderIterator | None = None

    # ---------------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Batches per super-block."""
        return self.order.block_size

    @property
    def shuffle(self) -> bool:
        """Whether the block order is shuffled."""
        return self.order.shuffle

    @property
    def seed(self) -> int:
        """The block-order seed."""
        return self.order.seed

    def _shard(self, start: int) -> RankShard:
        return RankShard(self.reader.num_batches, self.rank, self.world_size, self.drop_last, start)

    def __len__(self) -> int:
        """Batches this rank yields in a whole epoch."""
        return self._shard(0).num_steps

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (and so the block order). A new epoch starts at its beginning;
        the current epoch keeps its position, so a resumed loop can call ``set_epoch`` as usual."""
        epoch = check_count(epoch, "epoch")
        if epoch != self.epoch:
            self._close_active()
            self.epoch = epoch
            self._consumed = 0
            self._completed = False

    def __iter__(self) -> Iterator[torch.Tensor]:
        self._close_active()
        if self._completed:
            self._consumed = 0
            self._completed = False
        it = _LoaderIterator(self)
        self._active = it
        return it.batches()

    def _close_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def close(self) -> None:
        """Stop read-ahead threads and release the file."""
        self._close_active()
        self.reader.close()

    def __enter__(self) -> BatchNativeLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------
    # state

    def _order_state(self, consumed: int, global_batch_size: int | None = None) -> OrderState:
        return OrderState(
            kind=_KIND, seed=self.order.seed, epoch=self.epoch, consumed=consumed,
            num_items=self.reader.num_batches,
            global_batch_size=self.world_size if global_batch_size is None else global_batch_size,
            fingerprint=self.reader.fingerprint,
            params={"block_size": self.order.block_size, "shuffle": self.order.shuffle,
                    "drop_last": self.drop_last},
        )

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch delivered to the training loop (JSON-able).

        Batches converted ahead but not yet delivered are not counted.
        """
        d = self._order_state(self._consumed).to_dict()
        d["world_size"] = self.world_size
        return d

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` stopped, on any world size.

        Raises:
            StateError: the state belongs to another file, seed, block size, shuffle or
                drop_last setting, another state version, or its position is out of range.
        """
        loaded = OrderState.from_dict(state)
        saved_world = state.get("world_size", 1)
        if isinstance(saved_world, bool) or not isinstance(saved_world, int) or saved_world < 1:
            raise StateError(f"world_size: must be a positive integer, got {saved_world!r}", field="world_size")
        nb = self.reader.num_batches
        max_consumed = nb if self.drop_last else nb + saved_world - 1
        # Every rank reads one whole file batch per step, so the global batch is the world
        # size: a batch-native run may resume on another world size (elastic restarts),
        # continuing at the saved position without skipping or repeating a batch.
        loaded.check_fits(self._order_state(0, loaded.global_batch_size), max_consumed=max_consumed)
        self._close_active()
        self.epoch = loaded.epoch
        self._consumed = loaded.consumed
        self._completed = False


class _LoaderIterator:
    """One pass over the rest of the current epoch.

    With read-ahead threads, up to ``prefetch`` batches are queued on a shared
    :class:`~zerobatch.core.pool.TaskPool` as gathers of a few batches each; the workers
    verify and convert them with the GIL released from start to finish, and this thread
    only waits for the oldest one, wraps it as tensors and queues the next.
    """

    def __init__(self, loader: BatchNativeLoader) -> None:
        self.loader = loader
        self.shard = loader._shard(loader._consumed)
        self.steps = self.shard.num_steps
        self.epoch = loader.epoch
        self.closed = False
        reader = loader.reader
        self._shape = (reader.batch_size, reader.seq_len)
        self._tickets: collections.deque[Any] = collections.deque()
        self._chunk = self._chunk_steps()
        self._plan = self._plan_chunks()
        self._advised: set[int] = set()
        self._pool = None
        self._depth = max(2, -(-loader.prefetch // self._chunk))
        self._buffers = BufferPool((self._chunk, *self._shape), np.int64, max_buffers=self._depth + 4)
        if loader.dtype != torch.int32 and loader.num_threads:
            self._pool = shared_pool(loader.num_threads)
            self._fill()

    def _chunk_steps(self) -> int:
        per_batch = self._shape[0] * self._shape[1] * 8
        return max(1, min(self.loader.prefetch, CHUNK_BYTES // per_batch))

    def _plan_chunks(self) -> Iterator[np.ndarray]:
        """Batch indices of each read, in order: up to ``chunk`` steps per read (the hand-off
        between threads is paid once per read), the first reads smaller (1, 2, 4... steps) so
        the first batch is ready as soon as possible. Indices are computed a page of steps
        at a time (one compiled call), reads are slices of a page."""
        order, shard = self.loader.order, self.shard
        page_steps = max(self._chunk, 1024)
        size = 1
        for page_first in range(0, self.steps, page_steps):
            page_count = min(page_steps, self.steps - page_first)
            page = order.items(self.epoch, shard.positions(page_first, page_count))
            at = 0
            while at < page_count:
                count = min(size, self._chunk, page_count - at)
                items = page[at:at + count]
                self._advise(items)
                yield items
                at += count
                size *= 2

    def _advise(self, items: np.ndarray) -> None:
        """``madvise(WILLNEED)`` each block of the file the first time a read reaches it, so
        the kernel reads the whole block ahead of the converters."""
        bs = self.loader.order.block_size
        first, last = int(items[0]) // bs, int(items[-1]) // bs
        blocks = (first,) if first == last else np.unique(items // bs).tolist()
        for b in blocks:
            if b not in self._advised:
                self._advised.add(b)
                self.loader.reader.advise(b * bs, (b + 1) * bs)

    def _fill(self) -> None:
        gather_async = self.loader.reader._slots.gather_async
        while len(self._tickets) < self._depth:
            items = next(self._plan, None)
            if items is None:
                return
            out = self._buffers.acquire()[:len(items)]
            self._tickets.append((gather_async(self._pool, items, out), out))

    def _chunks(self) -> Iterator[Any]:
        """Each read's batches, as a sequence of tensors, in order."""
        reader = self.loader.reader
        if self.loader.dtype == torch.int32:
            read = reader.read_batch_torch
            for items in self._plan:
                yield [read(int(i), dtype=torch.int32) for i in items]
        elif self._pool is None:
            gather = reader._slots.gather
            for items in self._plan:
                yield torch.from_numpy(gather(items, self._buffers.acquire()[:len(items)])).unbind(0)
        else:
            tickets = self._tickets
            while tickets:
                ticket, out = tickets.popleft()
                ticket.wait()
                self._fill()
                yield torch.from_numpy(out).unbind(0)

    def batches(self) -> Iterator[torch.Tensor]:
        """The generator ``iter(loader)`` returns."""
        loader = self.loader
        start, world = self.shard.start, self.shard.world_size
        step = 0
        try:
            for chunk in self._chunks():
                for batch in chunk:
                    if self.closed:
                        return
                    step += 1
                    # Counted as delivered now: a state saved while the loop works on this
                    # batch resumes after it.
                    loader._consumed = start + step * world
                    yield batch
                del chunk
            if not self.closed:
                loader._completed = True
                loader._active = None
        finally:
            self.close()

    def close(self) -> None:
        """Stop: drop queued reads (waiting only for those a worker has started). Idempotent."""
        self.closed = True
        while self._tickets:
            ticket, _ = self._tickets.popleft()
            ticket.cancel()
