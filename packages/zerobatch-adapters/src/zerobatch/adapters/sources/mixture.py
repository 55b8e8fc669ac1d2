"""Several sources interleaved in exact proportions, as one loader source."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from zerobatch.adapters.sources._base import DEFAULT_SEED, Source
from zerobatch.formats.errors import ConfigError
from zerobatch.readers.base import Access
from zerobatch.samplers import IndexOrder, MixtureOrder, MixtureSampler, Schedule, WeightSchedule
from zerobatch.samplers.schedule import check_batch_schedule

__all__ = ["Curriculum", "Mixture"]


class Mixture(Source):
    """Several sources interleaved in exact proportions (:class:`~zerobatch.samplers.MixtureOrder`).

    Every global batch takes its samples from the sources by the "largest sampling error
    first" rule, each source in its own order (a fresh shuffle per pass over it), small
    sources cycled as often as their weight asks. A loader over a mixture is endless: it has
    no epochs; stop after as many steps as the run needs. Its state holds the count consumed
    per source, and a run resumed with other weights, or with sources added, continues each
    source where it stopped.

    Args:
        sources: ``(source, weight)`` pairs, or ``(name, source, weight)`` triples. The
            name identifies a source in a saved state (default: its kind and fingerprint).
            All sources must hand out the same kind of step (for example token windows of
            the same ``seq_len``), read as stacked arrays.
        seed: the seed of every source's order.
        shuffle: shuffle each source (else each is read in ascending order).
        weight_schedule: a :class:`~zerobatch.samplers.WeightSchedule`: weights that change
            at given steps (piecewise constant, or linear between points); the loader's state
            records the step, so a run resumed anywhere (at a change point, on another world
            size) continues as an uninterrupted one.
        batch_schedule: ``[(step, global batch), ...]`` from step 0: a global-batch-size ramp
            (the loader then needs no batch size; every batch splits over the ranks).
    """

    kind = "mixture"

    #: every step reads one source (a :class:`Curriculum`): sources of other shapes may follow
    #: one another, and sources that read step by step are allowed
    one_source_per_step = False

    def __init__(self, sources: Sequence[tuple[Any, ...]], *, seed: int = DEFAULT_SEED, shuffle: bool = True,
                 weight_schedule: WeightSchedule | None = None, batch_schedule: Any = None) -> None:
        super().__init__()
        self.batch_schedule = None if batch_schedule is None else check_batch_schedule(batch_schedule, 1)
        entries = []
        for i, entry in enumerate(sources):
            if not isinstance(entry, tuple) or len(entry) not in (2, 3):
                raise ConfigError(f"sources: each entry is (source, weight) or (name, source, weight), got {entry!r}",
                                  field="sources")
            name, source, weight = entry if len(entry) == 3 else (None, *entry)
            if not isinstance(source, Source) or isinstance(source, Mixture):
                raise ConfigError(f"sources: entry {i} is not a zerobatch source", field="sources")
            if not source.stacked and not self.one_source_per_step:
                raise ConfigError(f"sources: {source.kind} source {i} reads step by step (boundaries, metadata "
                                  "or unpadded fields); a mixture needs stacked reads", field="sources")
            if name is None:
                name = f"{source.kind}:{source.fingerprint}" if source.fingerprint else f"source{i}"
            entries.append((name, source, weight))
        if not entries:
            raise ConfigError("sources: a mixture needs at least one source", field="sources")
        first = entries[0][1]
        for name, source, _ in entries[1:]:
            if type(source) is not type(first) or source.rows_per_item != first.rows_per_item \
                    or source.output != first.output or source.stacked != first.stacked:
                raise ConfigError(f"sources: {name!r} is a {source.kind} source; every source of a mixture must be "
                                  f"of one kind ({first.kind}) with the same rows per item and outputs",
                                  field="sources")
        if not self.one_source_per_step:
            _check_shapes(entries)
        self.stacked = first.stacked
        self.names = [e[0] for e in entries]
        self.sources = [e[1] for e in entries]
        self.weights = [e[2] for e in entries]
        self.seed, self.shuffle = seed, shuffle
        self.mixture_order = MixtureOrder([(n, s.num_items, w) for n, s, w in entries], seed=seed,
                                          shuffle=shuffle, weight_schedule=weight_schedule)
        self.weight_schedule = weight_schedule
        self.num_items = sum(s.num_items for s in self.sources)
        self.fingerprint = ",".join(f"{n}={s.fingerprint}" for n, s in zip(self.names, self.sources, strict=True))
        self.rows_per_item = first.rows_per_item
        self.output = first.output         # every source hands out the same kind of step

    @property
    def mixture_schedule(self) -> MixtureOrder:
        """The former name of :attr:`mixture_order`."""
        return self.mixture_order

    @property
    def access(self) -> Access:
        return Access.of_all(s.access for s in self.sources)

    def schedule(self, batch_size: int, *, rank: int, world_size: int, shuffle: bool = True, seed: int = 0,
                 tail: str = "drop", order: IndexOrder | None = None, epoch: int = 0) -> Schedule:
        """A :class:`~zerobatch.samplers.MixtureSampler` over the mixture's order (the
        loader's ``shuffle``, ``seed`` and ``tail`` do not apply: the mixture has its own
        seed and no epochs).

        Raises:
            ConfigError: an ``order`` (each source has its own) or an epoch other than 0.
        """
        if order is not None:
            raise ConfigError("order: a mixture orders each source itself", field="order")
        if epoch:
            raise ConfigError("epoch: a mixture has no epochs", field="epoch")
        if self.batch_schedule is not None:
            return MixtureSampler(copy.deepcopy(self.mixture_order), rank=rank, world_size=world_size,
                                  batch_schedule=self.batch_schedule)
        return MixtureSampler(copy.deepcopy(self.mixture_order), batch_size, rank=rank, world_size=world_size)

    def chunk_steps(self, items_per_step: int) -> int:
        return 1

    def prepare(self, items: np.ndarray, sources: np.ndarray | None = None) -> int | None:
        """Read-ahead hints: each source hears of its own items of these steps (a source at a
        URL fetches their bytes in the background); returns the bytes they hinted when every
        source says. Sources read where they lie are not hinted (as before)."""
        if sources is None or not self.access.fetched:
            return None
        flat_items, flat_tags = items.reshape(-1), sources.reshape(-1)
        total: int | None = 0
        for k, source in enumerate(self.sources):
            where = np.flatnonzero(flat_tags == k)
            if where.size:
                n = source.prepare(flat_items[where].reshape(1, -1))
                total = None if n is None or total is None else total + n
        return total

    def read(self, items: np.ndarray, dtype: np.dtype, sources: np.ndarray | None = None) -> dict[str, Any]:
        if sources is None:
            raise ConfigError("a mixture is read with the source of every item", field="sources")
        if self.one_source_per_step:
            # a step of one source: its own read (each step is read alone: chunk_steps is 1)
            ks = np.unique(sources)
            if ks.size != 1:
                raise ConfigError("a curriculum step mixes sources", field="sources")
            return self.sources[int(ks[0])].read(items, dtype)
        steps, per = items.shape
        flat_items, flat_tags = items.reshape(-1), sources.reshape(-1)
        out: dict[str, np.ndarray] = {}
        rows = self.rows_per_item
        for k, source in enumerate(self.sources):
            where = np.flatnonzero(flat_tags == k)
            if where.size == 0:
                continue
            part = source.read(flat_items[where].reshape(1, -1), dtype)
            if not isinstance(part, dict):
                raise ConfigError(f"sources: {self.names[k]!r} did not read stacked arrays", field="sources")
            for key, value in part.items():
                value = value.reshape(where.size, rows, *value.shape[2:])
                dest = out.get(key)
                if dest is None:
                    dest = out[key] = np.empty((flat_items.size, rows, *value.shape[2:]), value.dtype)
                dest[where] = value
        return {k: v.reshape(steps, per * rows, *v.shape[2:]) for k, v in out.items()}

    def close(self) -> None:
        for s in self.sources:
            s.close()


class Curriculum(Mixture):
    """Sources that follow one another by step: a sequence-length curriculum (windows of 512
    tokens, then of 2048), with a global batch per phase (a batch-size ramp).

    Args:
        phases: ``(start step, source, global batch)`` per phase, or ``(name, start step,
            source, global batch)`` (the name identifies the phase's source in a saved
            state); the first phase starts at step 0. Every source hands out the same kind of
            step (for example ``TokenWindows`` of different ``seq_len``, or
            ``PackedDocuments`` rows of different lengths).
        seed, shuffle: as for :class:`Mixture`: each phase's source is read in its own order,
            continuing across its passes (a fresh shuffle per pass).
        batch_schedule: extra ``(step, global batch)`` points inside phases (a finer ramp);
            each phase's start sets its own batch.

    Step ``s`` reads the phase that started last at or before ``s``; the state records the
    step and each phase's consumed count, so a run resumed anywhere (at a phase change, on
    another world size) continues as an uninterrupted one. Give the loader no batch size.
    """

    kind = "curriculum"
    one_source_per_step = True

    def __init__(self, phases: Sequence[tuple[Any, ...]], *, seed: int = DEFAULT_SEED, shuffle: bool = True,
                 batch_schedule: Any = None) -> None:
        entries, points, sizes = [], [], []
        for i, phase in enumerate(phases):
            if not isinstance(phase, tuple) or len(phase) not in (3, 4):
                raise ConfigError(f"phases: each is (start step, source, global batch) or (name, start step, source, "
                                  f"global batch), got {phase!r}", field="phases")
            name, start, source, g = phase if len(phase) == 4 else (f"phase{i}", *phase)
            entries.append((name, source, 1.0))
            points.append((start, {name: 1.0}))
            sizes.append((start, g))
        if not entries or points[0][0] != 0:
            raise ConfigError("phases: the first phase starts at step 0", field="phases")
        merged = dict(sizes)
        for step, g in batch_schedule or ():
            merged.setdefault(step, g)
        super().__init__(entries, seed=seed, shuffle=shuffle, weight_schedule=WeightSchedule(points),
                         batch_schedule=sorted(merged.items()))


def _check_shapes(entries: list[tuple[str, Source, Any]]) -> None:
    """Every source's items must stack into one batch: read item 0 of each (one small read)
    and compare the arrays' names, shapes and types.

    Raises:
        ConfigError: two sources whose items differ, naming both and their shapes.
    """
    seen: tuple[str, dict[str, tuple[tuple[int, ...], str]]] | None = None
    for name, source, _ in entries:
        if not source.num_items:
            continue
        probe = source.read(np.zeros((1, 1), np.int64), np.dtype(np.int64))
        if not isinstance(probe, dict):
            continue
        shapes = {key: (tuple(int(n) for n in a.shape[2:]), a.dtype.str) for key, a in probe.items()
                  if isinstance(a, np.ndarray)}
        if seen is None:
            seen = (name, shapes)
        elif shapes != seen[1]:
            def show(d: dict[str, tuple[tuple[int, ...], str]]) -> str:
                return ", ".join(f"{k} {list(v[0])}" for k, v in sorted(d.items()))
            raise ConfigError(f"sources: the items of {seen[0]!r} ({show(seen[1])}) and of {name!r} ({show(shapes)}) "
                              f"have different shapes; every source of a mixture must hand out items of one shape "
                              f"(for example token windows of one seq_len)", field="sources")
