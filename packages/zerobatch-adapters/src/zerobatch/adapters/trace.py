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
            # the run's progress: the state loaded into a copy of the schedule
            probe = copy.deepcopy(self.loader.schedule)
            probe.load_state_dict(state)
            if getattr(probe, "offset", 0):
                raise ConfigError(f"global_batch_size: the run was resumed with a global batch of "
                                  f"{self.card.get('global_batch_size')} from a state of another one; its steps no "
                                  f"longer number as one run's and cannot be traced", field="global_batch_size")
            self.position = probe.global_step
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
            # a mixture is walked from its start (in one compiled walk of its picks), once for
            # every rank: rank 0's schedule stands at the step, each rank plans from a copy
            base = self._schedule(0, world)
            if base.global_step > step:
                base = self._schedule(0, world, fresh=True)
            if base.global_step < step:
                base.load_state_dict(base.advanced(step - base.global_step))
            sched = copy.copy(base)
            sched.rank = rank
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
        keep = lo < hi                                   # (an empty record holds no token)
        docs, span, lo, hi, ds, de = docs[keep], span[keep], lo[keep], hi[keep], ds[keep], de[keep]
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
        ``{"step", "epoch", "rank", "row", "item", "tokens", "row_offset"}`` (and ``source``
        for a mixture), in step order."""
        return self.documents([document], source=source, until=until)[0]

    def documents(self, documents: Sequence[int], *, source: str | None = None,
                  until: int | None = None) -> list[list[dict[str, Any]]]:
        """:meth:`document` for many documents at once (one pass over the inverse for all)."""
        occ = self.occurrences(documents, source=source, until=until)
        names = [n for n, _ in self.members]
        found: list[list[dict[str, Any]]] = [[] for _ in range(len(occ["query_size"]))]
        cols = [occ[k].tolist() for k in ("query", "step", "epoch", "rank", "row", "item", "start", "stop",
                                            "row_offset", "source")]
        for q, step, epoch, rank, row, item, a, b, off, k in zip(*cols, strict=True):
            rec = {"step": step, "epoch": None if epoch < 0 else epoch, "rank": rank, "row": row, "item": item,
                   "tokens": [a, b], "row_offset": off}
            if names[k] is not None:
                rec["source"] = names[k]
            found[q].append(rec)
        return found

    def occurrences(self, documents: Sequence[int], *, source: str | None = None,
                    until: int | None = None) -> dict[str, np.ndarray]:
        """The inverse as arrays (one entry per row a document's tokens entered), sorted by
        query, step, rank and row: ``query`` (the document's place in ``documents``),
        ``step``, ``epoch`` (-1: an endless run), ``rank``, ``row``, ``item``, ``start`` and
        ``stop`` (the document's tokens in that row, global positions), ``row_offset`` and
        ``source`` (a member's index). ``query_size``: ``len(documents)``.

        Raises:
            ConfigError: a document out of range, or an endless run without ``until``.
        """
        k0 = _member_index(self.source, source)
        units = self.members[k0][1].units()
        docs = np.asarray(list(documents), dtype=np.int64).reshape(-1)
        if docs.size and (docs.min() < 0 or docs.max() >= units.num_documents):
            raise ConfigError(f"document: outside the {units.num_documents} documents", field="document")
        stop = self._until(until)
        ds, de = units.document_spans(docs)
        per = self.source.rows_per_item
        parts = []
        for k in _same_dataset(self.source, k0):        # every source reading that dataset
            member = self.members[k][1]
            items, which = member.items_at(ds, de)
            if not items.size:
                continue
            pair, step, rank, index, epoch = self._occurrences(items, k, stop)
            # where each (item, document) pair's tokens sit in the item's rows
            p_pair, p_row, p_lo, p_hi, p_off = self._pair_parts(member, items, which, ds, de, per)
            order = np.argsort(p_pair, kind="stable")
            p_pair, p_row, p_lo, p_hi, p_off = (x[order] for x in (p_pair, p_row, p_lo, p_hi, p_off))
            first = np.searchsorted(p_pair, pair, side="left")
            count = np.searchsorted(p_pair, pair, side="right") - first
            hit = np.repeat(np.arange(pair.size), count)
            part = np.repeat(first - np.cumsum(count) + count, count) + np.arange(int(count.sum()))
            parts.append({"query": which[pair[hit]], "step": step[hit], "epoch": epoch[hit], "rank": rank[hit],
                          "row": index[hit] * per + p_row[part], "item": items[pair[hit]], "start": p_lo[part],
                          "stop": p_hi[part], "row_offset": p_off[part],
                          "source": np.full(hit.size, k, np.int64)})
        keys = ("query", "step", "epoch", "rank", "row", "item", "start", "stop", "row_offset", "source")
        out = {key: np.concatenate([p[key] for p in parts]) if parts else np.zeros(0, np.int64) for key in keys}
        order = np.lexsort((out["row"], out["rank"], out["step"], out["query"]))
        out = {key: v[order].astype(np.int64) for key, v in out.items()}
        out["query_size"] = np.zeros(docs.size, np.int8)
        return out

    @staticmethod
    def _pair_parts(member: Any, items: np.ndarray, which: np.ndarray, ds: np.ndarray, de: np.ndarray,
                    per: int) -> tuple[np.ndarray, ...]:
        """Per (item, document) pair and each of the item's spans holding the document's tokens:
        ``(pair, row of the item, start, stop, offset in the row)``."""
        w, a, b = member.token_spans(items)
        lens = b - a
        new_item = np.ones(w.size, bool)
        new_item[1:] = w[1:] != w[:-1]
        group_start = np.flatnonzero(new_item)
        group = np.cumsum(new_item) - 1
        if per > 1:                         # one span a row: the row is the span's place in the item
            row = np.arange(w.size) - group_start[group]
            base = np.zeros(w.size, np.int64)
        else:                               # every span in one row: the row offset runs on
            row = np.zeros(w.size, np.int64)
            ends = np.cumsum(lens)
            base = ends - lens - (ends - lens)[group_start][group]
        d = which[w]
        lo, hi = np.maximum(a, ds[d]), np.minimum(b, de[d])
        keep = lo < hi
        return w[keep], row[keep], lo[keep], hi[keep], (base + lo - a)[keep]

    def _worlds_at(self, steps: np.ndarray) -> np.ndarray:
        starts = np.asarray([w[0] for w in self.worlds], np.int64)
        sizes = np.asarray([w[1] for w in self.worlds], np.int64)
        return sizes[np.maximum(np.searchsorted(starts, steps, side="right") - 1, 0)]

    def _occurrences(self, items: np.ndarray, k: int, stop: int) -> tuple[np.ndarray, ...]:
        """``(pair, step, rank, row in the rank's share, epoch)`` of every time an item was
        read before ``stop`` (-1: no epochs)."""
        from zerobatch.samplers import IndexSampler
        sched = self.loader.schedule
        if isinstance(sched, IndexSampler):
            out = self._index_occurrences(sched, items, stop)
        else:
            out = self._walk_occurrences(items, k, stop)
        return self._checked(out, items, k)

    def _index_occurrences(self, sched: Any, items: np.ndarray, stop: int) -> tuple[np.ndarray, ...]:
        """An index order inverted: each item's position in every epoch before ``stop`` (the
        Feistel permutation's inverse), cut into step, rank and row."""
        order, g, n = sched.order, sched.global_batch_size, sched.order.num_items
        pairs = np.arange(items.size, dtype=np.int64)
        if not order.has_epochs:
            if order.kind != "sliding":
                return self._scan_occurrences(items, stop)
            # item i is at positions i, i + n, i + 2n, ...
            reps = np.maximum((stop * g - 1 - items) // n + 1, 0) if n else np.zeros_like(items)
            pp = np.repeat(pairs, reps)
            pos = np.repeat(items, reps) + n * (np.arange(int(reps.sum()), dtype=np.int64)
                                                 - np.repeat(np.cumsum(reps) - reps, reps))
            return self._cut(pp, pos, g, np.full(pp.size, -1, np.int64), 0, stop)
        spe = sched._steps(0)
        end = spe * g if sched.tail != "keep" else n        # positions an epoch delivers
        parts = []
        for e in range(-(-stop // spe) if spe else 0):
            pos = order.positions_of(e, items)
            pp = pairs
            if sched.tail == "pad":        # the last step filled with positions wrapped to the start
                extra = pos + n < end
                pos, pp = np.concatenate([pos, pos[extra] + n]), np.concatenate([pairs, pairs[extra]])
            keep = pos < end
            parts.append(self._cut(pp[keep], pos[keep], g, np.full(int(keep.sum()), e, np.int64), e * spe, stop))
        if not parts:
            return tuple(np.zeros(0, np.int64) for _ in range(5))
        return tuple(np.concatenate(col) for col in zip(*parts, strict=True))

    def _cut(self, pairs: np.ndarray, pos: np.ndarray, g: int, epochs: np.ndarray, first: int,
             stop: int) -> tuple[np.ndarray, ...]:
        steps = pos // g + first
        keep = steps < stop
        pairs, pos, steps, epochs = pairs[keep], pos[keep], steps[keep], epochs[keep]
        idx = pos % g
        w = self._worlds_at(steps)
        return pairs, steps, idx % w, idx // w, epochs

    def _checked(self, occ: tuple[np.ndarray, ...], items: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
        """Occurrences in steps an exclusion may change, checked against the step as the
        loader plans it: the row may be gone, or moved up."""
        excl = self.loader._exclusions
        if excl is None or not excl.entries:
            return occ
        pair, step, rank, index, epoch = (np.array(x) for x in occ)
        first = min(e["from_step"] for e in excl.entries)
        keep = np.ones(pair.size, bool)
        todo = np.flatnonzero(step >= first)
        for i in todo[np.argsort(step[todo], kind="stable")].tolist():     # in step order: one walk
            s, r = int(step[i]), int(rank[i])
            got, tags = self._planned(s, r, int(self._worlds_at(np.asarray([s]))[0]))
            match = got == items[pair[i]]
            if tags is not None:
                match &= tags == k
            where = np.flatnonzero(match)
            if where.size:
                index[i] = where[0]
            else:
                keep[i] = False
        return pair[keep], step[keep], rank[keep], index[keep], epoch[keep]

    def _scan_occurrences(self, items: np.ndarray, stop: int) -> tuple[np.ndarray, ...]:
        """An order with no inverse (random draws): the steps before ``stop`` read one by one."""
        out: list[tuple[int, int, int, int, int]] = []
        for s in range(stop):
            w = self._world(s)
            for r in range(w):
                got, _ = self._planned(s, r, w)
                for p in np.flatnonzero(_isin(items, np.unique(got))).tolist():
                    for j in np.flatnonzero(got == items[p]).tolist():
                        out.append((p, s, r, j, -1))
        cols = list(zip(*out, strict=True)) if out else [[] for _ in range(5)]
        return tuple(np.asarray(c, np.int64) for c in cols)

    def _walk_occurrences(self, items: np.ndarray, k: int, stop: int) -> tuple[np.ndarray, ...]:
        """A mixture, inverted: the counts at which source ``k`` took each item (its order's
        inverse, epoch after epoch of the source), then one compiled walk of the picks
        (:meth:`~zerobatch.samplers.MixtureOrder.skip_steps`) finding the sample that took
        each count: O(samples) at nanoseconds each, for any number of documents. (Exclusions
        are applied by :meth:`_checked`.)"""
        sched = self.loader.schedule
        fresh = copy.deepcopy(sched.mixture)
        sizes = sched.global_batches(0, stop)
        size, order = fresh.sizes[k], fresh._orders[k]
        # samples of source k before `stop`: the card's state has them at its position, else
        # one walk counts them
        saved = (self.card.get("state") or {}).get("mixture", {}).get("sources", {}).get(fresh.names[k], {})
        if stop == self.position and isinstance(saved.get("consumed"), int):
            total = saved["consumed"]
        else:
            probe = copy.deepcopy(fresh)
            probe.skip_steps(sizes)
            total = probe.consumed[k]
        counts, pairs = [], []
        pair_ids = np.arange(items.size, dtype=np.int64)
        for e in range(-(-total // size)):
            c = e * size + order.positions_of(e, items)
            keep = c < total
            counts.append(c[keep])
            pairs.append(pair_ids[keep])
        if not counts:
            return tuple(np.zeros(0, np.int64) for _ in range(5))
        c, p = np.concatenate(counts), np.concatenate(pairs)
        # (an item holding several of the documents is one count for all of them)
        unique, back = np.unique(c, return_inverse=True)
        sample = fresh.skip_steps(sizes, watch=k, counts=unique)[back]
        ok = sample >= 0
        p, sample = p[ok], sample[ok]
        ends = np.cumsum(sizes)
        step = np.searchsorted(ends, sample, side="right")
        i = sample - (ends[step] - sizes[step])
        w = self._worlds_at(step)
        b = sizes[step] // w
        return p, step, i // b, i % b, np.full(p.size, -1, np.int64)
