"""The trace of a run: what any step held, when any document was seen (see
:mod:`zerobatch.adapters.provenance`, whose run cards it reads).

``zerobatch trace CARD --step N`` and ``--document D`` call it."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from zerobatch.adapters._loader import BaseLoader
from zerobatch.adapters.provenance import _isin, _member_index, _members, _same_dataset, loader_from_card, read_card
from zerobatch.core.checks import check_count
from zerobatch.formats.errors import ConfigError

__all__ = ["Trace"]




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
        self.loader = loader_from_card(self.card, BaseLoader, load_state=False, num_threads=0)
        self.source = self.loader.source
        self.members = _members(self.source)
        self.worlds = [tuple(w) for w in self.card.get("world_sizes") or [[0, self.loader.world_size]]]
        state = self.card.get("state")
        self.position: int | None = None
        if state is not None:
            probe = loader_from_card(self.card, BaseLoader, num_threads=0, rank=0, world_size=self._world(0))
            self.position = probe.schedule.global_step
            probe.close()
        self._schedules: dict[tuple[int, int], Any] = {}

    def close(self) -> None:
        self.loader.close()

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def units(self, source: str | None = None) -> Any:
        """What numbers the documents of ``source`` (a mixture's source by name): a TOKSTREAM
        reader, or an LLMBATCH file's rows."""
        return self.members[_member_index(self.source, source)][1].units()

    @staticmethod
    def tokens(units: Any, start: int, stop: int) -> np.ndarray:
        """The tokens ``[start, stop)`` of a dataset (reads them)."""
        return units.window(int(start), int(stop - start))

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
        """A mixture, inverted: the counts at which source ``k`` took each item (its order's
        inverse, epoch after epoch of the source), then one compiled walk of the picks
        (:meth:`~zerobatch.samplers.MixtureOrder.skip_steps`) finding the sample that took
        each count: O(samples) at nanoseconds each, for any number of documents."""
        sched = self.loader.schedule
        fresh = copy.deepcopy(sched.mixture)
        sizes = sched.global_batches(0, stop)
        probe = copy.deepcopy(fresh)
        probe.skip_steps(sizes)
        size, order = fresh.sizes[k], fresh._orders[k]
        total = probe.consumed[k]                           # samples of source k before `stop`
        counts, pairs = [], []
        pair_ids = np.arange(items.size, dtype=np.int64)
        for e in range(-(-total // size)):
            c = e * size + order.positions_of(e, items)
            keep = c < total
            counts.append(c[keep])
            pairs.append(pair_ids[keep])
        if not counts:
            return []
        c = np.concatenate(counts)
        p = np.concatenate(pairs)
        # (an item holding several of the documents is one count for all of them)
        unique, back = np.unique(c, return_inverse=True)
        found = fresh.skip_steps(sizes, watch=k, counts=unique)[back]
        ends = np.cumsum(sizes)
        out: list[tuple[int, int, int, int, int | None]] = []
        excl = self.loader._exclusions
        first_excl = min((e["from_step"] for e in excl.entries), default=None) if excl is not None else None
        for pair, sample in zip(p.tolist(), found.tolist(), strict=True):
            if sample < 0:
                continue
            s = int(np.searchsorted(ends, sample, side="right"))
            i = sample - (int(ends[s - 1]) if s else 0)
            w = self._world(s)
            b = int(sizes[s]) // w
            r, j = divmod(i, b)
            if first_excl is not None and s >= first_excl:
                src, its = sched.whole_step(s)
                mask = excl.keep(s, its, src)
                if mask is not None:
                    if not mask[i] or not mask.reshape(w, b).any(axis=1).all():
                        continue
                    j = int(mask[r * b:i].sum())
            out.append((pair, s, r, j, None))
        return out
