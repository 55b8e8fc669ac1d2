"""Pure-NumPy twins of every compiled kernel: the oracle the tests check the kernels against.

Same functions, same arguments, same results and the same exceptions as the compiled
modules, written for clarity rather than speed. ``ZEROBATCH_PUREPYTHON=1`` makes
``zerobatch.core`` export these instead of the compiled kernels (slow; for debugging and for
platforms without a compiler).

XXH3-64 is ported from xxHash 0.8 (``_vendor/xxhash.h``): the short-input paths in Python
integers, the long-input path with NumPy ``uint64`` arithmetic (wrapping by definition).
"""

from __future__ import annotations

import math
import operator
import struct
from typing import Any

import numpy as np

from zerobatch.core._checks import as_positions, check_count, check_out, check_position, check_seed, positions_and_out
from zerobatch.core._header_common import (
    FIELD_NAMES,
    check_uint,
    geometry_message,
    header_from_fields,
    pack_fields,
    parse_message,
)
from zerobatch.core._status import raise_for_status
from zerobatch.formats import llmbatch as L
from zerobatch.formats.errors import ConfigError, CorruptError, IntegrityError

__all__ = [
    "ChunkRecords",
    "gather_rows",
    "locate_windows",
    "FeistelPermutation",
    "FileMapping",
    "RecordGather",
    "buffer_views",
    "zrecord_status_error",
    "WindowGather",
    "gather_windows",
    "epoch_seed",
    "random_draws",
    "LLMBatchSlots",
    "TaskPool",
    "block_shuffle_items",
    "hash_slots",
    "llmbatch_batch_offsets",
    "llmbatch_geometry",
    "max_u32",
    "pad_rows",
    "pack_llmbatch_header",
    "parse_llmbatch_header",
    "widen_u32",
    "xxh3_64",
    "xxh3_kernel",
]

# --------------------------------------------------------------------------------------------
# XXH3-64, seed 0, default secret

_M64 = (1 << 64) - 1
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_P64_4, _P64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
_MX1, _MX2 = 0x165667919E3779F9, 0x9FB21C651E98DF25
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_STRIPE = 64
_STRIPES_PER_BLOCK = (len(_SECRET) - _STRIPE) // 8  # 16
_BLOCK = _STRIPE * _STRIPES_PER_BLOCK  # 1024


def _r64(b: bytes | memoryview, i: int) -> int:
    return int.from_bytes(b[i:i + 8], "little")


def _r32(b: bytes | memoryview, i: int) -> int:
    return int.from_bytes(b[i:i + 4], "little")


def _mul_fold(a: int, b: int) -> int:
    p = a * b
    return (p & _M64) ^ (p >> 64)


def _avalanche(h: int) -> int:
    h ^= h >> 37
    h = (h * _MX1) & _M64
    return h ^ (h >> 32)


def _xxh64_avalanche(h: int) -> int:
    h ^= h >> 33
    h = (h * _P64_2) & _M64
    h ^= h >> 29
    h = (h * _P64_3) & _M64
    return h ^ (h >> 32)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M64


def _rrmxmx(h: int, n: int) -> int:
    h ^= _rotl(h, 49) ^ _rotl(h, 24)
    h = (h * _MX2) & _M64
    h ^= ((h >> 35) + n) & _M64
    h = (h * _MX2) & _M64
    return h ^ (h >> 28)


def _mix16(b: bytes, i: int, s: int) -> int:
    return _mul_fold(_r64(b, i) ^ _r64(_SECRET, s), _r64(b, i + 8) ^ _r64(_SECRET, s + 8))


