"""Schedules: which items each step of one rank holds, and where a run stands.

A loader asks its schedule for nothing but this interface, so everything about positions,
rank sharding, epochs and resuming lives here and not in the loaders:

- :meth:`Schedule.plan` yields the rest of the pass (an epoch, or an endless stream) from the
  current position as :class:`Planned` pages: each holds the items of several steps
  (``int64 (steps, items_per_step)``), for a mixture the source of each item, and the
  position after each step. ``plan(first, stride)`` yields only steps ``first, first +
  stride, ...`` (worker ``w`` of ``k`` data-loading processes plans ``plan(w, k)``).
- :meth:`Schedule.advance_to` records a step as delivered (the loop received its batch);
  :meth:`Schedule.finish` records the end of the pass.
- :meth:`Schedule.state_dict` / :meth:`Schedule.load_state_dict` save and restore the
  position after the last delivered step; :meth:`Schedule.advanced` is the state ``n``
  steps further.

Two schedules implement it, each over an order that says which item every global sample is:
:class:`~zerobatch.samplers.IndexSampler` (one :class:`~zerobatch.samplers.IndexOrder` cut
into global batches, dealt round-robin to ranks) and :class:`MixtureSampler` (a
:class:`~zerobatch.samplers.MixtureOrder`: several sources in exact proportions). The orders
know nothing of ranks, steps or delivered positions; that is the schedules' part.

**One resume rule for every schedule.** A state is the count of what the whole job consumed
(global positions of the epoch, or samples per mixture source), never a per-rank position,
so it loads on any world size. With the same global batch the run continues exactly as an
uninterrupted run would; with another global batch it continues from the same position:
nothing consumed comes again in that epoch and nothing is skipped, but the later steps group
the remaining items differently.
"""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from zerobatch.core.checks import check_count
from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.samplers._dist import resolve_rank
from zerobatch.samplers.mixture import MixtureOrder
from zerobatch.samplers.state import STATE_VERSION

if TYPE_CHECKING:
    from zerobatch.samplers.orders import IndexOrder

__all__ = ["MixtureSampler", "Planned", "Schedule", "batch_sizes"]


def check_batch_schedule(points: Any, world_size: int) -> list[tuple[int, int]]:
    """``[(step, global batch)]`` from a step-keyed global batch schedule (a ramp): steps
    increasing from 0, every batch a positive multiple of ``world_size``.

    Raises:
        ConfigError: points out of order, or a batch that does not split over the ranks.
    """
    if points is None:
        return []
    out: list[tuple[int, int]] = []
    for entry in points:
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise ConfigError(f"batch_schedule: each point is (step, global batch), got {entry!r}",
                              field="batch_schedule")
        step = check_count(entry[0], "batch_schedule step")
        g = check_count(entry[1], "batch_schedule global batch", minimum=1, maximum=2**48)
        if g % world_size:
            raise ConfigError(f"batch_schedule: a global batch of {g} at step {step} cannot be split over "
                              f"{world_size} ranks", field="batch_schedule")
        if out and step <= out[-1][0]:
            raise ConfigError("batch_schedule: steps must increase", field="batch_schedule")
        out.append((step, g))
    if not out or out[0][0] != 0:
        raise ConfigError("batch_schedule: the first point is step 0", field="batch_schedule")
    return out


def batch_sizes(batch_size: int | None, global_batch_size: int | None, world_size: int) -> tuple[int, int]:
    """``(per rank, global)`` batch sizes from exactly one of them.

    Raises:
        ConfigError: both or neither given, one out of range, or a global batch that does not
            split evenly over ``world_size`` ranks.
    """
    if (batch_size is None) == (global_batch_size is None):
        raise ConfigError("pass exactly one of batch_size and global_batch_size", field="batch_size")
    if batch_size is not None:
        b = check_count(batch_size, "batch_size", minimum=1, maximum=2**40)
        return b, b * world_size
    g = check_count(global_batch_size, "global_batch_size", minimum=1, maximum=2**48)
    if g % world_size:
        raise ConfigError(f"global_batch_size {g} cannot be split over {world_size} ranks", field="global_batch_size")
    return g // world_size, g


