"""TOKSTREAM as loader sources: next-token windows anywhere in the stream (with the
document-boundary outputs and per-token metadata on request), and whole documents padded to
a width."""

from __future__ import annotations

from typing import Any

import numpy as np

from zerobatch.adapters.sources._base import (CHUNK_BYTES, IGNORE_INDEX, Access, Array, ReadTicket, Source, Value,
                                              check_dataset, check_pad_id, check_position_dtype, check_seq_len,
                                              hinted_bytes, next_token_pair, open_reader)
from zerobatch.core import pad_rows
from zerobatch.core.checks import check_count
from zerobatch.formats.errors import ConfigError

__all__ = ["TokenDocuments", "TokenWindows"]


class TokenWindows(Source):
    """Windows of a TOKSTREAM dataset: window ``k`` is tokens ``[k * stride, k * stride + L)``.

    Args:
        reader: the dataset folder or an open :class:`~zerobatch.readers.tokstream.TokenStreamReader`.
        seq_len: tokens per training sequence.
        next_token: read ``seq_len + 1`` tokens and hand out ``(x, y)``, two views of one
            buffer (``x = w[:, :-1]``, ``y = w[:, 1:]``); else ``seq_len`` tokens.
        stride: tokens between window starts (default: ``seq_len``, so consecutive windows
            of next-token pairs share one token and every token is a target once).
        boundaries: also hand out the document-boundary outputs of the inputs:
            ``position_ids``, ``segment_ids``, ``cu_seqlens`` and ``max_seqlen``.
        metadata: also hand out ``metadata_ids`` (``int32`` per input token, -1 where none)
            and ``metadata`` (the distinct objects, decoded on access).
        position_dtype: ``int64`` or ``int32`` position ids.
        loss_mask: ``labels`` are ``-100`` where the dataset's loss mask (``convert --chat``)
            is off: only the tokens of the trained roles are targets.
        verify: check chunk checksums on first read.

    With ``boundaries``, ``metadata`` or ``loss_mask`` a step is a dict (``input_ids``,
    ``labels`` or ``input_ids`` alone, and the extras); otherwise the tokens, or the
    ``(x, y)`` pair.
    """

    token_arrays_only = True       # (int32 ids may cross to a device, widened there)

    kind = "tokstream-windows"
    item_name = "windows"

    def __init__(self, reader: Any, seq_len: int, *, next_token: bool = True, stride: int | None = None,
                 boundaries: bool = False, metadata: bool = False, position_dtype: Any = np.int64,
                 loss_mask: bool = False, verify: bool = True) -> None:
        super().__init__()
        from zerobatch.readers.tokstream import TokenStreamReader
        check_dataset(reader, "TokenWindows", ("tokstream",))
        self.reader = open_reader(reader, TokenStreamReader, verify=verify)
        self.label_mask = _loss_mask(self.reader, loss_mask, next_token)
        self.seq_len = check_seq_len(seq_len)
        self.next_token = bool(next_token)
        self.length = self.seq_len + 1 if self.next_token else self.seq_len
        self.stride = self.seq_len if stride is None else check_count(stride, "stride", minimum=1)
        self.boundaries = bool(boundaries)
        self.metadata = bool(metadata)
        self.position_dtype = check_position_dtype(position_dtype)
        self.stacked = not (self.boundaries or self.metadata or self.label_mask is not None)
        self.output = self._output()
        self.num_items = self.reader.num_windows(self.length, self.stride)
        self.fingerprint = self.reader.manifest.build_id


    @property
    def access(self) -> Access:
        return self.reader.access
    def geometry(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "stride": self.stride, "next_token": self.next_token}

    def units(self) -> Any:
        return self.reader

    def token_spans(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        starts = np.asarray(items, np.int64).reshape(-1) * self.stride
        return np.arange(starts.size, dtype=np.int64), starts, starts + self.length

    def items_at(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # window k holds [k * stride, k * stride + length): it meets [a, b) when
        # k * stride < b and k * stride + length > a
        a, b = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
        first = np.maximum((a - self.length) // self.stride + 1, 0)
        last = np.minimum((b - 1) // self.stride, self.num_items - 1)
        return _runs(first, np.maximum(last + 1, first))

    def _output(self) -> Any:
        tokens = next_token_pair() if self.next_token else Array("tokens")
        if self.stacked:
            return tokens
        out: dict[str, Any] = {}
        if self.boundaries:
            out.update(position_ids=Array("position_ids"), segment_ids=Array("segment_ids"),
                       cu_seqlens=Array("cu_seqlens"), max_seqlen=Value("max_seqlen"))
        if self.metadata:
            out.update(metadata_ids=Array("metadata_ids"), metadata=Value("metadata"))
        if self.next_token:
            out.update(input_ids=tokens[0], labels=Array("labels") if self.label_mask is not None else tokens[1])
        else:
            out["input_ids"] = tokens
        return out

    def chunk_steps(self, items_per_step: int) -> int:
        if not self.stacked:
            return 1
        return max(1, CHUNK_BYTES // (items_per_step * self.length * 8))

    def prepare(self, items: np.ndarray) -> int | None:
        """A dataset at a URL: the blocks of these windows fetched in the background, steps
        ahead of their read (the schedule is known)."""
        if not self.reader.access.fetched:
            return None
        self.reader.prefetch(self.reader.window_starts(items.reshape(-1), self.length, self.stride), self.length)
        return hinted_bytes(self.reader, items.size * self.length)

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any] | list[dict[str, Any]]:
        steps, per = items.shape
        reader, length = self.reader, self.length
        # window k starts at k * stride; the schedule's items are in [0, num_items), and the
        # kernel refuses a window outside the stream (an item past the last window starts
        # past num_tokens - length), so no check of the items is needed here
        starts = items.reshape(-1) * self.stride
        if self.stacked:
            out = self._buffer((steps * per, length), dtype)
            reader.read_into(starts, out)
            return {"tokens": out.reshape(steps, per, length)}
        result = []
        inputs = self.seq_len
        for s in range(steps):
            st = starts[s * per:(s + 1) * per]
            step: dict[str, Any] = {}
            # with the loss mask, the labels w[:, 1:] (-100 where it is off) come from the same
            # compiled read as the tokens
            extra: dict[str, Any] = {}
            if self.label_mask is not None:
                step["labels"] = np.empty((st.size, length - 1), dtype)
                extra = {"labels": step["labels"], "label_mask": self.label_mask, "ignore_id": IGNORE_INDEX}
            if self.boundaries:
                tokens, pos, seg, cu, longest = reader.windows_with_boundaries(
                    st, length, dtype=dtype, boundaries_length=inputs, position_dtype=self.position_dtype, **extra)
                step.update(tokens=tokens, position_ids=pos, segment_ids=seg, cu_seqlens=cu,
                            max_seqlen=int(longest))
            else:
                step["tokens"] = reader.windows(st, length, dtype=dtype, **extra)
            if self.metadata:
                meta = reader.windows_metadata(st, inputs)
                step.update(metadata_ids=meta.ids, metadata=meta.objects)
            result.append(step)
        return result

    def read_async(self, pool: Any, items: np.ndarray, dtype: np.dtype) -> Any:
        """A stacked read queued on ``pool`` through the reader's
        :meth:`~zerobatch.readers.tokstream.TokenStreamReader.read_async` (from mapped files,
        one compiled task: the gather and the checks of blocks read for the first time run
        without the GIL from start to finish); ``None`` for reads with per-step outputs."""
        if not self.stacked:
            return None
        steps, per = items.shape
        out = self._buffer((steps * per, self.length), dtype)
        ticket = self.reader.read_async(pool, items.reshape(-1) * self.stride, out)
        return ReadTicket(ticket, {"tokens": out.reshape(steps, per, self.length)})

    def close(self) -> None:
        self.reader.close()                  # and its loss-mask stream



def _runs(first: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(values, which)``: ``range(first[i], stop[i])`` for every ``i``, concatenated."""
    counts = np.maximum(stop - first, 0)
    which = np.repeat(np.arange(first.size, dtype=np.int64), counts)
    before = np.cumsum(counts) - counts
    values = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(before - first, counts)
    return values, which


def _documents_at(reader: Any, starts: np.ndarray, stops: np.ndarray,
                  width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(documents, which)``: the documents holding a token of each range ``[starts, stops)``
    (only their first ``width`` tokens counted, when a row holds no more)."""
    a, b = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
    keep = b > a
    first = np.zeros(a.size, np.int64)
    last = np.full(a.size, -1, np.int64)
    if keep.any():
        first[keep] = reader.documents_at(a[keep])
        last[keep] = reader.documents_at(b[keep] - 1)
    docs, which = _runs(first, last + 1)
    if width is not None and docs.size:
        d_start, _ = reader.document_spans(docs)
        inside = d_start + width > a[which]
        docs, which = docs[inside], which[inside]
    return docs, which


def _loss_mask(reader: Any, loss_mask: bool, next_token: bool) -> str | None:
    """``"loss_mask"``, the stream masking the labels of ``reader``'s chat dataset, when
    ``loss_mask`` (the dataset is checked to have it: the reader opens it now and keeps it,
    hinted and fetched with the tokens, read in the same compiled calls, closed with the
    reader); else None."""
    if not loss_mask:
        return None
    if not next_token:
        raise ConfigError("loss_mask: the mask turns off labels; it needs next_token=True", field="loss_mask")
    reader.stream("loss_mask")
    return "loss_mask"


class TokenDocuments(Source):
    """Whole documents of a TOKSTREAM dataset, one per row, padded or cut to ``width`` tokens.

    Args:
        reader: the dataset folder or an open reader.
        width: tokens per row (longer documents are cut).
        pad_id: the token written into padding.
        next_token: hand out ``input_ids = t[:, :-1]`` and ``labels = t[:, 1:]`` (padding
            labelled ``-100``, the ignore index of ``cross_entropy``); else ``input_ids``.
        loss_mask: ``labels`` are also ``-100`` where the dataset's loss mask
            (``convert --chat``) is off.

    Each step is a dict with ``input_ids``, ``attention_mask`` (bool) and, for next-token
    pairs, ``labels``.
    """

    token_arrays_only = True       # (int32 ids may cross to a device, widened there)

    kind = "tokstream-documents"
    item_name = "documents"

    def __init__(self, reader: Any, width: int, *, pad_id: int = 0, next_token: bool = True,
                 loss_mask: bool = False, verify: bool = True) -> None:
        super().__init__()
        from zerobatch.readers.tokstream import TokenStreamReader
        check_dataset(reader, "TokenDocuments", ("tokstream",))
        self.reader = open_reader(reader, TokenStreamReader, verify=verify)
        self.label_mask = _loss_mask(self.reader, loss_mask, next_token)
        self.width = check_count(width, "width", minimum=2 if next_token else 1)
        self.pad_id = check_pad_id(pad_id)
        self.next_token = bool(next_token)
        self.output = ({"input_ids": Array("tokens", slice(None, -1)), "labels": Array("labels", slice(1, None)),
                        "attention_mask": Array("mask", slice(None, -1))} if self.next_token else
                       {"input_ids": Array("tokens"), "attention_mask": Array("mask")})
        self.num_items = self.reader.num_documents
        self.fingerprint = self.reader.manifest.build_id


    @property
    def access(self) -> Access:
        return self.reader.access

    def units(self) -> Any:
        return self.reader

    def token_spans(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        flat = np.asarray(items, np.int64).reshape(-1)
        starts, stops = self.reader.document_spans(flat)
        return np.arange(flat.size, dtype=np.int64), starts, np.minimum(stops, starts + self.width)

    def items_at(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _documents_at(self.reader, starts, stops, self.width)

    def chunk_steps(self, items_per_step: int) -> int:
        return max(1, CHUNK_BYTES // (items_per_step * self.width * 9))

    def prepare(self, items: np.ndarray) -> int | None:
        """A dataset at a URL: these documents' blocks fetched in the background, steps ahead
        of their read (returns an upper bound of their bytes: ``width`` tokens each)."""
        if not self.reader.access.fetched:
            return None
        self.reader.prefetch(documents=items.reshape(-1), length=self.width)
        return hinted_bytes(self.reader, items.size * self.width)

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any]:
        steps, per = items.shape
        width, reader = self.width, self.reader
        flat = items.reshape(-1)
        starts, stops = reader.document_spans(flat)
        lengths = np.minimum(stops - starts, width)
        tokens = self._buffer((flat.size, width), dtype)
        labels = self._buffer((flat.size, width), dtype) if self.next_token else None
        # with the loss mask, the reads write each token's label (-100 where the mask is off)
        # in the same compiled pass as the tokens, and pad_rows only their padding
        own = labels if self.label_mask is not None else None
        extra: dict[str, Any] = {} if own is None else {"label_mask": self.label_mask, "label_shift": 0,
                                                         "ignore_id": IGNORE_INDEX}
        # One compiled gather of width tokens from every document's start (a short document's
        # row runs on into the next documents), then one compiled pass writing the padding over
        # the overrun, the mask and the labels. Rows of documents too near the end for a whole
        # window are copied one by one.
        fits = starts + width <= reader.num_tokens
        if reader.access.exact:
            # where a read costs its bytes (fetched ones), the overrun would cost too: each
            # document's own tokens, exactly
            inside = np.arange(width)[None, :] < lengths[:, None]
            values = None if own is None else np.empty(int(lengths.sum()), dtype)
            flat_tokens = reader.ranges(starts, starts + lengths, dtype=dtype, labels=values, **extra)
            tokens[inside] = flat_tokens
            if own is not None:
                own[inside] = values
        elif fits.all():
            reader.windows(starts, width, out=tokens, labels=own, **extra)
        else:
            rows = np.flatnonzero(fits)
            if rows.size:
                part = None if own is None else np.empty((rows.size, width), dtype)
                tokens[rows] = reader.windows(starts[rows], width, dtype=dtype, labels=part, **extra)
                if own is not None:
                    own[rows] = part
            for r in np.flatnonzero(~fits).tolist():
                n = int(lengths[r])
                if own is None:
                    tokens[r, :n] = reader.window(int(starts[r]), n, dtype=dtype)
                else:
                    reader.ranges([int(starts[r])], [int(starts[r]) + n], out=tokens[r, :n], labels=own[r, :n],
                                  **extra)
        mask = self._buffer((flat.size, width), np.dtype(np.bool_))
        pad_rows(tokens, lengths, self.pad_id, mask, labels, IGNORE_INDEX, label_values=own)
        out = {"tokens": tokens.reshape(steps, per, width), "mask": mask.reshape(steps, per, width)}
        if labels is not None:
            out["labels"] = labels.reshape(steps, per, width)
        return out

    def close(self) -> None:
        self.reader.close()                  # and its loss-mask stream
