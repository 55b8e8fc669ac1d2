"""Whole documents of a TOKSTREAM dataset packed into rows of exactly ``seq_len`` tokens
(``+ 1`` for next-token pairs), with the outputs of variable-length attention.

The plan (which pieces of which documents fill which row) is made once when the source opens,
by the compiled planner :func:`zerobatch.core.pack_plan` (GIL-free; asv's
``bench_packing.Plan.time_plan_1m_documents`` times it), from the documents in a Feistel
order of ``seed`` (or in dataset order), so it is the same in every process and every run: a
loader's state holds its position among the rows only, never a buffer. The loader then
shuffles, shards across ranks and resumes rows as it does windows (exact and elastic resume
included).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from zerobatch.adapters.sources._base import (CHUNK_BYTES, IGNORE_INDEX, Access, Array, ReadTicket, Source, Value,
                                              check_dataset, check_pad_id, check_position_dtype,
                                              check_seq_len, hinted_bytes)
from zerobatch.core import PACKING_ALGORITHMS, pack_plan, pack_rows
from zerobatch.core.checks import check_count
from zerobatch.formats.errors import ConfigError
from zerobatch.readers.base import Documents
from zerobatch.readers.llmchnk import RecordDocuments
from zerobatch.samplers import GlobalRandomOrder

if TYPE_CHECKING:
    from zerobatch.readers.tokstream import TokenStreamReader

__all__ = ["FlatDocuments", "PackedDocuments", "RecordDocuments"]


def open_documents(value: Any, verify: bool, source: str) -> Documents:
    """The :class:`~zerobatch.readers.base.Documents` of ``value``: a TOKSTREAM dataset's
    reader, or an LLMCHNK file's records (a path, URL or open reader); ``source``: the source
    opening it, named by the message of a path of another format."""
    from zerobatch.readers.llmchnk import LLMChunkReader
    from zerobatch.readers.tokstream import TokenStreamReader
    if isinstance(value, (TokenStreamReader, RecordDocuments)):
        return value
    if isinstance(value, LLMChunkReader):
        return value.documents()
    check_dataset(value, source, ("tokstream", "llmchnk"))
    if isinstance(value, (str, os.PathLike)):
        from zerobatch.readers.detect import find
        fmt = find(value)
        if fmt is not None and fmt.name == "llmchnk":
            return LLMChunkReader(value, verify=verify).documents()
    return TokenStreamReader(value, verify=verify)


def _no_mask_in_records(reader: Any, loss_mask: bool, split_at_turns: bool | None) -> None:
    if isinstance(reader, RecordDocuments) and (loss_mask or split_at_turns):
        field = "loss_mask" if loss_mask else "split_at_turns"
        raise ConfigError(f"{field}: an LLMCHNK file has no loss mask (convert chat data to TOKSTREAM with --chat)",
                          path=reader.path, field=field)


#: The label conventions a packed or flat source hands out (``layout=``).
LAYOUTS = ("next-token", "hf")


def resolve_layout(layout: str | None, next_token: bool, what: str) -> str:
    """``layout``, checked; ``None`` is ``"next-token"``, with a warning when Hugging Face
    ``transformers`` is loaded in this process: its models shift the labels themselves, so
    next-token labels given to ``model(**batch)`` or a ``Trainer`` train on the token after
    next, silently. Naming the layout silences it."""
    if layout is None:
        import sys
        if next_token and "transformers" in sys.modules:
            import warnings
            warnings.warn(f"{what}: labels are next-token (already shifted: labels[i] is the token after input_ids[i]); "
                          "Hugging Face models shift labels themselves and would train on the token after next. For "
                          "model(**batch) or a Trainer, pass layout='hf' (unshifted labels, cu_seq_lens_q/k, "
                          "max_length_q/k, as DataCollatorWithFlattening); layout='next-token' silences this",
                          UserWarning, stacklevel=3)
        return "next-token"
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {LAYOUTS}, got {layout!r}", field="layout")
    if layout == "hf" and not next_token:
        raise ConfigError("layout: 'hf' hands out labels; it needs next_token=True", field="layout")
    return layout


def _hf_output(position_ids: bool, cu_seqlens: bool) -> dict[str, Any]:
    """Hugging Face's key names (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``)."""
    out: dict[str, Any] = {"input_ids": Array("tokens"), "labels": Array("labels")}
    if position_ids:
        out["position_ids"] = Array("position_ids")
    if cu_seqlens:
        out.update(cu_seq_lens_q=Array("cu_seqlens"), cu_seq_lens_k=Array("cu_seqlens"),
                   max_length_q=Value("max_seqlen"), max_length_k=Value("max_seqlen"))
    return out


