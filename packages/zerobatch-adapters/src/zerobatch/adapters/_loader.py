"""The loader the PyTorch and JAX adapters share (NumPy only; they add the conversion).

Positions: global step ``s`` of a pass that starts at position ``start`` gives rank ``r`` of
``W`` the positions ``start + s*G + r + W*j`` for ``j < b`` (``b`` items per rank, global batch
``G = W*b``): round-robin over ranks, as :class:`~zerobatch.samplers.IndexSampler` deals
them, and the order maps each position to an item. The state is the count of global
positions delivered to the training loop, so a run saved on one world size continues on
another: with the same global batch in exactly the order of an uninterrupted run, with
another global batch from the same position (nothing skipped or repeated either way).

A mixture has no epochs: each step takes the next ``G`` samples of its
:class:`~zerobatch.samplers.MixtureSchedule` and rank ``r`` reads samples
``[r*b, (r+1)*b)`` of them; its state is the schedule's (counts per source).

Read-ahead: reads are planned in order, a few steps per read when the source can read them
together, and run on the shared read-ahead threads (:mod:`zerobatch.adapters._workers`); the
compiled reads release the GIL, so they overlap the training step. The thread that iterates
only waits for the oldest read (or runs it itself when no worker has started it), converts it
and queues the next.
"""

from __future__ import annotations

import collections
import copy
import functools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from zerobatch.adapters._workers import shared_workers
from zerobatch.adapters.sources import Mixture, Source, open_source
from zerobatch.core.pool import shared_pool
from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.samplers import TAILS, IndexOrder, OrderState, check_count, check_seed, resolve_rank

__all__ = ["LOADER_STATE_VERSION", "BaseLoader"]

#: Version of a mixture loader's state (index loaders use the samplers' ``OrderState``).
LOADER_STATE_VERSION = 1