def _xxh3_short(b: bytes) -> int:
    n = len(b)
    s = _SECRET
    if n == 0:
        return _xxh64_avalanche(_r64(s, 56) ^ _r64(s, 64))
    if n <= 3:
        combined = (b[0] << 16) | (b[n >> 1] << 24) | b[n - 1] | (n << 8)
        return _xxh64_avalanche(combined ^ (_r32(s, 0) ^ _r32(s, 4)))
    if n <= 8:
        in64 = _r32(b, n - 4) + (_r32(b, 0) << 32)
        return _rrmxmx(in64 ^ (_r64(s, 8) ^ _r64(s, 16)), n)
    if n <= 16:
        lo = _r64(b, 0) ^ (_r64(s, 24) ^ _r64(s, 32))
        hi = _r64(b, n - 8) ^ (_r64(s, 40) ^ _r64(s, 48))
        swapped = int.from_bytes(lo.to_bytes(8, "little"), "big")
        return _avalanche((n + swapped + hi + _mul_fold(lo, hi)) & _M64)
    acc = (n * _P64_1) & _M64
    if n <= 128:
        if n > 32:
            if n > 64:
                if n > 96:
                    acc += _mix16(b, 48, 96) + _mix16(b, n - 64, 112)
                acc += _mix16(b, 32, 64) + _mix16(b, n - 48, 80)
            acc += _mix16(b, 16, 32) + _mix16(b, n - 32, 48)
        acc += _mix16(b, 0, 0) + _mix16(b, n - 16, 16)
        return _avalanche(acc & _M64)
    # 129..240
    for i in range(8):
        acc += _mix16(b, 16 * i, 16 * i)
    acc = _avalanche(acc & _M64)
    for i in range(8, n // 16):
        acc += _mix16(b, 16 * i, 16 * (i - 8) + 3)
    acc += _mix16(b, n - 16, 136 - 17)
    return _avalanche(acc & _M64)


_SECRET_WORDS = np.frombuffer(_SECRET, dtype="<u8", count=(len(_SECRET) - 7) // 8)


def _secret_lanes(offset: int) -> np.ndarray:
    return np.frombuffer(_SECRET[offset:offset + 64], dtype="<u8").astype(np.uint64)


# Secret words for stripe k of a block: secret[8k : 8k + 64].
_STRIPE_KEYS = np.stack([_secret_lanes(8 * k) for k in range(_STRIPES_PER_BLOCK)])
_SCRAMBLE_KEY = _secret_lanes(len(_SECRET) - _STRIPE)
_LAST_KEY = _secret_lanes(len(_SECRET) - _STRIPE - 7)
_LANE_SWAP = np.array([1, 0, 3, 2, 5, 4, 7, 6])
_LOW32 = np.uint64(0xFFFFFFFF)


def _accumulate(acc: np.ndarray, stripes: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """acc += the contributions of `stripes` ([k, 8] u64) keyed by `keys` ([k, 8] u64).

    Every step of accumulate_512 only adds into the accumulators, so a block's stripes can
    be summed in any order.
    """
    if stripes.shape[0] == 0:
        return acc
    with np.errstate(over="ignore"):
        data_key = stripes ^ keys
        product = (data_key & _LOW32) * (data_key >> np.uint64(32))
        acc = acc + product.sum(axis=0, dtype=np.uint64)
        acc = acc + stripes.sum(axis=0, dtype=np.uint64)[_LANE_SWAP]
    return acc


def _xxh3_long(b: bytes) -> int:
    n = len(b)
    acc = np.array([_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1], dtype=np.uint64)
    nb_blocks = (n - 1) // _BLOCK
    words = np.frombuffer(b, dtype="<u8", count=n // 8).astype(np.uint64)
    with np.errstate(over="ignore"):
        for blk in range(nb_blocks):
            stripes = words[blk * 128:(blk + 1) * 128].reshape(_STRIPES_PER_BLOCK, 8)
            acc = _accumulate(acc, stripes, _STRIPE_KEYS)
            acc = acc ^ (acc >> np.uint64(47))
            acc = acc ^ _SCRAMBLE_KEY
            acc = acc * np.uint64(_P32_1)
        nb_stripes = ((n - 1) - _BLOCK * nb_blocks) // _STRIPE
        start = nb_blocks * 128
        stripes = words[start:start + nb_stripes * 8].reshape(nb_stripes, 8)
        acc = _accumulate(acc, stripes, _STRIPE_KEYS[:nb_stripes])
        last = np.frombuffer(b[n - _STRIPE:], dtype="<u8").astype(np.uint64).reshape(1, 8)
        acc = _accumulate(acc, last, _LAST_KEY.reshape(1, 8))
    a = [int(x) for x in acc]
    result = (n * _P64_1) & _M64
    for i in range(4):
        result += _mul_fold(a[2 * i] ^ _r64(_SECRET, 11 + 16 * i), a[2 * i + 1] ^ _r64(_SECRET, 11 + 16 * i + 8))
    return _avalanche(result & _M64)


def _bytes_of(data: Any) -> bytes:
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ConfigError("expected a C-contiguous buffer", field="data")
    return mv.cast("B").tobytes() if mv.ndim != 1 or mv.format != "B" else bytes(mv)


def xxh3_64(data: Any) -> int:
    """XXH3-64 (seed 0) of a buffer."""
    b = _bytes_of(data)
    return _xxh3_short(b) if len(b) <= 240 else _xxh3_long(b)


def xxh3_kernel() -> str:
    """Twin of the compiled kernel query: this module hashes in Python."""
    return "reference"


def hash_slots(data: Any, offset: int, slot_size: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
    """XXH3-64 of ``count`` consecutive slots of ``slot_size`` bytes from ``offset``."""
    b = _bytes_of(data)
    if offset < 0 or slot_size < 1 or count < 0:
        raise ConfigError(
            f"hash_slots needs offset >= 0, slot_size >= 1 and count >= 0, "
            f"got offset={offset}, slot_size={slot_size}, count={count}", field="slot_size")
    if offset > len(b) or slot_size * count > len(b) - offset:
        raise ConfigError(
            f"hash_slots: {count} slots of {slot_size} bytes from offset {offset} do not fit "
            f"in a buffer of {len(b)} bytes", field="count")
    if out is None:
        out = np.empty(count, dtype=np.uint64)
    if out.shape != (count,):
        raise ConfigError(f"hash_slots: out holds {out.size} digests, expected {count}", field="out")
    for i in range(count):
        out[i] = xxh3_64(b[offset + i * slot_size:offset + (i + 1) * slot_size])
    return out


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


# --------------------------------------------------------------------------------------------
# Gather


def _tokens(src: Any) -> np.ndarray:
    b = memoryview(src).cast("B")
    if len(b) % 4:
        raise ConfigError(f"src holds {len(b)} bytes, not a multiple of 4", field="src")
    return np.frombuffer(b, dtype="<u4")


def _out_array(out: Any, elements: int, what: str) -> np.ndarray:
    arr = np.asarray(out)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ConfigError(f"{what}: out must be a writable C-contiguous buffer", field="out")
    if arr.dtype not in (np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint32)):
        raise ConfigError(f"{what}: out must hold int64, int32 or uint32 elements, got {arr.dtype}", field="out")
    if arr.size != elements:
        raise ConfigError(f"{what}: out holds {arr.size} elements, expected {elements}", field="out")
    return arr.reshape(-1)


def _convert(tokens: np.ndarray, flat: np.ndarray) -> bool:
    """flat[:] = tokens; False when flat is int32 and a token is 2**31 or more."""
    if flat.dtype == np.int32 and tokens.size and int(tokens.max()) >= 2**31:
        return False
    flat[...] = tokens.astype(flat.dtype, copy=False) if flat.dtype != np.int32 else tokens.view(np.int32)
    return True


def widen_u32(src: Any, out: Any) -> Any:
    """Convert little-endian ``uint32`` tokens into a preallocated output."""
    t = _tokens(src)
    flat = _out_array(out, t.size, "widen_u32")
    if not _convert(t, flat):
        raise ConfigError("widen_u32: a token is 2**31 or more and does not fit in int32", field="out")
    return out


def max_u32(src: Any) -> int:
    """Largest little-endian ``uint32`` in a buffer (0 for an empty one)."""
    t = _tokens(src)
    return int(t.max()) if t.size else 0


def _rows_fit(a: Any, shape: tuple[int, ...], dtypes: tuple[Any, ...]) -> bool:
    return (isinstance(a, np.ndarray) and a.shape == shape and a.flags.c_contiguous and a.flags.writeable
            and a.dtype in tuple(np.dtype(d) for d in dtypes))


def pad_rows(tokens: Any, lengths: Any, pad_id: int = 0, mask: Any = None, labels: Any = None,
             ignore_id: int = -100) -> Any:
    """Padding after each row's first ``lengths[r]`` tokens, the mask and the labels."""
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 2 or not _rows_fit(tokens, tokens.shape,
                                                                                (np.int64, np.int32)):
        raise ConfigError("pad_rows: tokens must be a writable C-contiguous int64 or int32 array [k, w]",
                          field="tokens")
    k, w = tokens.shape
    lens = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
    if lens.size != k:
        raise ConfigError(f"pad_rows: lengths holds {lens.size} values for {k} rows", field="lengths")
    if tokens.dtype == np.int32 and not (-2**31 <= pad_id < 2**31 and -2**31 <= ignore_id < 2**31):
        raise ConfigError(f"pad_rows: pad_id {pad_id} or ignore_id {ignore_id} does not fit in int32",
                          field="pad_id")
    if mask is not None and not _rows_fit(mask, tokens.shape, (np.bool_, np.uint8)):
        raise ConfigError(f"pad_rows: mask must be a writable C-contiguous bool or uint8 array of shape "
                          f"{tokens.shape}", field="mask")
    if labels is not None and not _rows_fit(labels, tokens.shape, (tokens.dtype,)):
        raise ConfigError(f"pad_rows: labels must be a writable C-contiguous {tokens.dtype} array of shape "
                          f"{tokens.shape}", field="labels")
    for name, other in (("mask", mask), ("labels", labels)):
        if other is not None and np.may_share_memory(tokens, other):
            raise ConfigError(f"pad_rows: {name} shares memory with tokens", field=name)
    bad = np.flatnonzero((lens < 0) | (lens > w))
    if bad.size:
        r = int(bad[0])
        raise ConfigError(f"pad_rows: lengths[{r}] = {lens[r]} is outside [0, {w}]", field="lengths")
    inside = np.arange(w)[None, :] < lens[:, None]
    np.putmask(tokens, ~inside, pad_id)
    if mask is not None:
        mask[...] = inside
    if labels is not None:
        labels[...] = np.where(inside, tokens, ignore_id)
    return tokens


class TaskPool:
    """Twin of the compiled ``TaskPool``: no threads, gathers run when queued."""

    def __init__(self, num_threads: int = 2, capacity: int = 256) -> None:
        if not 1 <= num_threads <= 256:
            raise ConfigError(f"num_threads must be between 1 and 256, got {num_threads}", field="num_threads")
        self.num_threads = num_threads
        self.threads: list[Any] = []
        self.pending = 0

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def reinit_after_fork(self) -> None:
        pass


class _Ticket:
    def __init__(self, out: Any, error: BaseException | None) -> None:
        self.out = out
        self.error = error

    def wait(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.out

    def cancel(self) -> bool:
        return False


class LLMBatchSlots:
    """Twin of the compiled ``LLMBatchSlots``: access to the batch slots of a mapped file."""

    def __init__(self, buffer: Any, header: L.LLMBatchHeader, *, verify: bool = True, path: Any = None) -> None:
        self._data = np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8)
        if self._data.size != header.file_size:
            raise ConfigError(f"LLMBatchSlots: buffer holds {self._data.size} bytes, header "
                              f"describes {header.file_size}", field="buffer", path=path)
        self.path = path
        self.num_batches = header.num_batches
        self.batch_size = header.batch_size
        self.seq_len = header.seq_len
        self.tokens_per_batch = header.batch_size * header.seq_len
        self.raw_batch_bytes = header.raw_batch_bytes
        self.padded_batch_bytes = header.padded_batch_bytes
        self.has_checksums = header.has_checksums
        self.verify = bool(verify and header.has_checksums)
        self.int32_safe = header.max_token is not None and header.max_token < 2**31
        self._trailer = header.trailer_offset
        self._verified = np.zeros(self.num_batches, dtype=bool)
        self._int32_ok = np.zeros(self.num_batches, dtype=bool)
        shape = (header.num_batches, header.batch_size, header.seq_len)
        strides = (header.padded_batch_bytes, header.seq_len * 4, 4)
        if header.num_batches:
            self._u32_views = np.ndarray(shape, "<u4", buffer=buffer, offset=L.HEADER_SIZE, strides=strides)
            self._i32_views = np.ndarray(shape, "<i4", buffer=buffer, offset=L.HEADER_SIZE, strides=strides)
        else:
            self._u32_views = np.zeros(shape, "<u4")
            self._i32_views = np.zeros(shape, "<i4")
        self._u32_views.flags.writeable = False

    def view_uint32(self, i: Any) -> np.ndarray:
        return self._u32_views[self.check(i)]

    def view_int32(self, i: Any) -> np.ndarray:
        return self._i32_views[self.check_int32(i)]

    def new_int64(self, i: Any) -> np.ndarray:
        return self.read_into(i, np.empty((self.batch_size, self.seq_len), np.int64))

    def gather_async(self, pool: Any, indices: Any, out: Any) -> _Ticket:
        idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        for j in idx:
            if j < 0 or j >= self.num_batches:
                raise IndexError(f"{self.path}: batch index {j} out of range [0, {self.num_batches})")
        _out_array(out, idx.size * self.tokens_per_batch, "gather")
        try:
            self.gather(idx, out)
        except Exception as exc:  # raised by wait(), as the compiled pool does
            return _Ticket(out, exc)
        return _Ticket(out, None)

    def _index(self, i: Any) -> int:
        j = operator.index(i)
        if j < 0 or j >= self.num_batches:
            raise IndexError(f"{self.path}: batch index {j} out of range [0, {self.num_batches})")
        return int(j)

    def _slot(self, i: int) -> np.ndarray:
        start = L.HEADER_SIZE + i * self.padded_batch_bytes
        return self._data[start:start + self.padded_batch_bytes]

    def _expected(self, i: int) -> int:
        return _r64(self._data[self._trailer + 8 * i:self._trailer + 8 * i + 8].tobytes(), 0)

    def _verify(self, i: int) -> None:
        if not self.verify or self._verified[i]:
            return
        got = xxh3_64(self._slot(i))
        if got != self._expected(i):
            raise IntegrityError(
                f"batch_checksum: batch {i} does not match its checksum (stored "
                f"0x{self._expected(i):016x}, computed 0x{got:016x})",
                path=self.path, field="batch_checksum")
        self._verified[i] = True

    def check(self, i: Any) -> int:
        idx = self._index(i)
        self._verify(idx)
        return idx

    def is_verified(self, i: Any) -> bool:
        return bool(self._verified[self._index(i)])

    def check_int32(self, i: Any) -> int:
        idx = self.check(i)
        if self.int32_safe or self._int32_ok[idx]:
            return idx
        m = max_u32(self._slot(idx)[:self.raw_batch_bytes])
        if m >= 2**31:
            raise ConfigError(f"batch {idx} holds token id {m}, which does not fit in int32; "
                              f"read it as int64", path=self.path, field="dtype")
        self._int32_ok[idx] = True
        return idx

    def _copy(self, idx: int, flat: np.ndarray) -> None:
        if not _convert(_tokens(self._slot(idx)[:self.raw_batch_bytes]), flat):
            raise ConfigError(f"batch {idx} holds a token id of 2**31 or more, which does not "
                              f"fit in int32; read it as int64", path=self.path, field="dtype")

    def read_into(self, i: Any, out: Any) -> Any:
        idx = self._index(i)
        flat = _out_array(out, self.tokens_per_batch, "read_into")
        self._verify(idx)
        self._copy(idx, flat)
        return out

    def gather(self, indices: Any, out: Any) -> Any:
        idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        for j in idx:
            if j < 0 or j >= self.num_batches:
                raise IndexError(f"{self.path}: batch index {j} out of range [0, {self.num_batches})")
        flat = _out_array(out, idx.size * self.tokens_per_batch, "gather")
        t = self.tokens_per_batch
        for k, j in enumerate(idx):
            self._verify(int(j))
            self._copy(int(j), flat[k * t:(k + 1) * t])
        return out

    def _check_range(self, start: int, stop: int, what: str) -> None:
        if start < 0 or start > stop or stop > self.num_batches:
            raise ConfigError(f"{what}: [{start}, {stop}) is not inside [0, {self.num_batches})",
                              field="stop", path=self.path)

    def verify_range(self, start: int, stop: int) -> list[int]:
        self._check_range(start, stop, "verify_range")
        bad = []
        if not self.has_checksums:
            return bad
        for i in range(start, stop):
            if xxh3_64(self._slot(i)) != self._expected(i):
                bad.append(i)
            else:
                self._verified[i] = True
        return bad

    def padding_is_zero(self, start: int, stop: int) -> bool:
        self._check_range(start, stop, "padding_is_zero")
        return not any(self._slot(i)[self.raw_batch_bytes:].any() for i in range(start, stop))

    def max_token(self, start: int, stop: int) -> int:
        self._check_range(start, stop, "max_token")
        return max((max_u32(self._slot(i)[:self.raw_batch_bytes]) for i in range(start, stop)), default=0)


# --------------------------------------------------------------------------------------------
# Offsets and orders


def llmbatch_batch_offsets(indices: Any, padded_batch_bytes: int, num_batches: int, out: np.ndarray | None = None) -> np.ndarray:
    """Byte offsets of LLMBATCH batches: ``4096 + i * padded_batch_bytes``."""
    if padded_batch_bytes < 1 or num_batches < 0 or L.HEADER_SIZE + num_batches * padded_batch_bytes > 2**63 - 1:
        raise ConfigError(f"padded_batch_bytes {padded_batch_bytes} x num_batches {num_batches} "
                          f"is not a valid geometry", field="num_batches")
    idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    if out is None:
        out = np.empty(idx.size, dtype=np.int64)
    if out.shape != idx.shape:
        raise ConfigError(f"out holds {out.size} offsets, expected {idx.size}", field="out")
    if idx.size and (idx.min() < 0 or idx.max() >= num_batches):
        raise IndexError(f"a batch index is outside [0, {num_batches})")
    out[...] = L.HEADER_SIZE + idx * padded_batch_bytes
    return out


def block_shuffle_items(block_perm: Any, block_size: int, n: int, positions: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Items at the given epoch positions of a block-shuffle order (see the compiled twin)."""
    if block_size < 1 or n < 0:
        raise ConfigError(f"block_size must be >= 1 and n >= 0, got block_size={block_size}, n={n}",
                          field="block_size")
    nblocks = -(-n // block_size)
    perm = np.ascontiguousarray(block_perm, dtype=np.int64).reshape(-1)
    if perm.size != nblocks:
        raise ConfigError(f"block_perm holds {perm.size} blocks, expected {nblocks}", field="block_perm")
    if perm.size and (perm.min() < 0 or perm.max() >= nblocks):
        raise ConfigError(f"block_perm names a block outside [0, {nblocks})", field="block_perm")
    pos = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
    if out is None:
        out = np.empty(pos.size, dtype=np.int64)
    if out.shape != pos.shape:
        raise ConfigError(f"out holds {out.size} items, expected {pos.size}", field="out")
    if pos.size and (pos.min() < 0 or pos.max() >= n):
        raise IndexError(f"an epoch position is outside [0, {n})")
    # The whole order, spelled out: concatenate the blocks in permuted order.
    order = np.concatenate([np.arange(b * block_size, min((b + 1) * block_size, n)) for b in perm]) \
        if nblocks else np.empty(0, dtype=np.int64)
    out[...] = order[pos]
    return out


# --------------------------------------------------------------------------------------
# Feistel permutation (twin of _feistel.pyx / _feistel.h), in exact Python integers.

_M32 = 0xFFFFFFFF
SPECK_ROUNDS = 27
FEISTEL_MAX_ROUNDS = 1024
FEISTEL_DEFAULT_ROUNDS = 6


def _ror32(x: int, r: int) -> int:
    return ((x >> r) | (x << (32 - r))) & _M32


def _rol32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _M32


def speck_expand(key_lo: int, key_hi: int) -> list[int]:
    """Speck64/128 round keys of the 128-bit key ``(key_lo, key_hi)`` (gfc's speck_expand)."""
    k = [key_lo & _M32, key_lo >> 32, key_hi & _M32, key_hi >> 32]
    b, a = k[0], k[1:]
    keys = [b]
    for i in range(SPECK_ROUNDS - 1):
        x = (_ror32(a[i % 3], 8) + b) & _M32
        x ^= i
        a[i % 3] = x
        b = _rol32(b, 3) ^ x
        keys.append(b)
    return keys


def speck_encrypt(keys: list[int], block: int) -> int:
    """Speck64/128 encryption of a 64-bit block (low word first)."""
    y, x = block & _M32, block >> 32
    for k in keys:
        x = ((_ror32(x, 8) + y) & _M32) ^ k
        y = _rol32(y, 3) ^ x
    return y | (x << 32)


def ceil_sqrt(n: int) -> int:
    """The least ``a >= 0`` with ``a * a >= n`` (exact, no floating point)."""
    r = math.isqrt(n)
    return r if r * r == n else r + 1


class FeistelPermutation:
    """Twin of :class:`zerobatch.core._feistel.FeistelPermutation` (see ``_feistel.h``)."""

    def __init__(self, n: Any, rounds: Any = FEISTEL_DEFAULT_ROUNDS, seed: Any = 0) -> None:
        self.n = check_count(n, "n")
        self.rounds = check_count(rounds, "rounds", maximum=FEISTEL_MAX_ROUNDS)
        self.seed = check_seed(seed)
        self._a = max(ceil_sqrt(self.n), 1)
        self._keys = [speck_expand(self.seed, j) for j in range(self.rounds)]

    @property
    def side(self) -> int:
        return 0 if self.n == 0 else self._a

    @property
    def path(self) -> str:
        return "portable"

    @property
    def simd(self) -> bool:
        return False

    def _use_path(self, name: str) -> None:
        if name != "portable":
            raise ConfigError(f"bulk path {name!r} is not available in the pure-Python twin", field="path")

    def _use_simd(self, flag: bool) -> None:
        pass

    def _fe(self, m: int) -> int:
        a = self._a
        left, right = m % a, m // a
        for keys in self._keys:
            left, right = right, (left + speck_encrypt(keys, right)) % a
        return a * left + right if self.rounds & 1 else a * right + left

    def _fe_inv(self, c: int) -> int:
        a = self._a
        if self.rounds & 1:
            left, right = c // a, c % a
        else:
            left, right = c % a, c // a
        for keys in reversed(self._keys):
            right, left = left, (right - speck_encrypt(keys, left)) % a
        return a * right + left

    def _encrypt(self, m: int) -> int:
        c = self._fe(m)
        while c >= self.n:
            c = self._fe(c)
        return c

    def _decrypt(self, c: int) -> int:
        m = self._fe_inv(c)
        while m >= self.n:
            m = self._fe_inv(m)
        return m

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(self.n)
            return self.take(np.arange(start, stop, step, dtype=np.int64))
        return self._encrypt(check_position(i, self.n, "position"))

    def inverse(self, j: Any) -> int:
        return self._decrypt(check_position(j, self.n, "value"))

    def range(self, start: Any, stop: Any, *, inverse: bool = False) -> np.ndarray:
        start = check_count(start, "start")
        stop = check_count(stop, "stop")
        if start > stop or stop > self.n:
            raise IndexError(f"range [{start}, {stop}) is not within [0, {self.n})")
        return self.fill(np.empty(stop - start, dtype=np.int64), start, inverse=inverse)

    def fill(self, out: Any, start: Any = 0, *, inverse: bool = False) -> np.ndarray:
        if not isinstance(out, np.ndarray):
            raise ConfigError("out must be a C-contiguous int64 numpy array", field="out")
        check_out(out, out.size)
        s = check_count(start, "start")
        if s + out.size > self.n:
            raise IndexError(f"positions [{s}, {s + out.size}) are not within [0, {self.n})")
        f = self._decrypt if inverse else self._encrypt
        flat = out.reshape(-1)
        for k in range(out.size):
            flat[k] = f(s + k)
        return out

    def take(self, positions: Any, out: Any = None, *, inverse: bool = False) -> np.ndarray:
        pos, out = positions_and_out(positions, out)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            what = "value" if inverse else "position"
            raise IndexError(f"a {what} is outside [0, {self.n})")
        f = self._decrypt if inverse else self._encrypt
        vals = [f(int(p)) for p in pos]
        out.reshape(-1)[:] = vals
        return out

    def __iter__(self) -> Any:
        return (self._encrypt(i) for i in range(self.n))

    def __reduce__(self) -> Any:
        return (type(self), (self.n, self.rounds, self.seed))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FeistelPermutation):
            return NotImplemented
        return (self.n, self.rounds, self.seed) == (other.n, other.rounds, other.seed)

    def __hash__(self) -> int:
        return hash((FeistelPermutation, self.n, self.rounds, self.seed))

    def __repr__(self) -> str:
        return f"FeistelPermutation(n={self.n}, rounds={self.rounds}, seed={self.seed})"


_DOMAIN_EPOCH = 0x7A62657063680000
_DOMAIN_DRAW_HI = 0x7A62647261770001
_DOMAIN_DRAW_LO = 0x7A62647261770002


def epoch_seed(seed: Any, epoch: Any) -> int:
    """Twin of :func:`zerobatch.core._feistel.epoch_seed`."""
    s = check_seed(seed)
    e = check_count(epoch, "epoch")
    return speck_encrypt(speck_expand(s, _DOMAIN_EPOCH), e)


def random_draws(seed: Any, counters: Any, n: Any, out: Any = None) -> np.ndarray:
    """Twin of :func:`zerobatch.core._feistel.random_draws`."""
    s = check_seed(seed)
    nn = check_count(n, "n", minimum=1)
    ctr, out = positions_and_out(counters, out, "counters")
    if ctr.size and ctr.min() < 0:
        raise IndexError("counters: a draw counter is negative")
    k0, k1 = speck_expand(s, _DOMAIN_DRAW_HI), speck_expand(s, _DOMAIN_DRAW_LO)
    vals = []
    for c in ctr.tolist():
        x = (speck_encrypt(k0, c) << 64) | speck_encrypt(k1, c)
        vals.append((x * nn) >> 128)
    out.reshape(-1)[:] = vals
    return out


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
            raise IndexError(f"a range is not within [0, {self.total})")
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
            raise IndexError(f"a window of {L} tokens falls outside [0, {self.total})")
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
            raise IndexError(f"a window of {L} tokens falls outside [0, {self.total})")
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
        raise IndexError(f"a window of {L} tokens falls outside [0, {total})")
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


class FileMapping:
    """Twin of :class:`zerobatch.core._mapping.FileMapping` on ``mmap.mmap`` (which keeps a
    duplicate of the descriptor: fine for debugging, not for thousands of shards)."""

    def __init__(self, fd: int, size: int, path: Any = None) -> None:
        import mmap

        if size < 0:
            raise ConfigError(f"size must be >= 0, got {size}", field="size")
        self.size, self.path = size, path
        self._m = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None

    @property
    def address(self) -> int:
        if self._m is None:
            return 0
        return np.frombuffer(self._m, dtype=np.uint8).ctypes.data

    @property
    def closed(self) -> bool:
        return self._m is not None and self._m.closed

    def advise(self, advice: str) -> None:
        if advice not in ("random", "sequential", "willneed", "normal"):
            raise ConfigError(f"advice must be random, sequential, willneed or normal, got {advice!r}",
                              field="advice")

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self._m if self._m is not None else b"")

    def close(self) -> None:
        if self._m is not None:
            self._m.close()

    def __len__(self) -> int:
        return self.size


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
            raise IndexError(f"index {int(idx[bad[0]])} is out of range for a store of {length} records")
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


# --------------------------------------------------------------------------------------------
# LLMCHNK records


class ChunkRecords:
    """Twin of :class:`zerobatch.core._llmchnk.ChunkRecords` (NumPy, same checks and errors)."""

    def __init__(self, buffer: Any, num_records: int, itemsize: int, checksums: bool, verify: bool,
                 path: Any = None) -> None:
        if itemsize not in (2, 4):
            raise ConfigError(f"itemsize must be 2 or 4, got {itemsize}", path=path, field="dtype")
        self._buf = np.frombuffer(buffer, np.uint8)
        self.num_records = int(num_records)
        self.itemsize = itemsize
        self.checksums = bool(checksums)
        self.verify = bool(verify and checksums)
        self.path = path
        if 32 + 8 * (self.num_records + 1) > self._buf.size:
            raise ConfigError("the buffer is shorter than the offset table", path=path, field="num_records")
        self._table = self._buf[32:32 + 8 * (self.num_records + 1)].view("<u8")
        self._sums = self._buf[self._buf.size - 16 - 8 * self.num_records:self._buf.size - 16].view("<u8") \
            if checksums else None
        self._verified = np.zeros(self.num_records if self.verify else 0, np.uint8)

    def _index(self, i: int) -> int:
        if not 0 <= i < self.num_records:
            raise IndexError(f"{self.path}: record index {i} out of range [0, {self.num_records})")
        return i

    def _check(self, i: int) -> None:
        if not self.verify or self._verified[i]:
            return
        a, b = int(self._table[i]), int(self._table[i + 1])
        got, stored = xxh3_64(self._buf[a:b].tobytes()), int(self._sums[i])  # type: ignore[index]
        if got != stored:
            raise IntegrityError(f"record_checksum: record {i} does not match its checksum (stored "
                                 f"0x{stored:016x}, computed 0x{got:016x})", path=self.path, field="record_checksum")
        self._verified[i] = 1

    def span(self, i: int) -> tuple[int, int]:
        self._check(self._index(int(i)))
        a = int(self._table[i])
        return a, (int(self._table[i + 1]) - a) // self.itemsize

    def lengths(self, indices: Any) -> np.ndarray:
        idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        for i in idx.tolist():
            self._index(i)
        return ((self._table[idx + 1] - self._table[idx]) // self.itemsize).astype(np.int64)

    def is_verified(self, i: int) -> bool:
        return bool(self.verify and 0 <= i < self.num_records and self._verified[i])

    def gather(self, indices: Any, out: Any, mask: Any = None, pad_id: int = 0) -> np.ndarray:
        idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        k = idx.size
        if not isinstance(out, np.ndarray) or out.ndim != 2 or out.shape[0] != k \
                or out.dtype not in (np.int64, np.int32) or not out.flags.c_contiguous or not out.flags.writeable:
            raise ConfigError(f"out must be a writable C-contiguous int64 or int32 array of {k} rows", field="out")
        wide = out.dtype == np.int64
        if not wide and not -2**31 <= pad_id < 2**31:
            raise ConfigError(f"pad_id {pad_id} does not fit in int32", field="pad_id")
        if mask is not None and (not isinstance(mask, np.ndarray) or mask.shape != out.shape
                                 or mask.dtype not in (np.uint8, np.bool_) or not mask.flags.c_contiguous
                                 or not mask.flags.writeable):
            raise ConfigError(f"mask must be a writable C-contiguous bool or uint8 array of shape {out.shape}",
                              field="mask")
        for i in idx.tolist():
            self._index(i)
        width = out.shape[1]
        dt = "<u4" if self.itemsize == 4 else "<u2"
        lengths = np.empty(k, np.int64)
        for r, i in enumerate(idx.tolist()):
            self._check(i)
            a, b = int(self._table[i]), int(self._table[i + 1])
            tokens = self._buf[a:b].view(dt)
            lengths[r] = tokens.size
            m = min(tokens.size, width)
            if not wide and m and int(tokens[:m].max()) >= 2**31:
                raise ConfigError(f"record {i} holds a token id of 2**31 or more, which does not fit in int32; "
                                  "read it as int64", path=self.path, field="dtype")
            out[r, :m] = tokens[:m]
            out[r, m:] = pad_id
            if mask is not None:
                mask[r, :m] = 1
                mask[r, m:] = 0
        return lengths


# --------------------------------------------------------------------------------------------
# feature matrices


def locate_windows(cum: Any, starts: Any, stride: int, indices: Any, rows: Any,
                   keys: Any) -> tuple[np.ndarray, np.ndarray]:
    """Twin of :func:`zerobatch.core._features.locate`."""
    cum = np.asarray(cum, np.int64)
    starts = np.asarray(starts, np.int64)
    idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    if cum.size != starts.size + 1 or len(rows) < idx.size or len(keys) < idx.size:
        raise ConfigError("locate: cum needs K + 1 entries and rows / keys room for every index", field="cum")
    total = int(cum[-1])
    for g in idx.tolist():
        if not 0 <= g < total:
            raise IndexError(f"window index {g} out of range [0, {total})")
    k = np.searchsorted(cum, idx, side="right") - 1
    rows[:idx.size] = starts[k] + (idx - cum[k]) * stride
    keys[:idx.size] = k
    return np.asarray(rows[:idx.size]), np.asarray(keys[:idx.size])


def gather_rows(buffer: Any, row_bytes: int, total_rows: int, rows: Any, count: int, out: Any) -> Any:
    """Twin of :func:`zerobatch.core._features.gather_rows`."""
    rr = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
    if row_bytes <= 0 or count < 0 or total_rows < 0:
        raise ConfigError("gather_rows: row_bytes must be positive, count and total_rows not negative",
                          field="row_bytes")
    for r in rr.tolist():
        if r < 0 or r > total_rows - count:
            raise IndexError(f"rows [{r}, {r + count}) are outside the matrix's {total_rows} rows")
    src = np.frombuffer(buffer, np.uint8)
    if src.size < total_rows * row_bytes:
        raise ConfigError("gather_rows: the buffer is shorter than total_rows rows", field="buffer")
    dst = out.reshape(-1).view(np.uint8)
    if dst.size != rr.size * count * row_bytes:
        raise ConfigError(f"out must hold {rr.size} windows of {count} rows of {row_bytes} bytes", field="out")
    w = count * row_bytes
    for i, r in enumerate(rr.tolist()):
        dst[i * w:(i + 1) * w] = src[r * row_bytes:r * row_bytes + w]
    return out
