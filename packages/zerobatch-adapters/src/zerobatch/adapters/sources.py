"""What a zerobatch loader reads: one :class:`Source` per way of cutting a dataset into items.

A source numbers its items ``0 .. num_items - 1`` (an LLMBATCH file's pre-formed batches, a
token stream's windows or documents, a record store's records), reads a step's items with
compiled, GIL-releasing gathers, and says how a step's arrays are handed to the training
loop (a tensor, next-token ``(x, y)`` views of one buffer, or a dict with the
document-boundary outputs and metadata). Sources are NumPy only; the PyTorch and JAX loaders
(:mod:`zerobatch.adapters.torch`, :mod:`zerobatch.adapters.jax`) convert what they return.

A read returns either one dict of arrays whose first axis is the step (``stacked``: every
step of the read has the same shapes) or a list of per-step dicts. Every source pickles as
its arguments, so loaders work in spawned worker processes.

- :class:`LLMBatchSource`: items are the file's ``[batch_size, seq_len]`` batches; the default
  order is the seed's block shuffle.
- :class:`LLMChunkSource`: items are the records of an LLMCHNK file, padded or cut to a row
  length chosen at read time;
- :class:`FeatureWindows`: items are windows of rows of a flat feature matrix;
- :class:`NpyTokenWindows`: items are next-token windows of a folder of ``.npy`` token files;
- :class:`TokenWindows`: items are windows of a TOKSTREAM dataset, optionally with the
  document-boundary outputs for variable-length attention and per-token metadata.
- :class:`TokenDocuments`: items are whole documents, padded (or cut) to a fixed width with
  an attention mask.
- :class:`RecordFields`: items are records of a ZRECORD store, by field.
- :class:`Mixture`: several sources interleaved in exact proportions.
"""

from __future__ import annotations

import copy
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from zerobatch.adapters._buffers import BufferPool
from zerobatch.core import pad_rows
from zerobatch.core.checks import check_count
from zerobatch.formats.errors import ConfigError, CorruptError
from zerobatch.samplers import (BlockShuffleOrder, GlobalRandomOrder, IndexOrder, IndexSampler, MixtureSampler,
                                MixtureSchedule, Schedule, SequentialOrder)

__all__ = ["FeatureWindows", "LLMBatchSource", "LLMChunkSource", "Mixture", "NpyTokenWindows", "RecordFields",
           "Source", "TokenDocuments", "TokenWindows"]

#: Bytes one read-ahead job fills when steps can be read together (amortizes the hand-off
#: between threads).
CHUNK_BYTES = 1 << 20

#: Label of tokens that are padding (the ``ignore_index`` of ``torch.nn.functional.cross_entropy``).
IGNORE_INDEX = -100


def xxh3_hex(data: bytes) -> str:
    from zerobatch.core import xxh3_64
    return f"{xxh3_64(data):016x}"


def _token_dtype(dtype: Any) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in (np.int64, np.int32):
        raise ConfigError(f"dtype must be int64 or int32, got {dt}", field="dtype")
    return dt


