/* Token copy loops of the TOKSTREAM window gather (_tokstream.pyx), widening u16/u32 token
 * ids to int64/int32 while tracking the largest id (checked against the vocabulary once per
 * run). Contiguous records (no metadata field) take loops the compiler vectorizes
 * (restrict pointers, a max reduction); records with a metadata field are read strided.
 * The widest ISA the CPU has is picked at load time (target_clones). */
#ifndef ZB_TOKSTREAM_H
#define ZB_TOKSTREAM_H

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define ZB_TS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ZB_TS_CLONES
#endif

/* Ask for the cache lines of [p, p + nbytes) (at most 4 KiB of them) without waiting. */
static inline void zb_ts_prefetch(const uint8_t *p, int64_t nbytes) {
    if (nbytes > 4096) nbytes = 4096;
    for (int64_t off = 0; off < nbytes; off += 64) __builtin_prefetch(p + off, 0, 0);
}

/* One segment of the boundary outputs: positions 0..n-1 (int64 or int32, either may be NULL)
 * and a constant segment number (seg may be NULL). */
ZB_TS_CLONES static void zb_ts_fill_segment(int64_t *restrict p64, int32_t *restrict p32, int32_t *restrict seg,
                                             int64_t n, int32_t segno) {
    if (p64 != NULL)
        for (int64_t k = 0; k < n; k++) p64[k] = k;
    else if (p32 != NULL)
        for (int64_t k = 0; k < n; k++) p32[k] = (int32_t)k;
    if (seg != NULL)
        for (int64_t k = 0; k < n; k++) seg[k] = segno;
}

#define ZB_TS_COPY(NAME, SRC_T, DST_T)                                                       \
    ZB_TS_CLONES static uint32_t NAME(const uint8_t *src, int64_t stride, DST_T *restrict dst, \
                                      int64_t n) {                                          \
        uint32_t m = 0;                                                                     \
        if (stride == (int64_t)sizeof(SRC_T)) {                                             \
            const SRC_T *restrict s = (const SRC_T *)src;                                   \
            for (int64_t k = 0; k < n; k++) {                                               \
                uint32_t v = s[k];                                                          \
                m = v > m ? v : m;                                                          \
                dst[k] = (DST_T)v;                                                          \
            }                                                                               \
        } else {                                                                            \
            for (int64_t k = 0; k < n; k++) {                                               \
                SRC_T v;                                                                    \
                memcpy(&v, src + k * stride, sizeof v);                                     \
                m = v > m ? v : m;                                                          \
                dst[k] = (DST_T)v;                                                          \
            }                                                                               \
        }                                                                                   \
        return m;                                                                           \
    }

ZB_TS_COPY(zb_ts_copy_u16_i64, uint16_t, int64_t)
ZB_TS_COPY(zb_ts_copy_u16_i32, uint16_t, int32_t)
ZB_TS_COPY(zb_ts_copy_u32_i64, uint32_t, int64_t)
ZB_TS_COPY(zb_ts_copy_u32_i32, uint32_t, int32_t)

#endif /* ZB_TOKSTREAM_H */
