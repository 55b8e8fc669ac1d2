# Offset math: where batches and blocks live in a file, and which batch an epoch position is.
#
# Contract
#   zb_llmbatch_offsets(indices, k, padded, num_batches, out)
#     post: ZB_OK and out[j] = 4096 + indices[j] * padded for every j < k; or ZB_E_INDEX
#           (out unspecified) when an index is outside [0, num_batches). The caller checked
#           that 4096 + num_batches * padded fits in 64 bits (the file exists).
#   zb_block_shuffle_items(perm, num_blocks, block_size, n, positions, k, out)
#     The block-shuffle order of n items: blocks of block_size consecutive items (the last
#     one shorter when block_size does not divide n) visited in the order `perm`, each block
#     in ascending order. Maps epoch positions to items in O(1) each.
#     pre:  perm is a permutation of [0, num_blocks), num_blocks = ceil(n / block_size).
#     post: ZB_OK and out[j] = item at epoch position positions[j]; ZB_E_INDEX when a
#           position is outside [0, n); ZB_E_ARGUMENT when perm names a block outside
#           [0, num_blocks) (out unspecified).
#   zb_first_unordered(values, n, strict)
#     post: the first k in [1, n) with values[k] <= values[k - 1] (strict) or values[k] <
#           values[k - 1] (not strict), or -1 when there is none: one pass over an index file's
#           entries (u64), no copy.

from libc.stdint cimport int64_t, uint64_t

from zerobatch.core._layout cimport LLMBATCH_HEADER_SIZE
from zerobatch.core._status cimport ZB_E_ARGUMENT, ZB_E_INDEX, ZB_OK

import numpy as np

from zerobatch.core.status import raise_for_status
from zerobatch.formats.errors import ConfigError, OutOfRangeError

__all__ = ["block_shuffle_items", "first_unordered", "llmbatch_batch_offsets"]


cdef int zb_llmbatch_offsets(const int64_t *indices, int64_t k, uint64_t padded,
                             uint64_t num_batches, int64_t *out) noexcept nogil:
    cdef int64_t j
    for j in range(k):
        if indices[j] < 0 or <uint64_t>indices[j] >= num_batches:
            return ZB_E_INDEX
        out[j] = LLMBATCH_HEADER_SIZE + indices[j] * <int64_t>padded
    return ZB_OK


cdef int zb_block_shuffle_items(const int64_t *perm, int64_t num_blocks, int64_t block_size,
                                int64_t n, const int64_t *positions, int64_t k,
                                int64_t *out) noexcept nogil:
    cdef int64_t last_len = n - (num_blocks - 1) * block_size  # 1..block_size
    cdef int64_t short_slot = num_blocks  # slot of the short block in perm (none if full)
    cdef int64_t j, p, slot, within, block, q
    if last_len != block_size:
        for j in range(num_blocks):
            if perm[j] == num_blocks - 1:
                short_slot = j
                break
    for j in range(k):
        p = positions[j]
        if p < 0 or p >= n:
            return ZB_E_INDEX
        if p < short_slot * block_size:
            slot = p // block_size
            within = p - slot * block_size
        elif p < short_slot * block_size + last_len:
            slot = short_slot
            within = p - short_slot * block_size
        else:
            q = p - (short_slot * block_size + last_len)
            slot = short_slot + 1 + q // block_size
            within = q - (slot - short_slot - 1) * block_size
        block = perm[slot]
        if block < 0 or block >= num_blocks:
            return ZB_E_ARGUMENT
        out[j] = block * block_size + within
    return ZB_OK


