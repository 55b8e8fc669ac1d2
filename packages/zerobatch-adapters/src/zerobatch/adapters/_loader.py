"""The loader the PyTorch and JAX adapters share (NumPy only; they add the conversion).

A loader does three things and nothing else:

1. **plans reads** from its schedule (:class:`~zerobatch.samplers.Schedule`, made by the
   source: an :class:`~zerobatch.samplers.IndexSampler` over the source's order, or a
   :class:`~zerobatch.samplers.MixtureSampler` for a mixture). Which items a step holds, how
   ranks split them and how a run resumes are the schedule's business;
2. **runs them ahead** on the shared read-ahead pool (:func:`zerobatch.core.pool.shared_pool`,
   threads ``zerobatch-loader-*``): a compiled read that releases the GIL from start to finish
   when the source has one (``read_async``: the checks of data read for the first time run
   inside it), else the source's read as a Python call whose kernels release the GIL. The
   first read (one step) runs on the iterating thread itself, so the first batch waits for
   nothing else; read-ahead starts with the second. Reads cover 1, 2, 4... steps up to the
   source's chunk, so later ones amortize the hand-off; at most ``prefetch`` steps are in
   flight (reads of views hold no buffer and cover :data:`~zerobatch.adapters.sources.VIEW_STEPS`
   steps: what runs ahead is their checking). The thread that iterates waits only for the
   oldest read (running it itself when no worker has started it) and never starts a read
   queued for a later step;
3. **delivers batches**: converts the oldest read (the torch and JAX subclasses make tensors
   or arrays; a stacked read is converted and cut once for all its steps) and hands its steps
   to the loop, recording each with
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

from zerobatch.adapters.metrics import LoaderMetrics, clock, nbytes, storage_counters
from zerobatch.adapters.sources import Source, open_source
from zerobatch.adapters.sources._base import DEFAULT_PREFETCH, DEFAULT_SEED, VIEW_STEPS, OutputPlan, StackedRuns
from zerobatch.core.checks import check_count
from zerobatch.core.pool import shared_pool
from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.samplers import TAILS, IndexOrder, Schedule, check_seed, resolve_rank

__all__ = ["DEFAULT_PREFETCH", "DEFAULT_SEED", "HEADSPACE_ENV", "READ_AHEAD_POOL", "WORKER_STATE", "BaseLoader"]


#: The name of the read-ahead pool's threads (``zerobatch-loader-0``...).
READ_AHEAD_POOL = "zerobatch-loader"

#: The ``kind`` of the state a loader saves inside a DataLoader worker process: that worker's
#: share of the rank's steps (``worker`` of ``num_workers``), the pass's ``start`` and the
#: steps of the share it ``delivered``.
WORKER_STATE = "zerobatch-worker"

#: The environment variable that turns on headspace mode in every loader made after it is set
#: (``ZEROBATCH_HEADSPACE=16``: replay the first 16 batches; see ``BaseLoader(headspace=)``).
HEADSPACE_ENV = "ZEROBATCH_HEADSPACE"


def _headspace(value: Any) -> int:
    if value is None:
        raw = os.environ.get(HEADSPACE_ENV, "").strip()
        if not raw:
            return 0
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{HEADSPACE_ENV}={raw!r}: give the number of batches to replay", field="headspace") from None
    return check_count(value, "headspace", maximum=1 << 20)


def default_num_threads() -> int:
    """Read-ahead threads by default: one fewer than the CPUs (the training thread keeps one),
    at least 1 and at most 2.

    With the data in the page cache a read-ahead thread neither gains nor loses in a training
    loop (reads are a small share of a step either way), and it lowers the raw batches per
    second of a loop with no compute (the hand-off between threads costs about as much as a
    read); with the data on disk one thread cuts the time inside ``next()`` several-fold, a
    second adds little. More threads than that only multiply idle threads per rank on large
    nodes. ``tools/read_ahead.py`` compares 0, 1 and 2 threads, page cache and disk; asv gates
    the default with bench_loader.TrainingLoop.track_step_time_ratio and
    bench_loader.EndToEnd.time_batches.
    """
    return max(1, min(2, (os.cpu_count() or 2) - 1))


class BaseLoader:
    """Batches of a :class:`~zerobatch.adapters.sources.Source` for one rank (see the module
    documentation); subclasses convert the NumPy arrays (:meth:`_convert`)."""

    #: The shared pool read-ahead runs on (its threads' name prefix).
    pool_name = READ_AHEAD_POOL
    #: ``dtype`` is a NumPy dtype here (a run card's ``dtype`` is passed on; framework loaders
    #: take their own dtypes).
    numpy_dtype_argument = True
    #: The iterating thread runs reads itself: the first read of a pass (the first batch
    #: waits for no hand-off) and a queued read no worker has started when it is waited for.
    #: A face whose reads must all run on the pool's threads turns it off.
    reads_here = True

    def __init__(self, source: Any, batch_size: int | None = None, *, global_batch_size: int | None = None,
                 shuffle: bool = True, seed: int = DEFAULT_SEED, drop_last: bool = True, tail: str | None = None,
                 order: Any = None, rank: int | None = None, world_size: int | None = None,
                 epoch: int = 0, prefetch: int = DEFAULT_PREFETCH, num_threads: int | None = None, dtype: Any = np.int64,
                 world: tuple[int, int] | None = None, headspace: int | None = None) -> None:
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
        if batch_size is None and self.source.batch_schedule is not None:
            batch_size = rows       # the source's batch schedule sets every step's batch
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
        if self.schedule.steps_per_epoch == 0:
            # every rank takes the same number of steps, so no rank would get a batch: refused
            # here rather than an epoch that ends before it starts (and loops that never end)
            g = self.schedule.global_batch_size
            raise ConfigError(f"no step: the {self.source.kind} source has {self.source.num_items} items, fewer than "
                              f"one global batch of {g} ({g // world_size} per rank x {world_size} ranks); use a "
                              f"smaller batch_size (or seq_len), or drop_last=False to keep a short step",
                              field="batch_size")
        self.seed = check_seed(seed)
        self.num_threads = check_count(default_num_threads() if num_threads is None else num_threads,
                                       "num_threads", maximum=256)
        self.prefetch = check_count(prefetch, "prefetch", minimum=1, maximum=1 << 20)
        self.dtype = self._np_dtype(dtype)
        # The pass being iterated, held weakly: the iterator owns it, so an iterator dropped
        # unfinished (or never started) closes its pass and releases the read-ahead threads.
        self._active: weakref.ref[_Pass] | None = None
        # A pass started by start_prefetch, held until the loop iterates (then it is _active).
        self._started: _Pass | None = None
        # Inside a DataLoader worker: this worker's share of the pass (a WORKER_STATE without
        # its kind), and whether it was loaded and not yet resumed.
        self._share: dict[str, Any] | None = None
        self._share_loaded = False
        # provenance: the world sizes of the run from the step each began at, and what is
        # excluded (zerobatch.adapters.provenance)
        self._worlds: list[list[int]] = [[0, world_size]]
        self._exclusions: Any = None
        # what the data path costs the loop (metrics()), and the headspace mode
        self._metrics = LoaderMetrics()
        self.headspace = _headspace(headspace)

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
        return self.schedule.order

    @property
    def tail(self) -> str:
        """How an epoch's short last step is handled (``"keep"`` for endless schedules)."""
        return self.schedule.tail

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

    @property
    def global_step(self) -> int:
        """Steps of the run delivered so far, over its epochs: the number of the next step,
        as a run card and :class:`~zerobatch.adapters.provenance.Trace` count them."""
        return self.schedule.global_step

    # ---------------------------------------------------------------------------------------
    # provenance (zerobatch.adapters.provenance)

    def describe(self, state: dict[str, Any] | None = None) -> dict[str, Any]:
        """The run card: a small JSON-able description (sources with their dataset build ids,
        seed, order, global batch, schedules, packing, world sizes, exclusions and the state,
        default the loader's now) that reconstructs every step of the run on every rank.
        Save it next to the state in each checkpoint; ``zerobatch trace CARD --step N`` says
        what a step held, ``--document D`` when a document was seen, and
        :meth:`from_card` rebuilds the loader (:func:`~zerobatch.adapters.provenance.run_card`)."""
        from zerobatch.adapters.provenance import run_card
        return run_card(self, state)

    @classmethod
    def from_card(cls, card: Any, *, rank: int | None = None, world_size: int | None = None,
                  load_state: bool = True, **kwargs: Any) -> BaseLoader:
        """The loader a run card describes, on this rank, with its exclusions and (unless
        ``load_state=False``) its state: the run continues exactly
        (:func:`~zerobatch.adapters.provenance.loader_from_card`)."""
        from zerobatch.adapters.provenance import loader_from_card
        return loader_from_card(card, cls, rank=rank, world_size=world_size, load_state=load_state, **kwargs)

    def exclude(self, documents: Any = None, *, steps: Any = None, source: str | None = None, by: str | None = None,
                from_step: int | None = None) -> dict[str, Any]:
        """Leave out, from ``from_step`` on (default: the next step), the rows holding any of
        ``documents`` and every step of ``steps``: after a loss spike traced to bad data, or
        to keep a contaminated document out.

        Args:
            documents: document indices (of ``source``, for a mixture), or with ``by`` the
                values of that metadata field (``"id"``, ``"url"``, ``"row"`` of
                ``--row-ids``), found in one pass over the dataset's metadata.
            steps: global steps to skip (a ``range``, steps, or ``(first, stop)`` pairs), on
                every rank: nothing is delivered for them.
            from_step: the first step the exclusion applies to; steps before it were trained
                as they were. Give it when excluding before :meth:`load_state_dict`.

        A row holding an excluded document is dropped, not replaced: the step is shorter and
        every other step of the run is exactly what it was (a step where a rank would be left
        without rows is skipped on every rank). The state records the exclusions in force
        before its position; a run card lists them. Returns what was excluded:
        ``{"documents", "items", "missing"}`` (``missing``: values of ``by`` not found).

        Raises:
            ConfigError: a document out of range, a source that cannot be traced to documents,
                steps before ``from_step``, or ``from_step`` before the next step.
        """
        from zerobatch.adapters.provenance import _member_index, find_documents
        start = self.global_step if from_step is None else check_count(from_step, "from_step")
        if start < self.global_step:
            raise ConfigError(f"from_step: step {start} was delivered already (the next step is {self.global_step}); "
                              f"a step already trained cannot change", field="from_step")
        docs: dict[str, list[int]] = {}
        missing: list[Any] = []
        if documents is not None:
            k = _member_index(self.source, source)
            from zerobatch.adapters.provenance import _members
            name, member = _members(self.source)[k]
            values = list(documents)
            if by is not None:
                found = find_documents(member.units(), by, values)
                missing = [v for v, d in found.items() if not d]
                values = sorted({d for ds in found.values() for d in ds})
            docs[name or ""] = [int(v) for v in values]
        entry = {"from_step": start, "steps": [] if steps is None else steps, "documents": docs}
        ex = self._exclusions_for()
        ex.add_entry(entry)
        self._apply_exclusions()
        items = sum(int(v.size) for v in ex._items[-1].values())
        return {"documents": sum(len(v) for v in docs.values()), "items": items, "missing": missing}

    def _exclusions_for(self) -> Any:
        if self._exclusions is None:
            from zerobatch.adapters.provenance import Exclusions
            self._exclusions = Exclusions(self.source)
        return self._exclusions

    def _apply_exclusions(self) -> None:
        self._close_active()
        ex = self._exclusions
        self.schedule.exclude = ex.keep if ex is not None and ex.entries else None

    # ---------------------------------------------------------------------------------------
    # iteration

    def _worker_split(self) -> tuple[int, int]:
        """``(worker, num_workers)`` of a data-loading worker process (torch sets it)."""
        return 0, 1

    def _in_worker(self) -> bool:
        """Whether this copy of the loader runs inside a DataLoader worker process."""
        return False

    def __iter__(self) -> Iterator[Any]:
        """The batches as NumPy arrays (the torch and JAX loaders yield their own types)."""
        return self._iter()

    # ---------------------------------------------------------------------------------------
    # metrics and headspace

    def metrics(self) -> dict[str, float]:
        """What the data path has cost this rank so far, as one flat dict of numbers: steps,
        items and bytes delivered, the time the loop waited inside ``next()`` (total, last,
        max, p50 and p99 of the last 1,024 steps) and its share of the loop's time, the reads
        queued ahead, object-storage requests, bytes, retries, throttling waits, checksum work
        and cache hits, and host-to-device copies (see :mod:`zerobatch.adapters.metrics`).
        Cheap enough to call every step; :func:`~zerobatch.adapters.metrics.format_metrics`
        makes it one line for a log."""
        out = self._metrics.snapshot()
        p = None if self._active is None else self._active()
        out["read_ahead"] = 0 if p is None or p.closed else len(p._tickets)
        out["read_ahead_target"] = 0 if p is None else p.depth
        out["headspace"] = 1 if self.headspace else 0
        out.update(storage_counters(self.source))
        return out

    def reset_metrics(self) -> None:
        """Start the counters of :meth:`metrics` again (those of object storage are the
        process's and keep counting)."""
        self._metrics.reset()

    def _replay(self) -> Iterator[Any]:
        """Headspace mode: the first ``headspace`` batches of the pass read once, then handed
        out again and again (without reading) for as many steps as the pass has; the
        position does not move (a checkpoint saved now resumes where the pass began)."""
        state = self.state_dict()
        self.schedule.begin()
        steps = self.schedule.steps_left()          # (None: endless)
        kept: list[Any] = []
        m = self._metrics
        asked = clock()
        m.asked(asked)
        try:
            for batch in self._iter_pass():
                kept.append(batch)
                now = clock()
                m.delivered(now - asked, now, self.items_per_step)
                yield batch
                asked = clock()
                if len(kept) >= self.headspace:
                    break
        finally:
            self._close_active()
            self.load_state_dict(state)
        if not kept:
            return
        k = len(kept)
        while steps is None or k < steps:
            batch = kept[k % len(kept)]
            k += 1
            now = clock()
            m.delivered(now - asked, now, self.items_per_step)
            yield batch
            asked = clock()

    def _iter(self) -> Iterator[Any]:
        if self.headspace and not self._in_worker():
            return self._replay()
        return self._iter_pass()

    def _iter_pass(self) -> Iterator[Any]:
        self._close_active()
        worker, num_workers = self._worker_split()
        skip = 0
        share = self._share
        if self._share_loaded and share is not None:
            if (share["worker"], share["num_workers"]) != (worker, num_workers):
                raise StateError(f"the state of DataLoader worker {share['worker']} of {share['num_workers']} was "
                                 f"loaded into worker {worker} of {num_workers}: a worker resumes only its own share "
                                 f"(restore the DataLoader's whole state, or load it into the loader and start a new "
                                 f"DataLoader)")
            skip = share["delivered"]
        p, self._started = self._started, None
        # (a DataLoader worker makes its own pass: it counts its share of the steps as it goes)
        if p is None or p.closed or (worker, num_workers) != (0, 1) or skip or self._in_worker():
            if p is not None:
                p.close()
            p = _Pass(self, worker, num_workers, skip=skip, share=self._in_worker())
        self._active = weakref.ref(p)
        return p.batches()

    def start_prefetch(self) -> None:
        """Start reading the first batches of the next pass now, on the read-ahead threads,
        and return at once (Grain's ``start_prefetch``): call it right after
        :meth:`load_state_dict`, before the trainer restores the model and the optimizer, and
        the first batch is read while they load rather than after. The next ``iter(loader)``
        continues this pass (its batches are not delivered, so not counted, before that);
        :meth:`load_state_dict`, :meth:`set_epoch` to another epoch or :meth:`close` drop it.
        With ``num_threads=0`` there are no threads to read on: it does nothing."""
        self._close_active()
        p = _Pass(self)
        if p.inline:
            p.close()
            return
        p.prestart()
        self._started = p

    def _close_active(self, wait: bool = True) -> None:
        started, self._started = self.__dict__.get("_started"), None
        if started is not None:
            started.close(wait)
        p = None if self._active is None else self._active()
        self._active = None
        if p is not None:
            p.close(wait)

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
        arrays, each array converted once. A stacked read's arrays are converted and cut once
        for all its steps, then split along the step axis: what is left per step is a tuple
        or dict of views (no framework indexing per step)."""
        plan = self.__dict__.get("_output_plan")
        if plan is None or plan.output is not self.source.output:
            plan = self._output_plan = OutputPlan(self.source.output)
        if isinstance(result, dict):            # stacked: a leading step axis on every array
            result = StackedRuns([result])
        if isinstance(result, StackedRuns):     # stacked runs, one after the other
            out = []
            for run in result:
                conv = {name: self._to_framework(v) for name, v in run.items()}
                out += plan.steps([self._unstack(leaf.cut(conv[leaf.name])) for leaf in plan.leaves])
        else:
            out = [plan.one({k: self._to_framework(v) if isinstance(v, np.ndarray) else v for k, v in step.items()})
                   for step in result]
        if type(self)._finish is not BaseLoader._finish:
            out = [self._finish(step) for step in out]
        return out

    # ---------------------------------------------------------------------------------------
    # state (the schedule's)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch delivered to the training loop (JSON-able).

        Batches read ahead but not yet delivered are not counted. Every rank holds the same
        state (any rank's may be saved).

        Inside a DataLoader worker process (torchdata's ``StatefulDataLoader`` saves each
        worker's dataset state) it is that worker's share instead: the pass's start, which
        steps the worker reads and how many of them it delivered (kind :data:`WORKER_STATE`).
        """
        if self._in_worker():
            share = self._share or {"start": self._schedule_state(), "worker": self._worker_split()[0],
                                    "num_workers": self._worker_split()[1], "delivered": 0}
            return {"kind": WORKER_STATE, "version": 1, **share, "start": dict(share["start"])}
        return self._schedule_state()

    def _schedule_state(self, state: dict[str, Any] | None = None) -> dict[str, Any]:
        """``state`` (default: the schedule's now) with the source's geometry under
        ``"source"`` (its kind and :meth:`~zerobatch.adapters.sources.Source.geometry`),
        which the schedule ignores and :meth:`load_state_dict` reads to name what changed
        when a state does not fit (states without it, saved by earlier releases, load as
        before)."""
        own = state is None
        state = self.schedule.state_dict() if state is None else state
        geometry = self.source.geometry()
        if geometry and "source" not in state:
            state = {**state, "source": {"kind": self.source.kind, **geometry}}
        if own:
            # what a run card needs besides (kept out of states that have no use for them)
            fingerprint = "" if self._exclusions is None else self._exclusions.fingerprint(self.global_step)
            if fingerprint:
                state["exclusions"] = fingerprint
            if len(self._worlds) > 1:
                state["worlds"] = [list(w) for w in self._worlds]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` stopped, on any world size.

        With the same global batch the run continues in exactly the order of an
        uninterrupted run; with another one it continues from the same position (the resume
        rule of :mod:`zerobatch.samplers.schedule`). States saved by release 0.1 load too.

        ``state`` may also be the whole state of a torchdata ``StatefulDataLoader`` over this
        loader (any number of workers, ``in_order=True``): the loader then stands where that
        run's training loop stood, so a new ``StatefulDataLoader`` over it, with any number of
        workers, continues exactly (torchdata itself restores a state only under the worker
        count that saved it). Inside a worker process it is that worker's share.

        Raises:
            StateError: the state belongs to another dataset, order, seed or tail policy, or
                another state version, or its position is beyond the epoch; a worker's share
                outside a worker; a torchdata state whose workers delivered steps out of order
                (``in_order=False``), which has no single position.
        """
        if not isinstance(state, dict):
            raise StateError(f"a loader state is a dict, got {type(state).__name__}", field="state")
        share = None
        saved = state
        try:
            if state.get("kind") == WORKER_STATE:
                if not self._in_worker():
                    raise StateError("this is the state of one DataLoader worker's share of the steps; load "
                                     "the DataLoader's whole state (StatefulDataLoader.state_dict()) instead")
                share = _check_share(state)
                state = share["start"]
            else:
                state = self._unwrap_state(state)
            self._close_active()
            before = self.schedule.state_dict()
            self.schedule.load_state_dict(state)
            try:
                worlds = self._check_provenance(state)
            except StateError:
                self.schedule.load_state_dict(before)
                raise
        except StateError as exc:
            better = self._geometry_error(saved, exc)
            if better is None:
                raise
            raise better from exc
        self._share, self._share_loaded = share, share is not None
        self._worlds = worlds

    def _check_provenance(self, state: dict[str, Any]) -> list[list[int]]:
        """The exclusions of a loaded ``state`` checked against this loader's (those in force
        before its position), and the run's world sizes with this one added.

        Raises:
            StateError: other exclusions (field ``exclusions``), or a malformed history.
        """
        at = self.global_step
        saved = state.get("exclusions", "")
        mine = "" if self._exclusions is None else self._exclusions.fingerprint(at)
        if saved != mine:
            have = "no exclusion" if not mine else "other exclusions"
            had = "none" if not saved else f"exclusions {saved!r}"
            raise StateError(f"exclusions: the state was saved at step {at} with {had}, and this loader has {have} "
                             f"in force before that step: exclude with from_step={at} or later (steps already "
                             f"trained cannot change), or the same exclusions as the run that saved it",
                             field="exclusions")
        worlds = state.get("worlds")
        if worlds is None:
            saved_world = state.get("world_size", self.world_size)
            worlds = [[0, saved_world]]
        if not isinstance(worlds, list) or not all(
                isinstance(w, list) and len(w) == 2 and all(type(x) is int and x >= 0 for x in w) for w in worlds):
            raise StateError(f"worlds: a list of [step, world size] pairs, got {worlds!r:.100}", field="worlds")
        worlds = [list(w) for w in worlds]
        if worlds[-1][1] != self.world_size:
            if worlds[-1][0] == at:
                worlds[-1][1] = self.world_size
            else:
                worlds.append([at, self.world_size])
        return worlds

    def _geometry_error(self, state: dict[str, Any], exc: StateError) -> StateError | None:
        """The error to raise instead of ``exc`` (a state refused for its item count or data)
        when the source's geometry explains it: the saved state was made with another
        ``seq_len`` (or stride, window...) than this loader's source. ``None``: no better
        words."""
        if exc.field not in ("num_items", "fingerprint"):
            return None
        geometry = self.source.geometry()
        saved = self._saved_schedule_state(state)
        if not geometry or saved is None:
            return None
        n, item = self.source.num_items, self.source.item_name
        theirs = saved.get("source")
        saved_n = saved.get("num_items")
        count = f" ({saved_n} {item})" if isinstance(saved_n, int) else ""
        if isinstance(theirs, dict) and theirs.get("kind") == self.source.kind:
            changed = [k for k in geometry if theirs.get(k, geometry[k]) != geometry[k]]
            if not changed:
                return None
            was = ", ".join(f"{k} {theirs[k]!r}" for k in changed)
            now = ", ".join(f"{k} {geometry[k]!r}" for k in changed)
            return StateError(f"{changed[0]}: the saved state was made with {was}{count} but this loader has "
                              f"{now} ({n} {item})", field=changed[0])
        same_data = saved.get("fingerprint") == self.source.fingerprint
        if theirs is None and exc.field == "num_items" and same_data:
            # a state saved before the geometry was recorded: the same data cut another way
            names = list(geometry)
            keys = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
            now = ", ".join(f"{k} {v!r}" for k, v in geometry.items())
            return StateError(f"num_items: the saved state has {saved_n} {item} but this loader has {n}: the "
                              f"same data cut another way, so the state was saved with another {keys} than "
                              f"this loader's {now}", field="num_items")
        return None

    def _saved_schedule_state(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """The schedule's state inside a loader state, a worker's share or a wrapper's state
        (``None`` when it has none)."""
        try:
            inner = self._wrapped_schedule_state(state)
            if inner is None:
                inner = state["start"] if state.get("kind") == WORKER_STATE else state
        except (KeyError, TypeError):
            return None
        return inner if isinstance(inner, dict) else None

    def _unwrap_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The schedule state ``state`` stands at: ``state`` itself here; a framework's loader
        reads the states of what wraps it there (torch's: torchdata's ``StatefulDataLoader``)."""
        return state

    def _wrapped_schedule_state(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """The schedule state inside a wrapper's ``state`` without checking it (for messages),
        or ``None`` when ``state`` is no wrapper's (see :meth:`_unwrap_state`)."""
        return None

    # ---------------------------------------------------------------------------------------
    # pickling: a loader pickles without its read-ahead (spawned workers rebuild it)

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_active"] = None
        d["_started"] = None        # (a pass started ahead holds read-ahead tickets: not copied)
        return d


class _Pass:
    """One pass over the rest of the current epoch (or an endless stream)."""

    def __init__(self, loader: BaseLoader, worker: int = 0, num_workers: int = 1, *, skip: int = 0,
                 share: bool = False) -> None:
        self.loader = loader
        self.source = loader.source
        self.schedule = loader.schedule
        self.schedule.begin()
        self.worker, self.num_workers, self.skip = worker, num_workers, skip
        # inside a worker process: the share this pass delivers, counted as it goes
        self.share: dict[str, Any] | None = None
        if share:
            self.share = {"start": loader._schedule_state(), "worker": worker, "num_workers": num_workers,
                          "delivered": skip}
            loader._share, loader._share_loaded = self.share, False
        self.closed = False
        # the dtype reads fill (a loader copying to a device may read narrower ids and widen
        # them there), and what is done to each read's result on the thread that read it
        # (the start of its copy to a device; never inside a DataLoader worker process)
        self.dtype = loader.dtype if share else (loader.__dict__.get("_read_dtype") or loader.dtype)
        self.stage = None if share else loader.__dict__.get("_stage")
        b = self.schedule.batch_size
        # reads of views (no output to hold) may cover more steps than ``prefetch``: what runs
        # ahead is then only their checking, and a longer read costs the loop less per step
        if self.source.zero_copy(self.dtype, b):
            self.chunk = VIEW_STEPS
        else:
            self.chunk = max(1, min(self.source.chunk_steps(b), loader.prefetch))
        self.depth = max(2, -(-loader.prefetch // self.chunk))
        self.inline = loader.num_threads == 0 or self.source.inline(self.dtype, b)
        self.pool = None
        if not self.inline:
            self.pool = shared_pool(loader.num_threads, loader.pool_name)
            self.pool.attach()
        self._tickets: collections.deque[tuple[Any, list[Any]]] = collections.deque()
        # as the source's storage declares (Access): the first read alone until it is in, its
        # requests ahead of any read-ahead's (the first batch is what the training loop waits
        # for; later steps' fetches start once it arrives, still well ahead of their turn)
        access = self.source.access
        self._first_alone = access.first_alone
        self._hint_groups, self._hint_bytes = access.hint_groups, access.hint_bytes
        self._plan = self._reads()
        self._prestarted = False

    def prestart(self) -> None:
        """Queue the first reads on the pool now (:meth:`BaseLoader.start_prefetch`): the first
        alone when the storage asks for it (``Access.first_alone``), else up to the depth."""
        self._prestarted = True
        plan = next(self._plan, None)
        if plan is not None:
            self._tickets.append(self._submit(*plan))
        if not self._first_alone:
            self._fill()
        self._first_alone = False

    def _reads(self) -> Iterator[tuple[np.ndarray, np.ndarray | None, list[Any]]]:
        """``(items (steps, k), sources or None, position after each step)`` per read, in
        order: the schedule's pages cut into reads of 1, 2, 4... steps up to the chunk."""
        size = 1
        # a source whose storage asks for it (Access.hint_groups) hears of steps ``prefetch``
        # at a time, up to hint_groups times that beyond the reads in flight: one hint covers
        # many steps, so the ranges of neighbouring steps (windows shuffled within a shard) go
        # out as one request, not one per step. The very first read is hinted alone (the
        # first batch waits on nothing else). Hints stop short of that while the bytes they
        # asked for beyond the reads planned reach Access.hint_bytes (large steps).
        groups, cap = self._hint_groups, self._hint_bytes
        group = self.loader.prefetch if groups else 0
        first = True
        ahead: collections.deque[tuple[int, int]] = collections.deque()    # (stop, bytes) of hints
        for page in self.schedule.plan(self.worker + self.num_workers * self.skip, self.num_workers):
            at, hinted = 0, 0
            ahead.clear()
            while at < page.steps:
                count = min(size, self.chunk, page.steps - at)
                items = page.items[at:at + count]
                sources = None if page.sources is None else page.sources[at:at + count]
                if not group or first:
                    if items.size:
                        self._prepare(items, sources)
                    hinted = at + count
                    first = False
                else:
                    while ahead and ahead[0][0] <= at + count:
                        ahead.popleft()
                    while hinted < min(page.steps, at + count + groups * group):
                        if cap and ahead and sum(b for _, b in ahead) >= cap:
                            break
                        stop = min(page.steps, hinted + group)
                        nbytes = self._prepare(page.items[hinted:stop],
                                               None if page.sources is None else page.sources[hinted:stop])
                        ahead.append((stop, nbytes or 0))
                        hinted = stop
                yield items, sources, page.after[at:at + count]
                at += count
                size *= 2

    def _prepare(self, items: np.ndarray, sources: np.ndarray | None) -> int | None:
        """The source's read-ahead hint for ``items`` (with each item's source, a mixture's):
        the bytes it hinted, when it says."""
        if not items.size:
            return 0
        return self.source.prepare(items) if sources is None else self.source.prepare(items, sources)  # type: ignore[call-arg]

    def _submit(self, items: np.ndarray, sources: np.ndarray | None, after: list[Any], *,
                here: bool = False) -> tuple[Any, list[Any]]:
        if items.shape[1] == 0:                 # this rank has nothing in a short last step
            return _Ready(None), after
        args = (items, self.dtype) if sources is None else (items, self.dtype, sources)
        stage = self.stage
        if stage is not None:
            read = functools.partial(_staged, stage, self.source.read, args)
            if here or self.pool is None:
                return _Ready(read()), after
            return self.pool.call(read, caller_runs=self.loader.reads_here), after
        if here or self.pool is None:
            return _Ready(self.source.read(*args)), after
        if sources is None and self.source.read_async is not None:
            ticket = self.source.read_async(self.pool, items, self.dtype)
            if ticket is not None:
                return ticket, after
        return self.pool.call(functools.partial(self.source.read, *args), caller_runs=self.loader.reads_here), after

    def _fill(self) -> None:
        while len(self._tickets) < (1 if self._first_alone else self.depth):
            plan = next(self._plan, None)
            if plan is None:
                return
            self._tickets.append(self._submit(*plan))

    def _results(self) -> Iterator[tuple[Any, list[Any]]]:
        if self.inline:
            for plan in self._plan:
                yield self._submit(*plan)
            return
        # the first read (one step) runs here, on the thread that waits for it: no thread to
        # start, no other read planned or queued before the first batch; read-ahead starts
        # when the loop asks for the second (a pass started ahead already queued it)
        if not self._prestarted:
            plan = next(self._plan, None)
            if plan is None:
                return
            if self.loader.reads_here:
                yield self._submit(*plan, here=True)
            else:
                self._tickets.append(self._submit(*plan))
            self._first_alone = False
            self._fill()
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
        m = ld._metrics
        replay = bool(ld.headspace)          # (the replay times the steps itself)
        items = ld.items_per_step
        asked = clock()
        m.asked(asked)
        try:
            for ready, after in self._results():
                if self.closed:
                    return
                if ready.result is not None:
                    m.read(nbytes(ready.result))
                outputs = [None] * len(after) if ready.result is None else ld._convert(ready.result, len(after))
                for out, pos in zip(outputs, after, strict=True):
                    if self.closed:
                        return
                    # Counted as delivered now: a state saved while the loop works on this
                    # batch resumes after it.
                    schedule.advance_to(pos)
                    if self.share is not None:
                        self.share["delivered"] += 1
                    if out is not None:
                        if not replay:
                            now = clock()
                            m.delivered(now - asked, now, items)
                        yield out
                        asked = clock()
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

    def close(self, wait: bool = True) -> None:
        """Stop: drop queued reads, wait for those a thread has started (the source may be
        closed right after; ``wait=False``: let them finish on their own). Idempotent."""
        self.closed = True
        while self._tickets:
            ticket, _ = self._tickets.popleft()
            ticket.cancel() if wait else ticket.cancel(False)
        if self.pool is not None and wait:     # (the last one out stops the pool's threads)
            pool, self.pool = self.pool, None
            pool.detach()


def _check_share(state: Any) -> dict[str, Any]:
    """The fields of a :data:`WORKER_STATE` (checked)."""
    if not isinstance(state, dict) or state.get("kind") != WORKER_STATE or state.get("version") != 1:
        raise StateError(f"not a zerobatch worker state (kind {WORKER_STATE!r}, version 1)", field="kind")
    share = {key: state.get(key) for key in ("start", "worker", "num_workers", "delivered")}
    counts = [share[key] for key in ("worker", "num_workers", "delivered")]
    if not isinstance(share["start"], dict) or not all(type(c) is int and c >= 0 for c in counts) \
            or share["worker"] >= share["num_workers"]:
        raise StateError(f"a bad zerobatch worker state: worker {share['worker']!r} of {share['num_workers']!r}, "
                         f"{share['delivered']!r} delivered", field="worker")
    return share


def _staged(stage: Any, read: Any, args: tuple[Any, ...]) -> Any:
    return stage(read(*args))


class _Ready:
    __slots__ = ("result",)

    def __init__(self, result: Any) -> None:
        self.result = result

    def wait(self) -> Any:
        return self.result

    def cancel(self, wait: bool = True) -> None:
        self.result = None
