"""ZRECORD entry snapshots, record checks and inflate: the twin of ``_zrecord.pyx`` (the same
functions, arguments, status codes and results; memory named by address is read through
``ctypes``)."""

from __future__ import annotations

import ctypes
import struct
import zlib
from typing import Any

import numpy as np

from zerobatch.core._twins.hash import xxh3_64
from zerobatch.core.status import STATUS, raise_for_status
from zerobatch.formats.errors import ConfigError
from zerobatch.formats.zrecord import ENTRY_DTYPE

__all__ = ["buffer_views", "check_records", "inflate_records", "publish_chunk", "record_views",
           "snapshot_entries", "zrecord_status_error"]

MIN_BYTES_PER_PART = 1 << 17


def _at(address: int, size: int) -> np.ndarray:
    """``size`` bytes at ``address`` as a uint8 array (empty for a null address)."""
    if not address or not size:
        return np.zeros(0, np.uint8)
    return np.frombuffer((ctypes.c_uint8 * size).from_address(int(address)), np.uint8)


def snapshot_entries(commit: Any, epoch: int, tables: Any, checks: Any, table_entries: Any, field_nos: Any,
                     indices: Any, out: Any, key32: int = 0) -> tuple[int, int, int, int]:
    c = np.frombuffer(commit, np.uint8)
    if c.size < 64:
        raise ConfigError("commit: fewer than 64 bytes", field="commit")
    taddr, caddr = np.asarray(tables, np.uint64), np.asarray(checks, np.uint64)
    tent = np.asarray(table_entries, np.uint64)
    fno = [int(f) for f in np.asarray(field_nos, dtype=np.int64).reshape(-1)]
    idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    if not isinstance(out, np.ndarray) or out.dtype != ENTRY_DTYPE or out.shape != (idx.size, len(fno)):
        raise ConfigError(f"out must be a writable C-contiguous ENTRY_DTYPE array of shape ({idx.size}, {len(fno)})",
                          field="out")
    for k in fno:
        if not 0 <= k < min(taddr.size, caddr.size, tent.size) or k > 65535:
            raise ConfigError(f"field number {k} has no table", field="field_nos")
    entries = {k: int(tent[k]) if taddr[k] and caddr[k] else 0 for k in fno}
    s1 = int(c[16:24].view("<u8")[0])
    if s1 & 1:
        return STATUS.ZB_RETRY, 0, 0, 0
    flags = int(c[12:16].view("<u4")[0])
    length, nch = int(c[24:32].view("<u8")[0]), int(c[32:40].view("<u8")[0])
    if flags or int(c[48:56].view("<u8")[0]) != epoch:
        return STATUS.ZB_STALE, 0, 0, 0
    status, bad = STATUS.ZB_OK, 0
    for pos, k in enumerate(fno):
        if length > entries[k]:
            status, bad = STATUS.ZB_NEED_TABLE, pos
            break
    if status == STATUS.ZB_OK:
        for i, j in enumerate(idx.tolist()):
            jj = j + length if j < 0 else j
            if not 0 <= jj < length:
                status, bad = STATUS.ZB_E_INDEX, i
                break
            for pos, k in enumerate(fno):
                raw = _at(int(taddr[k]) + jj * 16, 16)
                out[i, pos] = raw.view(ENTRY_DTYPE)[0]
                crc = zlib.crc32(raw.tobytes() + struct.pack("<QI", jj, k)) ^ key32
                if crc != int(_at(int(caddr[k]) + jj * 4, 4).view("<u4")[0]):
                    status, bad = STATUS.ZB_E_CHECKSUM, i * len(fno) + pos
                    break
            if status != STATUS.ZB_OK:
                break
    if int(c[16:24].view("<u8")[0]) != s1:
        return STATUS.ZB_RETRY, 0, 0, 0
    return status, length, nch, bad


def _inflate(src: bytes, logical: int) -> bytes | None:
    """Raw deflate of exactly ``logical`` bytes that ends exactly at the end of ``src``."""
    d = zlib.decompressobj(-15)
    try:
        raw = d.decompress(src, logical + 1)
    except zlib.error:
        return None
    if len(raw) != logical or not d.eof or d.unconsumed_tail or d.unused_data:
        return None
    return raw


def _chunk(bases: np.ndarray, sizes: np.ndarray, c: int) -> np.ndarray | None:
    if c >= bases.size or not bases[c]:
        return None
    return _at(int(bases[c]), int(sizes[c]))


