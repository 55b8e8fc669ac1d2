"""Batches of item indices for one rank: a global order, cut into global batches, dealt to
ranks with no communication, with an exact resume on any world size.

Global step ``s`` of an epoch consumes the global positions ``[s*G, (s+1)*G)``, where
``G = world_size * batch_size`` is the global batch. Rank ``r`` takes positions
``s*G + r, s*G + r + W, s*G + r + 2W, ...`` (round-robin, as in the seed's
``range(rank, len, ranks)``), and the order (:mod:`zerobatch.samplers.orders`) says which
item each position is. Because every rank computes its own positions from
``(seed, epoch, step)``, ranks never talk to each other, and because a saved state is a
count of global positions, a run saved on ``W`` ranks continues on ``W'`` ranks with the same
``G`` without skipping or repeating a single position.

The tail of an epoch (fewer than ``G`` positions) is handled as asked:

- ``"keep"``: one last, shorter global batch (with several ranks, some get one index less,
  possibly none);
- ``"drop"``: no rank reads it;
- ``"pad"``: it is filled to a whole global batch with positions wrapped to the start of the
  epoch (re-read items), counted in :attr:`IndexSampler.padding`.

Endless streams (sliding, random) have no epochs and no tail.

:class:`IndexSampler` is a :class:`~zerobatch.samplers.Schedule`: the loaders plan their reads
with :meth:`IndexSampler.plan` and record each delivered step with
:meth:`IndexSampler.advance_to`. A state loads on any world size and with any global batch
(the resume rule of :mod:`zerobatch.samplers.schedule`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from zerobatch.core.checks import check_count, check_out
from zerobatch.formats.errors import ConfigError, OutOfRangeError, StateError
from zerobatch.samplers._dist import resolve_rank
from zerobatch.samplers.orders import IndexOrder
from zerobatch.samplers.schedule import Planned, Schedule, batch_sizes
from zerobatch.samplers.state import OrderState

__all__ = ["TAILS", "IndexSampler"]

#: Ways to end an epoch whose length is not a multiple of the global batch.
TAILS = ("keep", "drop", "pad")


#: Steps whose items one :meth:`IndexSampler.plan` page computes in one compiled call.
PLAN_PAGE_STEPS = 1024


class IndexSampler(Schedule):
    """This rank's batches of item indices, step by step, seekable and resumable.

    Args:
        order: the global order (:class:`SequentialOrder`, :class:`GlobalRandomOrder`,
            :class:`BlockShuffleOrder`, :class:`SlidingOrder`, :class:`RandomOrder`...).
        batch_size: indices per batch on this rank. Give this or ``global_batch_size``.
        global_batch_size: indices per step over all ranks; must be a multiple of
            ``world_size``.
        rank, world_size: this process's place in the job (default: ``torch.distributed``
            if initialized, else ``RANK`` / ``WORLD_SIZE``, else a single process).
        tail: ``"keep"``, ``"drop"`` or ``"pad"`` (see the module documentation).
        epoch: the starting epoch.
        fingerprint: identity of the data (a file's build id) recorded in the state and
            checked on load.
        label: what the items are (a loader's source family: ``"tokstream-windows"``...),
            recorded in the state's ``kind`` and checked on load.

    Raises:
        ConfigError: an argument out of range.

    Example::

        sampler = IndexSampler(GlobalRandomOrder(len(dataset), seed=7), batch_size=32)
        for epoch in range(sampler.epoch, num_epochs):
            sampler.set_epoch(epoch)
            for indices in sampler:            # int64 array of 32 item indices
                ...
                state = sampler.state_dict()   # JSON-able; resume with load_state_dict
    """

    def __init__(self, order: IndexOrder, batch_size: int | None = None, *,
                 global_batch_size: int | None = None, rank: int | None = None,
                 world_size: int | None = None, tail: str = "keep", epoch: int = 0,
                 fingerprint: str = "", label: str = "") -> None:
        if not isinstance(order, IndexOrder):
            raise ConfigError(f"order must be an IndexOrder, got {type(order).__name__}", field="order")
        self.order = order
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.batch_size, self.global_batch_size = batch_sizes(batch_size, global_batch_size, self.world_size)
        if tail not in TAILS:
            raise ConfigError(f"tail must be one of {TAILS}, got {tail!r}", field="tail")
        if not order.has_epochs and tail != "keep":
            raise ConfigError(f"tail={tail!r} needs an order with epochs; {order.kind} is endless",
                              field="tail")
        self.tail = tail
        if not isinstance(fingerprint, str):
            raise ConfigError(f"fingerprint must be a string, got {fingerprint!r}", field="fingerprint")
        self.fingerprint = fingerprint
        if not isinstance(label, str):
            raise ConfigError(f"label must be a string, got {label!r}", field="label")
        self.label = label
        self.epoch = check_count(epoch, "epoch")
        if not order.has_epochs and self.epoch:
            raise ConfigError(f"epoch: a {order.kind} order is endless, its only epoch is 0", field="epoch")
        self._consumed = 0
        self._offset = 0
        self._completed = False

    @property
    def kind(self) -> str:  # type: ignore[override]
        """The state's ``kind``: the order's kind, after the label when there is one
        (``"tokstream-windows/global-random"``)."""
        return f"{self.label}/{self.order.kind}" if self.label else self.order.kind

    @property
    def endless(self) -> bool:
        """An endless order (no epochs)."""
        return not self.order.has_epochs

    @classmethod
    def from_state(cls, order: IndexOrder, state: dict[str, Any], *, rank: int | None = None,
                   world_size: int | None = None, fingerprint: str = "", label: str = "") -> IndexSampler:
        """A sampler on any world size that continues ``state`` exactly: the global batch and
        tail policy come from the state, the per-rank batch is ``global_batch_size /
        world_size``.

        Raises:
            StateError: the state does not fit ``order`` (another dataset, seed or order), its
                global batch cannot be split over ``world_size`` ranks, or its position is
                beyond the epoch.
        """
        loaded = OrderState.from_dict(state)
        r, w = resolve_rank(rank, world_size)
        g = loaded.global_batch_size
        if g % w:
            raise StateError(f"global_batch_size: the state was saved with a global batch of {g} "
                             f"positions and it cannot be split over {w} ranks",
                             field="global_batch_size")
        tail = loaded.params.get("tail", "keep")
        if tail not in TAILS:
            raise StateError(f"tail: unknown tail policy {tail!r} in the saved state", field="tail")
        if not order.has_epochs:
            tail = "keep"
        sampler = cls(order, global_batch_size=g, rank=r, world_size=w, tail=tail,
                      fingerprint=fingerprint, label=label)
        sampler.load_state_dict(state)
        return sampler

    # -----------------------------------------------------------------------------------
    # geometry

    def _steps(self, offset: int) -> int | None:
        n, g = self.order.num_items, self.global_batch_size
        if not self.order.has_epochs:
            return None if n else 0
        rest = max(n - offset, 0)
        return rest // g if self.tail == "drop" else -(-rest // g)

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps in a whole epoch (the same on every rank), ``None`` for an endless stream
        (0 when the index space is empty). An epoch resumed from a state of another global
        batch counts its steps from where that state stopped (see :attr:`offset`)."""
        return self._steps(self._offset)

    @property
    def offset(self) -> int:
        """Where the steps of the current epoch start: 0, or, in an epoch resumed from a state
        saved with another global batch, the saved position modulo this global batch (the
        steps go on from exactly that position)."""
        return self._offset

    @property
    def epoch_positions(self) -> int | None:
        """Global positions consumed by a whole epoch, padding included (``None``: endless)."""
        steps = self.steps_per_epoch
        if steps is None:
            return None
        return self.order.num_items if self.tail == "keep" else self._offset + steps * self.global_batch_size

    @property
    def padding(self) -> int:
        """Positions of each epoch that re-read items to fill the last step (``tail="pad"``)."""
        total = self.epoch_positions
        return 0 if total is None else max(total - self.order.num_items, 0)

    @property
    def dropped(self) -> int:
        """Items of each epoch no rank reads (``tail="drop"``)."""
        total = self.epoch_positions
        return 0 if total is None else max(self.order.num_items - total, 0)

    def __len__(self) -> int:
        """Batches this rank yields in a whole epoch.

        Raises:
            TypeError: the order is an endless stream.
        """
        steps = self.steps_per_epoch
        if steps is None:
            raise TypeError(f"a {self.order.kind} order is endless: it has no length")
        return steps

    def positions(self, step: int, *, epoch: int | None = None) -> np.ndarray:
        """This rank's global positions at ``step`` of an epoch (``int64``; O(1) to compute).

        Raises:
            OutOfRangeError: ``step`` beyond the epoch.
        """
        step = check_count(step, "step")
        offset = self._offset if epoch is None or epoch == self.epoch else 0
        steps = self._steps(offset)
        if steps is not None and step >= steps:
            raise OutOfRangeError(f"step {step} is beyond the epoch's {steps} steps", field="step")
        g, w = self.global_batch_size, self.world_size
        if step > (2**63 - 1 - g - offset) // g:
            raise OutOfRangeError(f"step {step}: its positions exceed 2**63 - 1", field="step")
        pos = offset + step * g + self.rank + w * np.arange(self.batch_size, dtype=np.int64)
        n = self.order.num_items
        if self.order.has_epochs:
            if self.tail == "keep":
                pos = pos[pos < n]
            elif self.tail == "pad":
                np.remainder(pos, n, out=pos)
        return pos

    def batch(self, step: int, *, epoch: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """This rank's item indices at ``step`` of ``epoch`` (default: the current epoch).

        A pure function of ``(order, epoch, step, rank, world_size, global batch)``: seeking
        to any step costs the same as the next one.

        Args:
            step: step within the epoch (any step of an endless stream).
            epoch: the epoch (default: :attr:`epoch`).
            out: a caller's ``int64`` buffer of ``batch_size`` elements; the returned array
                is a view of its first ``k`` elements (``k < batch_size`` only for a kept tail).

        Raises:
            OutOfRangeError: ``step`` beyond the epoch.
            ConfigError: an unfit ``out``.
        """
        epoch = self.epoch if epoch is None else check_count(epoch, "epoch")
        pos = self.positions(step, epoch=epoch)
        if out is None:
            return self.order.items(epoch, pos)
        check_out(out, self.batch_size)
        view = out[: pos.size]
        self.order.items(epoch, pos, view)
        return view

    # -----------------------------------------------------------------------------------
    # iteration and state

    @property
    def step(self) -> int:
        """The next step of the current epoch to be delivered."""
        return -(-(self._consumed - self._offset) // self.global_batch_size)

    @property
    def consumed(self) -> int:
        """Global positions of the current epoch delivered so far (all ranks, padding included)."""
        return self._consumed

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch. A new epoch starts at its beginning; the current one keeps its
        position, so a resumed loop can call ``set_epoch`` as usual.

        Raises:
            ConfigError: an endless order and an epoch other than 0.
        """
        epoch = check_count(epoch, "epoch")
        if not self.order.has_epochs and epoch != 0:
            raise ConfigError(f"a {self.order.kind} order is endless: its only epoch is 0", field="epoch")
        if epoch != self.epoch:
            self.epoch = epoch
            self._consumed = 0
            self._offset = 0
            self._completed = False

    def seek(self, step: int) -> None:
        """Move to ``step`` of the current epoch in O(1): the next batch delivered is
        ``batch(step)``, exactly as if ``step`` batches had been consumed (on every rank).

        Raises:
            OutOfRangeError: ``step`` beyond the end of the epoch.
        """
        step = check_count(step, "step")
        steps = self.steps_per_epoch
        if steps is not None and step > steps:
            raise OutOfRangeError(f"step {step} is beyond the epoch's {steps} steps", field="step")
        self._consumed = self._after(step)
        self._completed = False

    def _after(self, steps: int, start: int | None = None) -> int:
        """The position after ``steps`` more steps from ``start`` (default: the offset)."""
        consumed = (self._offset if start is None else start) + steps * self.global_batch_size
        if self.order.has_epochs and self.tail == "keep":
            consumed = min(consumed, self.order.num_items)
        return consumed

    def batches(self, out: np.ndarray | None = None) -> Iterator[np.ndarray]:
        """Yield the rest of the current epoch's batches (forever for an endless stream).

        The position advances as each batch is delivered, so :meth:`state_dict` taken
        inside the loop resumes right after the batch being processed.

        Args:
            out: a caller's ``int64`` buffer of ``batch_size`` elements, reused for every
                batch (each yielded array is a view of it, valid until the next one).
        """
        self.begin()
        if out is not None:
            check_out(out, self.batch_size)
        epoch, steps = self.epoch, self.steps_per_epoch
        step = self.step
        while steps is None or step < steps:
            if self.epoch != epoch:
                return
            batch = self.batch(step, epoch=epoch, out=out)
            self._consumed = self._after(step + 1)
            yield batch
            step += 1
        self._completed = True

    def __iter__(self) -> Iterator[np.ndarray]:
        return self.batches()

    # -----------------------------------------------------------------------------------
    # the Schedule interface (what the loaders call)

    def steps_left(self) -> int | None:
        """Steps from the current position to the end of the epoch (``None``: endless)."""
        steps = self.steps_per_epoch
        return None if steps is None else max(steps - self.step, 0)

    def begin(self) -> None:
        """Start a pass: after a finished one, the same epoch starts again from its beginning."""
        if self._completed:
            self._consumed = 0
            self._offset = 0
            self._completed = False

    def plan(self, first: int = 0, stride: int = 1) -> Iterator[Planned]:
        """Steps ``first, first + stride, ...`` of the rest of the epoch (counted from the
        current position), a page of up to 1024 steps at a time (one compiled call computes
        a page's items); a kept short last step comes alone in its page."""
        first = check_count(first, "first")
        stride = check_count(stride, "stride", minimum=1)
        steps_left = self.steps_left()
        base = self.step
        epoch, g, n = self.epoch, self.global_batch_size, self.order.num_items
        keep = self.tail == "keep" and not self.endless
        rel = first
        while steps_left is None or rel < steps_left:
            stop = rel + PLAN_PAGE_STEPS * stride
            if steps_left is not None:
                stop = min(stop, steps_left)
            rels = np.arange(rel, stop, stride, dtype=np.int64)
            rel = int(rels[-1]) + stride
            steps = base + rels
            after = self._offset + (steps + 1) * g
            short = keep and int(after[-1]) > n          # the kept short last step: alone
            if keep:
                np.minimum(after, n, out=after)
            full = steps[:-1] if short else steps
            if self.exclude is not None:
                yield from self._excluding(epoch, steps, after, short)
                continue
            if full.size:
                items = self._items(epoch, self._positions_of(full))
                yield Planned(items, None, after[:full.size].tolist())
            if short:
                pos = self._positions_of(steps[-1:])
                pos = pos[:, pos[0] < n]
                yield Planned(self._items(epoch, pos), None, [int(after[-1])])

    def _excluding(self, epoch: int, steps: np.ndarray, after: np.ndarray, short: bool) -> Iterator[Planned]:
        """:meth:`plan`'s page of ``steps`` under exclusions: each step's whole global batch
        checked (:meth:`Schedule._kept`); the steps they leave as they are still go out
        together, a changed one alone with the items kept."""
        n, g = self.order.num_items, self.global_batch_size
        first_global = self.epoch * (self._steps(0) or 0) if self.order.has_epochs else 0
        run: list[int] = []

        def flush() -> Iterator[Planned]:
            if run:
                chosen = steps[run]
                yield Planned(self._items(epoch, self._positions_of(chosen)), None, after[run].tolist())
                run.clear()

        for i, step in enumerate(steps.tolist()):
            whole = self._offset + step * g + np.arange(g, dtype=np.int64)
            if self.order.has_epochs and self.tail == "pad":
                whole %= n
            last = short and i == steps.size - 1
            if last:
                whole = whole[whole < n]
            kept = self._kept(first_global + step, self.order.items(epoch, whole), None)
            if kept is None and not last:
                run.append(i)
                continue
            yield from flush()
            pos = self._positions_of(steps[i:i + 1])
            if last:
                pos = pos[:, pos[0] < n]
            if kept is not None:
                pos = pos[:, kept[:pos.shape[1]]]
            yield Planned(self._items(epoch, pos), None, [int(after[i])])
        yield from flush()

    @property
    def global_step(self) -> int:
        """Steps of the run delivered so far: ``epoch * steps_per_epoch + step`` (a whole
        epoch's steps from its start; the step within the epoch of an endless order)."""
        if not self.order.has_epochs:
            return self.step
        return self.epoch * (self._steps(0) or 0) + self.step

    def _shares(self, mask: np.ndarray) -> np.ndarray:
        w = self.world_size
        k = -(-mask.size // w)
        padded = np.zeros(k * w, bool)
        padded[:mask.size] = mask
        shares = padded.reshape(k, w).T.copy()
        # a kept short step: a rank holding no position of it keeps nothing by nature
        owned = (np.arange(k * w).reshape(k, w).T < mask.size)
        shares[~owned.any(axis=1)] = True
        return shares

    def global_items(self, steps: Any) -> np.ndarray:
        """``int64 (len(steps), global_batch_size)``: the items of every rank at ``steps`` of
        the current epoch (column ``i`` is rank ``i % world_size``'s ``i // world_size``-th
        item), as each rank plans them; what a pre-flight plan of a whole job reads."""
        st = np.asarray(steps, dtype=np.int64).reshape(-1)
        g = self.global_batch_size
        pos = (self._offset + st[:, None] * g) + np.arange(g, dtype=np.int64)[None, :]
        if self.order.has_epochs and self.tail == "pad":
            np.remainder(pos, self.order.num_items, out=pos)
        return self._items(self.epoch, pos)

    def _positions_of(self, steps: np.ndarray) -> np.ndarray:
        """``int64 (len(steps), batch_size)``: this rank's positions at each step (pad: wrapped)."""
        g, w = self.global_batch_size, self.world_size
        pos = (self._offset + steps[:, None] * g) + (self.rank + w * np.arange(self.batch_size, dtype=np.int64))[None, :]
        if self.order.has_epochs and self.tail == "pad":
            np.remainder(pos, self.order.num_items, out=pos)
        return pos

    def _items(self, epoch: int, pos: np.ndarray) -> np.ndarray:
        return self.order.items(epoch, pos.reshape(-1)).reshape(pos.shape)

    @property
    def position(self) -> int:
        """Global positions of the epoch delivered (:attr:`consumed`)."""
        return self._consumed

    def advance_to(self, position: Any) -> None:
        """Record a delivered step: ``position`` is its :attr:`Planned.after` entry."""
        self._consumed = int(position)

    def finish(self) -> None:
        """The epoch's pass ran to its end: the next :meth:`begin` starts the epoch again."""
        self._completed = True

    def advanced(self, steps: int, state: dict[str, Any] | None = None) -> dict[str, Any]:
        """The state ``steps`` delivered steps after ``state`` (default: the current
        position), in O(1); this sampler is left as it was."""
        steps = check_count(steps, "steps")
        if state is None:
            d = self.state_dict()
        else:
            d = dict(state)
            d["params"] = dict(d.get("params", {}))
            probe = IndexSampler(self.order, global_batch_size=self.global_batch_size, rank=self.rank,
                                 world_size=self.world_size, tail=self.tail, fingerprint=self.fingerprint,
                                 label=self.label)
            probe.load_state_dict(d)
            d = probe.state_dict()
        g = d["global_batch_size"]
        consumed = d["consumed"] + steps * g
        if self.order.has_epochs and self.tail == "keep":
            consumed = min(consumed, self.order.num_items)
        d["consumed"] = consumed
        return d

    # -----------------------------------------------------------------------------------
    # state

    def _params(self) -> dict[str, Any]:
        params = dict(self.order.params())
        params["tail"] = self.tail
        return params

    def _order_state(self, consumed: int) -> OrderState:
        return OrderState(kind=self.kind, seed=self.order.seed, epoch=self.epoch,
                          consumed=consumed, num_items=self.order.num_items,
                          global_batch_size=self.global_batch_size,
                          fingerprint=self.fingerprint, params=self._params())

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch delivered: JSON-able, a few hundred bytes.

        Holds the order (kind, seed, size, parameters, fingerprint), the epoch, the global
        positions consumed and the global batch; ``world_size`` is recorded for information
        only (any world size can resume).
        """
        d = self._order_state(self._consumed).to_dict()
        d["world_size"] = self.world_size
        return d

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` stopped: with the same global batch exactly as an
        uninterrupted run; with another one from the same position (nothing skipped or
        repeated in the epoch; see :attr:`offset`).

        Raises:
            StateError: another order, seed, dataset size, fingerprint, label or tail
                policy; a position beyond the epoch or between the steps of its own global
                batch; a ``world_size`` that is not a positive integer; an unknown state
                version.
        """
        loaded = OrderState.from_dict(state)
        saved_world = state.get("world_size", 1)
        if isinstance(saved_world, bool) or not isinstance(saved_world, int) or saved_world < 1:
            raise StateError(f"world_size: must be a positive integer, got {saved_world!r}", field="world_size")
        n = self.order.num_items
        if self.order.has_epochs:
            g = loaded.global_batch_size
            # the end of the epoch as the state's own global batch cut it
            own_steps = n // g if self.tail == "drop" else -(-n // g)
            total = n if self.tail == "keep" else own_steps * g
        else:
            total = None
        loaded.check_fits(self._order_state(0), max_consumed=2**63 - 1 if total is None else max(total, n))
        if not self.order.has_epochs and loaded.epoch != 0:
            raise StateError(f"epoch: a {self.order.kind} order is endless, its only epoch is 0, "
                             f"the state says {loaded.epoch}", field="epoch")
        if loaded.consumed % loaded.global_batch_size and loaded.consumed != total:
            raise StateError(f"consumed: {loaded.consumed} positions is not a whole number of "
                             f"global batches of {loaded.global_batch_size}", field="consumed")
        if total is not None and loaded.consumed > total:
            raise StateError(f"consumed: the saved state has consumed {loaded.consumed} positions but the "
                             f"epoch holds {total}: a step beyond the epoch", field="consumed")
        self.epoch = loaded.epoch
        self._consumed = loaded.consumed
        self._offset = 0
        if loaded.global_batch_size != self.global_batch_size and loaded.consumed != total:
            self._offset = loaded.consumed % self.global_batch_size
        self._completed = False

    def __repr__(self) -> str:
        return (f"IndexSampler({self.order!r}, batch_size={self.batch_size}, rank={self.rank}, "
                f"world_size={self.world_size}, tail={self.tail!r}, epoch={self.epoch})")
