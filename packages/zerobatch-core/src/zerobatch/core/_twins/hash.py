"""XXH3-64 (seed 0, default secret) and per-slot hashing: the twin of ``_hash.pyx``.

Ported from xxHash 0.8 (``_vendor/xxhash.h``): the short-input paths in Python integers, the
long-input path with NumPy ``uint64`` arithmetic (wrapping by definition).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from zerobatch.formats.errors import ConfigError

__all__ = ["hash_slots", "xxh3_64", "xxh3_kernel"]


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
