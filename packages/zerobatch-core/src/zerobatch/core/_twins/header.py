"""LLMBATCH header parsing, geometry and packing: the twin of ``_header.pyx``."""

from __future__ import annotations

import struct
from typing import Any

from zerobatch.core._header_common import (
    FIELD_NAMES,
    check_uint,
    geometry_message,
    header_from_fields,
    pack_fields,
    parse_message,
)
from zerobatch.core._twins.hash import _bytes_of, _r64, xxh3_64
from zerobatch.core.status import raise_for_status
from zerobatch.formats import llmbatch as L
from zerobatch.formats.errors import ConfigError

__all__ = ["llmbatch_geometry", "pack_llmbatch_header", "parse_llmbatch_header"]


# --------------------------------------------------------------------------------------------
# LLMBATCH header


def _parse_fields(b: bytes, file_size: int) -> tuple[int, dict[str, Any]]:
    f: dict[str, Any] = {k: 0 for k in (
        "version", "batch_size", "seq_len", "num_batches", "dtype", "seed", "total_records",
        "has_ext", "ext_version", "ext_flags", "hash_algo", "max_token", "trailer_offset",
        "trailer_size", "trailer_hash", "header_hash", "computed_header_hash",
        "raw_batch_bytes", "padded_batch_bytes", "data_end", "expected_file_size", "bad_field")}
    f["build_id"] = bytes(16)
    f["file_size"] = file_size
    idx = FIELD_NAMES.index

    def fail(status: int, field: str) -> tuple[int, dict[str, Any]]:
        f["bad_field"] = idx(field)
        return status, f

    if len(b) < L.HEADER_SIZE or file_size < L.HEADER_SIZE:
        return fail(1, "header")
    if b[:8] != L.MAGIC:
        return fail(2, "magic")
    (_, f["version"], f["batch_size"], f["seq_len"], f["num_batches"], f["dtype"], f["seed"],
     f["total_records"]) = struct.unpack_from(L.HEADER_STRUCT, b, 0)
    if f["version"] != L.VERSION:
        return fail(3, "version")
    if f["dtype"] != L.DTYPE_UINT32:
        return fail(4, "dtype")
    if b[40:48] == L.EXT_MAGIC:
        f["has_ext"] = True
        f["header_hash"] = _r64(b, L.HEADER_HASH_OFFSET)
        f["computed_header_hash"] = xxh3_64(b[:L.HEADER_HASH_OFFSET])
        f["ext_version"], f["ext_flags"], f["hash_algo"], f["max_token"] = struct.unpack_from("<IIII", b, 48)
        f["trailer_offset"], f["trailer_size"], f["trailer_hash"] = struct.unpack_from("<QQQ", b, 64)
        f["build_id"] = b[88:104]
        if f["header_hash"] != f["computed_header_hash"]:
            return fail(11, "header_hash")
        if f["ext_version"] != L.EXT_VERSION:
            return fail(3, "ext_version")
        if f["ext_flags"] & ~L.EXT_FLAGS_KNOWN:
            return fail(5, "ext_flags")
        if f["hash_algo"] != L.HASH_ALGO_XXH3_64:
            return fail(3, "hash_algo")
        if any(b[L.EXT_RESERVED_START:L.HEADER_HASH_OFFSET]):
            return fail(10, "reserved")
        if not f["ext_flags"] & L.EXT_FLAG_MAX_TOKEN and f["max_token"] != 0:
            return fail(6, "max_token")
    elif any(b[40:L.HEADER_SIZE]):
        return fail(10, "reserved")
    bs, sl = f["batch_size"], f["seq_len"]
    if bs == 0:
        return fail(6, "batch_size")
    if sl == 0:
        return fail(6, "seq_len")
    if bs > L.MAX_BATCH_SIZE:
        return fail(7, "batch_size")
    if sl > L.MAX_SEQ_LEN:
        return fail(7, "seq_len")
    raw = bs * sl * L.TOKEN_ITEMSIZE
    if raw > L.MAX_BATCH_BYTES:
        return fail(7, "batch_bytes")
    padded = -(-raw // L.BATCH_ALIGNMENT) * L.BATCH_ALIGNMENT
    f["raw_batch_bytes"], f["padded_batch_bytes"] = raw, padded
    checksum_bytes = L.CHECKSUM_SIZE if f["ext_flags"] & L.EXT_FLAG_BATCH_CHECKSUMS else 0
    nb = f["num_batches"]
    if nb > (file_size - L.HEADER_SIZE) // (padded + checksum_bytes):
        return fail(1, "num_batches")
    f["data_end"] = L.HEADER_SIZE + nb * padded
    f["expected_file_size"] = f["data_end"] + nb * checksum_bytes
    if f["has_ext"]:
        if f["trailer_offset"] != f["data_end"]:
            return fail(6, "trailer_offset")
        if f["trailer_size"] != nb * checksum_bytes:
            return fail(6, "trailer_size")
        if checksum_bytes == 0 and f["trailer_hash"] != 0:
            return fail(6, "trailer_hash")
    if file_size != f["expected_file_size"]:
        return fail(9, "file_size")
    return 0, f


def parse_llmbatch_header(buf: Any, file_size: int, *, path: Any = None) -> L.LLMBatchHeader:
    """Parse and validate an LLMBATCH header against the file's real size."""
    if isinstance(file_size, bool) or file_size < 0:
        raise ConfigError(f"file_size must be an integer >= 0, got {file_size!r}", field="file_size")
    b = _bytes_of(buf)[:L.HEADER_SIZE]
    status, f = _parse_fields(b, file_size)
    if status:
        raise_for_status(status, parse_message(status, f), path=path, field=FIELD_NAMES[f["bad_field"]])
    return header_from_fields(f)


def llmbatch_geometry(batch_size: Any, seq_len: Any) -> tuple[int, int]:
    """Bytes of one batch and of its page-aligned slot."""
    bs = check_uint(batch_size, "batch_size", 2**32 - 1)
    sl = check_uint(seq_len, "seq_len", 2**32 - 1)
    for name, v in (("batch_size", bs), ("seq_len", sl)):
        if v == 0:
            raise ConfigError(geometry_message(6, name, bs, sl), field=name)
    for name, v, limit in (("batch_size", bs, L.MAX_BATCH_SIZE), ("seq_len", sl, L.MAX_SEQ_LEN)):
        if v > limit:
            raise_for_status(7, geometry_message(7, name, bs, sl), field=name)
    raw = bs * sl * L.TOKEN_ITEMSIZE
    if raw > L.MAX_BATCH_BYTES:
        raise_for_status(7, geometry_message(7, "batch_bytes", bs, sl), field="batch_bytes")
    return raw, -(-raw // L.BATCH_ALIGNMENT) * L.BATCH_ALIGNMENT


def pack_llmbatch_header(
    *,
    batch_size: Any,
    seq_len: Any,
    num_batches: Any,
    seed: Any,
    total_records: Any,
    extension: bool = True,
    checksums: bool = True,
    max_token: Any = None,
    trailer_hash: Any = 0,
    build_id: Any = None,
) -> bytes:
    """Pack a 4096-byte LLMBATCH header."""
    f = pack_fields(batch_size=batch_size, seq_len=seq_len, num_batches=num_batches, seed=seed,
                    total_records=total_records, extension=extension, checksums=checksums,
                    max_token=max_token, trailer_hash=trailer_hash, build_id=build_id)
    out = bytearray(L.HEADER_SIZE)
    struct.pack_into(L.HEADER_STRUCT, out, 0, L.MAGIC, L.VERSION, f["batch_size"], f["seq_len"],
                     f["num_batches"], L.DTYPE_UINT32, f["seed"], f["total_records"])
    if f["has_ext"]:
        out[40:48] = L.EXT_MAGIC
        struct.pack_into("<IIII", out, 48, L.EXT_VERSION, f["ext_flags"], L.HASH_ALGO_XXH3_64, f["max_token"])
        struct.pack_into("<QQQ", out, 64, f["trailer_offset"], f["trailer_size"], f["trailer_hash"])
        out[88:104] = f["build_id"]
        struct.pack_into("<Q", out, L.HEADER_HASH_OFFSET, xxh3_64(bytes(out[:L.HEADER_HASH_OFFSET])))
    return bytes(out)