TURN_SCAN_TOKENS = 1 << 24
"""Loss-mask tokens read at once while looking for turn ends (64 MiB as int32)."""


def _greedy_cuts(ends: np.ndarray, n: int, cap: int) -> list[int]:
    """Cut points of a document of ``n`` tokens into pieces of at most ``cap``: each piece
    ends at the last of ``ends`` (sorted) it can reach, or at ``cap`` tokens when it reaches
    none."""
    cuts, pos = [], 0
    while n - pos > cap:
        j = int(np.searchsorted(ends, pos + cap, side="right")) - 1
        cut = int(ends[j]) if j >= 0 and ends[j] > pos else pos + cap
        cuts.append(cut)
        pos = cut
    return cuts


class PackedDocuments(Source):
    """Rows of whole documents of a TOKSTREAM dataset, packed without cutting them.

    Args:
        reader: the dataset folder (or URL), or an open
            :class:`~zerobatch.readers.tokstream.TokenStreamReader`; or an LLMCHNK file (path,
            URL or open :class:`~zerobatch.readers.llmchnk.LLMChunkReader`), whose records
            are the documents.
        seq_len: input tokens per row.
        next_token: rows of ``seq_len + 1`` tokens handed out as ``input_ids = row[:-1]`` and
            ``labels`` (the next token, ``-100`` where it is padding or, with
            ``mask_boundaries``, another document); else rows of ``seq_len`` tokens,
            ``input_ids`` alone.
        algorithm: ``"best-fit"`` (best-fit decreasing: each window's pieces longest first,
            each into the fullest row that still holds it; the least padding), ``"first-fit"``
            (each piece, in order, into the first row with room) or ``"concat"`` (documents
            back to back, cut at row ends: no padding, documents split).
        buffer: documents planned together (the look-ahead): more packs tighter.
        seed: the order the documents are packed in (a Feistel permutation; ``None``: the
            dataset's order). The loader shuffles the rows on top of it.
        pad_id: the token of padding.
        mask_boundaries: ``labels`` are ``-100`` where the next token starts another
            document (no document is trained to predict the next one's first token).
        position_dtype: ``int64`` or ``int32`` position ids.
        loss_mask: ``labels`` are also ``-100`` where the dataset's loss mask
            (``convert --chat``) is off: only the trained roles' tokens are targets.
        cu_seqlens: hand out ``cu_seqlens`` and ``max_seqlen``. Without them every step has
            the same shapes, so reads are stacked (several steps at once) and the source can
            go into a weighted :class:`Mixture` (attention kernels can take the boundaries
            from ``position_ids``, as Hugging Face's flash-attention path does).
        split_at_turns: cut a conversation longer than a row where a trained message ends
            (the loss mask of ``convert --chat`` turning off: the end of an assistant turn), so
            that each piece holds whole exchanges and no answer is parted from its prompt; a
            stretch of more than a row without such an end is cut at the row's end. ``None``
            (default): when ``loss_mask`` is on. Needs the dataset's loss mask.
        layout: the label convention. ``"next-token"`` (``None``, the default): ``labels``
            are already shifted (``labels[i]`` is the token after ``input_ids[i]``), for a
            loss taken directly (``cross_entropy(logits, labels)``: torchtitan, Megatron, a
            loop of your own). ``"hf"``: Hugging Face's convention, for ``model(**batch)``
            and ``Trainer``, whose models shift labels themselves: rows of ``seq_len``
            tokens, ``labels`` equal to ``input_ids`` but ``-100`` on padding, at each
            piece's first token and where the loss mask is off; keys ``input_ids``,
            ``labels``, ``position_ids`` and (with ``cu_seqlens``) ``cu_seq_lens_q``,
            ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``. Left at ``None`` while
            ``transformers`` is loaded, a warning says so.
        verify: check chunk checksums on first read.

    A document longer than a row is split, never dropped or truncated: its first tokens fill
    whole rows (or, with ``split_at_turns``, pieces end at turn ends), its rest is packed like
    a short document. Each step is a dict: ``input_ids``
    (and ``labels``), ``position_ids`` (restarting at 0 at each piece of a document),
    ``segment_ids`` (the piece's number in its row, ``-1`` on padding), ``attention_mask``
    (``False`` on padding), and for the inputs of the whole step ``cu_seqlens`` (``int32``
    starts of every piece, and of each row's padding, over the flattened batch, ending with
    ``batch x seq_len``) and ``max_seqlen``, as variable-length attention kernels take them.

    Attributes:
        padding: the fraction of row tokens that are padding over the plan.
        split_documents: documents cut over more than one row.
    """

    token_arrays_only = True       # (int32 ids may cross to a device, widened there)

    kind = "tokstream-packed"
    item_name = "rows"

    def __init__(self, reader: Any, seq_len: int, *, next_token: bool = True, algorithm: str = "best-fit",
                 buffer: int = 4096, seed: int | None = 0, pad_id: int = 0, mask_boundaries: bool = True,
                 position_dtype: Any = np.int64, loss_mask: bool = False, cu_seqlens: bool = True,
                 split_at_turns: bool | None = None, layout: str | None = None, verify: bool = True) -> None:
        super().__init__()
        from zerobatch.adapters.sources.tokstream import _loss_mask
        self.layout = resolve_layout(layout, bool(next_token), "PackedDocuments")
        self.reader: Documents = open_documents(reader, verify, "PackedDocuments")
        _no_mask_in_records(self.reader, loss_mask, split_at_turns)
        self.label_mask = _loss_mask(self.reader, loss_mask, next_token)
        self.seq_len = check_seq_len(seq_len)
        self.next_token = bool(next_token)
        # Hugging Face's layout: rows of seq_len tokens whose labels are their own tokens
        self.capacity = self.seq_len + 1 if self.next_token and self.layout == "next-token" else self.seq_len
        if algorithm not in PACKING_ALGORITHMS:
            raise ConfigError(f"algorithm must be one of {PACKING_ALGORITHMS}, got {algorithm!r}", field="algorithm")
        self.algorithm = algorithm
        self.buffer = check_count(buffer, "buffer", minimum=1)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ConfigError(f"seed must be a non-negative integer or None, got {seed!r}", field="seed")
        self.seed = None if seed is None else int(seed)
        self.pad_id = check_pad_id(pad_id)
        self.mask_boundaries = bool(mask_boundaries)
        self.position_dtype = check_position_dtype(position_dtype)
        self.with_cu_seqlens = bool(cu_seqlens)
        self.stacked = not self.with_cu_seqlens
        self.split_at_turns = bool(loss_mask) if split_at_turns is None else bool(split_at_turns)
        if self.split_at_turns and self.algorithm == "concat":
            raise ConfigError("split_at_turns: concat cuts documents at row ends by definition; use best-fit or "
                              "first-fit", field="split_at_turns")
        inputs = slice(None, -1) if self.capacity > self.seq_len else None
        if self.layout == "hf":
            self.output = _hf_output(True, self.with_cu_seqlens)
        else:
            self.output = {"input_ids": Array("tokens", inputs), "position_ids": Array("position_ids", inputs),
                           "segment_ids": Array("segment_ids", inputs), "attention_mask": Array("mask", inputs)}
            if self.with_cu_seqlens:
                self.output.update(cu_seqlens=Array("cu_seqlens"), max_seqlen=Value("max_seqlen"))
            if self.next_token:
                self.output["labels"] = Array("labels")
        self._plan()
        self.fingerprint = (f"{self.reader.build_id}:packed:{self.algorithm}:{self.capacity}:{self.buffer}:"
                            f"{'none' if self.seed is None else self.seed}{':turns' if self.split_at_turns else ''}")


    @property
    def access(self) -> Access:
        return self.reader.access
    def geometry(self) -> dict[str, Any]:
        """What decides the packing (the fingerprint holds it too, less readably)."""
        return {"seq_len": self.seq_len, "next_token": self.next_token, "layout": self.layout,
                "algorithm": self.algorithm, "buffer": self.buffer, "seed": self.seed,
                "split_at_turns": self.split_at_turns}

    def _plan(self) -> None:
        n = self.reader.num_documents
        starts, stops = self.reader.document_spans(np.arange(n, dtype=np.int64))
        order = (np.arange(n, dtype=np.int64) if self.seed is None or n < 2 else
                 GlobalRandomOrder(n, seed=self.seed).items(0, np.arange(n, dtype=np.int64)))
        starts, lengths = starts[order], (stops - starts)[order]
        # the planner's items: documents, or with split_at_turns the pieces of long ones
        item_start, item_len, item_doc = (self._turn_pieces(starts, lengths) if self.split_at_turns else
                                          (starts, lengths, None))
        row_ptr, piece_item, piece_offset, piece_len = pack_plan(item_len, self.capacity, self.buffer,
                                                                 self.algorithm)
        self.row_ptr = row_ptr
        self.piece_start = item_start[piece_item] + piece_offset
        self.piece_len = piece_len
        self.num_items = row_ptr.size - 1
        total = int(lengths.sum())
        self.padding = 1.0 - total / (self.num_items * self.capacity) if self.num_items else 0.0
        piece_doc = piece_item if item_doc is None else item_doc[piece_item]
        self.split_documents = int(np.count_nonzero(np.bincount(piece_doc, minlength=n) > 1))
        if self.num_items == 0:
            raise ConfigError("the dataset holds no tokens to pack", path=self.reader.path, field="documents")

    def _turn_pieces(self, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Documents longer than a row cut where a trained message ends (the loss mask going
        from 1 to 0), each piece as long as a row allows; ``(starts, lengths, document)`` of
        the pieces, in document order. Only the long documents' masks are read, in batches of
        at most :data:`TURN_SCAN_TOKENS`."""
        from zerobatch.readers.tokstream import open_loss_mask
        cap = self.capacity
        long_docs = np.flatnonzero(lengths > cap)
        reader = cast("TokenStreamReader", self.reader)        # (a chat dataset: _no_mask_in_records)
        mask = reader.stream(self.label_mask) if self.label_mask is not None else open_loss_mask(reader)
        cuts: dict[int, list[int]] = {}
        try:
            first = 0
            while first < long_docs.size:
                sizes = np.cumsum(lengths[long_docs[first:]])
                last = first + max(1, int(np.searchsorted(sizes, TURN_SCAN_TOKENS, side="right")))
                batch = long_docs[first:last]
                a, b = starts[batch], starts[batch] + lengths[batch]
                flat = mask.ranges(a, b, dtype=np.int32)
                at = 0
                for d, n in zip(batch.tolist(), lengths[batch].tolist(), strict=True):
                    m = flat[at:at + n]
                    at += n
                    ends = np.flatnonzero(m[:-1] > m[1:]) + 1     # a trained stretch ends here
                    cuts[d] = _greedy_cuts(ends, n, cap)
                first = last
        finally:
            if self.label_mask is None:
                mask.close()
        if long_docs.size == 0:
            return starts, lengths, np.arange(starts.size, dtype=np.int64)
        counts = np.ones(starts.size, np.int64)
        counts[long_docs] = [len(cuts[d]) + 1 for d in long_docs.tolist()]
        item_doc = np.repeat(np.arange(starts.size, dtype=np.int64), counts)
        offsets = np.zeros(item_doc.size, np.int64)
        item_len = np.repeat(lengths, counts)
        first_item = np.cumsum(counts) - counts
        for d in long_docs.tolist():
            edges = np.asarray([0, *cuts[d], int(lengths[d])], np.int64)
            k = int(first_item[d])
            offsets[k:k + edges.size - 1] = edges[:-1]
            item_len[k:k + edges.size - 1] = np.diff(edges)
        return starts[item_doc] + offsets, item_len, item_doc

    def __getstate__(self) -> dict[str, Any]:
        # a worker process plans again (deterministic, about 0.1 s per million documents)
        # rather than receiving the plan's arrays (24 bytes a piece) through a pipe
        d = super().__getstate__()
        for key in ("row_ptr", "piece_start", "piece_len", "_by_start"):
            d.pop(key, None)
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        super().__setstate__(d)
        self._plan()

    def units(self) -> Any:
        return self.reader

    def token_spans(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        starts, lens, which = self.pieces(items)
        return which.astype(np.int64), starts, starts + lens

    def items_at(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows holding a token of each range: the pieces are a partition of the
        dataset's tokens, so those meeting ``[a, b)`` are a run of the pieces sorted by
        start (the sort made once, 16 bytes a piece, on first use)."""
        from zerobatch.adapters.sources.tokstream import _runs
        by_start = self.__dict__.get("_by_start")
        if by_start is None:
            order = np.argsort(self.piece_start, kind="stable")
            by_start = self._by_start = (order, self.piece_start[order])
        order, sorted_starts = by_start
        a, b = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
        first = np.maximum(np.searchsorted(sorted_starts, a, side="right") - 1, 0)
        stop = np.searchsorted(sorted_starts, b, side="left")
        idx, which = _runs(first, np.maximum(stop, first))
        piece = order[idx]
        meets = (self.piece_start[piece] < b[which]) & (self.piece_start[piece] + self.piece_len[piece] > a[which])
        piece, which = piece[meets], which[meets]
        rows = np.searchsorted(self.row_ptr, piece, side="right").astype(np.int64) - 1
        return rows, which

    def pieces(self, rows: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(token starts, lengths, row of each piece)`` of ``rows``' pieces, row after row."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        a, b = self.row_ptr[rows], self.row_ptr[rows + 1]
        count = b - a
        which = np.repeat(np.arange(rows.size), count)
        before = np.cumsum(count) - count
        idx = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(before - a, count)
        return self.piece_start[idx], self.piece_len[idx], which

    def prepare(self, items: np.ndarray) -> int | None:
        """A dataset at a URL: these rows' tokens fetched in the background, steps ahead."""
        if not self.reader.access.fetched:
            return None
        starts, lens, _ = self.pieces(items)
        if lens.size:
            self.reader.prefetch(starts, stops=starts + lens)
        return hinted_bytes(self.reader, int(lens.sum()))

    def chunk_steps(self, items_per_step: int) -> int:
        if not self.stacked:
            return 1
        return max(1, CHUNK_BYTES // (items_per_step * self.capacity * 32))

    def read(self, items: np.ndarray, dtype: np.dtype) -> list[dict[str, Any]] | dict[str, Any]:
        if self.stacked:
            # every step's rows laid out at once; arrays with a leading step axis
            steps, per = items.shape
            out = self._step(items.reshape(-1), dtype)
            return {k: v.reshape(steps, per, *v.shape[1:]) for k, v in out.items() if isinstance(v, np.ndarray)
                    and k != "cu_seqlens"}
        return [self._step(items[s], dtype) for s in range(items.shape[0])]

    def _step(self, rows: np.ndarray, dtype: np.dtype) -> dict[str, Any]:
        cap, n = self.capacity, rows.size
        starts, lens, which = self.pieces(rows)
        values = None
        if self.label_mask is not None:
            # each token's label value (-100 where the loss mask is off) read in the same
            # compiled pass as the tokens; pack_rows lays the labels out from them
            values = np.empty(int(lens.sum()), dtype)
            flat = cast("TokenStreamReader", self.reader).ranges(starts, starts + lens, dtype=dtype, labels=values,
                                                                 label_mask=self.label_mask, label_shift=0,
                                                                 ignore_id=IGNORE_INDEX)
        else:
            flat = self.reader.ranges(starts, starts + lens, dtype=dtype)
        tokens = self._buffer((n, cap), dtype)
        seg = self._buffer((n, cap), np.dtype(np.int32))
        pos = self._buffer((n, cap), self.position_dtype)
        mask = self._buffer((n, cap), np.dtype(np.bool_))
        # next-token labels (cap - 1 a row), or Hugging Face's: the tokens themselves (the model
        # shifts them), -100 on padding and where a piece starts (no piece is trained to
        # continue the one before it), laid out by the same compiled pass
        labels = None
        if self.next_token:
            labels = self._buffer((n, cap) if self.layout == "hf" else (n, cap - 1), dtype)
        cu, longest = pack_rows(flat, lens, which, self.seq_len, tokens, seg, pos, mask, labels, pad_id=self.pad_id,
                                ignore_id=IGNORE_INDEX, mask_boundaries=self.mask_boundaries, label_values=values)
        out: dict[str, Any] = {"tokens": tokens, "segment_ids": seg, "position_ids": pos, "mask": mask,
                               "cu_seqlens": cu.copy(), "max_seqlen": longest}
        if labels is not None:
            out["labels"] = labels
        return out

    def close(self) -> None:
        self.reader.close()                  # and its loss-mask stream


class FlatDocuments(Source):
    """Whole documents of a TOKSTREAM dataset handed out flat, without padding: each step's
    documents back to back as one ``[1, T]`` row with ``cu_seqlens`` (the layout of Hugging
    Face's ``DataCollatorWithFlattening`` and of variable-length attention kernels).

    Args:
        reader: the dataset folder (or URL), or an open reader; or an LLMCHNK file, whose
            records are the documents (as for :class:`PackedDocuments`).
        token_budget: None: an item is a document, and the loader's ``batch_size`` counts
            documents per step. A number: an item is a group of whole documents holding at
            most this many tokens (planned as :class:`PackedDocuments` plans rows: best-fit
            decreasing over ``buffer`` documents in the Feistel order of ``seed``; a longer
            document is split into pieces of the budget), and ``batch_size`` counts groups:
            ``batch_size=1`` gives steps of at most ``token_budget`` tokens.
        algorithm, buffer, seed: the grouping with a ``token_budget`` (see
            :class:`PackedDocuments`).
        next_token: hand out ``labels`` (the next token of the same document, ``-100`` at
            each document's last token); else ``input_ids`` and the boundaries alone.
        position_ids: hand out ``position_ids`` (restarting at each document). ``False`` is
            the leaner layout for a model that takes ``cu_seqlens`` (variable-length
            attention kernels need no positions, or derive them on the device): the step then
            costs the gather alone, plus the labels when ``next_token`` (a copy).
        position_dtype: ``int64`` or ``int32`` position ids.
        loss_mask: ``labels`` are also ``-100`` where the dataset's loss mask is off.
        split_at_turns: with a ``token_budget``, a conversation longer than the budget is cut
            where a trained message ends (see :class:`PackedDocuments`); ``None``: when
            ``loss_mask`` is on.
        layout: the label convention. ``"next-token"`` (``None``, the default): ``labels``
            are already shifted (``[11,12,13,14,21,22,23]`` gives ``[12,13,14,-100,22,23,
            -100]``), for a loss taken directly. ``"hf"``: exactly what Hugging Face's
            ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` makes, for
            ``model(**batch)`` and ``Trainer`` (the model shifts): ``labels``
            ``[-100,12,13,14,-100,22,23]`` and the keys ``input_ids``, ``labels``,
            ``position_ids``, ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``,
            ``max_length_k``. Left at ``None`` while ``transformers`` is loaded, a warning
            says so.
        verify: check chunk checksums on first read.

    A step is a dict: ``input_ids`` ``[1, T]``, ``labels`` ``[1, T]``, ``position_ids``
    ``[1, T]`` (restarting at each document), ``cu_seqlens`` (``int32``, documents + 1 entries,
    ending with ``T``), ``max_seqlen`` and ``lengths`` (each document's tokens); with
    ``layout="hf"``, Hugging Face's keys instead. Each output is written once, in compiled
    code: the tokens by the gather (which checks the blocks it reads for the first time), the
    positions and labels by one pass over them (both layouts: Hugging Face's labels are the
    next-token labels one place later).
    """

    token_arrays_only = True       # (int32 ids may cross to a device, widened there)

    kind = "tokstream-flat"
    item_name = "documents"

    def __init__(self, reader: Any, token_budget: int | None = None, *, algorithm: str = "best-fit",
                 buffer: int = 4096, seed: int | None = 0, next_token: bool = True, position_ids: bool = True,
                 position_dtype: Any = np.int64, loss_mask: bool = False, split_at_turns: bool | None = None,
                 layout: str | None = None, verify: bool = True) -> None:
        super().__init__()
        from zerobatch.adapters.sources.tokstream import _loss_mask
        self.layout = resolve_layout(layout, bool(next_token), "FlatDocuments")
        self.reader: Documents = open_documents(reader, verify, "FlatDocuments")
        _no_mask_in_records(self.reader, loss_mask, split_at_turns)
        self.next_token = bool(next_token)
        self.label_mask = _loss_mask(self.reader, loss_mask, self.next_token)
        self.position_ids = bool(position_ids)
        self.position_dtype = check_position_dtype(position_dtype)
        self.stacked = False
        if self.layout == "hf":
            self.output = _hf_output(self.position_ids, True)
        else:
            self.output = {"input_ids": Array("tokens"), "cu_seqlens": Array("cu_seqlens"),
                           "max_seqlen": Value("max_seqlen"), "lengths": Array("lengths")}
            if self.position_ids:
                self.output["position_ids"] = Array("position_ids")
            if self.next_token:
                self.output["labels"] = Array("labels")
        self.token_budget = None if token_budget is None else check_count(token_budget, "token_budget", minimum=1)
        build_id = self.reader.build_id
        if self.token_budget is None:
            self.groups = None
            self.num_items = self.reader.num_documents
            self.fingerprint = build_id
        else:
            self.groups = PackedDocuments(self.reader, self.token_budget, next_token=False, algorithm=algorithm,
                                          buffer=buffer, seed=seed, split_at_turns=(
                                              bool(loss_mask) if split_at_turns is None else split_at_turns))
            self.num_items = self.groups.num_items
            self.fingerprint = self.groups.fingerprint.replace(":packed:", ":flat:")
            self.item_name = "groups of documents"
        if self.num_items == 0:
            raise ConfigError("the dataset holds no documents", path=self.reader.path, field="documents")


    @property
    def access(self) -> Access:
        return self.reader.access
    def geometry(self) -> dict[str, Any]:
        """The token budget and, with one, how documents are grouped under it."""
        if self.groups is None:
            return {"token_budget": None}
        g = self.groups.geometry()
        return {"token_budget": self.token_budget, **{k: g[k] for k in ("algorithm", "buffer", "seed",
                                                                        "split_at_turns")}}

    def units(self) -> Any:
        return self.reader

    def token_spans(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        flat = np.asarray(items, np.int64).reshape(-1)
        if self.groups is not None:
            return self.groups.token_spans(flat)
        starts, stops = self.reader.document_spans(flat)
        return np.arange(flat.size, dtype=np.int64), starts, stops

    def items_at(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.groups is not None:
            return self.groups.items_at(starts, stops)
        from zerobatch.adapters.sources.tokstream import _documents_at
        return _documents_at(self.reader, starts, stops)

    def _pieces(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.groups is not None:
            starts, lens, _ = self.groups.pieces(items)
            return starts, lens
        starts, stops = self.reader.document_spans(items)
        keep = stops > starts
        return starts[keep], (stops - starts)[keep]

    def prepare(self, items: np.ndarray) -> int | None:
        """A dataset at a URL: these documents' tokens fetched in the background, steps ahead."""
        if not self.reader.access.fetched:
            return None
        starts, lens = self._pieces(items.reshape(-1))
        if lens.size:
            self.reader.prefetch(starts, stops=starts + lens)
        return hinted_bytes(self.reader, int(lens.sum()))

    def read(self, items: np.ndarray, dtype: np.dtype) -> list[dict[str, Any]]:
        return [self._step(items[s], dtype) for s in range(items.shape[0])]

    def read_async(self, pool: Any, items: np.ndarray, dtype: np.dtype) -> Any:
        """One step queued on ``pool`` as one compiled task (a local dataset): the tokens
        gathered, their unchecked blocks checked, and the positions and labels (masked by the
        loss mask, read in the same task) written in one GIL-free pass over each document;
        ``None`` otherwise (the step is then read as a Python call)."""
        if items.shape[0] != 1 or not self.reader.access.tasks:
            return None
        starts, lens, step, tokens, pos, labels = self._outputs(items[0], dtype)
        ticket = self.reader.ranges_async(pool, starts, starts + lens, tokens, position_ids=pos, labels=labels,
                                          ignore_id=IGNORE_INDEX, **self._masked(labels))
        return ReadTicket(ticket, [step])

    def _masked(self, labels: Any) -> dict[str, Any]:
        """The reader's arguments masking ``labels`` with the loss mask (none without it: an
        LLMCHNK file's records take none)."""
        return {} if self.label_mask is None or labels is None else {"label_mask": self.label_mask}

    def _outputs(self, items: np.ndarray, dtype: np.dtype) -> tuple[Any, ...]:
        """A step's pieces and its outputs, allocated (pooled) but not filled."""
        starts, lens = self._pieces(items)
        cu = np.empty(lens.size + 1, np.int32)
        cu[0] = 0
        np.cumsum(lens, out=cu[1:])
        total = int(cu[-1])
        tokens = self._flat(total, dtype)
        pos = self._flat(total, self.position_dtype) if self.position_ids else None
        labels = None
        step: dict[str, Any] = {"tokens": tokens[None, :], "cu_seqlens": cu,
                                "max_seqlen": int(lens.max()) if lens.size else 0, "lengths": lens}
        if pos is not None:
            step["position_ids"] = pos[None, :]
        if self.next_token and self.layout == "hf":
            # Hugging Face's labels are the next-token labels one place later: the compiled
            # pass writes next-token labels into [1:], whose first document's end lands on the
            # second document's first place; the first place is -100
            buf = self._flat(total + 1, dtype)
            buf[0] = IGNORE_INDEX
            labels = buf[1:]
            step["labels"] = buf[None, :total]
        elif self.next_token:
            labels = self._flat(total, dtype)
            step["labels"] = labels[None, :]
        return starts, lens, step, tokens, pos, labels

    def _step(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any]:
        starts, lens, step, tokens, pos, labels = self._outputs(items, dtype)
        if tokens.size:
            # one compiled pass: tokens, checks, positions and labels (masked by the loss mask,
            # read in the same pass: both layouts, see _outputs)
            self.reader.ranges(starts, starts + lens, out=tokens, position_ids=pos, labels=labels,
                               ignore_id=IGNORE_INDEX, **self._masked(labels))
        return step

    def close(self) -> None:
        self.reader.close()                  # and its loss-mask stream