@dataclasses.dataclass(frozen=True)
class Planned:
    """Consecutive planned steps of one rank.

    Attributes:
        items: ``int64 (steps, k)``: the items of each step (``k`` is the per-rank batch, or
            fewer for a kept short last step, alone in its page).
        sources: ``int32 (steps, k)``: a mixture's source of each item; ``None`` otherwise.
        after: the schedule's position after each step (for :meth:`Schedule.advance_to`).
    """

    items: np.ndarray
    sources: np.ndarray | None
    after: list[Any]

    @property
    def steps(self) -> int:
        return len(self.after)


class Schedule(ABC):
    """Which items each step of one rank holds, and where the run stands (module docs).

    Attributes:
        kind: the schedule's name in a saved state.
        rank, world_size: this process's place in the job.
        batch_size: items per full step on this rank.
        global_batch_size: items per step over all ranks.
        epoch: the current epoch (0 for an endless schedule).
        order: the index order (``None`` where each source has its own: a mixture).
        tail: how an epoch's short last step is handled (``"keep"`` for endless schedules).
    """

    kind: str
    rank: int
    world_size: int
    batch_size: int
    global_batch_size: int
    epoch: int
    order: IndexOrder | None = None
    tail: str = "keep"
    #: Exclusions (set by a loader: :meth:`zerobatch.adapters.BaseLoader.exclude`):
    #: ``keep(global_step, items, sources)`` over a step's whole global batch returns ``None``
    #: (the step is untouched) or which of its items are kept (none: the step is skipped). A
    #: step where some rank would keep nothing is skipped on every rank (ranks stay in step).
    exclude: Callable[[int, np.ndarray, np.ndarray | None], np.ndarray | None] | None = None

    @property
    @abstractmethod
    def global_step(self) -> int:
        """Steps of the run delivered so far, over its epochs (the number of the next step)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Schedule:
        # a copy shares the exclusions (a loader's, holding its source): they are read only
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = value if key == "exclude" else copy.deepcopy(value, memo)
        return new

    @abstractmethod
    def _shares(self, mask: np.ndarray) -> np.ndarray:
        """``bool (world_size, k)``: ``mask`` over a step's global batch dealt to the ranks."""

    def _kept(self, step: int, whole: np.ndarray, sources: np.ndarray | None) -> np.ndarray | None:
        """This rank's kept items of global step ``step`` (a bool mask over its share), or
        ``None`` when the exclusions leave the step as it is."""
        if self.exclude is None:
            return None
        mask = self.exclude(step, whole, sources)
        if mask is None:
            return None
        shares = self._shares(np.asarray(mask, bool))
        if not shares.any(axis=1).all():
            return np.zeros(shares.shape[1], bool)         # some rank would be left with nothing
        return shares[self.rank]

    @property
    @abstractmethod
    def endless(self) -> bool:
        """No epochs: a pass never ends by itself."""

    @property
    @abstractmethod
    def steps_per_epoch(self) -> int | None:
        """Steps in a whole epoch (``None``: endless)."""

    @abstractmethod
    def steps_left(self) -> int | None:
        """Steps from the current position to the end of the pass (``None``: endless)."""

    @abstractmethod
    def begin(self) -> None:
        """Start a pass: after a finished pass the same epoch starts again from its beginning."""

    @abstractmethod
    def plan(self, first: int = 0, stride: int = 1) -> Iterator[Planned]:
        """Steps ``first, first + stride, ...`` of the rest of the pass, counted from the
        current position, as pages of consecutive planned steps."""

    @property
    @abstractmethod
    def position(self) -> Any:
        """The position after the last delivered step (opaque; what :class:`Planned` holds)."""

    @abstractmethod
    def advance_to(self, position: Any) -> None:
        """A step was delivered: ``position`` is the :attr:`Planned.after` entry of that step."""

    @abstractmethod
    def finish(self) -> None:
        """The pass ran to its end (the next pass starts the epoch again)."""

    @abstractmethod
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a new one starts at its beginning, the current one keeps its place."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The position after the last delivered step (JSON-able)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` stopped (the module's resume rule)."""

    def advanced(self, steps: int, state: dict[str, Any] | None = None) -> dict[str, Any]:
        """The state ``steps`` delivered steps after ``state`` (default: the current position);
        this schedule is left as it was."""
        steps = check_count(steps, "steps")
        other = copy.deepcopy(self)
        if state is not None:
            other.load_state_dict(state)
        pos = other.position
        if steps:
            for page in other.plan(0, 1):
                if steps <= page.steps:
                    pos = page.after[steps - 1]
                    break
                steps -= page.steps
                pos = page.after[-1]
        other.advance_to(pos)
        return other.state_dict()


