# C-level LLMCHNK kernels: records of a mapped file copied into caller batches, each checked
# against its checksum the first time it is served. No Python object, no state but the
# caller's (the verified bitmap is the reader's); status codes from _status.h.

from libc.stdint cimport int64_t, uint8_t

# A validated LLMCHNK file as the kernels see it.
cdef struct zb_chnk_file:
    const uint8_t *base         # the whole file
    int64_t num_records         # N
    int64_t table               # byte offset of the N + 1 record offsets (u64 LE)
    int64_t sums                # byte offset of the N record checksums (u64 LE), or -1: none
    int itemsize                # 2 (uint16 tokens) or 4 (uint32)
    uint8_t *verified           # the caller's bitmap (a byte per record) of records already checked, or NULL

# Check record i against its checksum unless `verified` marks it (then marks it).
# post: ZB_OK; ZB_E_CHECKSUM (the record's bytes do not match).
cdef int zb_chnk_check(const zb_chnk_file *f, int64_t i) noexcept nogil

# Copy records idx[r] (checked, in range) into the k rows of `rows` (int64 when `wide`, else
# int32; `width` tokens each): the first min(len, width) tokens, then pad; lengths[r] = the
# record's tokens; mask rows (optional, uint8) get 1 on record tokens, 0 on padding.
# post: ZB_OK; ZB_E_CHECKSUM / ZB_E_RANGE (an id of 2**31 or more into int32), *bad = the record.
cdef int zb_chnk_gather(const zb_chnk_file *f, const int64_t *idx, int64_t k, int64_t width, void *rows,
                        bint wide, int64_t pad, uint8_t *mask, int64_t *lengths, int64_t *bad) noexcept nogil
