# C-level checksum kernel: XXH3-64 (xxHash 0.8, seed 0) from the vendored
# single-header xxHash (_vendor/xxhash.h, BSD-2-Clause), compiled inline into each module.

from libc.stdint cimport uint8_t, uint64_t

cdef extern from *:
    """
    #include <stdlib.h>
    #include <string.h>
    /* x86-64 builds target the baseline (SSE2); inputs of more than 240 bytes take xxHash's
       AVX2 or AVX-512 long-input loop when the CPU and OS support them (checked at run time,
       as xxHash's own xxh_x86dispatch.c does). Every path computes the same XXH3-64. */
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) \
        && !defined(__AVX2__) && !defined(ZB_XXH_NO_DISPATCH)
    #define ZB_XXH_DISPATCH 1
    #define XXH_X86DISPATCH 1
    #include <immintrin.h>
    #define XXH_DISPATCH_AVX2 1
    #define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
    #define XXH_DISPATCH_AVX512 1
    #define XXH_TARGET_AVX512 __attribute__((__target__("avx512f")))
    #endif
    #define XXH_INLINE_ALL
    #define XXH_STATIC_LINKING_ONLY
    #include "_vendor/xxhash.h"
    #if ZB_XXH_DISPATCH
    XXH_NO_INLINE XXH_TARGET_AVX2 XXH64_hash_t zb_xxh3_long_avx2(const void *p, size_t n) {
        return XXH3_hashLong_64b_internal(p, n, XXH3_kSecret, sizeof(XXH3_kSecret),
                                          XXH3_accumulate_avx2, XXH3_scrambleAcc_avx2);
    }
    XXH_NO_INLINE XXH_TARGET_AVX512 XXH64_hash_t zb_xxh3_long_avx512(const void *p, size_t n) {
        return XXH3_hashLong_64b_internal(p, n, XXH3_kSecret, sizeof(XXH3_kSecret),
                                          XXH3_accumulate_avx512, XXH3_scrambleAcc_avx512);
    }
    /* 0: baseline, 1: AVX2, 2: AVX-512F; ZEROBATCH_XXH3=sse2|avx2 caps it (for tests). */
    static int zb_xxh3_level = -1;
    static int zb_xxh3_pick(void) {
        int level = 0;
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2")) level = 1;
        if (__builtin_cpu_supports("avx512f")) level = 2;
        const char *cap = getenv("ZEROBATCH_XXH3");
        if (cap && strcmp(cap, "sse2") == 0) level = 0;
        else if (cap && strcmp(cap, "avx2") == 0 && level > 1) level = 1;
        zb_xxh3_level = level;
        return level;
    }
    static inline uint64_t zb_xxh3_64(const uint8_t *p, uint64_t n) {
        if (n > XXH3_MIDSIZE_MAX) {
            int level = zb_xxh3_level >= 0 ? zb_xxh3_level : zb_xxh3_pick();
            if (level == 2) return (uint64_t)zb_xxh3_long_avx512(p, (size_t)n);
            if (level == 1) return (uint64_t)zb_xxh3_long_avx2(p, (size_t)n);
        }
        return (uint64_t)XXH3_64bits((const void *)p, (size_t)n);
    }
    static inline int zb_xxh3_path(void) { return zb_xxh3_level >= 0 ? zb_xxh3_level : zb_xxh3_pick(); }
    #else
    static inline uint64_t zb_xxh3_64(const uint8_t *p, uint64_t n) {
        return (uint64_t)XXH3_64bits((const void *)p, (size_t)n);
    }
    static inline int zb_xxh3_path(void) { return -1; }
    #endif
    """
    uint64_t zb_xxh3_64(const uint8_t *p, uint64_t n) noexcept nogil
    int zb_xxh3_path() noexcept nogil

# Hash `count` consecutive slots of `slot_size` bytes starting at `base` into out[0..count).
cdef void zb_hash_slots(const uint8_t *base, uint64_t slot_size, uint64_t count,
                        uint64_t *out) noexcept nogil
