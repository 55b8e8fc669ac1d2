# C-level offset kernels: where LLMBATCH batches live in a file, and which item a position of a
# block-shuffle epoch is. Status codes from _status.h; contracts in _offsets.pyx.

from libc.stdint cimport int64_t, uint64_t

# out[j] = 4096 + indices[j] * padded; ZB_E_INDEX for an index outside [0, num_batches).
cdef int zb_llmbatch_offsets(const int64_t *indices, int64_t k, uint64_t padded,
                             uint64_t num_batches, int64_t *out) noexcept nogil

# out[j] = the item at epoch position positions[j] of the block-shuffle order `perm` of n
# items in blocks of block_size; ZB_E_INDEX (a position outside [0, n)), ZB_E_ARGUMENT (perm
# names a block outside [0, num_blocks)).
cdef int zb_block_shuffle_items(const int64_t *perm, int64_t num_blocks, int64_t block_size,
                                int64_t n, const int64_t *positions, int64_t k,
                                int64_t *out) noexcept nogil

# The first k in [1, n) whose entry does not increase from values[k - 1] (strict: <=; else <),
# or -1.
cdef int64_t zb_first_unordered(const uint64_t *values, int64_t n, bint strict) noexcept nogil
