"""TOKSTREAM window gathers: the twin of ``_tokstream.pyx``."""

from __future__ import annotations

from typing import Any

import numpy as np
from zerobatch.core.checks import (
    as_positions,
    check_count,
)
from zerobatch.formats.errors import ConfigError, CorruptError, OutOfRangeError

__all__ = ["WindowGather", "gather_windows"]


class WindowGather:
    """Twin of :class:`zerobatch.core._tokstream.WindowGather`."""

    def __init__(self, bases: Any, cum: Any, itemsize: int, token_size: int, vocab: int,
                 paths: Any = None, documents: Any = None, fds: Any = None, metadata_indexes: Any = None) -> None:
        self.args = (bases, cum, itemsize, token_size, vocab)
        self.paths = paths
        self.midx = None if metadata_indexes is None else [np.asarray(x, dtype=np.uint64) for x in metadata_indexes]
        self.total = int(np.asarray(cum)[-1])
        self.doc_starts = None
        if documents is not None:
            c = np.asarray(cum, dtype=np.int64)
            self.doc_starts = np.unique(np.concatenate(
                [c[k] + np.asarray(d, dtype=np.int64)[:-1] for k, d in enumerate(documents)] + [c[:-1]]))

    def gather_ranges(self, starts: Any, stops: Any, out: Any) -> np.ndarray:
        a, b = as_positions(starts, "starts"), as_positions(stops, "stops")
        if a.size != b.size:
            raise ConfigError("stops: one per start", field="stops")
        if a.size and ((a < 0).any() or (b < a).any() or (b > self.total).any()):
            raise OutOfRangeError(f"a range is not within [0, {self.total})")
        flat = out.reshape(-1)
        at = 0
        for x, y in zip(a.tolist(), b.tolist(), strict=True):
            if y > x:
                gather_windows(*self.args, [x], y - x, flat[at:at + y - x], paths=self.paths)
                at += y - x
        return out

    def boundaries(self, starts: Any, length: Any, position_ids: Any = None, segment_ids: Any = None,
                   cu_seqlens: Any = None, *, position_dtype: Any = np.int64,
                   segments: bool = True) -> tuple[np.ndarray, Any, np.ndarray, int]:
        if self.doc_starts is None:
            raise ConfigError("boundaries: this gatherer has no document indexes", field="documents")
        L = check_count(length, "length", minimum=1)
        st = as_positions(starts, "starts")
        if st.size and (st.min() < 0 or st.max() > self.total - L):
            raise OutOfRangeError(f"a window of {L} tokens falls outside [0, {self.total})")
        pos_ids = np.empty((st.size, L), dtype=np.int64)
        seg_ids = np.empty((st.size, L), dtype=np.int32)
        cu, maxlen = [], 0
        for w, p in enumerate(st.tolist()):
            cuts = [p] + [int(d) for d in self.doc_starts if p < d < p + L] + [p + L]
            for k in range(len(cuts) - 1):
                a, b = cuts[k], cuts[k + 1]
                pos_ids[w, a - p:b - p] = np.arange(b - a)
                seg_ids[w, a - p:b - p] = k
                cu.append(w * L + a - p)
                maxlen = max(maxlen, b - a)
        cu.append(st.size * L)
        cu_arr = np.array(cu, dtype=np.int32)
        for buf, val in ((position_ids, pos_ids), (segment_ids, seg_ids), (cu_seqlens, None)):
            if buf is not None and val is not None:
                buf.reshape(-1)[:] = val.reshape(-1)
        if cu_seqlens is not None:
            cu_seqlens.reshape(-1)[:cu_arr.size] = cu_arr
        if position_ids is None and position_dtype is None:
            return None, seg_ids if segments else None, cu_arr, maxlen
        pdt = position_ids.dtype if position_ids is not None else np.dtype(position_dtype)
        return pos_ids.astype(pdt), seg_ids if segments else None, cu_arr, maxlen

    def gather(self, starts: Any, length: Any, out: Any, pool: Any = None) -> np.ndarray:
        return gather_windows(*self.args, starts, length, out, paths=self.paths)

    def metadata_ids(self, starts: Any, length: Any, ids: Any = None, out: Any = None) -> tuple[np.ndarray, np.ndarray]:
        if self.midx is None:
            raise ConfigError("metadata_ids: this gatherer has no metadata indexes", field="metadata_indexes")
        L = check_count(length, "length")
        st = as_positions(starts, "starts")
        if st.size and (st.min() < 0 or st.max() > self.total - L):
            raise OutOfRangeError(f"a window of {L} tokens falls outside [0, {self.total})")
        if out is not None:
            self.gather(st, L, out)
        bases, cum, itemsize, token_size, _ = self.args
        c = np.asarray(cum, dtype=np.int64)
        mids = np.concatenate([_records(b, int(c[k + 1] - c[k]), itemsize, token_size)["metadata_id"]
                               for k, b in enumerate(bases)])
        res = np.empty((st.size, L), np.int32) if ids is None else ids
        numbers: dict[tuple[int, int], int] = {}
        for w, p in enumerate(st.tolist()):
            for k in range(L):
                m = int(mids[p + k])
                if m == 0xFFFFFFFF:
                    res[w, k] = -1
                    continue
                s = int(np.searchsorted(c, p + k, side="right") - 1)
                if m >= self.midx[s].size - 1:
                    raise CorruptError(f"metadata_id: the id at global position {p + k} is not below the shard's "
                                       f"{self.midx[s].size - 1} metadata blobs", field="metadata_id")
                res[w, k] = numbers.setdefault((s, m), len(numbers))
        table = np.array([(s, m, int(self.midx[s][m]), int(self.midx[s][m + 1])) for (s, m) in numbers],
                         dtype=np.int64).reshape(-1, 4)
        return res, table

    def gather_with_boundaries(self, starts: Any, length: Any, out: Any, bounds_length: Any = None,
                               position_ids: Any = None, segment_ids: Any = None, cu_seqlens: Any = None, *,
                               position_dtype: Any = np.int64, segments: bool = True) -> tuple:
        L = check_count(length, "length", minimum=1)
        BL = L - 1 if bounds_length is None else check_count(bounds_length, "bounds_length")
        if not 1 <= BL <= L:
            raise ConfigError(f"bounds_length must be in [1, {L}], got {BL}", field="bounds_length")
        self.gather(starts, L, out)
        return (out, *self.boundaries(starts, BL, position_ids, segment_ids, cu_seqlens,
                                      position_dtype=position_dtype, segments=segments))


