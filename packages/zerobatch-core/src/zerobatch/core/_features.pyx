# Feature matrices: global window index -> (key, row) by binary search, and window gathers.
#
# Contract (the C kernels are declared in _features.pxd)
#   locate_windows(cum, starts, stride, indices, rows, keys): cum holds K + 1 non-decreasing
#     window counts (cum[0] = 0, cum[K] = total), starts the K first rows of the keys. For each
#     index g in [0, total): keys[r] = the k with cum[k] <= g < cum[k + 1] (binary search,
#     O(log K)), rows[r] = starts[k] + (g - cum[k]) * stride. An index outside [0, total)
#     raises OutOfRangeError before anything is written.
#   gather_rows(buffer, row_bytes, total_rows, rows, count, out): copies rows
#     [rows[r], rows[r] + count) of the row-major matrix in `buffer` into out[r]; every range
#     is checked against total_rows first. Both loops run with the GIL released.

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcpy

from zerobatch.core._status cimport ZB_E_INDEX, ZB_OK

import numpy as np

from zerobatch.core.status import raise_for_status
from zerobatch.formats.errors import ConfigError

__all__ = ["gather_rows", "locate_windows"]


cdef int zb_feat_locate(const int64_t *cum, const int64_t *starts, int64_t num_keys, int64_t stride,
                        const int64_t *idx, int64_t n, int64_t *rows, int64_t *keys, int64_t *bad) noexcept nogil:
    cdef int64_t total = cum[num_keys], r, g, lo, hi, mid
    for r in range(n):
        if idx[r] < 0 or idx[r] >= total:
            bad[0] = r
            return ZB_E_INDEX
    for r in range(n):
        g = idx[r]
        lo = 0
        hi = num_keys
        while lo < hi:
            mid = (lo + hi) >> 1
            if cum[mid + 1] <= g:
                lo = mid + 1
            else:
                hi = mid
        keys[r] = lo
        rows[r] = starts[lo] + (g - cum[lo]) * stride
    return ZB_OK


cdef int zb_feat_gather_rows(const uint8_t *src, int64_t row_bytes, int64_t total_rows, const int64_t *rows,
                             int64_t n, int64_t count, uint8_t *out, int64_t *bad) noexcept nogil:
    cdef int64_t r
    for r in range(n):
        if rows[r] < 0 or rows[r] > total_rows - count:
            bad[0] = r
            return ZB_E_INDEX
    for r in range(n):
        memcpy(out + r * count * row_bytes, src + rows[r] * row_bytes, count * row_bytes)
    return ZB_OK


def locate_windows(const int64_t[::1] cum, const int64_t[::1] starts, int64_t stride, indices,
                   int64_t[::1] rows, int64_t[::1] keys):
    """See the module comment. Returns ``(rows, keys)``."""
    cdef const int64_t[::1] idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    cdef int64_t n = idx.shape[0], K = starts.shape[0], bad = 0
    cdef int status = ZB_OK
    if cum.shape[0] != K + 1 or rows.shape[0] < n or keys.shape[0] < n:
        raise ConfigError("locate: cum needs K + 1 entries and rows / keys room for every index", field="cum")
    if n:
        with nogil:
            status = zb_feat_locate(&cum[0], &starts[0] if K else NULL, K, stride, &idx[0], n, &rows[0], &keys[0],
                                    &bad)
    if status != ZB_OK:
        raise_for_status(status, f"window index {idx[bad]} out of range [0, {cum[K]})", field="index")
    return np.asarray(rows[:n]), np.asarray(keys[:n])


def gather_rows(buffer, int64_t row_bytes, int64_t total_rows, rows, int64_t count, out):
    """See the module comment. Returns ``out``."""
    cdef const int64_t[::1] rr = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
    cdef int64_t n = rr.shape[0], bad = 0
    cdef int status = ZB_OK
    if row_bytes <= 0 or count < 0 or total_rows < 0:
        raise ConfigError("gather_rows: row_bytes must be positive, count and total_rows not negative",
                          field="row_bytes")
    cdef Py_buffer src, dst
    PyObject_GetBuffer(buffer, &src, PyBUF_C_CONTIGUOUS)
    try:
        if src.len < total_rows * row_bytes:
            raise ConfigError("gather_rows: the buffer is shorter than total_rows rows", field="buffer")
        PyObject_GetBuffer(out, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        try:
            if dst.len != n * count * row_bytes:
                raise ConfigError(f"out must hold {n} windows of {count} rows of {row_bytes} bytes", field="out")
            if n:
                with nogil:
                    status = zb_feat_gather_rows(<const uint8_t *>src.buf, row_bytes, total_rows, &rr[0], n, count,
                                                 <uint8_t *>dst.buf, &bad)
        finally:
            PyBuffer_Release(&dst)
    finally:
        PyBuffer_Release(&src)
    if status != ZB_OK:
        raise_for_status(status, f"rows [{rr[bad]}, {rr[bad] + count}) are outside the matrix's {total_rows} rows",
                         field="rows")
    return out