def _pad_id(value: Any) -> int:
    """A padding id: an integer that fits the int32 batches as well as the int64 ones."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not -2**31 <= int(value) < 2**31:
        raise ConfigError(f"pad_id must be an integer in [-2**31, 2**31), got {value!r}", field="pad_id")
    return int(value)


class Source(ABC):
    """Items a loader can read (see the module documentation).

    Attributes:
        kind: the source family, recorded in a loader's state.
        num_items: items in the source.
        fingerprint: identity of the data (a build id), checked when a state is loaded.
        rows_per_item: rows of the batch dimension one item fills (a pre-formed LLMBATCH
            batch fills ``batch_size`` rows, everything else one).
        stacked: every read returns one dict of arrays with a leading step axis.
    """

    kind: str = ""
    #: When set, a step is handed out as this one array (``emit`` returns ``step[passthrough]``).
    passthrough: str | None = None
    num_items: int = 0
    fingerprint: str = ""
    rows_per_item: int = 1
    stacked: bool = True

    def __init__(self) -> None:
        self._pools: dict[tuple[Any, ...], BufferPool] = {}
        self._pools_lock = threading.Lock()

    def default_order(self, shuffle: bool, seed: int) -> IndexOrder:
        """The order a loader uses unless given one: a Feistel shuffle, or ascending."""
        return GlobalRandomOrder(self.num_items, seed=seed) if shuffle else SequentialOrder(self.num_items)

    def schedule(self, batch_size: int, *, rank: int, world_size: int, shuffle: bool = True, seed: int = 0,
                 tail: str = "drop", order: IndexOrder | None = None, epoch: int = 0) -> Schedule:
        """The schedule a loader reads this source in: an
        :class:`~zerobatch.samplers.IndexSampler` of ``batch_size`` items per step on this
        rank over ``order`` (default :meth:`default_order`), with the source's fingerprint and
        kind checked when a state is loaded. An endless order keeps every step (no tail).

        Raises:
            ConfigError: an order over another number of items, or an argument out of range.
        """
        if order is None:
            order = self.default_order(shuffle, seed)
        elif not isinstance(order, IndexOrder) or order.num_items != self.num_items:
            raise ConfigError(f"order must be an IndexOrder over the source's {self.num_items} items", field="order")
        if not order.has_epochs:
            tail = "keep"
        return IndexSampler(order, batch_size, rank=rank, world_size=world_size, tail=tail, epoch=epoch,
                            fingerprint=self.fingerprint, label=self.kind)

    def chunk_steps(self, items_per_step: int) -> int:
        """Steps one read covers (1 for sources that read step by step)."""
        return 1

    def inline(self, dtype: np.dtype, items_per_step: int) -> bool:
        """True when a read costs nothing worth a thread (zero-copy views)."""
        return False

    def prepare(self, items: np.ndarray) -> None:  # noqa: B027 - optional hook, no-op by default
        """Called in order as reads are planned (read-ahead hints)."""

    #: ``read_async(pool, items, dtype)``: queue a compiled read on a
    #: :class:`~zerobatch.core.pool.TaskPool`, returning an object with ``wait()`` (the
    #: result) and ``cancel()``; sources without it are read on Python threads.
    read_async: Any = None

    @abstractmethod
    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any] | list[dict[str, Any]]:
        """Read ``items`` (``int64 (steps, items_per_step)``), on a worker thread."""

    @abstractmethod
    def emit(self, step: dict[str, Any]) -> Any:
        """What the loop receives for one step's arrays (NumPy, torch or JAX alike)."""

    def emit_stacked(self, arrays: dict[str, Any], unstack: Any) -> list[Any] | None:
        """All steps of a stacked read at once (``unstack(a)`` splits ``a`` along its first
        axis); ``None`` when the source emits step by step."""
        return None

    def _buffer(self, shape: tuple[int, ...], dtype: np.dtype, count: int = 24) -> np.ndarray:
        """A reusable output array (never one the training loop still holds)."""
        key = (shape, dtype.str)
        with self._pools_lock:
            pool = self._pools.get(key)
            if pool is None:
                if len(self._pools) > 16:
                    self._pools.clear()
                pool = self._pools[key] = BufferPool(shape, dtype, max_buffers=count)
        return pool.acquire()

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release the files."""

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_pools"] = {}
        d.pop("_pools_lock", None)
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._pools_lock = threading.Lock()


def _open(value: Any, cls: type, **kwargs: Any) -> Any:
    return value if isinstance(value, cls) else cls(value, **kwargs)


class LLMBatchSource(Source):
    """The pre-formed batches of an LLMBATCH file (``batch_size`` rows each).

    Args:
        path: the ``.batch`` file, or an open :class:`~zerobatch.readers.llmbatch.BatchFileReader`.
        block_size: batches per super-block of the default block-shuffle order.
        verify: check each batch's checksum the first time it is read.
    """

    kind = "llmbatch"
    passthrough = "tokens"

    def __init__(self, path: Any, *, block_size: int = 256, verify: bool = True) -> None:
        super().__init__()
        from zerobatch.readers.llmbatch import BatchFileReader
        self.reader = _open(path, BatchFileReader, verify=verify)
        self.block_size = check_count(block_size, "block_size", minimum=1)
        self.num_items = self.reader.num_batches
        self.fingerprint = self.reader.fingerprint
        self.rows_per_item = self.reader.batch_size
        self._shape = (self.reader.batch_size, self.reader.seq_len)
        self._advised: set[int] = set()

    def default_order(self, shuffle: bool, seed: int) -> IndexOrder:
        """The seed's block shuffle (:class:`~zerobatch.samplers.BlockShuffleOrder`)."""
        return BlockShuffleOrder(self.num_items, self.block_size, seed=seed, shuffle=shuffle)

    def chunk_steps(self, items_per_step: int) -> int:
        per_step = items_per_step * self._shape[0] * self._shape[1] * 8
        return max(1, CHUNK_BYTES // per_step)

    def inline(self, dtype: np.dtype, items_per_step: int) -> bool:
        return dtype == np.int32 and items_per_step == 1

    def prepare(self, items: np.ndarray) -> None:
        """``madvise(WILLNEED)`` each block of the file the first time a read reaches it."""
        bs = self.block_size
        first, last = int(items.flat[0]) // bs, int(items.flat[-1]) // bs
        blocks = (first,) if first == last else np.unique(items // bs).tolist()
        for b in blocks:
            if b not in self._advised:
                self._advised.add(b)
                self.reader.advise(b * bs, (b + 1) * bs)

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any] | list[dict[str, Any]]:
        steps, per = items.shape
        if self.inline(dtype, per):
            view = self.reader.read_batch_numpy
            return [{"tokens": view(int(i), dtype=np.int32)} for i in items[:, 0].tolist()]
        n = steps * per
        out = self._buffer((n, *self._shape), dtype)
        self.reader._slots.gather(items.reshape(-1), out)
        return {"tokens": out.reshape(steps, per * self._shape[0], self._shape[1])}

    def read_async(self, pool: Any, items: np.ndarray, dtype: np.dtype) -> Any:
        """Queue the read on ``pool`` (a compiled :class:`~zerobatch.core.pool.TaskPool`):
        the workers verify and convert with the GIL released from start to finish."""
        steps, per = items.shape
        out = self._buffer((steps * per, *self._shape), dtype)
        ticket = self.reader._slots.gather_async(pool, items.reshape(-1), out)
        return _Ticket(ticket, {"tokens": out.reshape(steps, per * self._shape[0], self._shape[1])})

    def emit(self, step: dict[str, Any]) -> Any:
        return step["tokens"]

    def close(self) -> None:
        self.reader.close()

    def __getstate__(self) -> dict[str, Any]:
        d = super().__getstate__()
        d["_advised"] = set()
        return d


class _Ticket:
    """A compiled read queued on a task pool, and the result it fills."""

    __slots__ = ("ticket", "result")

    def __init__(self, ticket: Any, result: Any) -> None:
        self.ticket, self.result = ticket, result

    def wait(self) -> Any:
        self.ticket.wait()
        return self.result

    def cancel(self) -> None:
        self.ticket.cancel()


class LLMChunkSource(Source):
    """The records of an LLMCHNK file, one per row, padded or cut to ``seq_len`` tokens (the
    batch size is chosen at read time).

    Args:
        path: the file or an open :class:`~zerobatch.readers.llmchnk.LLMChunkReader`.
        seq_len: tokens per row (default: the header's nominal length).
        pad_id: the id written after a short record.
        mask: hand out ``{"input_ids", "attention_mask"}`` (True on record tokens) instead of
            the token array alone.
        verify: check each record's checksum the first time it is read.
    """

    kind = "llmchnk"

    def __init__(self, path: Any, seq_len: int | None = None, *, pad_id: int = 0, mask: bool = False,
                 verify: bool = True) -> None:
        super().__init__()
        from zerobatch.readers.llmchnk import LLMChunkReader
        self.reader = _open(path, LLMChunkReader, verify=verify)
        width = self.reader.seq_len if seq_len is None else seq_len
        self.seq_len = check_count(width, "seq_len", minimum=1)
        self.pad_id = _pad_id(pad_id)
        self.mask = bool(mask)
        self.passthrough = None if self.mask else "tokens"
        self.num_items = self.reader.num_records
        self.fingerprint = self.reader.fingerprint

    def chunk_steps(self, items_per_step: int) -> int:
        return max(1, CHUNK_BYTES // (items_per_step * self.seq_len * 8))

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any]:
        steps, per = items.shape
        out = self._buffer((steps * per, self.seq_len), dtype)
        # The compiled gather writes the mask with the rows when given one.
        mask = self._buffer((steps * per, self.seq_len), np.dtype(np.bool_)) if self.mask else None
        tokens, mask = self.reader.gather(items.reshape(-1), out=out, pad_id=self.pad_id, mask=mask)
        result = {"tokens": tokens.reshape(steps, per, self.seq_len)}
        if self.mask:
            result["mask"] = mask.reshape(steps, per, self.seq_len)
        return result

    def emit(self, step: dict[str, Any]) -> Any:
        if self.mask:
            return {"input_ids": step["tokens"], "attention_mask": step["mask"]}
        return step["tokens"]

    def close(self) -> None:
        self.reader.close()


class NpyTokenWindows(Source):
    """Next-token windows of a folder of ``.npy`` token files (the seed's DatasetLoader data):
    window ``k`` of a file is its tokens ``[k*seq_len, k*seq_len + seq_len + 1)``; windows
    never cross from one file into the next. Files are memory-mapped, in sorted name order.

    Args:
        folder: the folder of 1-D ``.npy`` files (``uint16``, ``uint32``, ``int32``, ``int64``).
        seq_len: tokens per training sequence.
        next_token: hand out ``(x, y)`` (two views of one ``[B, seq_len + 1]`` buffer); else
            windows of ``seq_len`` tokens.
    """

    kind = "npy-windows"

    def __init__(self, folder: Any, seq_len: int, *, next_token: bool = True) -> None:
        super().__init__()
        from zerobatch.adapters.npy_folder import NpyTokenFolder
        self.seq_len = check_count(seq_len, "seq_len", minimum=1)
        self.next_token = bool(next_token)
        self.length = self.seq_len + 1 if self.next_token else self.seq_len
        self.files = NpyTokenFolder(folder, 1, self.seq_len, 0, 1, require_step=False)
        lengths = np.array(self.files.lengths, np.int64)
        counts = np.where(lengths >= self.length, (lengths - self.length) // self.seq_len + 1, 0)
        self._cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._starts = np.zeros(len(lengths), np.int64)
        self.num_items = int(self._cum[-1])
        self.fingerprint = xxh3_hex(repr(self.files.fingerprint()).encode())
        self.passthrough = None if self.next_token else "tokens"
        self._maps: list[np.ndarray] | None = None

    def chunk_steps(self, items_per_step: int) -> int:
        return max(1, CHUNK_BYTES // (items_per_step * self.length * 8))

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any]:
        from zerobatch.core import locate_windows
        steps, per = items.shape
        flat = items.reshape(-1)
        rows, files = np.empty(flat.size, np.int64), np.empty(flat.size, np.int64)
        locate_windows(self._cum, self._starts, self.seq_len, flat, rows, files)
        if self._maps is None:
            self._maps = [np.load(p, mmap_mode="r", allow_pickle=False) for p in self.files.paths]
        out = self._buffer((flat.size, self.length), dtype)
        for r, (f, row) in enumerate(zip(files.tolist(), rows.tolist(), strict=True)):
            np.copyto(out[r], self._maps[f][row:row + self.length], casting="unsafe")
        if out.size and int(out.min()) < 0:
            raise CorruptError("a negative token id in a window", path=self.files.folder, field="token")
        return {"tokens": out.reshape(steps, per, self.length)}

    def emit_stacked(self, arrays: dict[str, Any], unstack: Any) -> list[Any] | None:
        if not self.next_token:
            return None
        t = arrays["tokens"]
        return list(zip(unstack(t[:, :, :-1]), unstack(t[:, :, 1:]), strict=True))

    def emit(self, step: dict[str, Any]) -> Any:
        t = step["tokens"]
        return (t[:, :-1], t[:, 1:]) if self.next_token else t

    def __getstate__(self) -> dict[str, Any]:
        d = super().__getstate__()
        d["_maps"] = None
        return d


class FeatureWindows(Source):
    """Windows of a flat feature matrix (``zerobatch.readers.features``): ``W`` rows of one
    key, never crossing into the next, with the next ``horizon`` rows as the target.

    Args:
        folder: the dataset folder or an open :class:`~zerobatch.readers.features.FeatureMatrix`.
        window, stride, horizon: as for ``FeatureMatrix``.

    A step is ``x`` (``[B, W, features]`` floats), or ``(x, y)`` with a horizon. The loader's
    ``dtype`` (for token ids) does not apply: values keep the matrix's float type.
    """

    kind = "features"

    def __init__(self, folder: Any, window: int | None = None, *, stride: int = 1, horizon: int = 0,
                 verify: bool = True) -> None:
        super().__init__()
        from zerobatch.readers.features import FeatureMatrix
        if isinstance(folder, FeatureMatrix):
            self.matrix = folder
        else:
            if window is None:
                raise ConfigError("window: give the rows per window", field="window")
            self.matrix = FeatureMatrix(folder, window, stride=stride, horizon=horizon, verify=verify)
        self.horizon = self.matrix.horizon
        self.passthrough = None if self.horizon else "x"
        self.num_items = len(self.matrix)
        self.fingerprint = self.matrix.build_id

    def chunk_steps(self, items_per_step: int) -> int:
        m = self.matrix
        return max(1, CHUNK_BYTES // max(1, items_per_step * (m.window + m.horizon) * m._row_bytes))

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any]:
        steps, per = items.shape
        x, y = self.matrix.windows(items.reshape(-1))
        out = {"x": x.reshape(steps, per, *x.shape[1:])}
        if y is not None:
            out["y"] = y.reshape(steps, per, *y.shape[1:])
        return out

    def emit(self, step: dict[str, Any]) -> Any:
        return (step["x"], step["y"]) if self.horizon else step["x"]


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
        verify: check chunk checksums on first read.

    With ``boundaries`` or ``metadata`` a step is a dict (``input_ids``, ``labels`` or
    ``input_ids`` alone, and the extras); otherwise the tokens, or the ``(x, y)`` pair.
    """

    kind = "tokstream-windows"

    def __init__(self, reader: Any, seq_len: int, *, next_token: bool = True, stride: int | None = None,
                 boundaries: bool = False, metadata: bool = False, position_dtype: Any = np.int64,
                 verify: bool = True) -> None:
        super().__init__()
        from zerobatch.readers.tokstream import TokenStreamReader
        self.reader = _open(reader, TokenStreamReader, verify=verify)
        self.seq_len = check_count(seq_len, "seq_len", minimum=1)
        self.next_token = bool(next_token)
        self.length = self.seq_len + 1 if self.next_token else self.seq_len
        self.stride = self.seq_len if stride is None else check_count(stride, "stride", minimum=1)
        self.boundaries = bool(boundaries)
        self.metadata = bool(metadata)
        self.position_dtype = np.dtype(position_dtype)
        if self.position_dtype not in (np.int64, np.int32):
            raise ConfigError(f"position_dtype must be int64 or int32, got {self.position_dtype}",
                              field="position_dtype")
        self.stacked = not (self.boundaries or self.metadata)
        self.passthrough = "tokens" if self.stacked and not self.next_token else None
        self.num_items = self.reader.num_windows(self.length, self.stride)
        self.fingerprint = self.reader.manifest.build_id

    def chunk_steps(self, items_per_step: int) -> int:
        if not self.stacked:
            return 1
        return max(1, CHUNK_BYTES // (items_per_step * self.length * 8))

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any] | list[dict[str, Any]]:
        steps, per = items.shape
        reader, length = self.reader, self.length
        starts = reader.window_starts(items.reshape(-1), length, self.stride)
        if self.stacked:
            out = self._buffer((steps * per, length), dtype)
            reader.windows(starts, length, out=out)
            return {"tokens": out.reshape(steps, per, length)}
        result = []
        inputs = self.seq_len
        for s in range(steps):
            st = starts[s * per:(s + 1) * per]
            step: dict[str, Any] = {}
            if self.boundaries:
                tokens, pos, seg, cu, longest = reader.windows_with_boundaries(
                    st, length, dtype=dtype, boundaries_length=inputs, position_dtype=self.position_dtype)
                step.update(tokens=tokens, position_ids=pos, segment_ids=seg, cu_seqlens=cu,
                            max_seqlen=int(longest))
            else:
                step["tokens"] = reader.windows(st, length, dtype=dtype)
            if self.metadata:
                meta = reader.windows_metadata(st, inputs)
                step.update(metadata_ids=meta.ids, metadata=meta.objects)
            result.append(step)
        return result

    def emit_stacked(self, arrays: dict[str, Any], unstack: Any) -> list[Any] | None:
        if not (self.stacked and self.next_token):
            return None
        t = arrays["tokens"]
        return list(zip(unstack(t[:, :, :-1]), unstack(t[:, :, 1:]), strict=True))

    def emit(self, step: dict[str, Any]) -> Any:
        t = step["tokens"]
        if self.stacked:
            return (t[:, :-1], t[:, 1:]) if self.next_token else t
        out = dict(step)
        del out["tokens"]
        if self.next_token:
            out["input_ids"], out["labels"] = t[:, :-1], t[:, 1:]
        else:
            out["input_ids"] = t
        return out

    def close(self) -> None:
        self.reader.close()


class TokenDocuments(Source):
    """Whole documents of a TOKSTREAM dataset, one per row, padded or cut to ``width`` tokens.

    Args:
        reader: the dataset folder or an open reader.
        width: tokens per row (longer documents are cut).
        pad_id: the token written into padding.
        next_token: hand out ``input_ids = t[:, :-1]`` and ``labels = t[:, 1:]`` (padding
            labelled ``-100``, the ignore index of ``cross_entropy``); else ``input_ids``.

    Each step is a dict with ``input_ids``, ``attention_mask`` (bool) and, for next-token
    pairs, ``labels``.
    """

    kind = "tokstream-documents"

    def __init__(self, reader: Any, width: int, *, pad_id: int = 0, next_token: bool = True,
                 verify: bool = True) -> None:
        super().__init__()
        from zerobatch.readers.tokstream import TokenStreamReader
        self.reader = _open(reader, TokenStreamReader, verify=verify)
        self.width = check_count(width, "width", minimum=2 if next_token else 1)
        self.pad_id = _pad_id(pad_id)
        self.next_token = bool(next_token)
        self.num_items = self.reader.num_documents
        self.fingerprint = self.reader.manifest.build_id

    def chunk_steps(self, items_per_step: int) -> int:
        return max(1, CHUNK_BYTES // (items_per_step * self.width * 9))

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any]:
        steps, per = items.shape
        width, reader = self.width, self.reader
        flat = items.reshape(-1)
        starts, stops = reader.document_spans(flat)
        lengths = np.minimum(stops - starts, width)
        tokens = self._buffer((flat.size, width), dtype)
        # One compiled gather of width tokens from every document's start (a short document's
        # row runs on into the next documents), then one compiled pass writing the padding over
        # the overrun, the mask and the labels. Rows of documents too near the end for a whole
        # window are copied one by one.
        fits = starts + width <= reader.num_tokens
        if fits.all():
            reader.windows(starts, width, out=tokens)
        else:
            rows = np.flatnonzero(fits)
            if rows.size:
                tokens[rows] = reader.windows(starts[rows], width, dtype=dtype)
            for r in np.flatnonzero(~fits).tolist():
                n = int(lengths[r])
                tokens[r, :n] = reader.window(int(starts[r]), n, dtype=dtype)
        mask = self._buffer((flat.size, width), np.dtype(np.bool_))
        labels = self._buffer((flat.size, width), dtype) if self.next_token else None
        pad_rows(tokens, lengths, self.pad_id, mask, labels, IGNORE_INDEX)
        out = {"tokens": tokens.reshape(steps, per, width), "mask": mask.reshape(steps, per, width)}
        if labels is not None:
            out["labels"] = labels.reshape(steps, per, width)
        return out

    def emit(self, step: dict[str, Any]) -> Any:
        t, m = step["tokens"], step["mask"]
        if self.next_token:
            return {"input_ids": t[:, :-1], "labels": step["labels"][:, 1:], "attention_mask": m[:, :-1]}
        return {"input_ids": t, "attention_mask": m}

    def close(self) -> None:
        self.reader.close()


class RecordFields(Source):
    """Records of a ZRECORD store, by field.

    Args:
        store: the store folder or an open :class:`~zerobatch.readers.zrecord.ZRecordStore`.
        fields: the fields to read (default: all).
        pad_to: for variable-length fields, the row width of a padded ``[batch, pad_to]``
            array (longer records are cut) with a ``<field>_mask``; an int for every such
            field or a dict by field. Unpadded variable-length fields come as lists of arrays.
        pad_value: the value written into padding.
        token_fields: fields holding token ids: handed out in the loader's ``dtype``
            (``int64`` by default) instead of their stored type.

    Fixed-shape fields come as ``[batch, *shape]`` arrays (absent records are zeros). One
    field is handed out as itself, several as a dict by name. A store that grows after the
    loader was made keeps serving its first ``num_items`` records.
    """

    kind = "zrecord"

    def __init__(self, store: Any, fields: Sequence[str] | None = None, *, pad_to: int | dict[str, int] | None = None,
                 pad_value: int | float = 0, token_fields: Sequence[str] = (), num_threads: int = 1) -> None:
        super().__init__()
        from zerobatch.readers.zrecord import ZRecordStore
        self.store = _open(store, ZRecordStore, num_threads=num_threads)
        names = self.store.keys() if fields is None else list(fields)
        specs = {}
        for name in names:
            try:
                specs[name] = self.store.meta.field(name)
            except KeyError:
                raise ConfigError(f"fields: the store has no field {name!r} (it has {self.store.keys()})",
                                  path=self.store.path, field="fields") from None
        self.fields = names
        self._fixed = {n: s.shape is not None for n, s in specs.items()}
        self._dtypes = {n: s.np_dtype for n, s in specs.items()}
        if isinstance(pad_to, dict):
            unknown = sorted(set(pad_to) - set(names))
            if unknown:
                raise ConfigError(f"pad_to: {unknown[0]!r} is not a read field", field="pad_to")
            self.pad_to = {n: check_count(w, f"pad_to[{n}]", minimum=1) for n, w in pad_to.items()}
        elif pad_to is None:
            self.pad_to = {}
        else:
            w = check_count(pad_to, "pad_to", minimum=1)
            self.pad_to = {n: w for n in names if not self._fixed[n]}
        self.pad_value = pad_value
        self.token_fields = set(token_fields)
        unknown = sorted(self.token_fields - set(names))
        if unknown:
            raise ConfigError(f"token_fields: {unknown[0]!r} is not a read field", field="token_fields")
        self.stacked = all(self._fixed[n] or n in self.pad_to for n in names)
        self.passthrough = names[0] if self.stacked and len(names) == 1 and names[0] not in self.pad_to else None
        self.num_items = len(self.store)

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any] | list[dict[str, Any]]:
        steps, per = items.shape
        flat = items.reshape(-1)
        with self.store.gather(flat, self.fields) as batch:
            data: dict[str, Any] = {}
            for name in self.fields:
                value = batch[name]
                cast = dtype if name in self.token_fields else None
                if self._fixed[name]:
                    data[name] = value if cast is None else value.astype(cast)
                elif name in self.pad_to:
                    width = self.pad_to[name]
                    arr = np.full((flat.size, width), self.pad_value, dtype=cast or self._dtypes[name])
                    mask = np.zeros((flat.size, width), dtype=bool)
                    for row, rec in enumerate(value):
                        k = min(len(rec), width)
                        arr[row, :k] = rec[:k]
                        mask[row, :k] = True
                    data[name], data[f"{name}_mask"] = arr, mask
                else:
                    data[name] = [np.array(rec, dtype=cast) for rec in value]
        if self.stacked:
            return {k: v.reshape(steps, per, *v.shape[1:]) for k, v in data.items()}
        return [{k: v[s * per:(s + 1) * per] for k, v in data.items()} for s in range(steps)]

    def emit(self, step: dict[str, Any]) -> Any:
        if len(step) == 1:
            return next(iter(step.values()))
        return step

    def close(self) -> None:
        self.store.close()


class Mixture(Source):
    """Several sources interleaved in exact proportions (:class:`~zerobatch.samplers.MixtureSchedule`).

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
    """

    kind = "mixture"

    def __init__(self, sources: Sequence[tuple[Any, ...]], *, seed: int = 0, shuffle: bool = True) -> None:
        super().__init__()
        entries = []
        for i, entry in enumerate(sources):
            if not isinstance(entry, tuple) or len(entry) not in (2, 3):
                raise ConfigError(f"sources: each entry is (source, weight) or (name, source, weight), got {entry!r}",
                                  field="sources")
            name, source, weight = entry if len(entry) == 3 else (None, *entry)
            if not isinstance(source, Source) or isinstance(source, Mixture):
                raise ConfigError(f"sources: entry {i} is not a zerobatch source", field="sources")
            if not source.stacked:
                raise ConfigError(f"sources: {source.kind} source {i} reads step by step (boundaries, metadata "
                                  "or unpadded fields); a mixture needs stacked reads", field="sources")
            if name is None:
                name = f"{source.kind}:{source.fingerprint}" if source.fingerprint else f"source{i}"
            entries.append((name, source, weight))
        if not entries:
            raise ConfigError("sources: a mixture needs at least one source", field="sources")
        first = entries[0][1]
        for name, source, _ in entries[1:]:
            if type(source) is not type(first) or source.rows_per_item != first.rows_per_item:
                raise ConfigError(f"sources: {name!r} is a {source.kind} source; every source of a mixture must be "
                                  f"of one kind ({first.kind}) with the same rows per item", field="sources")
        self.names = [e[0] for e in entries]
        self.sources = [e[1] for e in entries]
        self.weights = [e[2] for e in entries]
        self.seed, self.shuffle = seed, shuffle
        self.mixture_schedule = MixtureSchedule([(n, s.num_items, w) for n, s, w in entries], seed=seed,
                                                shuffle=shuffle)
        self.num_items = sum(s.num_items for s in self.sources)
        self.fingerprint = ",".join(f"{n}={s.fingerprint}" for n, s in zip(self.names, self.sources, strict=True))
        self.rows_per_item = first.rows_per_item

    def schedule(self, batch_size: int, *, rank: int, world_size: int, shuffle: bool = True, seed: int = 0,
                 tail: str = "drop", order: IndexOrder | None = None, epoch: int = 0) -> Schedule:
        """A :class:`~zerobatch.samplers.MixtureSampler` over the mixture's schedule (the
        loader's ``shuffle``, ``seed`` and ``tail`` do not apply: the mixture has its own
        seed and no epochs).

        Raises:
            ConfigError: an ``order`` (each source has its own) or an epoch other than 0.
        """
        if order is not None:
            raise ConfigError("order: a mixture orders each source itself", field="order")
        if epoch:
            raise ConfigError("epoch: a mixture has no epochs", field="epoch")
        return MixtureSampler(copy.deepcopy(self.mixture_schedule), batch_size, rank=rank, world_size=world_size)

    def chunk_steps(self, items_per_step: int) -> int:
        return 1

    def read(self, items: np.ndarray, dtype: np.dtype, sources: np.ndarray | None = None) -> dict[str, Any]:
        if sources is None:
            raise ConfigError("a mixture is read with the source of every item", field="sources")
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

    def emit(self, step: dict[str, Any]) -> Any:
        return self.sources[0].emit(step)

    def close(self) -> None:
        for s in self.sources:
            s.close()


def open_source(value: Any, **kwargs: Any) -> Source:
    """A source for ``value``: a source as is, an LLMBATCH file path (``.batch``)."""
    if isinstance(value, Source):
        return value
    from zerobatch.readers.llmbatch import BatchFileReader
    if isinstance(value, BatchFileReader):
        return LLMBatchSource(value, **kwargs)
    if isinstance(value, (str, os.PathLike)) and os.path.isfile(value):
        return LLMBatchSource(value, **kwargs)
    raise ConfigError(f"source: expected a zerobatch source (LLMBatchSource, TokenWindows, TokenDocuments, "
                      f"RecordFields, Mixture) or a .batch file, got {value!r}", field="source")