def check_records(entries: Any, chunk_base: Any, chunk_size: Any, committed: int, field_no: int, codec: int,
                  fixed_len: int, max_len: int, itemsize: int, verify: bool, out: Any = None, pool: Any = None,
                  threads: int = 1, key: int = 0, first: int = 0) -> tuple[int, int, int, np.ndarray, np.ndarray]:
    bases, sizes = np.asarray(chunk_base, np.uint64), np.asarray(chunk_size, np.uint64)
    if bases.size != sizes.size:
        raise ConfigError("chunk_base and chunk_size must have one entry per chunk", field="chunk_size")
    ents = np.ascontiguousarray(entries).view(ENTRY_DTYPE).reshape(-1)
    n = ents.size
    payload, lens = np.zeros(n, np.uint64), np.zeros(n, np.int64)
    flat = None if out is None else np.asarray(out).reshape(-1).view(np.uint8)
    if flat is not None and fixed_len and flat.size < fixed_len * n:
        raise ConfigError("out is too small for the records", field="out")
    for i, e in enumerate(ents):
        c, off, ln = int(e["chunk"]), int(e["offset"]), int(e["length"])
        if ln == 0:
            lens[i] = -1
            if flat is not None and fixed_len:
                flat[i * fixed_len:(i + 1) * fixed_len] = 0
            continue
        if c >= committed or c < first:
            return STATUS.ZB_E_FIELD, i, 0, payload, lens
        base = _chunk(bases, sizes, c)
        if base is None:
            return STATUS.ZB_NEED_CHUNK, i, c, payload, lens
        if ln < 16 or off % 16:
            return STATUS.ZB_E_FIELD, i, 0, payload, lens
        if off + ln >= 1 << 64:
            return STATUS.ZB_E_OVERFLOW, i, 0, payload, lens
        if off + ln > base.size:
            return STATUS.ZB_NEED_CHUNK, i, c, payload, lens
        h = base[off:off + ln].tobytes()
        digest, logical, rcodec, magic, fno = struct.unpack_from("<QIBBH", h)
        if magic != 0x5A:
            return STATUS.ZB_E_MAGIC, i, 0, payload, lens
        if verify and xxh3_64(h[8:]) ^ key != digest:
            return STATUS.ZB_E_CHECKSUM, i, 0, payload, lens
        if rcodec != codec or fno != field_no or (codec == 0 and logical != ln - 16) \
                or (fixed_len and logical != fixed_len):
            return STATUS.ZB_E_FIELD, i, 0, payload, lens
        if logical > max_len:
            return STATUS.ZB_E_LIMIT, i, 0, payload, lens
        if itemsize > 1 and logical % itemsize:
            return STATUS.ZB_E_FIELD, i, 0, payload, lens
        if codec == 1 and (logical > (ln - 16) * 1032 + 1024 or (logical == 0 and _inflate(h[16:], 0) is None)):
            return STATUS.ZB_E_FIELD, i, 0, payload, lens
        lens[i] = logical
        payload[i] = off + 16
        if flat is None:
            continue
        data = h[16:16 + logical] if codec == 0 else _inflate(h[16:], logical)
        if data is None:
            return STATUS.ZB_E_FIELD, i, 0, payload, lens
        flat[i * fixed_len:i * fixed_len + logical] = np.frombuffer(data, np.uint8)
    return STATUS.ZB_OK, 0, 0, payload, lens


def inflate_records(entries: Any, chunk_base: Any, chunk_size: Any, payload: Any, lens: Any, out: Any,
                    out_offsets: Any, pool: Any = None, threads: int = 1) -> tuple[int, int]:
    bases, sizes = np.asarray(chunk_base, np.uint64), np.asarray(chunk_size, np.uint64)
    ents = np.ascontiguousarray(entries).view(ENTRY_DTYPE).reshape(-1)
    for i, e in enumerate(ents):
        if lens[i] <= 0:
            continue
        base = _chunk(bases, sizes, int(e["chunk"]))
        src = base[int(payload[i]): int(e["offset"]) + int(e["length"])].tobytes()
        raw = _inflate(src, int(lens[i]))
        if raw is None:
            return STATUS.ZB_E_FIELD, i
        o = int(out_offsets[i])
        out[o:o + len(raw)] = np.frombuffer(raw, np.uint8)
    return STATUS.ZB_OK, 0


def publish_chunk(chunk_base: Any, chunk_size: Any, c: int, address: int, size: int) -> None:
    if c >= len(chunk_base) or len(chunk_base) != len(chunk_size):
        raise ConfigError(f"chunk {c} is beyond the chunk arrays", field="chunk")
    chunk_base[c] = address
    chunk_size[c] = size


def record_views(chunk_base: Any, chunk_size: Any, owners: Any, chunks: Any, payload: Any, lens: Any, dtype: Any,
                 shape: Any = None) -> list[Any]:
    bases, sizes = np.asarray(chunk_base, np.uint64), np.asarray(chunk_size, np.uint64)
    out: list[Any] = [None] * len(lens)
    for i in range(len(lens)):
        if lens[i] < 0:
            continue
        c = int(chunks[i])
        if c >= bases.size or not bases[c] or int(payload[i]) + int(lens[i]) > int(sizes[c]):
            raise_for_status(STATUS.ZB_E_ARGUMENT, f"record {i} lies outside the mapped chunks", field="chunk")
        base = np.frombuffer(owners[c], np.uint8)       # keeps the mapping alive
        v = base[int(payload[i]): int(payload[i]) + int(lens[i])].view(dtype)
        out[i] = v.reshape(shape) if shape is not None else v
    return out


def buffer_views(buf: np.ndarray, offsets: Any, lens: Any, dtype: Any, shape: Any = None) -> list[Any]:
    if not buf.flags.c_contiguous:
        raise ConfigError("buf must be C-contiguous", field="buf")
    out: list[Any] = [None] * len(lens)
    for i in range(len(lens)):
        if lens[i] >= 0:
            if int(offsets[i]) + int(lens[i]) > buf.nbytes:
                raise ConfigError(f"record {i} lies outside the buffer", field="offsets")
            v = buf[int(offsets[i]): int(offsets[i]) + int(lens[i])].view(dtype)
            out[i] = v.reshape(shape) if shape is not None else v
    return out


def zrecord_status_error(status: int, message: str, path: Any = None, field: Any = None) -> None:
    raise_for_status(status, message, path=path, field=field)
