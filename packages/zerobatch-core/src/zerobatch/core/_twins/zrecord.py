"""ZRECORD entry snapshots, record checks and inflate: the twin of ``_zrecord.pyx``."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from zerobatch.core._status import raise_for_status
from zerobatch.core._twins.hash import xxh3_64
from zerobatch.core._twins.mapping import FileMapping
from zerobatch.formats.errors import OutOfRangeError

__all__ = ["RecordGather", "buffer_views", "zrecord_status_error"]


# --------------------------------------------------------------------------------------------
# ZRECORD


class RecordGather:
    """Twin of :class:`zerobatch.core._zrecord.RecordGather` (same results and failure tuples)."""

    def __init__(self, commit: Any, epoch: int) -> None:
        self._commit = _zr_bytes(commit)
        if self._commit.size < 64:
            raise ValueError("commit: fewer than 64 bytes")
        self._commit_obj = commit
        self.epoch = epoch
        self._tables: dict[int, np.ndarray] = {}
        self._checks: dict[int, np.ndarray] = {}
        self._table_objs: dict[int, Any] = {}
        self._chunks: dict[int, np.ndarray] = {}
        self._chunk_objs: dict[int, Any] = {}

    def set_table(self, k: int, table: Any, check: Any) -> None:
        if not 0 <= k <= 65535:
            raise ValueError("field number out of range")
        raw, chk = _zr_bytes(table), _zr_bytes(check)
        n = min(raw.size // 16, chk.size // 4)
        self._tables[k] = raw[: n * 16].view(_ZR_ENTRY)
        self._checks[k] = chk[: n * 4].view("<u4")
        self._table_objs[k] = (table, check)

    def set_chunk(self, c: int, mapping: Any) -> None:
        if mapping is None or len(mapping) == 0:
            self._chunks.pop(c, None)
            self._chunk_objs.pop(c, None)
            return
        self._chunks[c] = _zr_bytes(mapping)
        self._chunk_objs[c] = mapping

    def chunk_array(self, c: int) -> np.ndarray:
        return self._chunks[c]

    def snapshot(self, indices: Any, fields: Any) -> Any:
        idx = np.ascontiguousarray(indices, dtype=np.int64)
        fno = [int(f) for f in np.asarray(fields, dtype=np.int64)]
        for k in fno:
            if k not in self._tables:
                raise ValueError(f"field number {k} has no table")
        c = self._commit
        s1 = int(c[16:24].view("<u8")[0])
        if s1 & 1:
            return ("retry", 0)
        flags = int(c[12:16].view("<u4")[0])
        length, nch = int(c[24:32].view("<u8")[0]), int(c[32:40].view("<u8")[0])
        if flags or int(c[48:56].view("<u8")[0]) != self.epoch:
            return ("stale", 0)
        for k in fno:
            if length > self._tables[k].size:
                return ("need_table", k)
        j = np.where(idx < 0, idx + length, idx)
        bad = np.flatnonzero((j < 0) | (j >= length))
        out = np.empty((idx.size, len(fno)), _ZR_ENTRY)
        broken = None
        if bad.size == 0:
            import zlib

            for col, k in enumerate(fno):
                out[:, col] = self._tables[k][j]
            for i in range(idx.size):
                for col, k in enumerate(fno):
                    crc = zlib.crc32(struct.pack("<QI", int(j[i]), k), zlib.crc32(out[i, col].tobytes()))
                    if crc != int(self._checks[k][j[i]]):
                        broken = ("bad_entry", k, int(idx[i]))
                        break
                if broken:
                    break
        if int(c[16:24].view("<u8")[0]) != s1:
            return ("retry", 0)
        if broken:
            return broken
        if bad.size:
            raise OutOfRangeError(f"index {int(idx[bad[0]])} is out of range for a store of {length} records")
        return out, length, nch

    def check(self, entries_col: Any, num_chunks: int, field_no: int, codec: int, fixed_len: int,
              max_len: int, verify: bool, out: Any = None, pool: Any = None, threads: int = 1,
              itemsize: int = 1) -> Any:
        return self._run(entries_col, num_chunks, field_no, codec, fixed_len, max_len, verify, out, itemsize)

    def views(self, chunks: Any, payload: Any, lens: Any, dtype: Any, shape: Any = None) -> list[Any]:
        out: list[Any] = [None] * len(lens)
        for i in range(len(lens)):
            if lens[i] >= 0:
                base = self._chunks[int(chunks[i])]
                v = base[int(payload[i]): int(payload[i]) + int(lens[i])].view(dtype)
                out[i] = v.reshape(shape) if shape is not None else v
        return out

    def inflate(self, entries_col: Any, field_no: int, payload: Any, lens: Any, out: Any, out_offsets: Any,
                pool: Any = None, threads: int = 1) -> Any:
        import zlib

        ents = np.ascontiguousarray(entries_col).view(_ZR_ENTRY).reshape(-1)
        for i, e in enumerate(ents):
            if lens[i] <= 0:
                continue
            p = self._chunks[int(e["chunk"])]
            src = p[int(payload[i]): int(e["offset"]) + int(e["length"])].tobytes()
            try:
                raw = _zr_inflate(zlib, src, int(lens[i]))
            except ValueError:
                return ("error", 6, i, (int(e["chunk"]), int(e["offset"]), int(e["length"])))
            o = int(out_offsets[i])
            out[o:o + len(raw)] = np.frombuffer(raw, np.uint8)
        return payload, lens

    def _run(self, entries_col: Any, num_chunks: int, field_no: int, codec: int, fixed_len: int, max_len: int,
             verify: bool, out: Any, itemsize: int = 1) -> Any:
        import zlib

        ents = np.ascontiguousarray(entries_col).view(_ZR_ENTRY).reshape(-1)
        n = ents.size
        payload = np.zeros(n, np.uint64)
        lens = np.zeros(n, np.int64)
        flat = None if out is None else np.asarray(out).reshape(-1).view(np.uint8)
        for i, e in enumerate(ents):
            c, off, ln = int(e["chunk"]), int(e["offset"]), int(e["length"])

            def fail(status: int, i: int = i, c: int = c, off: int = off, ln: int = ln) -> Any:
                return ("error", status, i, (c, off, ln))

            if ln == 0:
                lens[i] = -1
                if flat is not None and fixed_len:
                    flat[i * fixed_len:(i + 1) * fixed_len] = 0
                continue
            if c >= num_chunks:
                return fail(6)
            base = self._chunks.get(c)
            if base is None:
                return ("need_chunk", c, i)
            if ln < 16 or off % 16:
                return fail(6)
            if off + ln >= 1 << 64:
                return fail(8)
            if off + ln > base.size:
                return ("need_chunk", c, i)
            h = base[off:off + ln].tobytes()
            digest, logical, rcodec, magic, fno = struct.unpack_from("<QIBBH", h)
            if magic != 0x5A:
                return fail(2)
            if verify and xxh3_64(h[8:]) != digest:
                return fail(11)
            if rcodec != codec or fno != field_no:
                return fail(6)
            if codec == 0 and logical != ln - 16:
                return fail(6)
            if fixed_len and logical != fixed_len:
                return fail(6)
            if logical > max_len:
                return fail(7)
            if itemsize > 1 and logical % itemsize:
                return fail(6)
            lens[i] = logical
            payload[i] = off + 16
            if flat is None:
                continue
            if codec == 0:
                data = h[16:16 + logical]
            else:
                try:
                    data = _zr_inflate(zlib, h[16:], logical)
                except ValueError:
                    return fail(6)
            flat[i * fixed_len:i * fixed_len + logical] = np.frombuffer(data, np.uint8)
        return payload, lens


def _zr_bytes(obj: Any) -> np.ndarray:
    """uint8 view of a buffer or of a (twin) FileMapping (``__buffer__`` needs Python 3.12)."""
    if isinstance(obj, FileMapping):
        return np.frombuffer(obj._m, np.uint8) if obj._m is not None else np.zeros(0, np.uint8)
    return np.frombuffer(obj, np.uint8)


_ZR_ENTRY = np.dtype([("chunk", "<u4"), ("offset", "<u8"), ("length", "<u4")])


def _zr_inflate(zlib: Any, src: bytes, logical: int) -> bytes:
    d = zlib.decompressobj(-15)
    try:
        raw = d.decompress(src, logical)
    except zlib.error as exc:
        raise ValueError(str(exc)) from None
    if len(raw) != logical or not d.eof or d.unconsumed_tail or d.unused_data:
        raise ValueError("inflated size disagrees")
    return raw


def buffer_views(buf: np.ndarray, offsets: Any, lens: Any, dtype: Any, shape: Any = None) -> list[Any]:
    """Twin of :func:`zerobatch.core._zrecord.buffer_views`."""
    out: list[Any] = [None] * len(lens)
    for i in range(len(lens)):
        if lens[i] >= 0:
            v = buf[int(offsets[i]): int(offsets[i]) + int(lens[i])].view(dtype)
            out[i] = v.reshape(shape) if shape is not None else v
    return out


def zrecord_status_error(status: int, message: str, path: Any = None, field: Any = None) -> None:
    raise_for_status(status, message, path=path, field=field)