def _records(base: Any, n: int, itemsize: int, token_size: int) -> np.ndarray:
    """A shard's records as a structured array (``token``, ``metadata_id``), from an address
    or a buffer."""
    import ctypes

    rec = np.dtype([("token", f"<u{token_size}"), ("metadata_id", "<u4")])
    if rec.itemsize != itemsize:
        raise ConfigError(f"itemsize {itemsize}: these records hold no metadata id", field="itemsize")
    if isinstance(base, (int, np.integer)):
        raw = (ctypes.c_uint8 * (n * itemsize)).from_address(int(base)) if n else b""
        return np.frombuffer(raw, dtype=rec, count=n)
    return np.frombuffer(base, dtype=rec, count=n)


def gather_windows(bases: Any, cum: Any, itemsize: int, token_size: int, vocab: int, starts: Any,
                   length: Any, out: Any, paths: Any = None) -> np.ndarray:
    """Twin of :func:`zerobatch.core._tokstream.gather_windows`; ``bases`` may also be a list
    of the shards' record buffers (NumPy arrays or bytes-like) instead of addresses."""
    import ctypes

    c = np.ascontiguousarray(cum, dtype=np.int64)
    ns = len(bases)
    if c.shape[0] != ns + 1 or ns < 1 or c[0] != 0 or (np.diff(c) < 0).any():
        raise ConfigError("cum must hold len(bases) + 1 non-decreasing cumulative counts from 0", field="cum")
    if itemsize not in (2, 4, 6, 8) or token_size not in (2, 4) or token_size > itemsize:
        raise ConfigError(f"itemsize {itemsize} / token_size {token_size} is not a record layout", field="itemsize")
    L = check_count(length, "length")
    st = as_positions(starts, "starts")
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable \
            or out.dtype not in (np.int64, np.int32) or out.size != st.size * L:
        raise ConfigError(f"out must be a writable C-contiguous int64 or int32 array of {st.size * L} elements",
                          field="out")
    total = int(c[-1])
    if st.size and (st.min() < 0 or st.max() > total - L):
        raise OutOfRangeError(f"a window of {L} tokens falls outside [0, {total})")
    if out.dtype == np.int32 and vocab > 2**31:
        raise ConfigError("out: int32 cannot hold every id of this vocabulary", field="out")
    rec = np.dtype([("token", f"<u{token_size}"), ("rest", f"V{itemsize - token_size}")]) \
        if itemsize > token_size else np.dtype(f"<u{token_size}")
    shards = []
    for s, base in enumerate(bases):
        n = int(c[s + 1] - c[s])
        if isinstance(base, (int, np.integer)):
            raw = (ctypes.c_uint8 * (n * itemsize)).from_address(int(base)) if n else b""
            arr = np.frombuffer(raw, dtype=rec, count=n)
        else:
            arr = np.frombuffer(base, dtype=rec, count=n)
        shards.append(arr["token"] if itemsize > token_size else arr)
    tokens = np.concatenate(shards) if shards else np.zeros(0, np.uint32)
    flat = out.reshape(-1)
    for w, pos in enumerate(st.tolist()):
        win = tokens[pos:pos + L]
        if win.size and int(win.max()) >= vocab:
            bad = pos + int(np.argmax(win >= vocab))
            shard = int(np.searchsorted(c, bad, side="right") - 1)
            raise CorruptError(f"token: the id at global position {bad} (record {bad - int(c[shard])} of shard "
                               f"{shard}) is not below the vocabulary size {vocab}",
                               path=None if paths is None else paths[shard], field="token")
        flat[w * L:(w + 1) * L] = win
    return out
