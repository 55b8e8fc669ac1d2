"""Provenance: which documents a training step saw, and at which steps a document was seen.

A zerobatch loader's order is a pure function of the dataset build, the seeds and the step
(an :class:`~zerobatch.samplers.IndexSampler` over a Feistel permutation, or a
:class:`~zerobatch.samplers.MixtureSampler`), so a small JSON **run card**
(:func:`run_card`, ``loader.describe()``) is all that is needed to answer both questions
exactly, long after the run, without a log of what was read:

- :meth:`Trace.step`: the rows of any step on every rank: the source, the item, the documents
  and token ranges each row holds (which part of each document), their metadata;
- :meth:`Trace.document` / :meth:`Trace.documents`: every (epoch, step, rank, row, offset) at
  which a document's tokens entered training, by inverting the order (the Feistel
  permutation's inverse: no scan of the steps) for a single source; a mixture's order is
  read in sequence (the source of a sample depends on the picks before it), so its inverse
  walks the steps once for any number of documents.

Both go through the loader's own schedule and the source's own geometry
(:meth:`~zerobatch.adapters.sources.Source.token_spans`,
:meth:`~zerobatch.adapters.sources.Source.items_at`), so what they say is what the loader
delivers, exclusions included.

**Exclusions** (:meth:`BaseLoader.exclude <zerobatch.adapters.BaseLoader.exclude>`): from a
given step on, skip steps or drop the rows holding given documents. A dropped row is not
replaced: the step is shortened, so every other step of the run stays exactly as it was (the
order, the trace and an exact resume are untouched; only the rows holding an excluded
document go). A step where some rank would be left with no row is skipped on every rank, so
ranks stay in step. The run card lists the exclusions; a loader state records the
fingerprint of those in force before its position, and a state saved under others is refused
(field ``exclusions``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from zerobatch.core.checks import check_count
from zerobatch.formats.errors import ConfigError, StateError

__all__ = ["CARD_VERSION", "Exclusions", "Trace", "find_documents", "loader_from_card", "read_card", "run_card",
           "source_from_spec", "spec_value"]

#: Version of the run card layout.
CARD_VERSION = 1
#: The key marking a run card (its value: :data:`CARD_VERSION`).
CARD_KEY = "zerobatch_run_card"
#: Largest run card accepted from a file (a card is a few KiB; exclusions of many documents more).
MAX_CARD_BYTES = 1 << 28


# ---------------------------------------------------------------------------------------------
# specs: sources, orders and schedules as JSON


def spec_value(value: Any, field: str) -> Any:
    """``value`` (a source's constructor argument) as JSON: a source as its spec, an open
    reader as its path, a dtype as its name, a weight schedule as its points.

    Raises:
        ConfigError: a value with no JSON form.
    """
    from zerobatch.adapters.sources import Source
    from zerobatch.samplers import WeightSchedule
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, Source):
        return value.spec()
    if isinstance(value, WeightSchedule):
        return {"zerobatch_weight_schedule": {"points": [[s, spec_value(w, field)] for s, w in
                                                         zip(value.steps, value.raw, strict=True)],
                                              "interpolation": value.interpolation}}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (tuple, list)):
        return [spec_value(v, field) for v in value]
    if isinstance(value, dict):
        return {str(k): spec_value(v, field) for k, v in value.items()}
    if isinstance(value, (np.dtype, type)):
        try:
            return np.dtype(value).name
        except TypeError:
            pass
    for attr in ("folder", "path"):         # an open reader: the dataset it reads
        where = getattr(value, attr, None)
        if isinstance(where, str) and hasattr(value, "close"):
            return where
    raise ConfigError(f"{field}: a {type(value).__name__} has no run card form (give sources paths, numbers and "
                      f"names)", field=field)


def _source_classes() -> dict[str, type]:
    from zerobatch.adapters import sources
    out = {}
    for name in sources.__all__:
        obj = getattr(sources, name)
        if isinstance(obj, type) and issubclass(obj, sources.Source) and obj is not sources.Source:
            out[name] = obj
    return out


def _from_json(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        if "zerobatch_source" in value:
            return source_from_spec(value)
        if "zerobatch_weight_schedule" in value:
            from zerobatch.samplers import WeightSchedule
            ws = value["zerobatch_weight_schedule"]
            if not isinstance(ws, dict) or not isinstance(ws.get("points"), list):
                raise ConfigError("a weight schedule of the run card has no points", field="weight_schedule")
            return WeightSchedule([tuple(p) for p in ws["points"]], interpolation=ws.get("interpolation", "constant"))
        return {k: _from_json(v, k) for k, v in value.items()}
    if isinstance(value, list):
        items = [_from_json(v, key) for v in value]
        # a mixture's entries and a curriculum's phases are tuples
        return [tuple(v) if isinstance(v, list) else v for v in items] if key in ("sources", "phases") else items
    return value


def source_from_spec(spec: Any) -> Any:
    """The source a :meth:`~zerobatch.adapters.sources.Source.spec` describes, opened again.

    Raises:
        ConfigError: not a source spec, or a class that is not a zerobatch source.
    """
    if not isinstance(spec, dict) or not isinstance(spec.get("zerobatch_source"), str):
        raise ConfigError(f"source: not a source spec: {spec!r:.200}", field="source")
    classes = _source_classes()
    name = spec["zerobatch_source"]
    cls = classes.get(name)
    if cls is None:
        raise ConfigError(f"source: {name!r} is not a zerobatch source ({', '.join(sorted(classes))})",
                          field="source")
    args = {k: _from_json(v, k) for k, v in spec.items() if k != "zerobatch_source"}
    try:
        return cls(**args)
    except TypeError as exc:
        raise ConfigError(f"source: {name} cannot be made from the run card's arguments: {exc}",
                          field="source") from None


_ORDERS = {"sequential": "SequentialOrder", "global-random": "GlobalRandomOrder", "block-shuffle": "BlockShuffleOrder",
           "sliding": "SlidingOrder", "random": "RandomOrder"}


def _order_spec(order: Any) -> dict[str, Any]:
    if order.kind not in _ORDERS or type(order).__name__ != _ORDERS[order.kind]:
        raise ConfigError(f"order: a {type(order).__name__} has no run card form", field="order")
    return {"kind": order.kind, "num_items": order.num_items, "seed": order.seed, **order.params()}


def _order_from_spec(spec: dict[str, Any]) -> Any:
    import zerobatch.samplers as S
    if not isinstance(spec, dict) or spec.get("kind") not in _ORDERS:
        raise ConfigError(f"order: not an order of a run card: {spec!r:.200}", field="order")
    d = dict(spec)
    kind, n = d.pop("kind"), d.pop("num_items")
    cls = getattr(S, _ORDERS[kind])
    if kind in ("sequential", "sliding"):
        return cls(n)
    return cls(n, **d)


# ---------------------------------------------------------------------------------------------
# the run card


def run_card(loader: Any, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """A small JSON-able description of ``loader`` that, with a saved state, reconstructs the
    exact sequence of its steps on every rank (``loader.describe()``): the source (its class,
    dataset paths, build ids and arguments), the order and seed, the global batch, the world
    sizes the run has had (from which step), the exclusions and the state (default: the
    loader's now). Save it with the checkpoint; :func:`loader_from_card` rebuilds the loader,
    :class:`Trace` answers what each step held.

    Raises:
        ConfigError: a source or order made of objects with no JSON form.
    """
    source = loader.source
    schedule = loader.schedule
    from zerobatch.samplers import IndexSampler
    card: dict[str, Any] = {
        CARD_KEY: CARD_VERSION,
        "source": source.spec(),
        "fingerprint": source.fingerprint,
        "num_items": source.num_items,
        # rows per step over all ranks, as the loader takes it (an LLMBATCH item is several rows)
        "global_batch_size": None if source.batch_schedule is not None else
        loader.global_batch_size * source.rows_per_item,
        "shuffle": loader.shuffle,
        "seed": loader.seed,
        "tail": loader.tail,
        "order": _order_spec(schedule.order) if isinstance(schedule, IndexSampler) else None,
        "dtype": loader.dtype.name,
        "world_sizes": [list(w) for w in loader._worlds],
        "exclusions": loader._exclusions.to_json() if loader._exclusions is not None else [],
        "state": loader.state_dict() if state is None else state,
    }
    return card


def read_card(card: Any) -> dict[str, Any]:
    """A run card: a dict, JSON text, or the path of a JSON file (a file holding a whole
    checkpoint's trainer state may hold the card under ``"zerobatch_run_card"``... any key:
    the first card found in the JSON is taken).

    Raises:
        ConfigError: not a run card, or one of another version.
        NotFoundError: no such file.
    """
    from zerobatch.formats.errors import NotFoundError
    from zerobatch.formats.strict_json import loads_strict
    path = None
    if isinstance(card, (str, os.PathLike)) and not (isinstance(card, str) and card.lstrip().startswith("{")):
        path = os.fspath(card)
        if os.path.isdir(path):
            path = os.path.join(path, "zerobatch_run_card.json")
        if not os.path.exists(path):
            raise NotFoundError("no run card here", path=path, field="card")
        if os.path.getsize(path) > MAX_CARD_BYTES:
            raise ConfigError(f"a run card of {os.path.getsize(path)} bytes is over {MAX_CARD_BYTES}", path=path,
                              field="card")
        with open(path, "rb") as f:
            card = f.read()
    if isinstance(card, (str, bytes)):
        card = loads_strict(card, error=ConfigError, field="card")
    found = _find_card(card)
    if found is None:
        raise ConfigError("not a zerobatch run card (loader.describe() writes one)", path=path, field="card")
    if found.get(CARD_KEY) != CARD_VERSION:
        raise ConfigError(f"{CARD_KEY}: version {found.get(CARD_KEY)!r}, this release reads {CARD_VERSION}",
                          path=path, field=CARD_KEY)
    return found


def _find_card(value: Any, depth: int = 0) -> dict[str, Any] | None:
    if isinstance(value, dict):
        if CARD_KEY in value:
            return value
        if depth < 6:
            for v in value.values():
                found = _find_card(v, depth + 1)
                if found is not None:
                    return found
    elif isinstance(value, list) and depth < 6:
        for v in value:
            found = _find_card(v, depth + 1)
            if found is not None:
                return found
    return None


def loader_from_card(card: Any, cls: type | None = None, *, rank: int | None = None, world_size: int | None = None,
                     load_state: bool = True, **kwargs: Any) -> Any:
    """The loader a run card describes (``cls``: default the NumPy
    :class:`~zerobatch.adapters.BaseLoader`; ``Loader.from_card`` makes a torch one), for
    ``rank`` of ``world_size`` (default: the environment's), with its exclusions and, unless
    ``load_state=False``, its state loaded: the run continues exactly. ``kwargs`` go to the
    loader (``prefetch``, ``num_threads``...).

    Raises:
        ConfigError: not a run card, or a source that cannot be opened again.
        StateError: the card's state does not fit the rebuilt loader (another dataset build).
    """
    from zerobatch.adapters._loader import BaseLoader
    card = read_card(card)
    cls = BaseLoader if cls is None else cls
    source = source_from_spec(card["source"])
    if source.fingerprint != card.get("fingerprint", source.fingerprint):
        raise StateError(f"fingerprint: the run card was made over {card['fingerprint']!r}, the data is now "
                         f"{source.fingerprint!r} (another build of the dataset)", field="fingerprint")
    args: dict[str, Any] = {"shuffle": card.get("shuffle", True), "seed": card.get("seed", 42),
                            "rank": rank, "world_size": world_size}
    if card.get("global_batch_size") is not None:
        args["global_batch_size"] = card["global_batch_size"]
    if source.batch_schedule is None and card.get("tail") is not None:
        args["tail"] = card["tail"]
    if card.get("order") is not None:
        args["order"] = _order_from_spec(card["order"])
    if "dtype" in card and "dtype" not in kwargs and cls is BaseLoader:
        args["dtype"] = card["dtype"]
    args.update(kwargs)
    loader = cls(source, **args)
    for entry in card.get("exclusions") or []:
        loader._exclusions_for().add_entry(entry)
    loader._apply_exclusions()
    worlds = card.get("world_sizes")
    if worlds:
        loader._worlds = [list(w) for w in worlds]
    if load_state and card.get("state") is not None:
        loader.load_state_dict(card["state"])
    return loader


# ---------------------------------------------------------------------------------------------
# exclusions


def _members(source: Any) -> list[tuple[str | None, Any]]:
    """``(name, source)`` of each source a loader's source reads: a mixture's, or itself."""
    from zerobatch.adapters.sources import Mixture
    if isinstance(source, Mixture):
        return list(zip(source.names, source.sources, strict=True))
    return [(None, source)]


def _dataset_id(member: Any) -> Any:
    """What identifies the dataset a source reads (its build id): a document is the same
    document whichever source of a mixture or phase of a curriculum reads it."""
    units = member.units()
    return getattr(units, "build_id", None) or id(units)


def _same_dataset(source: Any, k: int) -> list[int]:
    """The members of ``source`` that read the dataset member ``k`` reads."""
    members = _members(source)
    mine = _dataset_id(members[k][1])
    return [j for j, (_, m) in enumerate(members) if j == k or _dataset_id(m) == mine]


def _member_index(source: Any, name: str | None) -> int:
    members = _members(source)
    if name is None:
        if len(members) > 1 and len(_same_dataset(source, 0)) < len(members):
            raise ConfigError(f"source: this loader reads {len(members)} sources; name the document's source "
                              f"({', '.join(str(n) for n, _ in members)})", field="source")
        return 0
    for k, (n, _) in enumerate(members):
        if n == name:
            return k
    raise ConfigError(f"source: {name!r} is not a source of this loader ({', '.join(str(n) for n, _ in members)})",
                      field="source")


def _isin(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    if sorted_set.size == 0:
        return np.zeros(values.shape, bool)
    at = np.searchsorted(sorted_set, values)
    return sorted_set[np.minimum(at, sorted_set.size - 1)] == values


def _step_ranges(steps: Any) -> list[list[int]]:
    """Steps as sorted, merged ``[first, stop)`` ranges: from a ``range``, an iterable of steps
    or ``(first, stop)`` pairs."""
    out: list[list[int]] = []
    if isinstance(steps, range):
        if steps.step != 1:
            raise ConfigError("steps: a range of step 1", field="steps")
        pairs = [(steps.start, steps.stop)] if len(steps) else []
    else:
        pairs = []
        for s in steps:
            if isinstance(s, (tuple, list)) and len(s) == 2:
                pairs.append((check_count(s[0], "steps"), check_count(s[1], "steps")))
            else:
                v = check_count(s, "steps")
                pairs.append((v, v + 1))
    for a, b in sorted(pairs):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


class Exclusions:
    """What a loader leaves out, from which step (see the module documentation): a list of
    entries ``{"from_step", "steps": [[first, stop), ...], "documents": {source: [index...]}}``
    (a single source is named ``""``), resolved to the items of each source that hold an
    excluded document's tokens."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.members = _members(source)
        self.entries: list[dict[str, Any]] = []
        self._items: list[dict[int, np.ndarray]] = []

    def add_entry(self, entry: dict[str, Any]) -> None:
        """Add an entry (as :meth:`to_json` lists them), checked and resolved to items.

        Raises:
            ConfigError: a malformed entry, an unknown source or a document out of range.
        """
        if not isinstance(entry, dict):
            raise ConfigError(f"exclusions: an entry is a dict, got {entry!r:.100}", field="exclusions")
        start = check_count(entry.get("from_step", 0), "from_step")
        steps = _step_ranges(entry.get("steps") or [])
        if steps and steps[0][0] < start:
            raise ConfigError(f"steps: step {steps[0][0]} is before from_step {start} (a step already trained "
                              f"cannot be skipped)", field="steps")
        docs = entry.get("documents") or {}
        if not isinstance(docs, dict):
            raise ConfigError("exclusions: documents are {source name: [indices]}", field="documents")
        items: dict[int, np.ndarray] = {}
        clean: dict[str, list[int]] = {}
        for name, values in docs.items():
            k = _member_index(self.source, name or None)
            member = self.members[k][1]
            units = member.units()
            d = np.unique(np.asarray(list(values), dtype=np.int64))
            if d.size and (d[0] < 0 or d[-1] >= units.num_documents):
                raise ConfigError(f"documents: {int(d[0] if d[0] < 0 else d[-1])} is outside the "
                                  f"{units.num_documents} documents of {name or 'the source'}", field="documents")
            if not d.size:
                continue
            starts, stops = units.document_spans(d)
            for j in _same_dataset(self.source, k):         # every source reading that dataset
                its, _ = self.members[j][1].items_at(starts, stops)
                items[j] = np.unique(np.concatenate([items.get(j, np.zeros(0, np.int64)), its]))
            clean[name or ""] = d.tolist()
        self.entries.append({"from_step": start, "steps": steps, "documents": clean})
        self._items.append(items)

    def to_json(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.entries)

    def fingerprint(self, before: int) -> str:
        """What identifies the exclusions in force before step ``before`` (``""``: none)."""
        active = [e for e in self.entries if e["from_step"] < before]
        if not active:
            return ""
        text = json.dumps(active, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()

    def skipped(self, step: int) -> bool:
        return any(e["from_step"] <= step and any(a <= step < b for a, b in e["steps"]) for e in self.entries)

    def keep(self, step: int, items: np.ndarray, sources: np.ndarray | None) -> np.ndarray | None:
        """Over the whole global batch of ``step`` (``items``, and a mixture's ``sources``):
        ``None`` when no exclusion touches it, else which items are kept (none: skipped)."""
        mask: np.ndarray | None = None
        for entry, per_source in zip(self.entries, self._items, strict=True):
            if entry["from_step"] > step:
                continue
            if any(a <= step < b for a, b in entry["steps"]):
                return np.zeros(items.shape, bool)
            for k, excluded in per_source.items():
                hit = _isin(items, excluded)
                if sources is not None:
                    hit &= sources == k
                if hit.any():
                    mask = ~hit if mask is None else mask & ~hit
        return mask


# ---------------------------------------------------------------------------------------------
# metadata


def find_documents(units: Any, key: str, values: Iterable[Any], *, chunk: int = 1 << 16) -> dict[Any, list[int]]:
    """The documents whose metadata ``key`` (a field kept at conversion: ``id``, ``url``,
    ``row`` with ``--row-ids``) is one of ``values``: one pass over the dataset's per-document
    metadata, ``chunk`` documents at a time (O(documents), no token read).

    Raises:
        ConfigError: the dataset keeps no metadata.
    """
    want = {v: [] for v in values}
    as_str = {str(v): v for v in want}
    n = units.num_documents
    for first in range(0, n, chunk):
        docs = np.arange(first, min(n, first + chunk), dtype=np.int64)
        starts, _ = units.document_spans(docs)
        meta = units.windows_metadata(starts, 1)
        if meta is None:
            raise ConfigError("the dataset keeps no per-document metadata (convert with --row-ids or "
                              "--metadata-fields)", field="metadata")
        ids = np.asarray(meta.ids).reshape(-1)
        objects = meta.objects
        for j in np.flatnonzero(ids >= 0).tolist():
            obj = objects[int(ids[j])]
            if isinstance(obj, dict) and key in obj:
                v = obj[key]
                hit = want.get(v) if not isinstance(v, (dict, list)) else None
                if hit is None and str(v) in as_str:
                    hit = want[as_str[str(v)]]
                if hit is not None:
                    hit.append(first + j)
    return want


# ---------------------------------------------------------------------------------------------
# the trace


class Trace:
    """Answers, from a run card, what any step held and when any document was seen (module
    documentation).

    Args:
        card: a run card (dict, JSON text or a file: :func:`read_card`).

    Global steps count the loader's steps from the start of the run, over its epochs
    (``epoch * steps_per_epoch + step`` for an epoch order, as
    :attr:`~zerobatch.samplers.IndexSampler.global_step`); with gradient accumulation a
    trainer's optimizer step is several loader steps.
    """

    def __init__(self, card: Any) -> None:
        self.card = read_card(card)
        self.loader = loader_from_card(self.card, load_state=False, num_threads=0)
        self.source = self.loader.source
        self.members = _members(self.source)
        self.worlds = [tuple(w) for w in self.card.get("world_sizes") or [[0, self.loader.world_size]]]
        state = self.card.get("state")
        self.position: int | None = None
        if state is not None:
            probe = loader_from_card(self.card, num_threads=0, rank=0, world_size=self._world(0))
            self.position = probe.schedule.global_step
            probe.close()
        self._schedules: dict[tuple[int, int], Any] = {}

    def close(self) -> None:
        self.loader.close()

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- geometry --------------------------------------------------------------------------

    def _world(self, step: int) -> int:
        w = self.worlds[0][1]
        for start, size in self.worlds:
            if start > step:
                break
            w = size
        return int(w)

    @property
    def steps_per_epoch(self) -> int | None:
        return self.loader.schedule.steps_per_epoch

    def _schedule(self, rank: int, world: int, fresh: bool = False) -> Any:
        """The loader's schedule as rank ``rank`` of ``world`` plans it (kept, so that a
        mixture's walk goes on from the last step asked)."""
        sched = None if fresh else self._schedules.get((rank, world))
        if sched is None:
            sched = copy.deepcopy(self.loader.schedule)
            sched.rank, sched.world_size = rank, world
            sched.batch_size = sched.global_batch_size // world
            sched.exclude = self.loader.schedule.exclude
            self._schedules[(rank, world)] = sched
        return sched

    def _planned(self, step: int, rank: int, world: int) -> tuple[np.ndarray, np.ndarray | None]:
        """``(items, sources)`` of ``rank`` at global ``step``, as the loader plans it."""
        from zerobatch.samplers import IndexSampler
        sched = self._schedule(rank, world)
        if isinstance(sched, IndexSampler):
            spe = sched.steps_per_epoch
            epoch, s = (0, step) if spe is None else divmod(step, spe)
            sched.set_epoch(epoch)
            sched.seek(s)
        else:
            if sched.global_step > step:            # a mixture is walked from its start
                sched = self._schedule(rank, world, fresh=True)
            if sched.global_step < step:
                sched.load_state_dict(sched.advanced(step - sched.global_step))
        page = next(iter(sched.plan(0, 1)))
        return page.items[0], None if page.sources is None else page.sources[0]

    # -- forward ---------------------------------------------------------------------------

    def step(self, step: int, rank: int | None = None, *, metadata: bool = True) -> dict[str, Any]:
        """What global ``step`` held on every rank (or ``rank``): per row, the source, the item
        and its spans of documents (``document``, the row's ``tokens`` of it as global token
        positions ``[start, stop)``, the document's own span, ``offset`` into the document,
        ``row_offset`` into the row) and, with ``metadata``, each document's metadata.

        Raises:
            OutOfRangeError: a step beyond the run (an epoch order's last epoch is not bounded:
                any epoch can be asked for).
        """
        step = check_count(step, "step")
        world = self._world(step)
        ranks = range(world) if rank is None else [check_count(rank, "rank", maximum=world - 1)]
        out: dict[str, Any] = {"step": step, "world_size": world, "ranks": []}
        spe = self.steps_per_epoch
        if spe:
            out["epoch"], out["epoch_step"] = divmod(step, spe)
        excl = self.loader._exclusions
        out["skipped"] = bool(excl is not None and excl.skipped(step))
        for r in ranks:
            items, sources = self._planned(step, r, world)
            out["ranks"].append({"rank": r, "rows": self._rows(items, sources, metadata)})
        if not out["skipped"] and excl is not None and all(not x["rows"] for x in out["ranks"]):
            out["skipped"] = True
        return out

    def _rows(self, items: np.ndarray, sources: np.ndarray | None, metadata: bool) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        tags = np.zeros(items.size, np.int64) if sources is None else sources.astype(np.int64)
        per = self.source.rows_per_item
        for k, (name, member) in enumerate(self.members):
            where = np.flatnonzero(tags == k)
            if not where.size:
                continue
            units = member.units()
            which, a, b = member.token_spans(items[where])
            pieces = self._split(units, a, b)
            if metadata and pieces:
                self._attach_metadata(units, pieces)
            by_span: dict[int, list[dict[str, Any]]] = {}
            for piece in pieces:
                by_span.setdefault(piece.pop("span"), []).append(piece)
            spans_of: dict[int, list[int]] = {}
            for span, j in enumerate(which.tolist()):
                spans_of.setdefault(j, []).append(span)
            for j, i in enumerate(where.tolist()):
                item = int(items[i])
                if per == 1:
                    at, docs = 0, []
                    for span in spans_of.get(j, []):
                        for piece in by_span.get(span, []):
                            piece["row_offset"] = at + piece["tokens"][0] - int(a[span])
                            docs.append(piece)
                        at += int(b[span] - a[span])
                    rows.append({"row": i, "source": name, "item": item, "documents": docs})
                    continue
                for r, span in enumerate(spans_of.get(j, [])):
                    docs = by_span.get(span, [])
                    for piece in docs:
                        piece["row_offset"] = piece["tokens"][0] - int(a[span])
                    rows.append({"row": i * per + r, "source": name, "item": item, "item_row": r,
                                 "documents": docs})
        rows.sort(key=lambda r: r["row"])
        return rows

    def _split(self, units: Any, a: np.ndarray, b: np.ndarray) -> list[dict[str, Any]]:
        """Spans ``[a, b)`` cut at document boundaries: one entry per (span, document)."""
        out: list[dict[str, Any]] = []
        if not a.size:
            return out
        first = units.documents_at(a)
        last = units.documents_at(b - 1)
        from zerobatch.adapters.sources.tokstream import _runs
        docs, span = _runs(first, last + 1)
        ds, de = units.document_spans(docs)
        lo, hi = np.maximum(ds, a[span]), np.minimum(de, b[span])
        for d, s, x, y, s0, s1 in zip(docs.tolist(), span.tolist(), lo.tolist(), hi.tolist(), ds.tolist(),
                                      de.tolist(), strict=True):
            out.append({"span": s, "document": d, "tokens": [x, y], "document_tokens": [s0, s1], "offset": x - s0})
        return out

    @staticmethod
    def _attach_metadata(units: Any, pieces: list[dict[str, Any]]) -> None:
        starts = np.asarray([p["document_tokens"][0] for p in pieces], np.int64)
        try:
            meta = units.windows_metadata(starts, 1)
        except Exception:       # noqa: BLE001 - a dataset without metadata: none to show
            return
        if meta is None:
            return
        ids = np.asarray(meta.ids).reshape(-1)
        for p, i in zip(pieces, ids.tolist(), strict=True):
            if i >= 0:
                p["metadata"] = meta.objects[i]

    # -- inverse ---------------------------------------------------------------------------

    def _until(self, until: int | None) -> int:
        if until is not None:
            return check_count(until, "until")
        if self.position:                   # the run's progress, when the card's state has any
            return self.position
        spe = self.steps_per_epoch
        if spe is None:
            raise ConfigError("until: an endless run (a mixture or an endless order) needs the step to look up to "
                              "(or a run card with a state)", field="until")
        return spe

    def document(self, document: int, *, source: str | None = None, until: int | None = None) -> list[dict[str, Any]]:
        """Every time a token of ``document`` (of ``source``, for a mixture) entered training
        before global step ``until`` (default: the position of the card's state, the run's progress;
        else, for a card saved at step 0, the end of the first epoch):
        ``{"step", "epoch", "rank", "row", "item", "tokens", "row_offset"}``, in step order."""
        return self.documents([document], source=source, until=until)[0]

    def documents(self, documents: Sequence[int], *, source: str | None = None,
                  until: int | None = None) -> list[list[dict[str, Any]]]:
        """:meth:`document` for many documents at once (one pass over the inverse for all)."""
        k0 = _member_index(self.source, source)
        units = self.members[k0][1].units()
        docs = np.asarray(list(documents), dtype=np.int64).reshape(-1)
        if docs.size and (docs.min() < 0 or docs.max() >= units.num_documents):
            raise ConfigError(f"document: outside the {units.num_documents} documents", field="document")
        stop = self._until(until)
        ds, de = units.document_spans(docs)
        found: list[list[dict[str, Any]]] = [[] for _ in range(docs.size)]
        per = self.source.rows_per_item
        for k in _same_dataset(self.source, k0):       # every source reading that dataset
            name, member = self.members[k]
            items, which = member.items_at(ds, de)
            if not items.size:
                continue
            hits = self._occurrences(items, k, stop)   # (pair, step, rank, row in the share, epoch)
            # where each (item, document) pair sits in the item's rows
            pair_parts = self._pair_parts(member, items, which, ds, de, per)
            for pair, step, rank, index, epoch in hits:
                for item_row, a, b, off in pair_parts[pair]:
                    rec = {"step": step, "epoch": epoch, "rank": rank, "row": index * per + item_row,
                           "item": int(items[pair]), "tokens": [a, b], "row_offset": off}
                    if name is not None:
                        rec["source"] = name
                    found[int(which[pair])].append(rec)
        for recs in found:
            recs.sort(key=lambda r: (r["step"], r["rank"], r["row"]))
        return found

    @staticmethod
    def _pair_parts(member: Any, items: np.ndarray, which: np.ndarray, ds: np.ndarray, de: np.ndarray,
                    per: int) -> list[list[tuple[int, int, int, int]]]:
        """For each (item, document) pair: ``(row of the item, start, stop, offset in the row)``
        of the document's tokens the item holds."""
        w, a, b = member.token_spans(items)
        parts: list[list[tuple[int, int, int, int]]] = [[] for _ in range(items.size)]
        seen_rows: dict[int, int] = {}
        at: dict[int, int] = {}
        for i, x, y in zip(w.tolist(), a.tolist(), b.tolist(), strict=True):
            r = seen_rows.get(i, -1) + 1 if per > 1 else 0
            seen_rows[i] = r
            base = 0 if per > 1 else at.get(i, 0)
            d = int(which[i])
            lo, hi = max(x, int(ds[d])), min(y, int(de[d]))
            if lo < hi:
                parts[i].append((r, lo, hi, base + lo - x))
            at[i] = base + (y - x) if per == 1 else 0
        return [[(r, lo, hi, off) for r, lo, hi, off in p] for p in parts]

    def _occurrences(self, items: np.ndarray, k: int, stop: int) -> list[tuple[int, int, int, int, int | None]]:
        from zerobatch.samplers import IndexSampler
        sched = self.loader.schedule
        if isinstance(sched, IndexSampler):
            return self._index_occurrences(sched, items, stop)
        return self._walk_occurrences(items, k, stop)

    def _index_occurrences(self, sched: Any, items: np.ndarray,
                           stop: int) -> list[tuple[int, int, int, int, int | None]]:
        """An index order inverted: each item's position in every epoch before ``stop``
        (the Feistel permutation's inverse), cut into step, rank and row."""
        order, g, n = sched.order, sched.global_batch_size, sched.order.num_items
        out: list[tuple[int, int, int, int, int | None]] = []
        pairs = np.arange(items.size, dtype=np.int64)
        if not order.has_epochs:
            if order.kind != "sliding":
                return self._scan_occurrences(items, stop)
            # item i is at positions i, i + n, i + 2n, ...
            last = stop * g
            reps = np.maximum((last - 1 - items) // n + 1, 0) if n else np.zeros_like(items)
            pos_pair = np.repeat(pairs, reps)
            base = np.repeat(items, reps)
            rank_in = np.arange(int(reps.sum()), dtype=np.int64) - np.repeat(np.cumsum(reps) - reps, reps)
            pos = base + rank_in * n
            self._cut(out, pos_pair, pos, g, None, 0)
            return self._checked(out, items, stop)
        spe = sched._steps(0)
        epochs = -(-stop // spe) if spe else 0
        end = spe * g if sched.tail != "keep" else n        # positions an epoch delivers
        for e in range(epochs):
            pos = order.positions_of(e, items)
            if sched.tail == "pad":
                # the last step is filled with positions wrapped to the epoch's start
                extra = pos + n < end
                pos = np.concatenate([pos, pos[extra] + n])
                pp = np.concatenate([pairs, pairs[extra]])
            else:
                pp = pairs
            keep = pos < end
            self._cut(out, pp[keep], pos[keep], g, e, e * spe, stop)
        return self._checked(out, items, stop)

    def _cut(self, out: list[Any], pairs: np.ndarray, pos: np.ndarray, g: int, epoch: int | None, first: int,
             stop: int | None = None) -> None:
        steps = pos // g + first
        idx = pos % g
        for p, s, i in zip(pairs.tolist(), steps.tolist(), idx.tolist(), strict=True):
            if stop is not None and s >= stop:
                continue
            w = self._world(s)
            out.append((p, s, i % w, i // w, epoch))

    def _checked(self, out: list[Any], items: np.ndarray, stop: int) -> list[Any]:
        """Occurrences in steps an exclusion may change, checked against the step as the
        loader plans it: the row may be gone, or moved up."""
        excl = self.loader._exclusions
        if excl is None or not excl.entries:
            return out
        first = min(e["from_step"] for e in excl.entries)
        kept = []
        for p, s, r, i, e in out:
            if s < first:
                kept.append((p, s, r, i, e))
                continue
            got, _ = self._planned(s, r, self._world(s))
            where = np.flatnonzero(got == items[p])
            if where.size:
                kept.append((p, s, r, int(where[0]), e))
        return kept

    def _scan_occurrences(self, items: np.ndarray, stop: int) -> list[tuple[int, int, int, int, int | None]]:
        """An order with no inverse (random draws): the steps before ``stop`` read one by one."""
        out = []
        for s in range(stop):
            w = self._world(s)
            for r in range(w):
                got, _ = self._planned(s, r, w)
                for p in np.flatnonzero(_isin(items, np.unique(got))).tolist():
                    for j in np.flatnonzero(got == items[p]).tolist():
                        out.append((p, s, r, j, None))
        return out

    def _walk_occurrences(self, items: np.ndarray, k: int, stop: int) -> list[tuple[int, int, int, int, int | None]]:
        """A mixture: its steps before ``stop`` walked once (its order is read in sequence),
        each step's samples of source ``k`` matched against ``items``."""
        sched = copy.deepcopy(self.loader.schedule)
        world0 = self._world(0)
        sched.rank, sched.world_size = 0, world0
        sched.batch_size = sched.global_batch_size // world0
        wanted = np.unique(items)
        pair_of = {int(v): [int(p) for p in np.flatnonzero(items == v)] for v in wanted.tolist()}
        out: list[tuple[int, int, int, int, int | None]] = []
        mix = copy.deepcopy(sched.mixture)
        for s in range(stop):
            g = sched.global_batch_at(s)
            src, its = mix.take_step(g)
            hit = np.flatnonzero((src == k) & _isin(its, wanted))
            if not hit.size:
                continue
            w = self._world(s)
            b = g // w
            excl = self.loader._exclusions
            mask = None if excl is None else excl.keep(s, its, src)
            if mask is not None:
                shares = mask.reshape(w, b)
                if not shares.any(axis=1).all():
                    continue
            for i in hit.tolist():
                r, j = divmod(i, b)
                if mask is not None:
                    if not mask[i]:
                        continue
                    j = int(mask[r * b:i].sum())
                for p in pair_of[int(its[i])]:
                    out.append((p, s, r, j, None))
        return out
