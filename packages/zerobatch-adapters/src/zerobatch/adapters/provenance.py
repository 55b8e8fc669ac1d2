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

__all__ = ["CARD_VERSION", "Exclusions", "card_or_none", "find_documents", "loader_from_card", "read_card", "run_card",
           "source_from_spec"]

#: Version of the run card layout.
CARD_VERSION = 1
#: The key marking a run card (its value: :data:`CARD_VERSION`).
CARD_KEY = "zerobatch_run_card"
#: Largest run card accepted from a file (a card is a few KiB; exclusions of many documents more).
MAX_CARD_BYTES = 1 << 28


# ---------------------------------------------------------------------------------------------
# specs: sources, orders and schedules as JSON


def _source_classes() -> dict[str, type]:
    from zerobatch.adapters import sources
    out = {}
    for name in sources.__all__:
        obj = getattr(sources, name)
        if isinstance(obj, type) and issubclass(obj, sources.Source) and obj is not sources.Source:
            out[name] = obj
    return out


def _from_json(value: Any, key: str = "") -> Any:
    """A run card's JSON value as a source's argument (:meth:`~zerobatch.adapters.sources.Source.spec`)."""
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


def card_or_none(loader: Any, state: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """:func:`run_card` for a checkpoint written by a trainer integration: ``None`` (and one
    warning) when the loader has no run card form (a source made of objects that are not
    readers, sources or weight schedules), so that checkpointing never fails for it."""
    try:
        return run_card(loader, state)
    except ConfigError as exc:
        if not getattr(loader, "_card_warned", False):
            import warnings
            warnings.warn(f"zerobatch: no run card in the checkpoint ({exc}); zerobatch trace will not read it",
                          RuntimeWarning, stacklevel=3)
            loader._card_warned = True
        return None


def read_card(card: Any) -> dict[str, Any]:
    """A run card: a dict, JSON text, the path of a JSON file or of a folder holding
    ``zerobatch_run_card.json``, or a file holding one anywhere inside (a trainer's
    ``trainer_state.json``, a torch checkpoint read with ``weights_only=True``): the first
    card found is taken.

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
            head = f.read(1)
        if head not in (b"{", b"[", b" ", b"\n", b"\t", b"\r"):
            card = _torch_checkpoint(path)        # a torch checkpoint holding the card (ckpt.pt, .ckpt)
        else:
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


def _torch_checkpoint(path: str) -> Any:
    """A torch checkpoint's contents, loaded with ``weights_only=True`` (tensors, dicts and
    plain values: no code runs)."""
    try:
        import torch
    except ImportError:
        raise ConfigError("not a JSON run card, and torch (to read a torch checkpoint) is not installed",
                          path=path, field="card") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:        # noqa: BLE001 - any unreadable file: one typed error
        raise ConfigError(f"neither a JSON run card nor a torch checkpoint holding one ({type(exc).__name__})",
                          path=path, field="card") from None


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


def loader_from_card(card: Any, cls: type, *, rank: int | None = None, world_size: int | None = None,
                     load_state: bool = True, **kwargs: Any) -> Any:
    """The loader a run card describes (``cls``: a loader class, as
    ``BaseLoader.from_card`` or the torch ``Loader.from_card`` call it), for
    ``rank`` of ``world_size`` (default: the environment's), with its exclusions and, unless
    ``load_state=False``, its state loaded: the run continues exactly. ``kwargs`` go to the
    loader (``prefetch``, ``num_threads``...).

    Raises:
        ConfigError: not a run card, or a source that cannot be opened again.
        StateError: the card's state does not fit the rebuilt loader (another dataset build).
    """
    card = read_card(card)
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
    if "dtype" in card and "dtype" not in kwargs and getattr(cls, "numpy_dtype_argument", False):
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
    """Which of ``values`` are in ``sorted_set`` (searched in sorted order: a step's items in a
    set of 500,000 in 40 us, not 320 us of cache misses)."""
    if sorted_set.size == 0 or values.size == 0:
        return np.zeros(values.shape, bool)
    flat = values.reshape(-1)
    order = np.argsort(flat, kind="stable")
    keys = flat[order]
    at = np.searchsorted(sorted_set, keys)
    hit = np.empty(flat.size, bool)
    hit[order] = sorted_set[np.minimum(at, sorted_set.size - 1)] == keys
    return hit.reshape(values.shape)


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


