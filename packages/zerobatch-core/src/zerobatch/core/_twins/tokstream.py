"""TOKSTREAM window gathers: the twin of ``_tokstream.pyx``."""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import numpy as np

from zerobatch.core._twins.hash import xxh3_64
from zerobatch.core.checks import as_positions, check_count
from zerobatch.core.status import STATUS, raise_for_status
from zerobatch.formats.errors import ConfigError, CorruptError, OutOfRangeError

__all__ = ["BlockChecks", "WindowGather", "WindowTicket", "gather_windows"]


class BlockChecks:
    """Twin of :class:`zerobatch.core._tokstream.BlockChecks` (a lock where the kernel flips
    bytes atomically)."""

    def __init__(self, block_counts: Any, block_bytes: int = 1 << 24) -> None:
        if block_bytes < 1 or block_bytes & (block_bytes - 1):
            raise ConfigError("block_bytes must be a power of two", field="block_bytes")
        counts = [check_count(n, "block_counts") for n in block_counts]
        self.num_shards = len(counts)
        self.block_bytes = block_bytes
        self._maps = [np.zeros(max(n, 1), np.uint8) for n in counts]
        self._nblocks = counts
        self._digests: list[Any] = [None] * len(counts)
        self._list_hash = [0] * len(counts)
        self._lists = [False] * len(counts)
        self._pending = sum(counts)
        self._marks = threading.Lock()
        self._claims = [np.zeros(max(n, 1), np.uint8) for n in counts]
        self.lock = threading.Condition()

    def set_digests(self, shard: int, digests: Any, list_hash: int) -> None:
        if not 0 <= shard < self.num_shards:
            raise ConfigError(f"shard must be in [0, {self.num_shards}), got {shard}", field="shard")
        arr = np.asarray(digests)
        if arr.dtype != np.dtype("<u8") or arr.ndim != 1 or not arr.flags.c_contiguous \
                or arr.shape[0] != self._nblocks[shard]:
            raise ConfigError(f"digests must be a C-contiguous <u8 array of {self._nblocks[shard]} digests",
                              field="digests")
        self._digests[shard] = arr
        self._list_hash[shard] = check_count(list_hash, "list_hash", maximum=2**64 - 1)
        self._lists[shard] = False

    @property
    def ready(self) -> bool:
        return all(d is not None for d in self._digests)

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def addresses(self) -> np.ndarray:
        return np.array([m.ctypes.data for m in self._maps], dtype=np.uint64)

    def _block_range(self, shard: int, first: int, count: int) -> None:
        if not 0 <= shard < self.num_shards:
            raise ConfigError(f"shard must be in [0, {self.num_shards}), got {shard}", field="shard")
        if first < 0 or count < 0 or first + count > self._nblocks[shard]:
            raise ConfigError(f"blocks [{first}, {first + count}) are not blocks of shard {shard} "
                              f"({self._nblocks[shard]})", field="block")

    def checked(self, shard: int, block: int) -> bool:
        self._block_range(shard, block, 1)
        return bool(self._maps[shard][block])

    def mark(self, shard: int, first: int, count: int = 1) -> int:
        self._block_range(shard, first, count)
        with self._marks:
            m = self._maps[shard][first:first + count]
            n = int((m == 0).sum())
            m[:] = 1
            self._pending -= n
        return n

    def mark_shard(self, shard: int) -> int:
        return self.mark(shard, 0, self._nblocks[shard] if 0 <= shard < self.num_shards else 0)

    def _pairs(self, pairs: Any) -> np.ndarray:
        p = np.ascontiguousarray(pairs, dtype=np.int64).reshape(-1, 2)
        for s, b in p.tolist():
            if not 0 <= s < self.num_shards or not 0 <= b < self._nblocks[s]:
                raise ConfigError(f"block {b} of shard {s} is not a block of the dataset", field="block")
        return p

    def claim(self, pairs: Any) -> np.ndarray:
        p = self._pairs(pairs)
        out = np.zeros(p.shape[0], dtype=bool)
        with self._marks:
            for i, (s, b) in enumerate(p.tolist()):
                if not self._maps[s][b] and not self._claims[s][b]:
                    self._claims[s][b] = 1
                    out[i] = True
        return out

    def release(self, pairs: Any) -> None:
        with self._marks:
            for s, b in self._pairs(pairs).tolist():
                self._claims[s][b] = 0

    def mark_pairs(self, pairs: Any) -> int:
        return sum(self.mark(s, b) for s, b in self._pairs(pairs).tolist())

    def reset(self, shard: int) -> None:
        self._block_range(shard, 0, self._nblocks[shard] if 0 <= shard < self.num_shards else 0)
        with self._marks:
            m = self._maps[shard][:self._nblocks[shard]]
            self._pending += int((m != 0).sum())
            m[:] = 0

    def check(self, src: Any, shard: int, b0: int, b1: int, size: int, path: Any) -> None:
        """Every block of shard ``shard``'s ``tokens.bin`` under bytes ``[b0, b1)`` checked,
        reading its bytes from ``src`` (an address, a buffer or ``("fd", n)``), as the
        kernel's ``_check_blocks``."""
        block = self.block_bytes
        for k in range(b0 // block, (b1 - 1) // block + 1):
            if self._maps[shard][k]:
                continue
            if not self._lists[shard]:
                got = xxh3_64(self._digests[shard].tobytes())
                if got != self._list_hash[shard]:
                    raise_for_status(STATUS.ZB_E_CHECKSUM, f"checksums.bin: the chunk digests of tokens.bin hash to "
                                     f"{got:016x}, the manifest records {self._list_hash[shard]:016x}",
                                     field="tokens.bin.xxh3",
                                     path=None if path is None else os.path.join(os.path.dirname(path), "checksums.bin"))
                self._lists[shard] = True
            a = k * block
            n = min(a + block, size) - a
            got = xxh3_64(bytes(_piece(src, a, n, 1, path)))
            want = int(self._digests[shard][k])
            if got != want:
                raise_for_status(STATUS.ZB_E_CHECKSUM, f"tokens.bin: block {k} (bytes [{a}, {a + n})) does not match "
                                 f"its checksum ({got:016x}, expected {want:016x})", path=path, field="xxh3")
            self.mark(shard, k)


class WindowTicket:
    """Twin of :class:`zerobatch.core._tokstream.WindowTicket`: the gather as a Python call on
    the pool twin."""

    def __init__(self, call: Any) -> None:
        self.call = call

    def wait(self) -> Any:
        if self.call.done() and getattr(self.call, "_cancelled", False):
            raise ConfigError("wait: this gather was cancelled", field="ticket")
        return self.call.wait()

    def cancel(self, wait: bool = True) -> bool:
        return bool(self.call.cancel())


class WindowGather:
    """Twin of :class:`zerobatch.core._tokstream.WindowGather`; ``bases`` may also be a list of
    the shards' record buffers (NumPy arrays or bytes-like) instead of addresses, and a read
    given ``fds`` reads each shard whole with ``os.pread``."""

    def __init__(self, bases: Any, cum: Any, itemsize: int, token_size: int, vocab: int,
                 paths: Any = None, documents: Any = None, metadata_indexes: Any = None,
                 num_shards: Any = None, checks: BlockChecks | None = None) -> None:
        c = np.ascontiguousarray(cum, dtype=np.int64)
        ns = c.shape[0] - 1
        if bases is not None and len(bases) != ns:
            raise ConfigError("cum must hold len(bases) + 1 cumulative counts from 0", field="cum")
        if bases is None and num_shards != ns:
            raise ConfigError("without bases, num_shards must be len(cum) - 1", field="num_shards")
        if ns < 1 or c[0] != 0 or (np.diff(c) < 0).any():
            raise ConfigError("cum must hold num_shards + 1 non-decreasing cumulative counts from 0", field="cum")
        if itemsize not in (2, 4, 6, 8) or token_size not in (2, 4) or token_size > itemsize:
            raise ConfigError(f"itemsize {itemsize} / token_size {token_size} is not a record layout",
                              field="itemsize")
        self.bases, self.cum, self.itemsize, self.token_size, self.vocab = bases, c, itemsize, token_size, vocab
        self.paths = paths
        if checks is not None and (not isinstance(checks, BlockChecks) or checks.num_shards != ns
                                   or not checks.ready):
            raise ConfigError("checks: a BlockChecks with the digests of every shard", field="checks")
        self.checks = checks
        self.num_shards = ns
        self.midx = None if metadata_indexes is None else [np.asarray(x, dtype=np.uint64) for x in metadata_indexes]
        self.total = int(c[-1])
        self.doc_starts = None
        self.docs = None if documents is None else [np.asarray(d, dtype=np.uint64) for d in documents]
        if documents is not None:
            self.doc_starts = np.unique(np.concatenate(
                [c[k] + np.asarray(d, dtype=np.int64)[:-1] for k, d in enumerate(documents)] + [c[:-1]]))

    @property
    def num_documents(self) -> int:
        return 0 if self.docs is None else int(sum(d.size - 1 for d in self.docs))

    def document_spans(self, indices: Any, starts: Any = None, stops: Any = None) -> tuple[np.ndarray, np.ndarray]:
        if self.docs is None:
            raise ConfigError("document_spans: this gatherer has no document indexes", field="documents")
        idx = as_positions(indices, "indices")
        cum_docs = np.concatenate([[0], np.cumsum([d.size - 1 for d in self.docs])]).astype(np.int64)
        a = np.empty(idx.size, np.int64) if starts is None else starts
        b = np.empty(idx.size, np.int64) if stops is None else stops
        for out, name in ((a, "starts"), (b, "stops")):
            _check_buffer(out, np.int64, (idx.size,), name)
        n = int(cum_docs[-1])
        for i, d in enumerate(idx.tolist()):
            if not 0 <= d < n:
                raise OutOfRangeError(f"a document index is outside [0, {n}): {d}", field="indices")
            sh = int(np.searchsorted(cum_docs, d, side="right")) - 1
            local = d - int(cum_docs[sh])
            x, y = int(self.docs[sh][local]), int(self.docs[sh][local + 1])
            size = int(self.cum[sh + 1] - self.cum[sh])
            if not 0 <= x <= y <= size:
                raise CorruptError(f"documents.index[{local}:{local + 2}]: document {local} of shard {sh} is not a "
                                   f"span of its {size} tokens", field="documents.index",
                                   path=None if self.paths is None else
                                   os.path.join(os.path.dirname(self.paths[sh]), "documents.index"))
            a[i], b[i] = int(self.cum[sh]) + x, int(self.cum[sh]) + y
        return a, b

    def _shards(self, fds: Any) -> list[Any]:
        """Each shard's record source: a buffer or an address, or ``("fd", descriptor)``."""
        if fds is None:
            if self.bases is None:
                raise ConfigError("fds: this dataset is read through descriptors; pass the table", field="fds")
            return list(self.bases)
        table = np.asarray(fds)
        if table.size != self.num_shards:
            raise ConfigError(f"fds must be a writable C-contiguous int32 array of {self.num_shards} elements",
                              field="fds")
        return [("fd", int(fd)) for fd in table.tolist()]

    def unchecked_chunks(self, starts: Any, length: Any = None, stops: Any = None, checked: Any = None,
                         chunk_bytes: int = 1 << 24, cap: int = 256) -> np.ndarray:
        if checked is None:
            raise ConfigError("checked: the bitmaps' addresses are needed", field="checked")
        maps = np.asarray(checked, dtype=np.uint64)
        if maps.size != self.num_shards:
            raise ConfigError("checked: one bitmap per shard", field="checked")
        if chunk_bytes < 1 or chunk_bytes & (chunk_bytes - 1):
            raise ConfigError("chunk_bytes must be a power of two", field="chunk_bytes")
        st = as_positions(starts, "starts")
        if stops is None:
            sp = st + check_count(length, "length")
        else:
            sp = as_positions(stops, "stops")
            if sp.size != st.size:
                raise ConfigError("stops: one per start", field="stops")
        out: list[tuple[int, int]] = []
        for a, b in zip(st.tolist(), sp.tolist(), strict=True):
            if a < 0 or b > self.total or b <= a:
                continue
            while a < b:
                s = int(np.searchsorted(self.cum, a, side="right")) - 1
                e = min(b, int(self.cum[s + 1]))
                b0 = (a - int(self.cum[s])) * self.itemsize
                b1 = (e - int(self.cum[s])) * self.itemsize
                for c in range(b0 // chunk_bytes, (b1 - 1) // chunk_bytes + 1):
                    flag = ctypes.c_uint8.from_address(int(maps[s]) + c).value
                    if not flag and (s, c) not in out:
                        out.append((s, c))
                        if len(out) == cap:
                            return np.array(out, dtype=np.int64).reshape(-1, 2)
                a = e
        return np.array(out, dtype=np.int64).reshape(-1, 2)

    def gather_ranges(self, starts: Any, stops: Any, out: Any, fds: Any = None, position_ids: Any = None,
                      labels: Any = None, ignore_id: int = -100, *, mask: Any = None, mask_fds: Any = None,
                      label_shift: int = 1) -> np.ndarray:
        a, b = self._check_ranges(starts, stops, out, position_ids, labels, ignore_id, mask, mask_fds, label_shift)
        flat = out.reshape(-1)
        lab = None if labels is None else labels.reshape(-1)
        shards = self._shards(fds)
        mshards = None if mask is None else mask._shards(mask_fds)
        at = 0
        for x, y in zip(a.tolist(), b.tolist(), strict=True):
            if y > x:
                n = y - x
                _gather(shards, self.cum, self.itemsize, self.token_size, self.vocab, [x], n, flat[at:at + n],
                        self.paths, self.checks, None if lab is None else lab[at:at + n - label_shift], mask,
                        mshards, label_shift, ignore_id)
                if position_ids is not None:
                    position_ids[at:at + n] = np.arange(n)
                if lab is not None and label_shift == 1:
                    lab[at + n - 1] = ignore_id
                at += n
        return out

    def _check_ranges(self, starts: Any, stops: Any, out: Any, position_ids: Any, labels: Any,
                      ignore_id: int, mask: Any = None, mask_fds: Any = None,
                      label_shift: int = 1) -> tuple[np.ndarray, np.ndarray]:
        a, b = as_positions(starts, "starts"), as_positions(stops, "stops")
        if a.size != b.size:
            raise ConfigError("stops: one per start", field="stops")
        for x, y in zip(a.tolist(), b.tolist(), strict=True):
            if x < 0 or y < x or y > self.total:
                raise OutOfRangeError(f"range [{x}, {y}) is not within [0, {self.total})", field="starts")
        total = int((b - a).sum())
        _check_out(out, total)
        if position_ids is not None:
            if not isinstance(position_ids, np.ndarray) or position_ids.dtype not in (np.int64, np.int32):
                raise ConfigError(f"position_ids must be a writable C-contiguous int32 array of {total} elements",
                                  field="position_ids")
            _check_buffer(position_ids, position_ids.dtype, (total,), "position_ids")
        self._check_labels(labels, mask, mask_fds, out.dtype, total, label_shift, ignore_id)
        return a, b

    def _check_labels(self, labels: Any, mask: Any, mask_fds: Any, dtype: Any, n: int, shift: int,
                      ignore_id: int) -> None:
        """A read's labels (``n`` values of ``dtype``) and the stream masking them, as the
        compiled ``_labels``."""
        if labels is None:
            if mask is not None:
                raise ConfigError("mask: it masks labels; pass labels too", field="labels")
            return
        if shift not in (0, 1):
            raise ConfigError(f"label_shift must be 0 or 1, got {shift}", field="label_shift")
        if n < 0:
            raise ConfigError(f"label_shift {shift}: the windows are shorter than it", field="label_shift")
        if dtype == np.int32 and not -2**31 <= ignore_id < 2**31:
            raise ConfigError("ignore_id does not fit int32 labels", field="ignore_id")
        _check_buffer(labels, dtype, (n,), "labels")
        if mask is None:
            return
        if not isinstance(mask, WindowGather):
            raise ConfigError("mask: a WindowGather of the labels' stream", field="mask")
        if mask.num_shards != self.num_shards or not np.array_equal(mask.cum, self.cum):
            raise ConfigError("mask: the stream's shards do not hold the tokens' counts (a stream of another "
                              "dataset)", field="mask")
        if mask_fds is None and mask.bases is None:
            raise ConfigError("mask_fds: the labels' stream is read through descriptors; pass its table",
                              field="mask_fds")

    def gather_ranges_async(self, pool: Any, starts: Any, stops: Any, out: Any, position_ids: Any = None,
                            labels: Any = None, ignore_id: int = -100, *, mask: Any = None,
                            label_shift: int = 1) -> WindowTicket:
        if self.bases is None:
            raise ConfigError("gather_ranges_async: this dataset is read through descriptors", field="fds")
        a, b = self._check_ranges(starts, stops, out, position_ids, labels, ignore_id, mask, None, label_shift)
        return WindowTicket(pool.call(lambda: self.gather_ranges(a, b, out, position_ids=position_ids, labels=labels,
                                                                 ignore_id=ignore_id, mask=mask,
                                                                 label_shift=label_shift)))

    def boundaries(self, starts: Any, length: Any, position_ids: Any = None, segment_ids: Any = None,
                   cu_seqlens: Any = None, *, position_dtype: Any = np.int64,
                   segments: bool = True) -> tuple[Any, Any, np.ndarray, int]:
        if self.doc_starts is None:
            raise ConfigError("boundaries: this gatherer has no document indexes", field="documents")
        L = check_count(length, "length", minimum=1)
        st = as_positions(starts, "starts")
        if st.size and (st.min() < 0 or st.max() > self.total - L):
            raise OutOfRangeError(f"a window of {L} tokens falls outside [0, {self.total})", field="starts")
        if st.size * L >= 2**31:
            raise ConfigError(f"boundaries: {st.size} x {L} tokens do not fit int32 cu_seqlens", field="length")
        pos_ids = np.empty((st.size, L), dtype=np.int64)
        seg_ids = np.empty((st.size, L), dtype=np.int32)
        cu, maxlen = [], 0
        for w, p in enumerate(st.tolist()):
            inside = self.doc_starts[(self.doc_starts > p) & (self.doc_starts < p + L)].tolist()
            cuts = [p, *inside, p + L]
            for k in range(len(cuts) - 1):
                a, b = cuts[k], cuts[k + 1]
                pos_ids[w, a - p:b - p] = np.arange(b - a)
                seg_ids[w, a - p:b - p] = k
                cu.append(w * L + a - p)
                maxlen = max(maxlen, b - a)
        cu.append(st.size * L)
        cu_arr = np.array(cu, dtype=np.int32)
        pdt = None
        if position_ids is not None:
            if not isinstance(position_ids, np.ndarray):
                raise ConfigError("position_ids must be a NumPy array", field="position_ids")
            pdt = position_ids.dtype
        elif position_dtype is not None:
            pdt = np.dtype(position_dtype)
        if pdt is not None and pdt not in (np.int64, np.int32):
            raise ConfigError(f"position_ids must be int64 or int32, got {pdt}", field="position_ids")
        pos = None
        if pdt is not None:
            pos = pos_ids.astype(pdt) if position_ids is None else position_ids
            if position_ids is not None:
                _check_buffer(position_ids, pdt, (st.size, L), "position_ids")
                position_ids[...] = pos_ids
        seg = None
        if segments:
            seg = seg_ids if segment_ids is None else segment_ids
            if segment_ids is not None:
                _check_buffer(segment_ids, np.int32, (st.size, L), "segment_ids")
                segment_ids[...] = seg_ids
        if cu_seqlens is not None:
            _check_buffer(cu_seqlens, np.int32, (st.size * L + 1,), "cu_seqlens")
            cu_seqlens[:cu_arr.size] = cu_arr
            cu_arr = cu_seqlens[:cu_arr.size]
        return pos, seg, cu_arr, maxlen

    def gather(self, starts: Any, length: Any, out: Any, pool: Any = None, fds: Any = None, *, labels: Any = None,
               mask: Any = None, mask_fds: Any = None, label_shift: int = 1, ignore_id: int = -100) -> np.ndarray:
        if labels is None and mask is None:
            return gather_windows(self._shards(fds), self.cum, self.itemsize, self.token_size, self.vocab, starts,
                                  length, out, paths=self.paths, checks=self.checks)
        L = check_count(length, "length")
        st = as_positions(starts, "starts")
        shards = self._shards(fds)
        _check_out(out, st.size * L)
        self._check_labels(labels, mask, mask_fds, out.dtype, st.size * (L - label_shift), label_shift, ignore_id)
        return _gather(shards, self.cum, self.itemsize, self.token_size, self.vocab, st, L, out, self.paths,
                       self.checks, labels, mask, None if mask is None else mask._shards(mask_fds), label_shift,
                       ignore_id)

    def gather_async(self, pool: Any, starts: Any, length: Any, out: Any, *, labels: Any = None, mask: Any = None,
                     label_shift: int = 1, ignore_id: int = -100) -> WindowTicket:
        if self.bases is None:
            raise ConfigError("gather_async: this dataset is read through descriptors", field="fds")
        L = check_count(length, "length")
        st = as_positions(starts, "starts")
        _check_out(out, st.size * L)
        if labels is not None or mask is not None:
            self._check_labels(labels, mask, None, out.dtype, st.size * (L - label_shift), label_shift, ignore_id)
        return WindowTicket(pool.call(lambda: self.gather(st, L, out, labels=labels, mask=mask,
                                                          label_shift=label_shift, ignore_id=ignore_id)))

    def metadata_ids(self, starts: Any, length: Any, ids: Any = None, out: Any = None,
                     fds: Any = None) -> tuple[np.ndarray, np.ndarray]:
        if self.midx is None:
            raise ConfigError("metadata_ids: this gatherer has no metadata indexes", field="metadata_indexes")
        L = check_count(length, "length")
        st = as_positions(starts, "starts")
        if st.size and (st.min() < 0 or st.max() > self.total - L):
            raise OutOfRangeError(f"a window of {L} tokens falls outside [0, {self.total})", field="starts")
        shards = self._shards(fds)
        if out is not None:
            gather_windows(shards, self.cum, self.itemsize, self.token_size, self.vocab, st, L, out,
                           paths=self.paths, checks=self.checks)
        elif self.checks is not None:
            for p in st.tolist():
                for s, first, n in _pieces(self.cum, p, L):
                    self.checks.check(shards[s], s, first * self.itemsize, (first + n) * self.itemsize,
                                      int(self.cum[s + 1] - self.cum[s]) * self.itemsize,
                                      None if self.paths is None else self.paths[s])
        c = self.cum
        res = np.empty((st.size, L), np.int32) if ids is None else ids
        if ids is not None:
            _check_buffer(ids, np.int32, (st.size, L), "ids")
        numbers: dict[tuple[int, int], int] = {}
        for w, p in enumerate(st.tolist()):
            mids = np.concatenate([_records(shards[s], n, self.itemsize, self.token_size, first)["metadata_id"]
                                   for s, first, n in _pieces(c, p, L)]) if L else np.zeros(0, np.uint32)
            for k in range(L):
                m = int(mids[k])
                if m == 0xFFFFFFFF:
                    res[w, k] = -1
                    continue
                s = int(np.searchsorted(c, p + k, side="right") - 1)
                if m >= self.midx[s].size - 1:
                    raise CorruptError(f"metadata_id: the id at global position {p + k} (record {p + k - int(c[s])} "
                                       f"of shard {s}) is not below the shard's {self.midx[s].size - 1} metadata "
                                       f"blobs", path=None if self.paths is None else self.paths[s],
                                       field="metadata_id")
                res[w, k] = numbers.setdefault((s, m), len(numbers))
        rows = []
        for s, m in numbers:
            idx = self.midx[s]
            a, b, end = int(idx[m]), int(idx[m + 1]), int(idx[-1])
            if a > b or b > end:
                raise CorruptError(f"metadata.index[{m}:{m + 2}]: [{a}, {b}) is not a range of metadata.bin's "
                                   f"{end} bytes", field="metadata.index",
                                   path=None if self.paths is None else
                                   os.path.join(os.path.dirname(self.paths[s]), "metadata.index"))
            rows.append((s, m, a, b))
        return res, np.array(rows, dtype=np.int64).reshape(-1, 4)

    def gather_with_boundaries(self, starts: Any, length: Any, out: Any, bounds_length: Any = None,
                               position_ids: Any = None, segment_ids: Any = None, cu_seqlens: Any = None, *,
                               position_dtype: Any = np.int64, segments: bool = True, fds: Any = None,
                               labels: Any = None, mask: Any = None, mask_fds: Any = None, label_shift: int = 1,
                               ignore_id: int = -100) -> tuple:
        if self.doc_starts is None:
            raise ConfigError("boundaries: this gatherer has no document indexes", field="documents")
        L = check_count(length, "length", minimum=1)
        BL = L - 1 if bounds_length is None else check_count(bounds_length, "bounds_length")
        if not 1 <= BL <= L:
            raise ConfigError(f"bounds_length must be in [1, {L}], got {BL}", field="bounds_length")
        st = as_positions(starts, "starts")
        if st.size and (st.min() < 0 or st.max() > self.total - L):
            raise OutOfRangeError(f"a window of {L} tokens falls outside [0, {self.total})", field="starts")
        self.gather(st, L, out, fds=fds, labels=labels, mask=mask, mask_fds=mask_fds, label_shift=label_shift,
                    ignore_id=ignore_id)
        return (out, *self.boundaries(st, BL, position_ids, segment_ids, cu_seqlens,
                                      position_dtype=position_dtype, segments=segments))


def _pieces(c: np.ndarray, pos: int, L: int) -> list[tuple[int, int, int]]:
    """``(shard, first record, count)`` of each piece of the window ``[pos, pos + L)``."""
    out = []
    while L > 0:
        s = int(np.searchsorted(c, pos, side="right")) - 1
        take = min(L, int(c[s + 1]) - pos)
        out.append((s, pos - int(c[s]), take))
        pos += take
        L -= take
    return out


def _check_out(out: Any, n: int) -> None:
    """A gather's token output: a writable C-contiguous ``int64`` / ``int32`` array of ``n``."""
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable \
            or out.dtype not in (np.int64, np.int32) or out.size != n:
        raise ConfigError(f"out must be a writable C-contiguous int64 or int32 array of {n} elements", field="out")


def _check_buffer(buf: Any, dtype: Any, shape: tuple[int, ...], name: str) -> None:
    if not isinstance(buf, np.ndarray) or buf.dtype != np.dtype(dtype) or not buf.flags.c_contiguous \
            or not buf.flags.writeable or (buf.size != int(np.prod(shape)) if len(shape) == 1 else buf.shape != shape):
        desc = f"{shape[0]} elements" if len(shape) == 1 else f"shape {shape}"
        raise ConfigError(f"{name} must be a writable C-contiguous {np.dtype(dtype)} array of {desc}", field=name)


def _piece(src: Any, first: int, count: int, itemsize: int, path: Any = None) -> memoryview:
    """Bytes of records ``[first, first + count)`` of one shard, whose source is an address
    (``int``), a buffer, or a descriptor (``("fd", n)``; ``path`` named when it comes short)."""
    a, n = first * itemsize, count * itemsize
    if n == 0:
        return memoryview(b"")
    if isinstance(src, tuple):
        data = os.pread(src[1], n, a)
        if len(data) != n:
            raise_for_status(STATUS.ZB_E_TRUNCATED, "tokens.bin: a shard ended before its last record (the file "
                             "shrank after open)", path=path, field="tokens.bin")
        return memoryview(data)
    if isinstance(src, (int, np.integer)):
        return memoryview((ctypes.c_uint8 * n).from_address(int(src) + a))
    return memoryview(src).cast("B")[a:a + n]


def _records(base: Any, n: int, itemsize: int, token_size: int, first: int = 0) -> np.ndarray:
    """Records ``[first, first + n)`` of a shard as a structured array (``token``,
    ``metadata_id``), from an address, a buffer or a descriptor."""
    rec = np.dtype([("token", f"<u{token_size}"), ("metadata_id", "<u4")])
    if rec.itemsize != itemsize:
        raise ConfigError(f"itemsize {itemsize}: these records hold no metadata id", field="itemsize")
    return np.frombuffer(_piece(base, first, n, itemsize), dtype=rec, count=n)


def _window_tokens(shards: Any, c: np.ndarray, itemsize: int, token_size: int, pos: int, L: int,
                   checks: BlockChecks | None = None, paths: Any = None) -> np.ndarray:
    """The token ids of ``[pos, pos + L)``, read piece by piece from the shards it spans (the
    checksum blocks under each piece checked first, with ``checks``)."""
    rec = np.dtype([("token", f"<u{token_size}"), ("rest", f"V{itemsize - token_size}")]) \
        if itemsize > token_size else np.dtype(f"<u{token_size}")
    parts = []
    while L > 0:
        s = int(np.searchsorted(c, pos, side="right")) - 1
        take = min(L, int(c[s + 1]) - pos)
        if checks is not None:
            local = pos - int(c[s])
            checks.check(shards[s], s, local * itemsize, (local + take) * itemsize,
                         (int(c[s + 1]) - int(c[s])) * itemsize, None if paths is None else paths[s])
        arr = np.frombuffer(_piece(shards[s], pos - int(c[s]), take, itemsize), dtype=rec, count=take)
        parts.append(arr["token"] if itemsize > token_size else arr)
        pos += take
        L -= take
    return np.concatenate(parts) if parts else np.zeros(0, np.uint32)


def _checked_tokens(shards: Any, c: np.ndarray, itemsize: int, token_size: int, vocab: int, pos: int, L: int,
                    checks: BlockChecks | None, paths: Any) -> np.ndarray:
    """The ids of ``[pos, pos + L)`` (as :func:`_window_tokens`), refused at or above ``vocab``."""
    win = _window_tokens(shards, c, itemsize, token_size, pos, L, checks, paths)
    if win.size and int(win.max()) >= vocab:
        bad = pos + int(np.argmax(win >= vocab))
        shard = int(np.searchsorted(c, bad, side="right") - 1)
        raise CorruptError(f"token: the id at global position {bad} (record {bad - int(c[shard])} of shard "
                           f"{shard}) is not below the vocabulary size {vocab}",
                           path=None if paths is None else paths[shard], field="token")
    return win


def _gather(shards: Any, c: np.ndarray, itemsize: int, token_size: int, vocab: int, starts: Any, L: int, out: Any,
            paths: Any, checks: BlockChecks | None, labels: Any = None, mask: Any = None, mshards: Any = None,
            shift: int = 1, ignore_id: int = -100) -> Any:
    """The windows into ``out`` and, with ``labels``, each window's labels right after its
    tokens (as the kernel: tokens ``[shift, L)``, ``ignore_id`` where ``mask``'s stream, read
    from ``mshards``, is 0)."""
    st = as_positions(starts, "starts")
    total = int(c[-1])
    if st.size and (st.min() < 0 or st.max() > total - L):
        raise OutOfRangeError(f"a window of {L} tokens falls outside [0, {total})", field="starts")
    if out.dtype == np.int32 and vocab > 2**31:
        raise ConfigError("out: int32 cannot hold every id of this vocabulary", field="out")
    flat = out.reshape(-1)
    lab = None if labels is None else labels.reshape(-1)
    n = L - shift
    for w, pos in enumerate(st.tolist()):
        win = _checked_tokens(shards, c, itemsize, token_size, vocab, pos, L, checks, paths)
        flat[w * L:(w + 1) * L] = win
        if lab is not None and n > 0:
            vals = flat[w * L + shift:(w + 1) * L]
            if mask is not None:
                keep = _checked_tokens(mshards, mask.cum, mask.itemsize, mask.token_size, mask.vocab, pos + shift, n,
                                       mask.checks, mask.paths)
                vals = np.where(keep != 0, vals, ignore_id)
            lab[w * n:(w + 1) * n] = vals
    return out


def gather_windows(bases: Any, cum: Any, itemsize: int, token_size: int, vocab: int, starts: Any,
                   length: Any, out: Any, paths: Any = None, checks: BlockChecks | None = None) -> np.ndarray:
    """Twin of :func:`zerobatch.core._tokstream.gather_windows`; ``bases`` may also be a list
    of the shards' record buffers (NumPy arrays or bytes-like), or of ``("fd", descriptor)``."""
    c = np.ascontiguousarray(cum, dtype=np.int64)
    ns = len(bases)
    if c.shape[0] != ns + 1 or ns < 1 or c[0] != 0 or (np.diff(c) < 0).any():
        raise ConfigError("cum must hold len(bases) + 1 non-decreasing cumulative counts from 0", field="cum")
    if itemsize not in (2, 4, 6, 8) or token_size not in (2, 4) or token_size > itemsize:
        raise ConfigError(f"itemsize {itemsize} / token_size {token_size} is not a record layout", field="itemsize")
    L = check_count(length, "length")
    st = as_positions(starts, "starts")
    _check_out(out, st.size * L)
    return _gather(bases, c, itemsize, token_size, vocab, st, L, out, paths, checks)
