# C-level gather kernels: copy little-endian uint32 tokens into int64 / int32 / uint32 outputs.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

# Output element kinds understood by the gather kernels.
cdef enum zb_out_kind:
    ZB_OUT_INT64 = 1
    ZB_OUT_INT32 = 2
    ZB_OUT_UINT32 = 3

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
    #define ZB_CLONES __attribute__((target_clones("avx2", "default")))
    #else
    #define ZB_CLONES
    #endif

    /* dst[i] = src[i] for n little-endian uint32 at src (any alignment). */
    ZB_CLONES static void zb_widen_u32_i64(const uint8_t *__restrict src, int64_t n,
                                           int64_t *__restrict dst) {
    #if !(defined(__BYTE_ORDER__) && (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__))
        if ((((uintptr_t)src) & 3u) == 0) {
            const uint32_t *s = (const uint32_t *)__builtin_assume_aligned(src, 4);
            for (int64_t i = 0; i < n; i++) dst[i] = (int64_t)s[i];
            return;
        }
        for (int64_t i = 0; i < n; i++) { uint32_t v; memcpy(&v, src + 4 * i, 4); dst[i] = (int64_t)v; }
    #else
        for (int64_t i = 0; i < n; i++) {
            uint32_t v; memcpy(&v, src + 4 * i, 4); dst[i] = (int64_t)__builtin_bswap32(v);
        }
    #endif
    }

    /* dst[i] = src[i] as int32; returns 1 (and leaves dst unspecified) when a token >= 2**31. */
    ZB_CLONES static int zb_narrow_u32_i32(const uint8_t *__restrict src, int64_t n,
                                           int32_t *__restrict dst) {
        uint32_t acc = 0;
        for (int64_t i = 0; i < n; i++) {
            uint32_t v; memcpy(&v, src + 4 * i, 4);
    #if defined(__BYTE_ORDER__) && (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__)
            v = __builtin_bswap32(v);
    #endif
            acc |= v;
            dst[i] = (int32_t)v;
        }
        return (acc >> 31) != 0;
    }

    /* dst[i] = src[i] as host-order uint32. */
    static void zb_copy_u32(const uint8_t *__restrict src, int64_t n, uint32_t *__restrict dst) {
    #if !(defined(__BYTE_ORDER__) && (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__))
        memcpy(dst, src, (size_t)n * 4);
    #else
        for (int64_t i = 0; i < n; i++) { uint32_t v; memcpy(&v, src + 4 * i, 4); dst[i] = __builtin_bswap32(v); }
    #endif
    }

    /* Largest of n little-endian uint32 (0 when n == 0). */
    ZB_CLONES static uint32_t zb_max_u32(const uint8_t *__restrict src, int64_t n) {
        uint32_t m = 0;
        for (int64_t i = 0; i < n; i++) {
            uint32_t v; memcpy(&v, src + 4 * i, 4);
    #if defined(__BYTE_ORDER__) && (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__)
            v = __builtin_bswap32(v);
    #endif
            m = v > m ? v : m;
        }
        return m;
    }

    /* Set bit i of a bitmap shared between threads; returns nothing. */
    static inline void zb_bit_set(uint8_t *bits, uint64_t i) {
        __atomic_fetch_or(bits + (i >> 3), (uint8_t)(1u << (i & 7u)), __ATOMIC_RELAXED);
    }
    static inline int zb_bit_get(const uint8_t *bits, uint64_t i) {
        return (__atomic_load_n(bits + (i >> 3), __ATOMIC_RELAXED) >> (i & 7u)) & 1u;
    }
    """
    void zb_widen_u32_i64(const uint8_t *src, int64_t n, int64_t *dst) noexcept nogil
    int zb_narrow_u32_i32(const uint8_t *src, int64_t n, int32_t *dst) noexcept nogil
    void zb_copy_u32(const uint8_t *src, int64_t n, uint32_t *dst) noexcept nogil
    uint32_t zb_max_u32(const uint8_t *src, int64_t n) noexcept nogil
    void zb_bit_set(uint8_t *bits, uint64_t i) noexcept nogil
    bint zb_bit_get(const uint8_t *bits, uint64_t i) noexcept nogil

# Convert n tokens at src into dst of the given kind. ZB_OK, or ZB_E_RANGE for an int32
# output and a token >= 2**31 (dst then unspecified).
cdef int zb_convert_tokens(const uint8_t *src, int64_t n, void *dst, int kind) noexcept nogil

# Everything a gather of LLMBATCH batches needs, as plain C data: the kernel runs on a
# TaskPool worker with no Python object in reach.
cdef struct zb_llmbatch_gather:
    const uint8_t *base          # the mapped file
    uint64_t padded              # slot size
    uint64_t tokens              # tokens per batch
    const uint8_t *trailer       # checksum trailer, NULL without checksums
    uint8_t *verified            # bitmap of verified batches (shared, atomic updates)
    uint8_t *int32_ok            # bitmap of batches known to hold no id of 2**31 or more
    bint verify
    const int64_t *items         # batch indices, validated by the submitter
    int64_t count
    char *out                    # count * tokens elements of `kind`; NULL: only check the batches
    int kind                     #   (and, with ZB_OUT_INT32, that every id fits int32)
    int64_t itemsize
    int64_t bad                  # set on failure: the batch at fault

# Run a gather; returns ZB_OK, ZB_E_CHECKSUM or ZB_E_RANGE (with g.bad set).
cdef int zb_llmbatch_gather_run(void *g) noexcept nogil