def llmbatch_batch_offsets(indices, padded_batch_bytes, num_batches, out=None):
    """Byte offsets of LLMBATCH batches: ``4096 + i * padded_batch_bytes``.

    Args:
        indices: integer array-like of batch indices.
        padded_batch_bytes: the file's slot size.
        num_batches: the file's batch count (indices must lie in ``[0, num_batches)``).
        out: optional ``int64`` array of ``len(indices)`` elements.

    Returns:
        An ``int64`` array of byte offsets.

    Raises:
        IndexError: an index outside ``[0, num_batches)``.
        ConfigError: the geometry does not fit in 63 bits or ``out`` does not fit.
    """
    if padded_batch_bytes < 1 or num_batches < 0 or \
            LLMBATCH_HEADER_SIZE + num_batches * padded_batch_bytes > 2**63 - 1:
        raise ConfigError(f"padded_batch_bytes {padded_batch_bytes} x num_batches "
                          f"{num_batches} is not a valid geometry", field="num_batches")
    cdef const int64_t[::1] idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    if out is None:
        out = np.empty(idx.shape[0], dtype=np.int64)
    cdef int64_t[::1] dst = out
    if dst.shape[0] != idx.shape[0]:
        raise ConfigError(f"out holds {dst.shape[0]} offsets, expected {idx.shape[0]}",
                          field="out")
    cdef int status = ZB_OK
    cdef uint64_t padded = padded_batch_bytes, nb = num_batches
    if idx.shape[0]:
        with nogil:
            status = zb_llmbatch_offsets(&idx[0], idx.shape[0], padded, nb, &dst[0])
    if status != ZB_OK:
        raise_for_status(status, f"a batch index is outside [0, {num_batches})", field="indices")
    return out


def block_shuffle_items(block_perm, block_size, n, positions, out=None):
    """Items at the given epoch positions of a block-shuffle order, GIL released.

    The order visits blocks of ``block_size`` consecutive items (the last one shorter when
    ``block_size`` does not divide ``n``) in the order ``block_perm``, each in ascending order.

    Args:
        block_perm: ``int64`` permutation of ``[0, ceil(n / block_size))``.
        block_size: items per block, at least 1.
        n: items in the order.
        positions: integer array-like of epoch positions in ``[0, n)``.
        out: optional ``int64`` array of ``len(positions)`` elements.

    Returns:
        An ``int64`` array of item indices.

    Raises:
        IndexError: a position outside ``[0, n)``.
        ConfigError: bad ``block_size``, ``n`` or ``block_perm``.
    """
    if block_size < 1 or n < 0:
        raise ConfigError(f"block_size must be >= 1 and n >= 0, got block_size={block_size}, "
                          f"n={n}", field="block_size")
    cdef int64_t nblocks = (n + block_size - 1) // block_size
    cdef const int64_t[::1] perm = np.ascontiguousarray(block_perm, dtype=np.int64).reshape(-1)
    if perm.shape[0] != nblocks:
        raise ConfigError(f"block_perm holds {perm.shape[0]} blocks, expected {nblocks}",
                          field="block_perm")
    cdef const int64_t[::1] pos = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
    if out is None:
        out = np.empty(pos.shape[0], dtype=np.int64)
    cdef int64_t[::1] dst = out
    if dst.shape[0] != pos.shape[0]:
        raise ConfigError(f"out holds {dst.shape[0]} items, expected {pos.shape[0]}",
                          field="out")
    cdef int status = ZB_OK
    cdef int64_t bs = block_size, nn = n
    if pos.shape[0]:
        with nogil:
            status = zb_block_shuffle_items(&perm[0], nblocks, bs, nn, &pos[0], pos.shape[0],
                                            &dst[0])
    if status == ZB_E_INDEX:
        raise OutOfRangeError(f"an epoch position is outside [0, {n})")
    if status != ZB_OK:
        raise_for_status(status, f"block_perm names a block outside [0, {nblocks})",
                         field="block_perm")
    return out


cdef int64_t zb_first_unordered(const uint64_t *values, int64_t n, bint strict) noexcept nogil:
    cdef int64_t k
    cdef uint64_t prev
    if n < 2:
        return -1
    prev = values[0]
    if strict:
        for k in range(1, n):
            if values[k] <= prev:
                return k
            prev = values[k]
    else:
        for k in range(1, n):
            if values[k] < prev:
                return k
            prev = values[k]
    return -1


def first_unordered(values, bint strict=True):
    """The first index ``k`` whose entry does not increase from the one before it (``strict``:
    ``values[k] <= values[k - 1]``; else ``values[k] < values[k - 1]``), or -1: one pass over the
    entries (an index file's ``uint64`` offsets, read in place), GIL released.

    Raises:
        ConfigError: ``values`` not a one-dimensional ``uint64`` array.
    """
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.dtype != np.uint64:
        raise ConfigError(f"values must be a 1-D uint64 array, got {arr.dtype} of shape {arr.shape}", field="values")
    arr = np.ascontiguousarray(arr)
    cdef const uint64_t[::1] v = arr
    cdef int64_t n = v.shape[0], k
    if n < 2:
        return -1
    with nogil:
        k = zb_first_unordered(&v[0], n, strict)
    return k
