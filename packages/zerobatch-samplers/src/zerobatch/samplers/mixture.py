"""Mixing sources in exact proportions, resumable across changes of the weights.

:class:`MixtureOrder` decides, sample by sample, which source the next sample comes from
and which item of that source it is:

- **Which source**: the "largest sampling error first" rule of Megatron's blended datasets.
  Pick ``t`` (counted from the last change of weights) goes to the source ``k`` with the
  largest ``w[k] * (t + 1) - n[k]``, where ``n[k]`` counts the picks of ``k`` since that
  change (ties: the source listed first). After any ``T`` picks every ``|n[k] - w[k] * T|``
  stays below 1: the proportions are exact at every step, not only on average.
- **Which item**: source ``k`` has its own order and its own count ``consumed[k]``; its
  ``c``-th sample is position ``c mod size`` of epoch ``c // size`` of that order (a fresh
  Feistel permutation per epoch with ``shuffle``, else ascending). A small source with a
  large weight is upsampled by cycling through epochs; a source is never repeated within one
  of its epochs.

The state (:meth:`MixtureOrder.state_dict`) holds every source's ``consumed`` count by
name, the weights, and the picks since the weights last changed. Loading it into a mixture
order with *other* weights, or with sources added or removed, continues every source that both
know exactly where it stopped (nothing already consumed comes again in that epoch), starts
new sources at 0, and applies the new weights from that point on.

Rank sharding needs no communication: every rank computes the same global sequence, and rank
``r`` of ``w`` takes samples ``[r * b, (r + 1) * b)`` of each global batch of ``w * b``.

**An order, not a schedule.** A mixture order plays for a mixture the role an
:class:`~zerobatch.samplers.IndexOrder` plays for one source: it says which (source, item)
each *global* sample is, for every rank alike, and knows nothing of ranks, batch sizes or
delivered steps. The :class:`~zerobatch.samplers.Schedule` over it is
:class:`~zerobatch.samplers.MixtureSampler` (as :class:`~zerobatch.samplers.IndexSampler` is
over an index order): it cuts the samples into steps, gives each rank its part and saves the
position, with this order's state nested under ``"mixture"``. Unlike an index order it is
read in sequence (:meth:`MixtureOrder.take`; its state is how far it has been read), because
the source of a sample depends on the picks before it. ``MixtureSchedule`` is its former
name, kept as an alias.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zerobatch.core.checks import check_count, check_rank, check_seed
from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.samplers.orders import GlobalRandomOrder, IndexOrder, SequentialOrder

__all__ = ["MIXTURE_STATE_VERSION", "MixtureOrder", "MixtureSchedule", "WeightSchedule"]

MIXTURE_STATE_VERSION = 1


class WeightSchedule:
    """Mixture weights that change with the training step.

    Args:
        points: ``(step, weights)`` pairs, steps strictly increasing from 0; ``weights`` a
            mapping of source name to weight (a source left out weighs 0 there), or a list
            in the sources' order. Before the first point the mixture's own weights hold.
        interpolation: ``"constant"`` (each point's weights hold until the next point) or
            ``"linear"`` (weights move linearly from each point to the next, step by step;
            the last point's hold after it).

    Raises:
        ConfigError: steps not increasing, or weights that are not non-negative finite
            numbers adding up to more than 0.
    """

    def __init__(self, points: Sequence[tuple[int, Any]], *, interpolation: str = "constant") -> None:
        if interpolation not in ("constant", "linear"):
            raise ConfigError(f"interpolation must be 'constant' or 'linear', got {interpolation!r}",
                              field="interpolation")
        if not points:
            raise ConfigError("points: a schedule needs at least one (step, weights) point", field="points")
        steps = []
        for entry in points:
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise ConfigError(f"points: each point is (step, weights), got {entry!r}", field="points")
            steps.append(check_count(entry[0], "step"))
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise ConfigError(f"points: steps must increase, got {steps}", field="points")
        self.steps = steps
        self.raw = [entry[1] for entry in points]
        self.interpolation = interpolation

    def resolve(self, names: list[str]) -> list[list[float]]:
        """Each point's weights as a list in the order of ``names``, normalized."""
        out = []
        for step, w in zip(self.steps, self.raw, strict=True):
            if isinstance(w, Mapping):
                unknown = sorted(set(w) - set(names))
                if unknown:
                    raise ConfigError(f"points: step {step} weighs {unknown[0]!r}, which is not a source of the "
                                      f"mixture ({names})", field="points")
                row = [w.get(n, 0.0) for n in names]
            else:
                row = list(w)
                if len(row) != len(names):
                    raise ConfigError(f"points: step {step} gives {len(row)} weights for {len(names)} sources",
                                      field="points")
            if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0
                   for x in row) or sum(row) <= 0:
                raise ConfigError(f"points: the weights of step {step} must be non-negative numbers adding up to "
                                  f"more than 0, got {row}", field="points")
            total = float(sum(row))
            out.append([float(x) / total for x in row])
        return out

    def fingerprint(self, names: list[str]) -> str:
        """What identifies the schedule (a state saved under another one restarts the proportions)."""
        rows = self.resolve(names)
        return hashlib.blake2b(repr((self.interpolation, self.steps, rows)).encode(), digest_size=8).hexdigest()

    def __repr__(self) -> str:
        return f"WeightSchedule({list(zip(self.steps, self.raw, strict=True))!r}, interpolation={self.interpolation!r})"


def _picks(steps: Any, since: list[int]) -> int:
    """A state's picks since the weights last changed, checked against the per-source counts.

    Raises:
        StateError: not a count, or not their sum.
    """
    try:
        steps = check_count(steps, "steps")
    except ConfigError as exc:
        raise StateError(f"state: {exc}", field="steps") from None
    if sum(since) != steps:
        raise StateError("state: the picks since the last reweighting do not add up", field="steps")
    return steps


def _source_seed(seed: int, name: str) -> int:
    """A source's own seed: independent of the other sources, stable across reweighting."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class MixtureOrder:
    """Which source and item each global sample of a mixture is (see the module documentation):
    the order a :class:`~zerobatch.samplers.MixtureSampler` cuts into steps.

    Args:
        sources: ``(name, size, weight)`` per source: a unique name (it identifies the source
            in a saved state), its number of items (>= 1) and a weight (> 0; weights are
            normalized).
        seed: the seed of every source's order.
        shuffle: each source in a fresh permutation per epoch (else ascending).
        weight_schedule: a :class:`WeightSchedule`: the weights change with the step (each
            :meth:`take_step` is one step). Within a stretch of constant weights the rule is
            the one above, counted from the stretch's start; while weights move linearly the
            error of source ``k`` is the sum of its weight over the picks so far minus its
            picks, so the proportions follow the moving weights within one sample.

    Raises:
        ConfigError: a duplicate or empty name, a size below 1, a weight that is not a
            positive finite number.
    """

    def __init__(self, sources: Sequence[tuple[str, int, float]], *, seed: int = 0, shuffle: bool = True,
                 weight_schedule: WeightSchedule | None = None) -> None:
        if not sources:
            raise ConfigError("sources: a mixture needs at least one source", field="sources")
        names, sizes, weights = [], [], []
        for entry in sources:
            if not isinstance(entry, tuple) or len(entry) != 3:
                raise ConfigError(f"sources: each source is (name, size, weight), got {entry!r}", field="sources")
            name, size, weight = entry
            if not isinstance(name, str) or not name:
                raise ConfigError(f"sources: a name must be a non-empty string, got {name!r}", field="sources")
            if name in names:
                raise ConfigError(f"sources: {name!r} is listed twice", field="sources")
            size = check_count(size, f"size of {name}", minimum=1)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                    or weight <= 0:
                raise ConfigError(f"sources: the weight of {name!r} must be a positive number, got {weight!r}",
                                  field="weights")
            names.append(name)
            sizes.append(size)
            weights.append(float(weight))
        total = sum(weights)
        self.names = names
        self.sizes = sizes
        self.weights = [w / total for w in weights]
        self.seed = check_seed(seed)
        self.shuffle = bool(shuffle)
        self._orders: list[IndexOrder] = [
            GlobalRandomOrder(n, seed=_source_seed(self.seed, name)) if self.shuffle else SequentialOrder(n)
            for name, n in zip(names, sizes, strict=True)]
        self.consumed = [0] * len(names)     # samples taken from each source, ever
        self._since = [0] * len(names)       # picks of each source since the weights last changed
        self._steps = 0                      # picks since the weights last changed
        if weight_schedule is not None and not isinstance(weight_schedule, WeightSchedule):
            raise ConfigError(f"weight_schedule must be a WeightSchedule, got {type(weight_schedule).__name__}",
                              field="weight_schedule")
        self.weight_schedule = weight_schedule
        self.base_weights = list(self.weights)
        self._points = weight_schedule.resolve(names) if weight_schedule is not None else []
        self.step = 0                        # steps taken (take_step)
        self._segment: int | None = None     # the stretch of the schedule the counters are of
        self._target = [0.0] * len(names)    # linear stretches: each source's weight summed over picks

    @property
    def total(self) -> int:
        """Samples taken so far, over all sources."""
        return sum(self.consumed)

    def _pick(self, n: int) -> np.ndarray:
        """The sources of the next ``n`` samples; advances the pick counters."""
        w, since, t = self.weights, self._since, self._steps
        k_range = range(len(w))
        out = np.empty(n, np.int32)
        for i in range(n):
            t += 1
            best, best_err = 0, w[0] * t - since[0]
            for k in k_range:
                err = w[k] * t - since[k]
                if err > best_err:
                    best, best_err = k, err
            since[best] += 1
            out[i] = best
        self._steps = t
        return out

    def _stretch(self, step: int) -> tuple[int, bool, list[float]]:
        """``(stretch, moving, weights)`` at ``step``: stretch -1 is before the first point
        (the mixture's own weights); stretch ``i`` starts at point ``i``; ``moving`` while
        the weights move linearly to the next point."""
        sched = self.weight_schedule
        if sched is None:
            return -1, False, self.base_weights
        i = int(np.searchsorted(np.asarray(sched.steps), step, side="right")) - 1
        if i < 0:
            return -1, False, self.base_weights
        if sched.interpolation == "constant" or i == len(sched.steps) - 1:
            return i, False, self._points[i]
        a, b = sched.steps[i], sched.steps[i + 1]
        f = (step - a) / (b - a)
        return i, True, [x + (y - x) * f for x, y in zip(self._points[i], self._points[i + 1], strict=True)]

    def _pick_moving(self, n: int, w: list[float]) -> np.ndarray:
        """:meth:`_pick` while the weights move: errors against each source's summed weight."""
        since, target = self._since, self._target
        out = np.empty(n, np.int32)
        for i in range(n):
            for k in range(len(w)):
                target[k] += w[k]
            best, best_err = 0, target[0] - since[0]
            for k in range(len(w)):
                err = target[k] - since[k]
                if err > best_err:
                    best, best_err = k, err
            since[best] += 1
            out[i] = best
        self._steps += n
        return out

    def take_step(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``n`` samples of the next step (:meth:`take` under the weights the weight
        schedule gives this step); advances the step."""
        n = check_count(n, "n")
        if self.weight_schedule is None:
            self.step += 1
            return self.take(n)
        moving, w = self._enter_stretch()
        self.step += 1
        if moving:
            return self._items(self._pick_moving(n, w))
        return self.take(n)

    def _enter_stretch(self) -> tuple[bool, list[float]]:
        """``(moving, weights)`` of the weight schedule's stretch at :attr:`step`; a new stretch's
        proportions count from here (its counters reset)."""
        stretch, moving, w = self._stretch(self.step)
        if stretch != self._segment:
            self._segment = stretch
            self._since, self._steps = [0] * len(self.names), 0
            self._target = [0.0] * len(self.names)
        self.weights = list(w)
        return moving, w

    def skip_steps(self, sizes: Any, *, watch: int | None = None, counts: Any = None) -> np.ndarray | None:
        """Advance by one step of each of ``sizes`` samples, exactly as :meth:`take_step` for
        each would, without computing the items: the picks run in one compiled walk per
        stretch of constant weights (:func:`zerobatch.core.mixture_walk`, the same float
        operations as the Python rule), so the state at step ``N`` of a long run costs
        nanoseconds a sample, not a Python loop; two sources under constant weights cost
        microseconds whatever the step (the rule in closed form:
        :mod:`zerobatch.samplers._two_sources`).

        With ``watch`` (a source's index) and ``counts`` (ascending counts of that source:
        its ``c``-th sample ever, 0-based), returns for each count the index of the sample
        that took it among the samples of these steps (-1: not reached).
        """
        from zerobatch.core import mixture_walk
        sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
        want = None if watch is None else np.asarray(counts, dtype=np.int64).reshape(-1)
        found = None if want is None else np.full(want.size, -1, np.int64)
        done = 0                              # samples of these steps walked so far
        i = 0
        sched = self.weight_schedule
        while i < sizes.size:
            moving = False
            j = sizes.size
            if sched is not None:
                moving, _ = self._enter_stretch()
                if moving:
                    j = i + 1
                else:
                    later = [p for p in sched.steps if p > self.step]
                    if later:
                        j = min(j, i + later[0] - self.step)
            n = int(sizes[i:j].sum())
            since = np.asarray(self._since, dtype=np.int64)
            before = since.copy()
            target = np.asarray(self._target, dtype=np.float64) if moving else None
            if len(self.names) == 2 and not moving:
                # two sources under constant weights: in closed form (exactly the picks' counts)
                from zerobatch.samplers._two_sources import walk_two
                if want is not None and found is not None:
                    base = self.consumed[watch] - self._since[watch]
                    part = np.full(want.size, -1, np.int64)
                    t = walk_two(mixture_walk, self.weights, since, self._steps, n, watch, base, want, part)
                    hit = (part >= 0) & (found < 0)
                    found[hit] = part[hit] + done
                else:
                    t = walk_two(mixture_walk, self.weights, since, self._steps, n)
            elif want is not None and found is not None:
                base = self.consumed[watch] - self._since[watch]
                todo = np.flatnonzero(found < 0)
                part = np.full(todo.size, -1, np.int64)
                t, _ = mixture_walk(self.weights, since, target, self._steps, n, moving, watch, base,
                                    want[todo], part)
                hit = part >= 0
                found[todo[hit]] = part[hit] + done
            else:
                t, _ = mixture_walk(self.weights, since, target, self._steps, n, moving)
            self._steps = self._steps + n if moving else t
            self._since = since.tolist()
            if moving:
                self._target = target.tolist()
            for k, d in enumerate((since - before).tolist()):
                self.consumed[k] += d
            self.step += j - i
            done += n
            i = j
        return found

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``n`` samples: ``(source index int32[n], item int64[n])``; advances."""
        n = check_count(n, "n")
        return self._items(self._pick(n))

    def _items(self, src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = src.size
        items = np.empty(n, np.int64)
        for k, order in enumerate(self._orders):
            where = np.flatnonzero(src == k)
            if where.size == 0:
                continue
            counts = self.consumed[k] + np.arange(where.size, dtype=np.int64)
            size = self.sizes[k]
            epochs, positions = np.divmod(counts, size)
            for e in np.unique(epochs).tolist():
                sel = epochs == e
                items[where[sel]] = order.items(int(e), positions[sel])
            self.consumed[k] += int(where.size)
        return src, items

    def batch(self, batch_size: int, *, rank: int = 0, world_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """This rank's part of the next global batch of ``batch_size * world_size`` samples
        (every rank advances by the whole global batch, with no communication)."""
        batch_size = check_count(batch_size, "batch_size", minimum=1)
        rank, world_size = check_rank(rank, world_size)
        src, items = self.take_step(batch_size * world_size)
        part = slice(rank * batch_size, (rank + 1) * batch_size)
        return src[part].copy(), items[part].copy()

    # ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-able: each source's count and size by name, the weights, the picks since the
        weights last changed."""
        return {
            "zerobatch_mixture": MIXTURE_STATE_VERSION,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "sources": {name: {"consumed": c, "size": n, "weight": w, "since": s}
                        for name, c, n, w, s in zip(self.names, self.consumed, self.sizes, self.weights,
                                                    self._since, strict=True)},
            "steps": self._steps,
            **({} if self.weight_schedule is None else {
                "step": self.step, "stretch": self._segment, "target": list(self._target),
                "schedule": self.weight_schedule.fingerprint(self.names)}),
        }

    def load_state_dict(self, state: Mapping[str, Any], *, step: int | None = None) -> None:
        """Continue from ``state``, even with other weights or sources (module docs). With a
        :class:`WeightSchedule`, the weight schedule continues at the state's step (``step``:
        the step to continue at when the state has none, a state saved without a weight
        schedule); the counters continue when the state was saved in the same stretch of
        the same weight schedule, else the proportions count from here.

        Raises:
            StateError: not a mixture state, another seed or shuffle, a source whose size
                changed (other data under the same name), or counts out of range.
        """
        if not isinstance(state, Mapping) or state.get("zerobatch_mixture") != MIXTURE_STATE_VERSION:
            raise StateError("state: not a mixture state of this version", field="zerobatch_mixture")
        if state.get("seed") != self.seed or state.get("shuffle") != self.shuffle:
            raise StateError(f"state: saved with seed {state.get('seed')!r} and shuffle {state.get('shuffle')!r}, "
                             f"this mixture has {self.seed} and {self.shuffle}", field="seed")
        saved = state.get("sources")
        if not isinstance(saved, Mapping):
            raise StateError("state: sources must be a mapping", field="sources")
        consumed = [0] * len(self.names)
        since = [0] * len(self.names)
        same_weights = set(saved) == set(self.names)
        for k, name in enumerate(self.names):
            entry = saved.get(name)
            if entry is None:
                continue
            if not isinstance(entry, Mapping):
                raise StateError(f"state: source {name!r} is not a mapping", field="sources")
            if entry.get("size") != self.sizes[k]:
                raise StateError(f"state: source {name!r} had {entry.get('size')!r} items, it has {self.sizes[k]} now",
                                 field="size")
            try:
                consumed[k] = check_count(entry.get("consumed"), f"consumed of {name}")
                since[k] = check_count(entry.get("since"), f"since of {name}")
            except ConfigError as exc:
                raise StateError(f"state: {exc}", field="consumed") from None
            w = entry.get("weight")
            if not isinstance(w, float) or abs(w - self.weights[k]) > 1e-12:
                same_weights = False
        steps = state.get("steps")
        if self.weight_schedule is not None:
            saved_step = state.get("step", step if step is not None else 0)
            try:
                self.step = check_count(saved_step, "step")
            except ConfigError as exc:
                raise StateError(f"state: {exc}", field="step") from None
            stretch, _, w = self._stretch(self.step)
            target = state.get("target")
            if (state.get("schedule") == self.weight_schedule.fingerprint(self.names) and set(saved) == set(self.names)
                    and state.get("stretch") == stretch and isinstance(target, list) and len(target) == len(since)
                    and all(isinstance(x, float) and math.isfinite(x) for x in target)):
                self._since, self._steps = since, _picks(steps, since)
                self._target = [float(x) for x in target]
                self._segment = stretch
            else:
                # saved without this schedule, or in another stretch of it: the proportions of
                # the current stretch count from here
                self._since, self._steps, self._target = [0] * len(self.names), 0, [0.0] * len(self.names)
                self._segment = stretch
            self.weights = list(w)
            self.consumed = consumed
            return
        if same_weights:
            self._since, self._steps = since, _picks(steps, since)
        else:
            # New weights (or sources): the exact proportions start again from here; every
            # source keeps its place in its own order.
            self._since, self._steps = [0] * len(self.names), 0
        self.consumed = consumed

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {w:.3f} of {s}" for n, w, s in zip(self.names, self.weights, self.sizes, strict=True))
        return f"MixtureOrder({parts}, seed={self.seed})"


#: The former name of :class:`MixtureOrder` (it is an order, not a
#: :class:`~zerobatch.samplers.Schedule`); code, pickles and states that name it keep working.
MixtureSchedule = MixtureOrder