class BaseLoader:
    """Batches of a :class:`~zerobatch.adapters.sources.Source` for one rank (see the module
    documentation); subclasses convert the NumPy arrays (:meth:`_convert`)."""

    def __init__(self, source: Any, batch_size: int | None = None, *, global_batch_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True, tail: str | None = None,
                 order: IndexOrder | None = None, rank: int | None = None, world_size: int | None = None,
                 epoch: int = 0, prefetch: int = 8, num_threads: int | None = None, dtype: Any = np.int64,
                 world: tuple[int, int] | None = None) -> None:
        self.source: Source = open_source(source)
        if world is not None and rank is None and world_size is None:
            rank, world_size = world
        self.rank, self.world_size = resolve_rank(rank, world_size)
        rows = self.source.rows_per_item
        if batch_size is not None and global_batch_size is not None:
            raise ConfigError("pass batch_size or global_batch_size, not both", field="batch_size")
        if global_batch_size is not None:
            g = check_count(global_batch_size, "global_batch_size", minimum=1, maximum=2**48)
            if g % self.world_size:
                raise ConfigError(f"global_batch_size {g} cannot be split over {self.world_size} ranks",
                                  field="global_batch_size")
            batch_size = g // self.world_size
        if batch_size is None:
            if rows == 1:
                raise ConfigError("batch_size: give the rows per batch (per rank)", field="batch_size")
            batch_size = rows
        batch_size = check_count(batch_size, "batch_size", minimum=1, maximum=2**40)
        if batch_size % rows:
            raise ConfigError(f"batch_size {batch_size} is not a multiple of the source's {rows} rows per item "
                              f"(a pre-formed batch)", field="batch_size")
        self.batch_size = batch_size
        self.items_per_step = batch_size // rows
        self.shuffle = bool(shuffle)
        self.seed = check_seed(seed)
        if tail is None:
            tail = "drop" if drop_last else "keep"
        if tail not in TAILS:
            raise ConfigError(f"tail must be one of {TAILS}, got {tail!r}", field="tail")
        self.tail = tail
        self.drop_last = tail == "drop"
        self.mixture = isinstance(self.source, Mixture)
        if self.mixture:
            if order is not None:
                raise ConfigError("order: a mixture orders each source itself", field="order")
            self.order = None
            self._schedule_state = self.source.schedule.state_dict()
        else:
            if order is None:
                order = self.source.default_order(self.shuffle, self.seed)
            elif not isinstance(order, IndexOrder) or order.num_items != self.source.num_items:
                raise ConfigError(f"order must be an IndexOrder over the source's {self.source.num_items} items",
                                  field="order")
            if not order.has_epochs and tail != "keep":
                tail = self.tail = "keep"
                self.drop_last = False
            self.order = order
        if num_threads is None:
            num_threads = max(1, (os.cpu_count() or 2) - 1)
        self.num_threads = check_count(num_threads, "num_threads", maximum=256)
        self.prefetch = check_count(prefetch, "prefetch", minimum=1, maximum=1 << 20)
        self.dtype = self._np_dtype(dtype)
        self.epoch = check_count(epoch, "epoch")
        if self.mixture and self.epoch:
            raise ConfigError("epoch: a mixture has no epochs", field="epoch")
        self._consumed = 0           # global positions of this epoch delivered to the loop
        self._steps_delivered = 0    # steps of a mixture delivered
        self._completed = False
        self._active: _Pass | None = None

    def _np_dtype(self, dtype: Any) -> np.dtype:
        dt = np.dtype(dtype)
        if dt not in (np.int64, np.int32):
            raise ConfigError(f"dtype must be int64 or int32, got {dtype!r}", field="dtype")
        return dt

    # ---------------------------------------------------------------------------------------
    # geometry

    @property
    def global_batch_size(self) -> int:
        """Items per step over all ranks."""
        return self.items_per_step * self.world_size

    @property
    def endless(self) -> bool:
        """No epochs (a mixture, or an endless order): iteration never ends by itself."""
        return self.mixture or not self.order.has_epochs  # type: ignore[union-attr]

    def _steps_from(self, start: int) -> int | None:
        if self.endless:
            return None
        n, g = self.source.num_items, self.global_batch_size
        rest = max(n - start, 0)
        return rest // g if self.tail == "drop" else -(-rest // g)

    def __len__(self) -> int:
        """Steps (batches on this rank) in a whole epoch.

        Raises:
            TypeError: the loader is endless (a mixture or an endless order).
        """
        steps = self._steps_from(0)
        if steps is None:
            raise TypeError("this loader is endless (a mixture or an endless order): it has no length")
        return steps

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch. A new epoch starts at its beginning; the current one keeps its
        position, so a resumed loop calls ``set_epoch`` as usual."""
        epoch = check_count(epoch, "epoch")
        if self.endless:
            if epoch != 0 and self.mixture:
                raise ConfigError("epoch: a mixture has no epochs", field="epoch")
            return
        if epoch != self.epoch:
            self._close_active()
            self.epoch = epoch
            self._consumed = 0
            self._completed = False

    # ---------------------------------------------------------------------------------------
    # iteration

    def _worker_split(self) -> tuple[int, int]:
        """``(worker, num_workers)`` of a data-loading worker process (torch sets it)."""
        return 0, 1

    def _iter(self) -> Iterator[Any]:
        self._close_active()
        if self._completed:
            self._consumed = 0
            self._completed = False
        p = _Pass(self, *self._worker_split())
        self._active = p
        return p.batches()

    def _close_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def close(self) -> None:
        """Stop read-ahead (queued reads are dropped) and release the source's files."""
        self._close_active()
        self.source.close()

    def __enter__(self) -> BaseLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _convert(self, result: Any, steps: int) -> list[Any]:
        """Per-step outputs of one read (NumPy here; subclasses make tensors)."""
        emit = self.source.emit
        if isinstance(result, dict):
            out = self.source.emit_stacked(result, list)
            if out is not None:
                return out
            return [emit({k: v[i] for k, v in result.items()}) for i in range(steps)]
        return [emit(step) for step in result]

    # ---------------------------------------------------------------------------------------
    # state

    def _order_state(self, consumed: int, global_batch_size: int | None = None) -> OrderState:
        if self.order is None:
            raise StateError("kind: a mixture's state is its schedule's", field="kind")
        params = dict(self.order.params())
        params["tail"] = self.tail
        return OrderState(kind=f"{self.source.kind}/{self.order.kind}", seed=self.order.seed, epoch=self.epoch,
                          consumed=consumed, num_items=self.source.num_items,
                          global_batch_size=self.global_batch_size if global_batch_size is None else global_batch_size,
                          fingerprint=self.source.fingerprint, params=params)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch delivered to the training loop (JSON-able).

        Batches read ahead but not yet delivered are not counted. Every rank holds the same
        state (any rank's may be saved).
        """
        if self.mixture:
            return {"zerobatch_loader": LOADER_STATE_VERSION, "kind": "mixture",
                    "mixture": copy.deepcopy(self._schedule_state), "steps": self._steps_delivered,
                    "global_batch_size": self.global_batch_size, "world_size": self.world_size}
        d = self._order_state(self._consumed).to_dict()
        d["world_size"] = self.world_size
        return d

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` stopped, on any world size.

        With the same global batch the run continues in exactly the order of an
        uninterrupted run; with another one it continues from the same position.

        Raises:
            StateError: the state belongs to another dataset, order, seed or tail policy, or
                another state version, or its position is beyond the epoch.
        """
        if not isinstance(state, dict):
            raise StateError(f"state: expected a dict, got {type(state).__name__}", field="state")
        if self.mixture:
            self._load_mixture(state)
            return
        if state.get("kind") == "mixture":
            raise StateError("kind: the state is a mixture's; this loader reads one source", field="kind")
        loaded = OrderState.from_dict(state)
        saved_world = state.get("world_size", 1)
        if isinstance(saved_world, bool) or not isinstance(saved_world, int) or saved_world < 1:
            raise StateError(f"world_size: must be a positive integer, got {saved_world!r}", field="world_size")
        n = self.source.num_items
        if self.endless:
            max_consumed = 2**63 - 1
        else:
            max_consumed = n + loaded.global_batch_size - 1 if self.tail == "pad" else n
        loaded.check_fits(self._order_state(0, loaded.global_batch_size), max_consumed=max_consumed)
        self._close_active()
        self.epoch = loaded.epoch
        self._consumed = loaded.consumed
        self._completed = False

    def _load_mixture(self, state: dict[str, Any]) -> None:
        if state.get("zerobatch_loader") != LOADER_STATE_VERSION or state.get("kind") != "mixture":
            raise StateError("zerobatch_loader: not a mixture loader state of this version", field="zerobatch_loader")
        steps = state.get("steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise StateError(f"steps: must be a count, got {steps!r}", field="steps")
        schedule = self.source.schedule  # type: ignore[union-attr]
        schedule.load_state_dict(state.get("mixture"))
        self._close_active()
        self._schedule_state = schedule.state_dict()
        self._steps_delivered = steps

    def _advanced_state(self, state: dict[str, Any], steps: int) -> dict[str, Any]:
        """``state`` after ``steps`` more whole steps (a worker-process loader's position)."""
        state = copy.deepcopy(state)
        if state.get("kind") == "mixture":
            schedule = copy.deepcopy(self.source.schedule)  # type: ignore[union-attr]
            schedule.load_state_dict(state["mixture"])
            for _ in range(steps):
                schedule.take(state["global_batch_size"])
            state["mixture"] = schedule.state_dict()
            state["steps"] += steps
            return state
        g = state["global_batch_size"]
        consumed = state["consumed"] + steps * g
        if self.tail == "keep" and not self.endless:
            consumed = min(consumed, self.source.num_items)
        state["consumed"] = consumed
        return state

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
        self.worker, self.num_workers = worker, num_workers
        self.epoch = loader.epoch
        self.start = loader._consumed
        self.steps = loader._steps_from(self.start)
        self.closed = False
        self.dtype = loader.dtype
        b = loader.items_per_step
        self.chunk = max(1, min(self.source.chunk_steps(b), loader.prefetch))
        self.depth = max(2, -(-loader.prefetch // self.chunk))
        self.inline = loader.num_threads == 0 or self.source.inline(self.dtype, b)
        self.workers = self.pool = None
        if not self.inline:
            if self.source.read_async is not None:
                self.pool = shared_pool(loader.num_threads)
            else:
                self.workers = shared_workers(loader.num_threads)
                self.workers.attach()
        self._tickets: collections.deque[Any] = collections.deque()
        if loader.mixture:
            self._schedule = copy.deepcopy(loader.source.schedule)  # type: ignore[union-attr]
            self._schedule.load_state_dict(loader._schedule_state)
            self._mix_base = loader._steps_delivered
            self._planned = 0
        self._plan = self._plan_reads()
        if not self.inline:
            self._fill()

    # -- planning -----------------------------------------------------------------------------

    def _positions(self, steps: np.ndarray) -> np.ndarray:
        ld = self.loader
        g, w, b = ld.global_batch_size, ld.world_size, ld.items_per_step
        pos = (self.start + steps[:, None] * g) + (ld.rank + w * np.arange(b, dtype=np.int64))[None, :]
        if not ld.endless and ld.tail == "pad":
            np.remainder(pos, ld.source.num_items, out=pos)
        return pos

    def _plan_reads(self) -> Iterator[tuple[np.ndarray, np.ndarray | None, list[Any]]]:
        """``(items (steps, b), tags or None, position after each step)`` per read, in order;
        the first reads cover 1, 2, 4... steps so the first batch is ready at once. Items
        are computed a page of steps at a time (one compiled call), reads are slices of it."""
        if self.loader.mixture:
            s = self.worker
            while True:
                yield self._mixture_plan([s])
                s += self.num_workers
        ld = self.loader
        g, n = ld.global_batch_size, ld.source.num_items
        keep = ld.tail == "keep" and not ld.endless
        page_steps = max(self.chunk, 1024)
        size = 1
        first = self.worker
        while self.steps is None or first < self.steps:
            stop = first + page_steps * self.num_workers
            if self.steps is not None:
                stop = min(stop, self.steps)
            steps = np.arange(first, stop, self.num_workers, dtype=np.int64)
            first = int(steps[-1]) + self.num_workers
            after = self.start + (steps + 1) * g
            short = keep and int(after[-1]) > n      # the short last step: read alone
            if keep:
                np.minimum(after, n, out=after)
            full = steps[:-1] if short else steps
            if full.size:
                pos = self._positions(full)
                items = ld.order.items(self.epoch, pos.reshape(-1)).reshape(pos.shape)  # type: ignore[union-attr]
                after_list = after.tolist()
                at = 0
                while at < full.size:
                    count = min(size, self.chunk, full.size - at)
                    part = items[at:at + count]
                    self.source.prepare(part)
                    yield part, None, after_list[at:at + count]
                    at += count
                    size *= 2
            if short:
                pos = self._positions(steps[-1:])
                pos = pos[:, pos[0] < n]
                items = ld.order.items(self.epoch, pos.reshape(-1)).reshape(pos.shape)  # type: ignore[union-attr]
                if items.size:
                    self.source.prepare(items)
                yield items, None, [int(after[-1])]

    def _mixture_plan(self, steps_list: list[int]) -> tuple[np.ndarray, np.ndarray | None, list[Any]]:
        ld = self.loader
        b, g = ld.items_per_step, ld.global_batch_size
        part = slice(ld.rank * b, (ld.rank + 1) * b)
        tags, items, after = [], [], []
        for s in steps_list:
            while self._planned < s:
                self._schedule.take(g)          # another worker's step
                self._planned += 1
            src, it = self._schedule.take(g)
            self._planned += 1
            tags.append(src[part])
            items.append(it[part])
            after.append((self._schedule.state_dict(), self._mix_base + self._planned))
        return np.stack(items), np.stack(tags), after

    def _submit(self, plan: tuple[np.ndarray, np.ndarray | None, list[Any]]) -> Any:
        items, tags, after = plan
        if items.shape[1] == 0:                 # this rank has nothing in a short last step
            return _Ready(None), after
        read = self.source.read
        fn = functools.partial(read, items, self.dtype, tags) if tags is not None else \
            functools.partial(read, items, self.dtype)
        if self.pool is not None:
            return self.source.read_async(self.pool, items, self.dtype), after
        if self.workers is None:
            return _Ready(fn()), after
        return self.workers.submit(fn), after

    def _fill(self) -> None:
        while len(self._tickets) < self.depth:
            plan = next(self._plan, None)
            if plan is None:
                return
            self._tickets.append(self._submit(plan))

    def _reads(self) -> Iterator[tuple[Any, list[Any]]]:
        if self.inline:
            for plan in self._plan:
                yield self._submit(plan)
            return
        tickets = self._tickets
        workers = self.workers
        while tickets:
            ticket, after = tickets.popleft()
            result = ticket.wait() if workers is None or isinstance(ticket, _Ready) else workers.wait(ticket)
            self._fill()
            yield _Ready(result), after

    # -- delivery -----------------------------------------------------------------------------

    def batches(self) -> Iterator[Any]:
        """The generator ``iter(loader)`` returns."""
        ld = self.loader
        try:
            for ready, after in self._reads():
                if self.closed:
                    return
                outputs = [None] * len(after) if ready.result is None else ld._convert(ready.result, len(after))
                for out, pos in zip(outputs, after, strict=True):
                    if self.closed:
                        return
                    # Counted as delivered now: a state saved while the loop works on this
                    # batch resumes after it.
                    if ld.mixture:
                        ld._schedule_state, ld._steps_delivered = pos
                    else:
                        ld._consumed = pos
                    if out is not None:
                        yield out
                del outputs, ready
            if not self.closed and not ld.endless:
                if self.steps:
                    last = self.start + self.steps * ld.global_batch_size
                    ld._consumed = min(last, ld.source.num_items) if ld.tail == "keep" else last
                ld._completed = True
                ld._active = None
        finally:
            self.close()

    def close(self) -> None:
        """Stop: drop queued reads, wait for those a thread has started (the source may be
        closed right after). Idempotent."""
        self.closed = True
        while self._tickets:
            ticket, _ = self._tickets.popleft()
            ticket.cancel()
        if self.workers is not None:
            workers, self.workers = self.workers, None
            workers.detach()


class _Ready:
    __slots__ = ("result",)

    def __init__(self, result: Any) -> None:
        self.result = result

    def wait(self) -> Any:
        return self.result

    def cancel(self) -> None:
        self.result = None
