# C-level checksum kernel: XXH3-64 (xxHash 0.8, seed 0) from the vendored
# single-header xxHash (_vendor/xxhash.h, BSD-2-Clause), compiled inline into each module.

from libc.stdint cimport uint8_t, uint64_t

cdef extern from *:
    """
    #define XXH_INLINE_ALL
    #define XXH_STATIC_LINKING_ONLY
    #include "_vendor/xxhash.h"
    static inline uint64_t zb_xxh3_64(const uint8_t *p, uint64_t n) {
        return (uint64_t)XXH3_64bits((const void *)p, (size_t)n);
    }
    """
    uint64_t zb_xxh3_64(const uint8_t *p, uint64_t n) noexcept nogil

# Hash `count` consecutive slots of `slot_size` bytes starting at `base` into out[0..count).
cdef void zb_hash_slots(const uint8_t *base, uint64_t slot_size, uint64_t count,
                        uint64_t *out) noexcept nogil
