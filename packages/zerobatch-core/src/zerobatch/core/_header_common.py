"""Shared by the compiled header kernel and its pure-NumPy twin: field names, error messages
and the conversion of parsed fields into :class:`LLMBatchHeader`.

Kept in one place so the compiled wrapper and ``_reference`` can never disagree on what an
error says or what a header holds.
"""

from __future__ import annotations

from typing import Any

from zerobatch.core.status import STATUS as S
from zerobatch.formats import llmbatch as L
from zerobatch.formats.errors import ConfigError
from zerobatch.formats.llmbatch import LLMBatchHeader

__all__ = [
    "FIELD_NAMES",
    "check_uint",
    "geometry_message",
    "header_from_fields",
    "pack_fields",
    "parse_message",
]

#: Index of each field name; the parse kernel's ``bad_field`` points into this tuple.
FIELD_NAMES = (
    "header", "magic", "version", "batch_size", "seq_len", "num_batches", "dtype", "seed",
    "total_records", "reserved", "ext_version", "ext_flags", "hash_algo", "max_token",
    "trailer_offset", "trailer_size", "trailer_hash", "build_id", "header_hash", "file_size",
    "batch_bytes",
)



def header_from_fields(f: dict[str, Any]) -> LLMBatchHeader:
    """Build the header record from the parse kernel's fields (status ZB_OK)."""
    flags = f["ext_flags"]
    has_ext = bool(f["has_ext"])
    return LLMBatchHeader(
        batch_size=f["batch_size"],
        seq_len=f["seq_len"],
        num_batches=f["num_batches"],
        seed=f["seed"],
        total_records=f["total_records"],
        version=f["version"],
        dtype=f["dtype"],
        raw_batch_bytes=f["raw_batch_bytes"],
        padded_batch_bytes=f["padded_batch_bytes"],
        data_offset=L.HEADER_SIZE,
        trailer_offset=f["data_end"],
        trailer_size=f["expected_file_size"] - f["data_end"],
        file_size=f["expected_file_size"],
        has_extension=has_ext,
        ext_flags=flags,
        has_checksums=bool(flags & L.EXT_FLAG_BATCH_CHECKSUMS),
        max_token=f["max_token"] if flags & L.EXT_FLAG_MAX_TOKEN else None,
        trailer_hash=f["trailer_hash"],
        header_hash=f["header_hash"],
        build_id=bytes(f["build_id"]) if has_ext else None,
    )


def parse_message(status: int, f: dict[str, Any]) -> str:
    """The error message for a failed parse, naming the field and the values."""
    field = FIELD_NAMES[f["bad_field"]]
    checksum_bytes = L.CHECKSUM_SIZE if f["ext_flags"] & L.EXT_FLAG_BATCH_CHECKSUMS else 0
    if status == S.ZB_E_TRUNCATED and field == "header":
        return (f"header: an LLMBATCH file needs at least {L.HEADER_SIZE} bytes for its header, "
                f"but the file holds {f['file_size']}")
    if status == S.ZB_E_TRUNCATED:
        nb = f["num_batches"]
        per_batch = f["padded_batch_bytes"] + checksum_bytes
        holds = (f["file_size"] - L.HEADER_SIZE) // per_batch
        return (f"num_batches: header claims {nb} batches ({nb * per_batch} bytes after the "
                f"header) but the file holds {holds}")
    if status == S.ZB_E_MAGIC:
        return "magic: not an LLMBATCH file (the first 8 bytes are not b'LLMBATCH')"
    if status == S.ZB_E_VERSION and field == "version":
        return f"version: unsupported LLMBATCH version {f['version']} (this release reads {L.VERSION})"
    if status == S.ZB_E_VERSION and field == "ext_version":
        return (f"ext_version: unsupported zerobatch extension version {f['ext_version']} "
                f"(this release reads {L.EXT_VERSION})")
    if status == S.ZB_E_VERSION:
        return f"hash_algo: unsupported checksum algorithm code {f['hash_algo']} (known: 1 = XXH3-64)"
    if status == S.ZB_E_DTYPE:
        return f"dtype: unsupported token dtype code {f['dtype']} (known: 0 = uint32)"
    if status == S.ZB_E_FLAGS:
        unknown = f["ext_flags"] & ~L.EXT_FLAGS_KNOWN
        return f"ext_flags: unknown flag bits 0x{unknown:x} in 0x{f['ext_flags']:x}"
    if status == S.ZB_E_CHECKSUM:
        return (f"header_hash: the header checksum does not match its bytes (stored "
                f"0x{f['header_hash']:016x}, computed 0x{f['computed_header_hash']:016x})")
    if status == S.ZB_E_RESERVED:
        return "reserved: reserved header bytes must be zero"
    if status == S.ZB_E_FIELD and field in ("batch_size", "seq_len"):
        return f"{field}: must be between 1 and 2**31-1, got 0"
    if status == S.ZB_E_LIMIT and field == "batch_size":
        return f"batch_size: must be between 1 and 2**31-1, got {f['batch_size']}"
    if status == S.ZB_E_LIMIT and field == "seq_len":
        return f"seq_len: must be between 1 and 2**31-1, got {f['seq_len']}"
    if status in (S.ZB_E_LIMIT, S.ZB_E_OVERFLOW):
        return (f"batch_bytes: batch_size {f['batch_size']} x seq_len {f['seq_len']} x 4 bytes "
                f"exceeds the limit of {L.MAX_BATCH_BYTES} bytes per batch")
    if status == S.ZB_E_FIELD and field == "trailer_offset":
        return (f"trailer_offset: extension says {f['trailer_offset']}, but the last batch ends "
                f"at {f['data_end']}")
    if status == S.ZB_E_FIELD and field == "trailer_size":
        return (f"trailer_size: extension says {f['trailer_size']} bytes, expected "
                f"{f['num_batches'] * checksum_bytes} for {f['num_batches']} batches")
    if status == S.ZB_E_FIELD and field == "trailer_hash":
        return "trailer_hash: must be zero when the file has no batch checksums"
    if status == S.ZB_E_FIELD and field == "max_token":
        return "max_token: must be zero when the max_token flag is not set"
    if status == S.ZB_E_SIZE:
        extra = f["file_size"] - f["expected_file_size"]
        return (f"file_size: the file holds {f['file_size']} bytes but its header describes "
                f"{f['expected_file_size']} ({extra} extra bytes after the last batch)")
    return f"{field}: invalid header (status {status})"


