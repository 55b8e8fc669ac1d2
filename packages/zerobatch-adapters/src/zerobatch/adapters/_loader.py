"""The loader the PyTorch and JAX adapters share (NumPy only; they add the conversion).

A loader does three things and nothing else:

1. **plans reads** from its schedule (:class:`~zerobatch.samplers.Schedule`, made by the
   source: an :class:`~zerobatch.samplers.IndexSampler` over the source's order, or a
   :class:`~zerobatch.samplers.MixtureSampler` for a mixture). Which items a step holds, how
   ranks split them and how a run resumes are the schedule's business;
2. **runs them ahead** on the shared read-ahead pool (:func:`zerobatch.core.pool.shared_pool`,
   threads ``zerobatch-loader-*``): a compiled read that releases the GIL from start to finish
   when the source has one (``read_async``), else the source's read as a Python call whose
   kernels release the GIL. Reads cover 1, 2, 4... steps up to the source's chunk, so the
   first batch is ready at once and later ones amortize the hand-off; at most ``prefetch``
   steps are in flight. The thread that iterates waits only for the oldest read (running it
   itself when no worker has started it) and never starts a read queued for a later step;
3. **delivers batches**: converts the oldest read (the torch and JAX subclasses make tensors
   or arrays) and hands its steps to the loop, recording each with
   :meth:`~zerobatch.samplers.Schedule.advance_to`, so a state saved while the loop works on
   a batch resumes right after it.
"""

from __future__ import annotations

import collections
import functools
import os
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from zerobatch.adapters.sources import Source, build, open_source
from zerobatch.core.checks import check_count
from zerobatch.core.pool import shared_pool
from zerobatch.formats.errors import ConfigError
from zerobatch.samplers import TAILS, IndexOrder, Schedule, check_seed, resolve_rank

__all__ = ["READ_AHEAD_POOL", "BaseLoader"]

#: The name of the read-ahead pool's threads (``zerobatch-loader-0``...).
READ_AHEAD_POOL = "zerobatch-loader"


def default_num_threads() -> int:
    """Read-ahead threads by default: one fewer than the CPUs (the training thread keeps one),
    at least 1 and at most 2.

    Measured on 2 CPUs (``tools/read_ahead.py``, docs/performance.md): with the data in the
    page cache a read-ahead thread neither gains nor loses in a training loop (reads take
    under 1 % of a 20 ms step either way), and it halves the raw batches per second of a
    loop with no compute (the hand-off between threads costs about as much as a read);
    with the data on disk one thread cuts the time inside ``next()`` by 2-9x (LLMCHNK
    4.4 % -> 0.5 % of the step, ZRECORD 7.5 % -> 3.0 %), a second adds little. More threads
    than that only multiply idle threads per rank on large nodes.
    """
    return max(1, min(2, (os.cpu_count() or 2) - 1))


