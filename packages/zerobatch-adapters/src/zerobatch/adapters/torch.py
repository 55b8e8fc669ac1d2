"""PyTorch adapters: loaders that yield torch tensors from zerobatch files.

:class:`BatchNativeLoader` streams an LLMBATCH file in block-shuffle order (the seed's
design), sharded over ranks with no communication, with an exact-resume state and threaded
read-ahead: worker threads verify and convert the next batches with the GIL released while
the training step runs, and ``madvise(WILLNEED)`` asks the kernel to read the next block
ahead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from zerobatch.adapters._dist import resolve_rank
from zerobatch.adapters._prefetch import OrderedPrefetcher
from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.readers.llmbatch import BatchFileReader
from zerobatch.samplers import BlockShuffleOrder, OrderState, RankShard, check_count, check_seed

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
        num_threads: read-ahead threads converting batches (0: convert on the calling thread).
        prefetch: batches converted ahead of the training loop.
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
                 num_threads: int = 2, prefetch: int = 16, verify: bool = True) -> None:
        self.reader = path if isinstance(path, BatchFileReader) else BatchFileReader(path, verify=verify)
        self.order = BlockShuffleOrder(self.reader.num_batches, block_size, seed=seed, shuffle=shuffle)
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.drop_last = bool(drop_last)
        if dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"dtype must be torch.int64 or torch.int32, got {dtype!r}", field="dtype")
        self.dtype = dtype
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
        return it

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

    def _order_state(self, consumed: int) -> OrderState:
        return OrderState(
            kind=_KIND, seed=self.order.seed, epoch=self.epoch, consumed=consumed,
            num_items=self.reader.num_batches, fingerprint=self.reader.fingerprint,
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
        loaded.check_fits(self._order_state(0), max_consumed=max_consumed)
        self._close_active()
        self.epoch = loaded.epoch
        self._consumed = loaded.consumed
        self._completed = False


class _LoaderIterator:
    """One pass over the rest of the current epoch."""

    def __init__(self, loader: BatchNativeLoader) -> None:
        self.loader = loader
        self.shard = loader._shard(loader._consumed)
        self.steps = self.shard.num_steps
        self.step = 0
        self.epoch = loader.epoch
        reader = loader.reader
        self._shape = (reader.batch_size, reader.seq_len)
        self._prefetcher: OrderedPrefetcher | None = None
        self._ready: list[torch.Tensor] = []
        self._ready_pos = 0
        if loader.dtype == torch.int32:
            self._next_batch = self._next_int32
        elif loader.num_threads == 0:
            self._jobs = self._plan()
            self._next_batch = self._next_inline
        else:
            chunk = self._chunk_steps()
            depth = max(1, -(-loader.prefetch // chunk))
            self._prefetcher = OrderedPrefetcher(self._plan(), depth=depth, num_threads=loader.num_threads,
                                                 name="zerobatch-llmbatch")
            self._next_batch = self._next_prefetched

    def _chunk_steps(self) -> int:
        per_batch = self._shape[0] * self._shape[1] * 8
        return max(1, min(self.loader.prefetch, CHUNK_BYTES // per_batch))

    def _plan(self) -> Iterator[Callable[[], list[torch.Tensor]]]:
        """Read jobs of up to ``chunk`` steps each, in order, with block read-ahead hints."""
        loader, reader, order = self.loader, self.loader.reader, self.loader.order
        chunk = self._chunk_steps()
        gather = reader._slots.gather
        shape = self._shape
        advised: set[int] = set()
        for first in range(0, self.steps, chunk):
            count = min(chunk, self.steps - first)
            items = order.items(self.epoch, self.shard.positions(first, count))
            self._advise(items, advised)

            def job(items: np.ndarray = items, count: int = count) -> list[torch.Tensor]:
                out = torch.empty((count, *shape), dtype=torch.int64)
                gather(items, out.numpy())
                return list(out.unbind(0))

            yield job

    def _advise(self, items: np.ndarray, advised: set[int]) -> None:
        """``madvise(WILLNEED)`` each block the first time the plan reaches it, and the next
        block of the file order too, so the kernel reads ahead of the converter threads."""
        bs = self.loader.order.block_size
        for block in np.unique(items // bs):
            b = int(block)
            if b not in advised:
                advised.add(b)
                self.loader.reader.advise(b * bs, (b + 1) * bs)

    def _next_prefetched(self) -> torch.Tensor:
        if self._ready_pos == len(self._ready):
            self._ready = next(self._prefetcher)  # type: ignore[arg-type]
            self._ready_pos = 0
        batch = self._ready[self._ready_pos]
        self._ready[self._ready_pos] = None  # type: ignore[call-overload]
        self._ready_pos += 1
        return batch

    def _next_inline(self) -> torch.Tensor:
        if self._ready_pos == len(self._ready):
            self._ready = list(next(self._jobs)())
            self._ready_pos = 0
        batch = self._ready[self._ready_pos]
        self._ready_pos += 1
        return batch

    def _next_int32(self) -> torch.Tensor:
        item = int(self.loader.order.items(self.epoch, self.shard.positions(self.step, 1))[0])
        if self.step % self.loader.order.block_size == 0:
            self._advise(np.array([item]), set())
        return self.loader.reader.read_batch_torch(item, dtype=torch.int32)

    def __iter__(self) -> _LoaderIterator:
        return self

    def __next__(self) -> torch.Tensor:
        loader = self.loader
        if loader._active is not self or self.step >= self.steps or loader.epoch != self.epoch:
            if self.step >= self.steps and loader._active is self:
                loader._completed = True
                loader._active = None
            self.close()
            raise StopIteration
        batch = self._next_batch()
        self.step += 1
        # Counted as delivered now: a state saved while the loop works on this batch resumes
        # after it.
        loader._consumed = self.shard.consumed_after(self.step)
        return batch

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        self._ready = []
        self._ready_pos = 0
