# Checksums: XXH3-64 of buffers, and of runs of fixed-size slots.
#
# Contract
#   zb_hash_slots(base, slot_size, count, out)
#     pre:  base points at count * slot_size readable bytes; out has room for count u64.
#     post: out[i] = XXH3-64(base[i*slot_size : (i+1)*slot_size]) for every i < count.
#     No status: it cannot fail once its preconditions hold; the wrappers check them.
#
# The wrappers accept any C-contiguous buffer (bytes, bytearray, mmap, memoryview, NumPy
# arrays, read-only or not) and release the GIL for inputs above 64 KiB.

from libc.stdint cimport uint8_t, uint64_t

from zerobatch.core._types cimport zb_mul_u64

import numpy as np

from zerobatch.formats.errors import ConfigError

__all__ = ["hash_slots", "xxh3_64", "xxh3_kernel"]

cdef uint64_t _GIL_FREE_BYTES = 65536


cdef void zb_hash_slots(const uint8_t *base, uint64_t slot_size, uint64_t count,
                        uint64_t *out) noexcept nogil:
    cdef uint64_t i
    for i in range(count):
        out[i] = zb_xxh3_64(base + i * slot_size, slot_size)


def xxh3_kernel() -> str:
    """The XXH3 loop hashing inputs longer than 240 bytes in this process: ``"avx512"``,
    ``"avx2"`` or ``"sse2"`` (x86-64, chosen from the CPU at the first hash; the environment
    variable ``ZEROBATCH_XXH3=sse2|avx2`` caps it), else ``"portable"`` (the build's own)."""
    cdef int level = zb_xxh3_path()
    return ("sse2", "avx2", "avx512")[level] if level >= 0 else "portable"


def xxh3_64(data) -> int:
    """XXH3-64 (seed 0) of a buffer.

    Args:
        data: any C-contiguous buffer.

    Returns:
        The 64-bit digest as a Python int.
    """
    cdef const uint8_t[::1] view = _as_bytes_view(data)
    cdef uint64_t n = view.shape[0]
    cdef const uint8_t *p = &view[0] if n > 0 else <const uint8_t *>b""
    cdef uint64_t h
    if n >= _GIL_FREE_BYTES:
        with nogil:
            h = zb_xxh3_64(p, n)
    else:
        h = zb_xxh3_64(p, n)
    return h


def hash_slots(data, Py_ssize_t offset, Py_ssize_t slot_size, Py_ssize_t count, out=None):
    """XXH3-64 of ``count`` consecutive slots of ``slot_size`` bytes from ``offset``.

    Args:
        data: any C-contiguous buffer.
        offset: byte offset of the first slot.
        slot_size: bytes per slot (at least 1).
        count: number of slots.
        out: optional ``uint64`` array of ``count`` elements to fill.

    Returns:
        A ``uint64`` array of ``count`` digests (``out`` when given).

    Raises:
        ConfigError: the slots do not lie inside ``data`` or ``out`` does not fit.
    """
    cdef const uint8_t[::1] view = _as_bytes_view(data)
    if offset < 0 or slot_size < 1 or count < 0:
        raise ConfigError(
            f"hash_slots needs offset >= 0, slot_size >= 1 and count >= 0, "
            f"got offset={offset}, slot_size={slot_size}, count={count}", field="slot_size")
    cdef uint64_t span
    if zb_mul_u64(<uint64_t>slot_size, <uint64_t>count, &span) or \
            <uint64_t>offset > <uint64_t>view.shape[0] or \
            span > <uint64_t>view.shape[0] - <uint64_t>offset:
        raise ConfigError(
            f"hash_slots: {count} slots of {slot_size} bytes from offset {offset} do not fit "
            f"in a buffer of {view.shape[0]} bytes", field="count")
    if out is None:
        out = np.empty(count, dtype=np.uint64)
    cdef uint64_t[::1] dst = out
    if dst.shape[0] != count:
        raise ConfigError(f"hash_slots: out holds {dst.shape[0]} digests, expected {count}",
                          field="out")
    if count == 0:
        return out
    with nogil:
        zb_hash_slots(&view[0] + offset, slot_size, count, &dst[0])
    return out


cdef const uint8_t[::1] _as_bytes_view(object data):
    """A flat byte view of any C-contiguous buffer (read-only buffers included)."""
    cdef object mv = memoryview(data)
    if not mv.c_contiguous:
        raise ConfigError("expected a C-contiguous buffer", field="data")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv
