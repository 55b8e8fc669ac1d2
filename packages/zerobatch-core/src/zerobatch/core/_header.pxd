# C-level LLMBATCH header kernels: parse + validate against the file's size, and pack.

from libc.stdint cimport uint8_t, uint32_t, uint64_t

cdef struct zb_llmbatch_header:
    # seed fields
    uint32_t version
    uint32_t batch_size
    uint32_t seq_len
    uint64_t num_batches
    uint32_t dtype
    uint32_t seed
    uint32_t total_records
    # zerobatch extension (zero when absent)
    bint has_ext
    uint32_t ext_version
    uint32_t ext_flags
    uint32_t hash_algo
    uint32_t max_token
    uint64_t trailer_offset
    uint64_t trailer_size
    uint64_t trailer_hash
    uint8_t build_id[16]
    uint64_t header_hash
    uint64_t computed_header_hash
    # derived (valid when parse returns ZB_OK)
    uint64_t raw_batch_bytes
    uint64_t padded_batch_bytes
    uint64_t data_end
    uint64_t expected_file_size
    uint64_t file_size
    # the field at fault when parse fails: an index into LLMBATCH_FIELD_NAMES
    int bad_field

# Parse and validate the first `n` bytes of a file of `file_size` bytes.
cdef int zb_llmbatch_parse(const uint8_t *buf, uint64_t n, uint64_t file_size,
                           zb_llmbatch_header *h) noexcept nogil

# Compute raw and padded batch bytes with limits and overflow checks.
cdef int zb_llmbatch_geometry(uint64_t batch_size, uint64_t seq_len,
                              uint64_t *raw, uint64_t *padded, int *bad_field) noexcept nogil

# Write the 4096-byte header described by `h` into `out` (extension and hash included when
# h.has_ext is set). The caller validated the fields.
cdef void zb_llmbatch_pack(const zb_llmbatch_header *h, uint8_t *out) noexcept nogil
