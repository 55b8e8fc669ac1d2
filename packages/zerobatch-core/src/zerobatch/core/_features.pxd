# C-level feature-matrix kernels: a global window index to (key, row) by binary search, and the
# gather of row windows. No Python object; status codes from _status.h; contracts in _features.pyx.

from libc.stdint cimport int64_t, uint8_t

# keys[r] = the k with cum[k] <= idx[r] < cum[k + 1]; rows[r] = starts[k] + (idx[r] - cum[k]) *
# stride. ZB_E_INDEX (*bad = r) for an index outside [0, cum[K]).
cdef int zb_feat_locate(const int64_t *cum, const int64_t *starts, int64_t num_keys, int64_t stride,
                        const int64_t *idx, int64_t n, int64_t *rows, int64_t *keys, int64_t *bad) noexcept nogil

# out[r] = rows [rows[r], rows[r] + count) of the row-major matrix at src (total_rows rows of
# row_bytes). ZB_E_INDEX (*bad = r) for a range outside the matrix (nothing copied after it).
cdef int zb_feat_gather_rows(const uint8_t *src, int64_t row_bytes, int64_t total_rows, const int64_t *rows,
                             int64_t n, int64_t count, uint8_t *out, int64_t *bad) noexcept nogil