class BaseLoader:
    """Batches of a :class:`~zerobatch.adapters.sources.Source` for one rank (see the module
    documentation); subclasses convert the NumPy arrays (:meth:`_convert`)."""

    def __init__(self, source: Any, batch_size: int | None = None, *, global_batch_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True, tail: str | None = None,
                 order: Any = None, rank: int | None = None, world_size: int | None = None,
                 epoch: int = 0, prefetch: int = 8, num_threads: int | None = None, dtype: Any = np.int64,
                 world: tuple[int, int] | None = None) -> None:
        self.source: Source = open_source(source)
        if world is not None and rank is None and world_size is None:
            rank, world_size = world
        rank, world_size = resolve_rank(rank, world_size)
        rows = self.source.rows_per_item
        if batch_size is not None and global_batch_size is not None:
            raise ConfigError("pass batch_size or global_batch_size, not both", field="batch_size")
        if global_batch_size is not None:
            g = check_count(global_batch_size, "global_batch_size", minimum=1, maximum=2**48)
            if g % world_size:
                raise ConfigError(f"global_batch_size {g} cannot be split over {world_size} ranks",
                                  field="global_batch_size")
            batch_size = g // world_size
        if batch_size is None:
            if rows == 1:
                raise ConfigError("batch_size: give the rows per batch (per rank)", field="batch_size")
            batch_size = rows
        batch_size = check_count(batch_size, "batch_size", minimum=1, maximum=2**40)
        if batch_size % rows:
            raise ConfigError(f"batch_size {batch_size} is not a multiple of the source's {rows} rows per item "
                              f"(a pre-formed batch)", field="batch_size")
        if tail is None:
            tail = "drop" if drop_last else "keep"
        if tail not in TAILS:
            raise ConfigError(f"tail must be one of {TAILS}, got {tail!r}", field="tail")
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.schedule: Schedule = self.source.schedule(batch_size // rows, rank=rank, world_size=world_size,
                                                       shuffle=self.shuffle, seed=seed, tail=tail, order=order,
                                                       epoch=epoch)
        self.seed = check_seed(seed)
        self.num_threads = check_count(default_num_threads() if num_threads is None else num_threads,
                                       "num_threads", maximum=256)
        self.prefetch = check_count(prefetch, "prefetch", minimum=1, maximum=1 << 20)
        self.dtype = self._np_dtype(dtype)
        # The pass being iterated, held weakly: the iterator owns it, so an iterator dropped
        # unfinished (or never started) closes its pass and releases the read-ahead threads.
        self._active: weakref.ref[_Pass] | None = None

    def _np_dtype(self, dtype: Any) -> np.dtype:
        dt = np.dtype(dtype)
        if dt not in (np.int64, np.int32):
            raise ConfigError(f"dtype must be int64 or int32, got {dtype!r}", field="dtype")
        return dt

    # ---------------------------------------------------------------------------------------
    # geometry (the schedule's)

    @property
    def rank(self) -> int:
        return self.schedule.rank

    @property
    def world_size(self) -> int:
        return self.schedule.world_size

    @property
    def items_per_step(self) -> int:
        """Items per step on this rank (an LLMBATCH item fills several rows)."""
        return self.schedule.batch_size

    @property
    def global_batch_size(self) -> int:
        """Items per step over all ranks."""
        return self.schedule.global_batch_size

    @property
    def order(self) -> IndexOrder | None:
        """The index order (``None`` for a mixture: each of its sources has its own)."""
        return getattr(self.schedule, "order", None)

    @property
    def tail(self) -> str:
        """How an epoch's short last step is handled (``"keep"`` for endless schedules)."""
        return getattr(self.schedule, "tail", "keep")

    @property
    def drop_last(self) -> bool:
        return self.tail == "drop"

    @property
    def epoch(self) -> int:
        """The current epoch (0 for an endless schedule)."""
        return self.schedule.epoch

    @property
    def endless(self) -> bool:
        """No epochs (a mixture, or an endless order): iteration never ends by itself."""
        return self.schedule.endless

    def __len__(self) -> int:
        """Steps (batches on this rank) in a whole epoch.

        Raises:
            TypeError: the loader is endless (a mixture or an endless order).
        """
        steps = self.schedule.steps_per_epoch
        if steps is None:
            raise TypeError("this loader is endless (a mixture or an endless order): it has no length")
        return steps

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch. A new epoch starts at its beginning; the current one keeps its
        position, so a resumed loop calls ``set_epoch`` as usual.

        Raises:
            ConfigError: an endless loader (a mixture or an endless order) and an epoch other than 0.
        """
        epoch = check_count(epoch, "epoch")
        if epoch != self.schedule.epoch:
            self._close_active()
        self.schedule.set_epoch(epoch)

    # ---------------------------------------------------------------------------------------
    # iteration

    def _worker_split(self) -> tuple[int, int]:
        """``(worker, num_workers)`` of a data-loading worker process (torch sets it)."""
        return 0, 1

    def __iter__(self) -> Iterator[Any]:
        """The batches as NumPy arrays (the torch and JAX loaders yield their own types)."""
        return self._iter()

    def _iter(self) -> Iterator[Any]:
        self._close_active()
        p = _Pass(self, *self._worker_split())
        self._active = weakref.ref(p)
        return p.batches()

    def _close_active(self) -> None:
        p = None if self._active is None else self._active()
        self._active = None
        if p is not None:
            p.close()

    def close(self) -> None:
        """Stop read-ahead (queued reads are dropped) and release the source's files."""
        self._close_active()
        self.source.close()

    def __enter__(self) -> BaseLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- conversion: the one generic path from a read to the steps the loop receives ----------
    # Subclasses say how an array becomes the framework's (_to_framework), how a converted
    # stacked array splits along its step axis (_unstack), and what is done to a whole step
    # once built (_finish); the structure of a step is the source's declared output.

    def _to_framework(self, array: np.ndarray) -> Any:
        """An array of a read as the loop receives it (NumPy here)."""
        return array

    def _unstack(self, value: Any) -> list[Any]:
        """A converted stacked array split along its step axis (views)."""
        return list(value)

    def _finish(self, step: Any) -> Any:
        """A built step, as the loop receives it."""
        return step

    def _convert(self, result: Any, steps: int) -> list[Any]:
        """Per-step outputs of one read: the source's declared output built over the read's
        arrays, each array converted once (a stacked read: once for all its steps)."""
        output = self.source.output
        if isinstance(result, dict):            # stacked: a leading step axis on every array
            parts = {name: self._unstack(self._to_framework(v)) for name, v in result.items()}
            return [self._finish(build(output, lambda leaf, i=i: leaf.cut(parts[leaf.name][i])))
                    for i in range(steps)]
        out = []
        for step in result:
            conv = {k: self._to_framework(v) if isinstance(v, np.ndarray) else v for k, v in step.items()}
            out.append(self._finish(build(output, lambda leaf, conv=conv: leaf.cut(conv[leaf.name]))))
        return out

    # ---------------------------------------------------------------------------------------
    # state (the schedule's)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch delivered to the training loop (JSON-able).

        Batches read ahead but not yet delivered are not counted. Every rank holds the same
        state (any rank's may be saved).
        """
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` stopped, on any world size.

        With the same global batch the run continues in exactly the order of an
        uninterrupted run; with another one it continues from the same position (the resume
        rule of :mod:`zerobatch.samplers.schedule`). States saved by release 0.1 load too.

        Raises:
            StateError: the state belongs to another dataset, order, seed or tail policy, or
                another state version, or its position is beyond the epoch.
        """
        self._close_active()
        self.schedule.load_state_dict(state)

    # ---------------------------------------------------------------------------------------
    # pickling: a loader pickles without its read-ahead (spawned workers rebuild it)

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_active"] = None
        return d


class _Pass:
    """One pass over the rest of the current epoch (or an endless stream)."""

    def __init__(self, loader: BaseLoader, worker: int = 0, num_workers: int = 1) -> None:
        self.loader = loader
        self.source = loader.source
        self.schedule = loader.schedule
        self.schedule.begin()
        self.worker, self.num_workers = worker, num_workers
        self.closed = False
        self.dtype = loader.dtype
        b = self.schedule.batch_size
        self.chunk = max(1, min(self.source.chunk_steps(b), loader.prefetch))
        self.depth = max(2, -(-loader.prefetch // self.chunk))
        self.inline = loader.num_threads == 0 or self.source.inline(self.dtype, b)
        self.pool = None
        if not self.inline:
            self.pool = shared_pool(loader.num_threads, READ_AHEAD_POOL)
            self.pool.attach()
        self._tickets: collections.deque[tuple[Any, list[Any]]] = collections.deque()
        self._plan = self._reads()
        if not self.inline:
            self._fill()

    def _reads(self) -> Iterator[tuple[np.ndarray, np.ndarray | None, list[Any]]]:
        """``(items (steps, k), sources or None, position after each step)`` per read, in
        order: the schedule's pages cut into reads of 1, 2, 4... steps up to the chunk."""
        size = 1
        for page in self.schedule.plan(self.worker, self.num_workers):
            at = 0
            while at < page.steps:
                count = min(size, self.chunk, page.steps - at)
                items = page.items[at:at + count]
                sources = None if page.sources is None else page.sources[at:at + count]
                if items.size:
                    self.source.prepare(items)
                yield items, sources, page.after[at:at + count]
                at += count
                size *= 2

    def _submit(self, items: np.ndarray, sources: np.ndarray | None, after: list[Any]) -> tuple[Any, list[Any]]:
        if items.shape[1] == 0:                 # this rank has nothing in a short last step
            return _Ready(None), after
        args = (items, self.dtype) if sources is None else (items, self.dtype, sources)
        if self.pool is None:
            return _Ready(self.source.read(*args)), after
        if sources is None and self.source.read_async is not None:
            return self.source.read_async(self.pool, items, self.dtype), after
        return self.pool.call(functools.partial(self.source.read, *args)), after

    def _fill(self) -> None:
        while len(self._tickets) < self.depth:
            plan = next(self._plan, None)
            if plan is None:
                return
            self._tickets.append(self._submit(*plan))

    def _results(self) -> Iterator[tuple[Any, list[Any]]]:
        if self.inline:
            for plan in self._plan:
                yield self._submit(*plan)
            return
        tickets = self._tickets
        while tickets:
            ticket, after = tickets.popleft()
            result = ticket.wait()
            self._fill()
            yield _Ready(result), after

    # -- delivery -----------------------------------------------------------------------------

    def batches(self) -> Iterator[Any]:
        """The generator ``iter(loader)`` returns."""
        ld, schedule = self.loader, self.schedule
        try:
            for ready, after in self._results():
                if self.closed:
                    return
                outputs = [None] * len(after) if ready.result is None else ld._convert(ready.result, len(after))
                for out, pos in zip(outputs, after, strict=True):
                    if self.closed:
                        return
                    # Counted as delivered now: a state saved while the loop works on this
                    # batch resumes after it.
                    schedule.advance_to(pos)
                    if out is not None:
                        yield out
                del outputs, ready
            if not self.closed and not schedule.endless:
                schedule.finish()
                ld._active = None
        finally:
            self.close()

    def __del__(self) -> None:
        # an iterator dropped before it ran to its end (or before it started)
        if not getattr(self, "closed", True):
            self.close()

    def close(self) -> None:
        """Stop: drop queued reads, wait for those a thread has started (the source may be
        closed right after). Idempotent."""
        self.closed = True
        while self._tickets:
            ticket, _ = self._tickets.popleft()
            ticket.cancel()
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool.detach()


class _Ready:
    __slots__ = ("result",)

    def __init__(self, result: Any) -> None:
        self.result = result

    def wait(self) -> Any:
        return self.result

    def cancel(self) -> None:
        self.result = None
