# Declaration-only: the integer types and checked 64-bit arithmetic every kernel uses.
#
# Offsets, counts and indices are 64-bit everywhere. Products and sums of numbers that come
# from a file go through zb_mul_u64 / zb_add_u64, which report overflow instead of wrapping.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

cdef extern from *:
    """
    #include <stdint.h>
    /* Return 1 and leave *out undefined on overflow, else 0. */
    static inline int zb_mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
        return __builtin_mul_overflow(a, b, out);
    }
    static inline int zb_add_u64(uint64_t a, uint64_t b, uint64_t *out) {
        return __builtin_add_overflow(a, b, out);
    }
    """
    bint zb_mul_u64(uint64_t a, uint64_t b, uint64_t *out) noexcept nogil
    bint zb_add_u64(uint64_t a, uint64_t b, uint64_t *out) noexcept nogil
