/* Token copy loops of the TOKSTREAM window gather (_tokstream.pyx), widening u16/u32 token
 * ids to int64/int32 while tracking the largest id (checked against the vocabulary once per
 * run). Contiguous records (no metadata field) take loops the compiler vectorizes
 * (restrict pointers, a max reduction); records with a metadata field are read strided.
 * The widest ISA the CPU has is picked at load time (target_clones). */
#ifndef ZB_TOKSTREAM_H
#define ZB_TOKSTREAM_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define ZB_TS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ZB_TS_CLONES
#endif

/* Ask for the first cache lines of [p, p + nbytes) (at most 512 bytes) without waiting, into
 * every cache level: the copy reads them a few windows later. Every level, because a
 * non-temporal hint (nearest level only) was slower; the first lines only, because asking for
 * a whole window stalls on the line fill buffers, and past them the hardware streamer follows
 * the window by itself (256 to 1024 bytes were alike). asv: bench_tokstream.Windows (random
 * 32 x 513 windows). */
static inline void zb_ts_prefetch(const uint8_t *p, int64_t nbytes) {
    if (nbytes > 512) nbytes = 512;
    for (int64_t off = 0; off < nbytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* Ask for write ownership of the cache lines of [p, p + nbytes) ahead of the stores: a batch's
 * outputs outgrow L1, and with two or three output streams the hardware did not fetch their
 * lines early enough (asv: bench_tokstream.Extras, time_windows_with_metadata (int64 tokens
 * and int32 ids) and time_windows_with_boundaries against time_windows_plain_same_dataset).
 * Prefetches never fault, so the range may run past the buffer. */
static inline void zb_ts_prefetchw(const void *p, int64_t nbytes) {
    for (int64_t off = 0; off < nbytes; off += 64) __builtin_prefetch((const char *)p + off, 1, 3);
}

/* Elements per block of the output loops: the next block's lines are prefetched for writing
 * while this one is written. */
#define ZB_TS_BLOCK 64

/* One segment of the boundary outputs: positions 0..n-1 (int64 or int32, either may be NULL)
 * and a constant segment number (seg may be NULL). */
ZB_TS_CLONES static void zb_ts_fill_segment(int64_t *restrict p64, int32_t *restrict p32, int32_t *restrict seg,
                                             int64_t n, int32_t segno) {
    if (seg == NULL) {
        /* one output stream: the hardware keeps up with it */
        if (p64 != NULL)
            for (int64_t k = 0; k < n; k++) p64[k] = k;
        else if (p32 != NULL)
            for (int64_t k = 0; k < n; k++) p32[k] = (int32_t)k;
        return;
    }
    /* positions and segment ids: two more streams beside the tokens; their lines are asked
     * for ahead, block by block (asv: bench_tokstream.Extras.time_windows_with_boundaries
     * against time_windows_plain_same_dataset) */
    for (int64_t b = 0; b < n; b += ZB_TS_BLOCK) {
        int64_t e = b + ZB_TS_BLOCK < n ? b + ZB_TS_BLOCK : n;
        if (p64 != NULL) {
            zb_ts_prefetchw(p64 + e, ZB_TS_BLOCK * 8);
            for (int64_t k = b; k < e; k++) p64[k] = k;
        } else if (p32 != NULL) {
            zb_ts_prefetchw(p32 + e, ZB_TS_BLOCK * 4);
            for (int64_t k = b; k < e; k++) p32[k] = (int32_t)k;
        }
        zb_ts_prefetchw(seg + e, ZB_TS_BLOCK * 4);
        for (int64_t k = b; k < e; k++) seg[k] = segno;
    }
}

/* Strided loads through these types may alias the records' bytes. */
typedef uint16_t __attribute__((may_alias)) zb_ts_u16;
typedef uint32_t __attribute__((may_alias)) zb_ts_u32;

/* The loop of one record layout: the token is element STEP * k of an array of SRC_T. Written
 * as plain indexing (not memcpy) so that GCC vectorizes the strided loads as well. */
#define ZB_TS_COPY_LOOP(SRC_T, STEP)                                                         \
    do {                                                                                    \
        const SRC_T *restrict s = (const SRC_T *)src;                                       \
        for (int64_t b = 0; b < n; b += ZB_TS_BLOCK) {                                      \
            int64_t e = b + ZB_TS_BLOCK < n ? b + ZB_TS_BLOCK : n;                          \
            zb_ts_prefetchw(dst + e, ZB_TS_BLOCK * (int64_t)sizeof *dst);                   \
            for (int64_t k = b; k < e; k++) {                                               \
                uint32_t v = s[(STEP) * k];                                                 \
                m = v > m ? v : m;                                                          \
                dst[k] = v;                                                                 \
            }                                                                               \
        }                                                                                   \
    } while (0)

/* Records are a u16 or u32 token, then (with metadata) a u32 metadata id: 2, 4, 6 or 8 bytes,
 * so a u16 token with metadata is every 3rd u16 and a u32 token with metadata every 2nd u32. */
#define ZB_TS_COPY(NAME, SRC_T, DST_T)                                                       \
    ZB_TS_CLONES static uint32_t NAME(const uint8_t *src, int64_t stride, DST_T *restrict dst, \
                                      int64_t n) {                                          \
        uint32_t m = 0;                                                                     \
        if (stride == (int64_t)sizeof(SRC_T))                                               \
            ZB_TS_COPY_LOOP(SRC_T, 1);                                                      \
        else if (sizeof(SRC_T) == 2 && stride == 6)                                         \
            ZB_TS_COPY_LOOP(SRC_T, 3);                                                      \
        else if (sizeof(SRC_T) == 4 && stride == 8)                                         \
            ZB_TS_COPY_LOOP(SRC_T, 2);                                                      \
        else                                                                                \
            for (int64_t k = 0; k < n; k++) {                                               \
                SRC_T v;                                                                    \
                memcpy(&v, src + k * stride, sizeof v);                                     \
                m = v > m ? v : m;                                                          \
                dst[k] = (DST_T)v;                                                          \
            }                                                                               \
        return m;                                                                           \
    }

ZB_TS_COPY(zb_ts_copy_u16_i64, zb_ts_u16, int64_t)
ZB_TS_COPY(zb_ts_copy_u16_i32, zb_ts_u16, int32_t)
ZB_TS_COPY(zb_ts_copy_u32_i64, zb_ts_u32, int64_t)
ZB_TS_COPY(zb_ts_copy_u32_i32, zb_ts_u32, int32_t)

/* ---- labels under a 0/1 stream --------------------------------------------------------- */

/* dst[k] = tok[k] where the stream's value at record k is non-zero, else `ignore` (a loss
 * mask turning labels off), returning the largest stream value (checked by the caller against
 * the stream's vocabulary). The stream's records are laid out as a token stream's (a u16 or
 * u32 value, then with metadata a u32 id); the select is branch-free, so the loop vectorizes. */
#define ZB_TS_MASK_LOOP(SRC_T, STEP)                                                         \
    do {                                                                                    \
        const SRC_T *restrict s = (const SRC_T *)src;                                       \
        for (int64_t b = 0; b < n; b += ZB_TS_BLOCK) {                                      \
            int64_t e = b + ZB_TS_BLOCK < n ? b + ZB_TS_BLOCK : n;                          \
            zb_ts_prefetchw(dst + e, ZB_TS_BLOCK * (int64_t)sizeof *dst);                   \
            for (int64_t k = b; k < e; k++) {                                               \
                uint32_t v = s[(STEP) * k];                                                 \
                m = v > m ? v : m;                                                          \
                dst[k] = v ? tok[k] : ignore;                                               \
            }                                                                               \
        }                                                                                   \
    } while (0)

#define ZB_TS_MASK(NAME, SRC_T, DST_T)                                                       \
    ZB_TS_CLONES static uint32_t NAME(const uint8_t *src, int64_t stride, const DST_T *restrict tok, \
                                      DST_T *restrict dst, int64_t n, DST_T ignore) {       \
        uint32_t m = 0;                                                                     \
        if (stride == (int64_t)sizeof(SRC_T))                                               \
            ZB_TS_MASK_LOOP(SRC_T, 1);                                                      \
        else if (sizeof(SRC_T) == 2 && stride == 6)                                         \
            ZB_TS_MASK_LOOP(SRC_T, 3);                                                      \
        else if (sizeof(SRC_T) == 4 && stride == 8)                                         \
            ZB_TS_MASK_LOOP(SRC_T, 2);                                                      \
        else                                                                                \
            for (int64_t k = 0; k < n; k++) {                                               \
                SRC_T v;                                                                    \
                memcpy(&v, src + k * stride, sizeof v);                                     \
                m = v > m ? v : m;                                                          \
                dst[k] = v ? tok[k] : ignore;                                               \
            }                                                                               \
        return m;                                                                           \
    }

ZB_TS_MASK(zb_ts_mask_u16_i64, zb_ts_u16, int64_t)
ZB_TS_MASK(zb_ts_mask_u16_i32, zb_ts_u16, int32_t)
ZB_TS_MASK(zb_ts_mask_u32_i64, zb_ts_u32, int64_t)
ZB_TS_MASK(zb_ts_mask_u32_i32, zb_ts_u32, int32_t)

/* ---- metadata ids ------------------------------------------------------------------- */

#define ZB_TS_NO_METADATA 0xFFFFFFFFu
#define ZB_TS_EMPTY_KEY 0xFFFFFFFFFFFFFFFFull

/* The distinct (shard, metadata id) pairs of a batch in order of first appearance, and an
 * open-addressing table (kept at most half full) from key = shard << 32 | id to the pair's
 * number. Zero-initialize, then zb_ts_distinct_init; zb_ts_distinct_free in every case. */
typedef struct {
    int64_t n, cap, slots;
    int64_t *shard;
    uint32_t *mid;
    uint64_t *keys;
    int32_t *vals;
    uint32_t *raw;             /* the caller's scratch for one window's raw ids (freed here) */
} zb_ts_distinct;

static inline int64_t zb_ts_slot(uint64_t key, int64_t slots) {
    return (int64_t)((key * 0x9E3779B97F4A7C15ull) >> 40) & (slots - 1);
}

static void zb_ts_distinct_free(zb_ts_distinct *d) {
    free(d->shard);
    free(d->mid);
    free(d->keys);
    free(d->vals);
    free(d->raw);
    d->shard = NULL, d->mid = NULL, d->keys = NULL, d->vals = NULL, d->raw = NULL;
}

static int zb_ts_distinct_rehash(zb_ts_distinct *d, int64_t slots) {
    uint64_t *keys = (uint64_t *)malloc((size_t)slots * sizeof *keys);
    int32_t *vals = (int32_t *)malloc((size_t)slots * sizeof *vals);
    if (keys == NULL || vals == NULL) {
        free(keys);
        free(vals);
        return -1;
    }
    for (int64_t i = 0; i < slots; i++) keys[i] = ZB_TS_EMPTY_KEY;
    for (int64_t i = 0; i < d->n; i++) {
        uint64_t key = (uint64_t)d->shard[i] << 32 | d->mid[i];
        int64_t h = zb_ts_slot(key, slots);
        while (keys[h] != ZB_TS_EMPTY_KEY) h = (h + 1) & (slots - 1);
        keys[h] = key;
        vals[h] = (int32_t)i;
    }
    free(d->keys);
    free(d->vals);
    d->keys = keys, d->vals = vals, d->slots = slots;
    return 0;
}

static int zb_ts_distinct_init(zb_ts_distinct *d) {
    d->n = 0, d->cap = 16;
    d->shard = (int64_t *)malloc(16 * sizeof *d->shard);
    d->mid = (uint32_t *)malloc(16 * sizeof *d->mid);
    if (d->shard == NULL || d->mid == NULL) return -1;
    return zb_ts_distinct_rehash(d, 64);
}

/* The number of (shard, mid), added if new; -2 when out of memory. */
static int32_t zb_ts_distinct_id(zb_ts_distinct *d, int64_t shard, uint32_t mid) {
    uint64_t key = (uint64_t)shard << 32 | mid;
    int64_t h = zb_ts_slot(key, d->slots);
    while (d->keys[h] != ZB_TS_EMPTY_KEY) {
        if (d->keys[h] == key) return d->vals[h];
        h = (h + 1) & (d->slots - 1);
    }
    if (d->n == d->cap) {
        int64_t *ns = (int64_t *)realloc(d->shard, (size_t)(2 * d->cap) * sizeof *ns);
        if (ns == NULL) return -2;
        d->shard = ns;
        uint32_t *nm = (uint32_t *)realloc(d->mid, (size_t)(2 * d->cap) * sizeof *nm);
        if (nm == NULL) return -2;
        d->mid = nm;
        d->cap *= 2;
    }
    d->shard[d->n] = shard;
    d->mid[d->n] = mid;
    d->keys[h] = key;
    d->vals[h] = (int32_t)d->n;
    d->n++;
    if (2 * d->n > d->slots && zb_ts_distinct_rehash(d, 2 * d->slots) != 0) return -2;
    return (int32_t)(d->n - 1);
}

/* The metadata ids of n records into ids, as raw u32 (a strided copy GCC vectorizes like
 * the token copies): after a u16 token (6-byte records: two u16 halves) or a u32 token. */
ZB_TS_CLONES static void zb_ts_mids_u16(const uint8_t *src, uint32_t *restrict ids, int64_t n) {
    const zb_ts_u16 *restrict s = (const zb_ts_u16 *)src;
    for (int64_t k = 0; k < n; k++) ids[k] = (uint32_t)s[3 * k + 1] | (uint32_t)s[3 * k + 2] << 16;
}

ZB_TS_CLONES static void zb_ts_mids_u32(const uint8_t *src, uint32_t *restrict ids, int64_t n) {
    const zb_ts_u32 *restrict s = (const zb_ts_u32 *)src;
    for (int64_t k = 0; k < n; k++) ids[k] = s[2 * k + 1];
}

/* Tokens and raw metadata ids of n records in one pass over them (one strided load of each
 * record group feeds both outputs); returns the largest token id. */
#define ZB_TS_COPY_META(NAME, SRC_T, STEP, DST_T)                                            \
    ZB_TS_CLONES static uint32_t NAME(const uint8_t *src, DST_T *restrict dst, uint32_t *restrict raw, \
                                      int64_t n) {                                          \
        const SRC_T *restrict s = (const SRC_T *)src;                                       \
        uint32_t m = 0;                                                                     \
        for (int64_t k = 0; k < n; k++) {                                                   \
            uint32_t v = s[(STEP) * k];                                                     \
            m = v > m ? v : m;                                                              \
            dst[k] = (DST_T)v;                                                              \
            raw[k] = (STEP) == 3 ? (uint32_t)s[3 * k + 1] | (uint32_t)s[3 * k + 2] << 16     \
                                 : (uint32_t)s[2 * k + 1];                                  \
        }                                                                                   \
        return m;                                                                           \
    }

ZB_TS_COPY_META(zb_ts_copy_meta_u16_i64, zb_ts_u16, 3, int64_t)
ZB_TS_COPY_META(zb_ts_copy_meta_u16_i32, zb_ts_u16, 3, int32_t)
ZB_TS_COPY_META(zb_ts_copy_meta_u32_i64, zb_ts_u32, 2, int64_t)
ZB_TS_COPY_META(zb_ts_copy_meta_u32_i32, zb_ts_u32, 2, int32_t)

/* The end of the run of values equal to ids[k] in ids[k..n), compared 64 at a time. */
ZB_TS_CLONES static int64_t zb_ts_run_end(const uint32_t *restrict ids, int64_t k, int64_t n) {
    const uint32_t v = ids[k];
    for (; k + 64 <= n; k += 64) {
        uint32_t diff = 0;
        for (int64_t j = k; j < k + 64; j++) diff |= ids[j] ^ v;
        if (diff) break;
    }
    while (k < n && ids[k] == v) k++;
    return k;
}

ZB_TS_CLONES static void zb_ts_fill_i32(int32_t *restrict p, int64_t n, int32_t v) {
    for (int64_t k = 0; k < n; k++) p[k] = v;
}

/* Number the raw metadata ids of one shard piece (raw: a scratch buffer that stays in L1, so
 * that the output is written once): ids[k] becomes the number of raw[k]'s distinct
 * (shard, id) pair, -1 for none, with one table lookup per run (a document, a span).
 * Returns -1, or the first position whose id is not below nmeta, or -2 when out of memory. */
static int64_t zb_ts_number_ids(const uint32_t *raw, int32_t *ids, int64_t n, int64_t shard, int64_t nmeta,
                                zb_ts_distinct *d) {
    int64_t k = 0;
    while (k < n) {
        uint32_t mid = raw[k];
        int64_t e = zb_ts_run_end(raw, k, n);
        int32_t num = -1;
        if (mid != ZB_TS_NO_METADATA) {
            if ((int64_t)mid >= nmeta) return k;
            num = zb_ts_distinct_id(d, shard, mid);
            if (num == -2) return -2;
        }
        zb_ts_fill_i32(ids + k, e - k, num);
        k = e;
    }
    return -1;
}

static inline int64_t zb_ts_meta_piece_portable(const uint8_t *src, int token_size, int64_t *dst64,
                                                int32_t *dst32, int32_t *ids, int64_t n, int64_t shard,
                                                int64_t nmeta, zb_ts_distinct *d, uint32_t *vmax) {
    uint32_t m = 0;
    if (dst64 == NULL && dst32 == NULL) {
        if (token_size == 2) zb_ts_mids_u16(src, d->raw, n);
        else zb_ts_mids_u32(src, d->raw, n);
    } else if (token_size == 2) {
        m = dst64 != NULL ? zb_ts_copy_meta_u16_i64(src, dst64, d->raw, n) : zb_ts_copy_meta_u16_i32(src, dst32, d->raw, n);
    } else {
        m = dst64 != NULL ? zb_ts_copy_meta_u32_i64(src, dst64, d->raw, n) : zb_ts_copy_meta_u32_i32(src, dst32, d->raw, n);
    }
    *vmax = m > *vmax ? m : *vmax;
    return zb_ts_number_ids(d->raw, ids, n, shard, nmeta, d);
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define ZB_TS_AVX512 __attribute__((target("avx512f,avx512bw")))

/* The block loop of zb_ts_meta_piece on AVX-512: 16 records per step. The tokens and the
 * metadata ids are picked out of the 6- or 8-byte records with one two-register permute
 * each; the ids are compared with the current run's id in one mask compare, and a block
 * without a change stores its 16 numbers with one store. Only a block where a document or
 * span starts is numbered lane by lane. Returns as zb_ts_number_ids; *done receives the
 * records handled (a multiple of 16; the caller does the rest). */
ZB_TS_AVX512 static int64_t zb_ts_meta_blocks_avx512(const uint8_t *src, int token_size, int64_t *dst64,
                                                     int32_t *dst32, int32_t *ids, int64_t n, int64_t shard,
                                                     int64_t nmeta, zb_ts_distinct *d, uint64_t vocab,
                                                     uint32_t *vmax, int64_t *done) {
    const int stride = token_size == 2 ? 6 : 8;
    __m512i tok_idx, mid_idx;
    uint16_t tw[32], mw[32];
    uint32_t td[16], md[16];
    if (token_size == 2) {
        /* words of 16 records: token j at word 3j, its id at words 3j+1 (low), 3j+2 (high);
         * the two loads hold words 0-31 and 16-47, so word w >= 32 is table entry w + 16 */
#define ZB_TS_W(w) (uint16_t)((w) < 32 ? (w) : (w) + 16)
        for (int j = 0; j < 16; j++) {
            tw[j] = tw[j + 16] = ZB_TS_W(3 * j);
            mw[2 * j] = ZB_TS_W(3 * j + 1);
            mw[2 * j + 1] = ZB_TS_W(3 * j + 2);
        }
#undef ZB_TS_W
        tok_idx = _mm512_loadu_si512(tw);
        mid_idx = _mm512_loadu_si512(mw);
    } else {
        /* dwords of 16 records: token j at dword 2j, its id at 2j+1 */
        for (int j = 0; j < 16; j++) {
            td[j] = (uint32_t)(2 * j);
            md[j] = (uint32_t)(2 * j + 1);
        }
        tok_idx = _mm512_loadu_si512(td);
        mid_idx = _mm512_loadu_si512(md);
    }
    /* tokens above `top` are out of the vocabulary: flagged per block in a mask accumulated in a
     * general register (a vector maximum would be kept in memory across the lookup calls) */
    const uint64_t top = vocab - 1;
    const __m512i topv = token_size == 2 ? _mm512_set1_epi16((short)(top < 0xFFFF ? top : 0xFFFF))
                                         : _mm512_set1_epi32((int)(uint32_t)(top < 0xFFFFFFFFu ? top : 0xFFFFFFFFu));
    uint64_t over = 0;
    uint32_t cur = ZB_TS_NO_METADATA;
    int32_t num = -1;
    __m512i curv = _mm512_set1_epi32((int)cur), numv = _mm512_set1_epi32(num);
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        const uint8_t *p = src + k * stride;
        /* this block's outputs are 128 + 64 bytes; ask for the lines 512 bytes on */
        zb_ts_prefetchw(ids + k + 128, 64);
        if (dst64 != NULL)
            zb_ts_prefetchw(dst64 + k + 64, 128);
        else if (dst32 != NULL)
            zb_ts_prefetchw(dst32 + k + 128, 64);
        /* 16 records: 96 bytes (6-byte records: two overlapping loads) or 128 bytes */
        __m512i a = _mm512_loadu_si512(p);
        __m512i b = _mm512_loadu_si512(p + (stride == 6 ? 32 : 64));
        __m512i mids, toks;
        if (token_size == 2) {
            mids = _mm512_permutex2var_epi16(a, mid_idx, b);
            toks = _mm512_permutex2var_epi16(a, tok_idx, b);
            over |= _mm512_cmpgt_epu16_mask(toks, topv);
            __m256i t16 = _mm512_castsi512_si256(toks);
            if (dst64 != NULL) {
                _mm512_storeu_si512(dst64 + k, _mm512_cvtepu16_epi64(_mm256_castsi256_si128(t16)));
                _mm512_storeu_si512(dst64 + k + 8, _mm512_cvtepu16_epi64(_mm256_extracti128_si256(t16, 1)));
            } else if (dst32 != NULL) {
                _mm512_storeu_si512(dst32 + k, _mm512_cvtepu16_epi32(t16));
            }
        } else {
            mids = _mm512_permutex2var_epi32(a, mid_idx, b);
            toks = _mm512_permutex2var_epi32(a, tok_idx, b);
            over |= _mm512_cmpgt_epu32_mask(toks, topv);
            if (dst64 != NULL) {
                _mm512_storeu_si512(dst64 + k, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(toks)));
                _mm512_storeu_si512(dst64 + k + 8, _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(toks, 1)));
            } else if (dst32 != NULL) {
                _mm512_storeu_si512(dst32 + k, toks);
            }
        }
        /* the lanes where the id differs from the one before (lane 0: from the current run) */
        __mmask16 change = _mm512_cmpneq_epu32_mask(mids, _mm512_alignr_epi32(mids, curv, 15));
        if (change == 0) {
            _mm512_storeu_si512(ids + k, numv);
            continue;
        }
        /* a run starts at each set bit: look its id up once and give it the lanes from there
         * on (in registers: a lane store then scalar loads would stall store forwarding) */
        __m512i numbers = numv;
        while (change) {
            int j = __builtin_ctz(change);
            change &= (__mmask16)(change - 1);
            cur = (uint32_t)_mm_cvtsi128_si32(_mm512_castsi512_si128(
                _mm512_permutexvar_epi32(_mm512_set1_epi32(j), mids)));
            if (cur == ZB_TS_NO_METADATA) {
                num = -1;
            } else if ((int64_t)cur >= nmeta) {
                *done = k;
                return k + j;
            } else {
                num = zb_ts_distinct_id(d, shard, cur);
                if (num == -2) return -2;
            }
            numbers = _mm512_mask_mov_epi32(numbers, (__mmask16)(0xFFFFu << j), _mm512_set1_epi32(num));
        }
        _mm512_storeu_si512(ids + k, numbers);
        curv = _mm512_set1_epi32((int)cur);
        numv = _mm512_set1_epi32(num);
    }
    /* a token out of the vocabulary: report the largest possible id, the caller finds it */
    if (over && (dst64 != NULL || dst32 != NULL)) *vmax = 0xFFFFFFFFu;
    *done = k;
    return -1;
}
#endif