class MixtureSampler(Schedule):
    """The steps of a :class:`~zerobatch.samplers.MixtureOrder` for one rank: every global
    step takes the next ``global_batch_size`` samples of the mixture order, and rank ``r``
    reads samples ``[r * b, (r + 1) * b)`` of them. Endless (a mixture has no epochs).

    Args:
        mixture: the mixture order (its state is this sampler's position).
        batch_size / global_batch_size: per rank / over all ranks (give one).
        rank, world_size: this process's place (default: from ``torch.distributed`` or the
            environment, see :func:`~zerobatch.samplers.resolve_rank`).

    The state holds the mixture's (counts consumed per source, by name) and the steps
    delivered; it resumes on any world size, with other weights or added sources
    (:meth:`MixtureOrder.load_state_dict`).

    ``batch_schedule``: ``[(step, global batch), ...]`` from step 0: the global batch changes
    at those steps (a batch-size ramp); every rank reads its share of each step's batch.
    """

    kind = "mixture"

    def __init__(self, mixture: MixtureOrder, batch_size: int | None = None, *,
                 global_batch_size: int | None = None, rank: int | None = None,
                 world_size: int | None = None, batch_schedule: Any = None) -> None:
        if not isinstance(mixture, MixtureOrder):
            raise ConfigError(f"mixture must be a MixtureOrder, got {type(mixture).__name__}", field="mixture")
        self.mixture = mixture
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.batch_schedule = check_batch_schedule(batch_schedule, self.world_size)
        if self.batch_schedule and batch_size is None and global_batch_size is None:
            global_batch_size = self.batch_schedule[0][1]
        self.batch_size, self.global_batch_size = batch_sizes(batch_size, global_batch_size, self.world_size)
        self.epoch = 0
        self._state = mixture.state_dict()      # the mixture order after the last delivered step
        self._steps = 0                         # steps delivered

    @property
    def schedule(self) -> MixtureOrder:
        """The former name of :attr:`mixture` (the mixture order, not a schedule)."""
        return self.mixture

    @property
    def endless(self) -> bool:
        return True

    @property
    def steps_per_epoch(self) -> int | None:
        return None

    def steps_left(self) -> int | None:
        return None

    def begin(self) -> None:
        pass

    def plan(self, first: int = 0, stride: int = 1) -> Iterator[Planned]:
        first = check_count(first, "first")
        stride = check_count(stride, "stride", minimum=1)
        mix = copy.deepcopy(self.mixture)
        mix.load_state_dict(self._state, step=self._steps)
        at = self._steps                        # the global step the plan starts at
        taken = 0
        step = first
        while True:
            while taken < step:
                mix.take_step(self.global_batch_at(at + taken))     # a step of another worker
                taken += 1
            g = self.global_batch_at(at + taken)
            b = g // self.world_size
            src, items = mix.take_step(g)
            taken += 1
            part = slice(self.rank * b, (self.rank + 1) * b)
            mine, tags = items[part], src[part]
            kept = self._kept(at + taken - 1, items, src)
            if kept is not None:
                mine, tags = mine[kept], tags[kept]
            yield Planned(mine.reshape(1, -1), tags.reshape(1, -1), [(mix.state_dict(), at + taken)])
            step += stride

    @property
    def global_step(self) -> int:
        return self._steps

    def _shares(self, mask: np.ndarray) -> np.ndarray:
        return mask.reshape(self.world_size, -1)

    def global_batches(self, first: int, count: int) -> np.ndarray:
        """``int64 [count]``: the global batch of steps ``first .. first + count - 1``."""
        steps = first + np.arange(count, dtype=np.int64)
        out = np.full(count, self.global_batch_size, np.int64)
        for start, size in self.batch_schedule:
            out[steps >= start] = size
        return out

    def advanced(self, steps: int, state: dict[str, Any] | None = None) -> dict[str, Any]:
        """The state ``steps`` delivered steps after ``state`` (default: the current position),
        in one compiled walk of the picks (:meth:`MixtureOrder.skip_steps`); this schedule is
        left as it was."""
        steps = check_count(steps, "steps")
        other = copy.deepcopy(self)
        if state is not None:
            other.load_state_dict(state)
        mix = copy.deepcopy(other.mixture)
        mix.load_state_dict(other._state, step=other._steps)
        mix.skip_steps(other.global_batches(other._steps, steps))
        other.advance_to((mix.state_dict(), other._steps + steps))
        return other.state_dict()

    def whole_step(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """``(sources, items)`` of global ``step``'s whole global batch (every rank's), from the
        start of the run (a fresh mixture order, walked to the step)."""
        step = check_count(step, "step")
        mix = copy.deepcopy(self.mixture)
        mix.skip_steps(self.global_batches(0, step))
        return mix.take_step(self.global_batch_at(step))

    def global_batch_at(self, step: int) -> int:
        """The global batch of ``step`` (the batch schedule's, else the fixed one)."""
        g = self.global_batch_size
        for start, size in self.batch_schedule:
            if start > step:
                break
            g = size
        return g

    @property
    def position(self) -> Any:
        return (self._state, self._steps)

    def advance_to(self, position: Any) -> None:
        self._state, self._steps = position

    def finish(self) -> None:
        pass

    def set_epoch(self, epoch: int) -> None:
        if check_count(epoch, "epoch") != 0:
            raise ConfigError("epoch: a mixture has no epochs", field="epoch")

    def state_dict(self) -> dict[str, Any]:
        return {"zerobatch_state": STATE_VERSION, "kind": self.kind, "mixture": copy.deepcopy(self._state),
                "steps": self._steps, "global_batch_size": self.global_batch_size, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (also a mixture state of the loaders of release 0.1,
        ``{"zerobatch_loader": 1, "kind": "mixture", ...}``).

        Raises:
            StateError: not a mixture state, or one that does not fit the mixture
                (:meth:`MixtureOrder.load_state_dict`).
        """
        if not isinstance(state, dict):
            raise StateError(f"state: expected a dict, got {type(state).__name__}", field="state")
        if state.get("kind") != "mixture":
            raise StateError(f"kind: the state is a {state.get('kind')!r} state; this loader reads a mixture",
                             field="kind")
        if state.get("zerobatch_state") != STATE_VERSION and state.get("zerobatch_loader") != 1:
            raise StateError("zerobatch_state: not a mixture state of this version", field="zerobatch_state")
        steps = state.get("steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise StateError(f"steps: must be a count, got {steps!r}", field="steps")
        probe = copy.deepcopy(self.mixture)
        # raises StateError for a state that does not fit; a weight schedule continues at `steps`
        probe.load_state_dict(state.get("mixture"), step=steps)
        self._state = probe.state_dict()
        self._steps = steps

    def __repr__(self) -> str:
        return (f"MixtureSampler({self.mixture!r}, batch_size={self.batch_size}, rank={self.rank}, "
                f"world_size={self.world_size})")