def geometry_message(status: int, field: str, batch_size: int, seq_len: int) -> str:
    """The error message for a geometry refused by ``llmbatch_geometry``."""
    if status == S.ZB_E_FIELD:
        return f"{field} must be between 1 and 2**31-1, got 0"
    if field == "batch_size":
        return f"batch_size must be between 1 and 2**31-1, got {batch_size}"
    if field == "seq_len":
        return f"seq_len must be between 1 and 2**31-1, got {seq_len}"
    return (f"batch_size {batch_size} x seq_len {seq_len} x 4 bytes exceeds the limit of "
            f"{L.MAX_BATCH_BYTES} bytes per batch")


def check_uint(value: Any, name: str, maximum: int) -> int:
    """``value`` as an int in ``[0, maximum]``, or ConfigError naming ``name``.

    ``bool`` and floats are refused (``True`` is an ``int`` in Python, never a count here).
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ConfigError(f"{name} must be an integer, got {value!r}", field=name)
    v = value.__index__()
    if v < 0 or v > maximum:
        raise ConfigError(f"{name} must be between 0 and {maximum}, got {v}", field=name)
    return v


def pack_fields(
    *,
    batch_size: Any,
    seq_len: Any,
    num_batches: Any,
    seed: Any,
    total_records: Any,
    extension: bool,
    checksums: bool,
    max_token: Any,
    trailer_hash: Any,
    build_id: Any,
) -> dict[str, Any]:
    """Validate the arguments of ``pack_llmbatch_header`` and derive the extension fields.

    The caller has already validated ``batch_size`` and ``seq_len`` with
    ``llmbatch_geometry``; ``padded`` comes from there.
    """
    from zerobatch.core import llmbatch_geometry

    _raw, padded = llmbatch_geometry(batch_size, seq_len)
    f: dict[str, Any] = {
        "batch_size": batch_size,
        "seq_len": seq_len,
        "num_batches": check_uint(num_batches, "num_batches", 2**64 - 1),
        "seed": check_uint(seed, "seed", 2**32 - 1),
        "total_records": check_uint(total_records, "total_records", 2**32 - 1),
        "has_ext": bool(extension),
        "ext_flags": 0,
        "max_token": 0,
        "trailer_offset": 0,
        "trailer_size": 0,
        "trailer_hash": 0,
        "build_id": bytes(16),
    }
    if not extension:
        return f
    if checksums:
        f["ext_flags"] |= L.EXT_FLAG_BATCH_CHECKSUMS
    if max_token is not None:
        f["ext_flags"] |= L.EXT_FLAG_MAX_TOKEN
        f["max_token"] = check_uint(max_token, "max_token", 2**32 - 1)
    nb = f["num_batches"]
    f["trailer_offset"] = L.HEADER_SIZE + nb * padded
    f["trailer_size"] = nb * L.CHECKSUM_SIZE if checksums else 0
    if f["trailer_offset"] + f["trailer_size"] > 2**64 - 1:
        raise ConfigError(
            f"num_batches {nb} makes the file larger than 2**64 bytes", field="num_batches"
        )
    if checksums:
        f["trailer_hash"] = check_uint(trailer_hash, "trailer_hash", 2**64 - 1)
    if build_id is not None:
        bid = bytes(build_id)
        if len(bid) != 16:
            raise ConfigError(f"build_id must be 16 bytes, got {len(bid)}", field="build_id")
        f["build_id"] = bid
    return f