/* Whether zb_ts_meta_piece takes the AVX-512 block loop: -1 until first use (then decided by
 * the CPU), 0 forces the portable path (tests run both). */
static int zb_ts_meta_simd = -1;

static int zb_ts_meta_simd_available(void) {
#if defined(__GNUC__) && defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
    return 0;
#endif
}

/* One shard piece of a window with metadata: copy its n tokens into dst64 or dst32 (unless
 * both are NULL) and number each record's metadata id into ids (the number of its distinct
 * (shard, id) pair, -1 for none), in one pass over the records. The AVX-512 block loop
 * where the CPU has it, the portable two-step path (strided copy, then run-by-run
 * numbering) elsewhere and for the last records. Returns -1, or the first record whose id is
 * not below nmeta, or -2 when out of memory; *vmax receives the largest token id copied, or
 * 0xFFFFFFFF when one is not below vocab. */
static int64_t zb_ts_meta_piece(const uint8_t *src, int token_size, int64_t *dst64, int32_t *dst32,
                                int32_t *ids, int64_t n, int64_t shard, int64_t nmeta, zb_ts_distinct *d,
                                uint64_t vocab, uint32_t *vmax) {
    int64_t done = 0, r;
    *vmax = 0;
#if defined(__GNUC__) && defined(__x86_64__)
    if (zb_ts_meta_simd < 0) zb_ts_meta_simd = zb_ts_meta_simd_available();
    if (zb_ts_meta_simd > 0 && n >= 16) {
        r = zb_ts_meta_blocks_avx512(src, token_size, dst64, dst32, ids, n, shard, nmeta, d, vocab, vmax, &done);
        if (r != -1) return r;
    }
#endif
    if (done == n) return -1;
    const int stride = token_size == 2 ? 6 : 8;
    r = zb_ts_meta_piece_portable(src + done * stride, token_size, dst64 == NULL ? NULL : dst64 + done,
                                  dst32 == NULL ? NULL : dst32 + done, ids + done, n - done, shard, nmeta, d,
                                  vmax);
    return r < 0 ? r : r + done;
}

#endif /* ZB_TOKSTREAM_H */
