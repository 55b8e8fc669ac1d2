/* Generalized Feistel cipher over [0, n): a keyed pseudorandom permutation in O(1) memory.
 *
 * The construction of gfc (github.com/maxmouchet/gfc, MIT, Maxime Mouchet), i.e. Black and
 * Rogaway, "Ciphers with Arbitrary Finite Domains" (CT-RSA 2002), Fig. 3 generalized Feistel
 * with cycle walking, with Speck64/128 as the round function:
 *
 *   a = b = ceil(sqrt(n))                                       (exact integer square root)
 *   K_j   = Speck64/128 key schedule of the 128-bit key {seed, j} (little-endian u64 pair)
 *   F_j(R)= Speck64/128 encryption of the 64-bit block R under K_j
 *   fe(m): L = m mod a, R = m div a; for j = 1..r: (L, R) = (R, (L + F_j(R)) mod a)
 *          -> a*L + R when r is odd, a*R + L when r is even
 *   encrypt(m) = fe(m), re-applied while the value is >= n   (cycle walking)
 *
 * fe is a bijection of [0, a*a) for any round function, so encrypt is a bijection of [0, n).
 * Two places where gfc's C code departs from that mathematics, and this file does not:
 *   - gfc computes a with a double-precision sqrt. From n = 2**52 + ... on the rounding can
 *     give a*a < n, and gfc then maps positions outside its Feistel domain: not a
 *     bijection. Here a is the exact integer ceil(sqrt(n)).
 *   - gfc adds L + F_j(R) in uint64_t, which wraps when F_j(R) >= 2**64 - L (probability
 *     about a / 2**64 per round): the round is then not invertible unless a divides 2**64.
 *     Here the sum is taken modulo a exactly ((F mod a) + L, reduced once).
 * Everywhere else the outputs are gfc's, bit for bit (tests compare with pygfc).
 *
 * Contract
 *   zb_feistel_setup(f, n, rounds, seed)
 *     pre:  n <= 2**63 - 1; f->keys has room for rounds * ZB_SPECK_ROUNDS u32.
 *     post: f ready; the round keys are expanded once here, never per call; f->simd says
 *           whether the bulk calls take the AVX-512 path (the CPU has it).
 *   zb_feistel_encrypt(f, m) / zb_feistel_decrypt(f, c)
 *     pre:  m, c < n.  post: the permutation's value and its inverse; never fail.
 *   zb_feistel_fill_range(f, start, count, out, inverse)
 *     pre:  start + count <= n.  post: out[i] = P(start + i) (P^-1 with inverse).
 *   zb_feistel_map(f, positions, count, out, inverse)
 *     post: ZB_OK and out[i] = P(positions[i]) for every i, or ZB_E_INDEX
 *           when a position is outside [0, n) (out unspecified). out may alias positions.
 *   All are thread-safe (f is read-only after setup) and never touch Python.
 *
 * The bulk calls run ZB_FEISTEL_LANES positions side by side. On CPUs with AVX-512 (checked
 * once at run time) the Speck rounds run in zmm registers and F mod a is computed exactly in
 * vector doubles (see the bulk path below); elsewhere a portable path vectorizes Speck at
 * the baseline ISA and reduces with a scalar reciprocal. Both give identical results (the
 * tests run both). Cython cannot attach target attributes, hence this header.
 */
#ifndef ZB_FEISTEL_H
#define ZB_FEISTEL_H

#include "_status.h"

#include <stdint.h>
#include <stddef.h>

#ifdef __FAST_MATH__
#error "_feistel.h relies on exact IEEE double rounding: do not build it with -ffast-math"
#endif

#define ZB_SPECK_ROUNDS 27
#define ZB_FEISTEL_LANES 32 /* positions per bulk block */
#define ZB_PORTABLE_LANES 16

typedef struct {
    uint64_t n;        /* size of the permuted range */
    uint64_t a;        /* ceil(sqrt(n)), at least 1 */
    uint64_t rounds;   /* Feistel rounds r */
    uint64_t barrett;  /* floor((2**64 - 1) / a), for division by a without DIV */
    uint32_t *keys;    /* rounds * ZB_SPECK_ROUNDS expanded Speck round keys */
    int simd;          /* bulk path: ZB_PATH_PORTABLE, _AVX2 or _AVX512 (the best available) */
} zb_feistel;

/* The lane loops must be inlined into each target clone to be compiled for its ISA. */
#define ZB_FEISTEL_INLINE static inline __attribute__((always_inline))

#define ZB_ROR32(x, r) (((x) >> (r)) | ((x) << (32 - (r))))
#define ZB_ROL32(x, r) (((x) << (r)) | ((x) >> (32 - (r))))

/* Speck64/128 key schedule of the key {lo, hi} (as gfc's speck_expand). */
static inline void zb_speck_expand(uint64_t lo, uint64_t hi, uint32_t *s) {
    uint32_t k[4] = {(uint32_t)lo, (uint32_t)(lo >> 32), (uint32_t)hi, (uint32_t)(hi >> 32)};
    uint32_t b = k[0];
    uint32_t a[3] = {k[1], k[2], k[3]};
    s[0] = b;
    for (uint32_t i = 0; i < ZB_SPECK_ROUNDS - 1; i++) {
        uint32_t *x = &a[i % 3];
        *x = ZB_ROR32(*x, 8);
        *x += b;
        *x ^= i;
        b = ZB_ROL32(b, 3);
        b ^= *x;
        s[i + 1] = b;
    }
}

/* Speck64/128 encryption of one 64-bit block (low word first, as gfc reads a uint64_t). */
static inline uint64_t zb_speck_encrypt(const uint32_t *k, uint64_t block) {
    uint32_t y = (uint32_t)block, x = (uint32_t)(block >> 32);
    for (int i = 0; i < ZB_SPECK_ROUNDS; i++) {
        x = ZB_ROR32(x, 8);
        x += y;
        x ^= k[i];
        y = ZB_ROL32(y, 3);
        y ^= x;
    }
    return (uint64_t)y | ((uint64_t)x << 32);
}

/* x div a and x mod a by a precomputed reciprocal: q is floor(x / a) minus 0, 1 or 2, fixed
 * by two branchless corrections (the corrections are data-dependent coin flips; branches
 * would mispredict half the time). */
static inline uint64_t zb_divmod(const zb_feistel *f, uint64_t x, uint64_t *rem) {
    uint64_t q = (uint64_t)(((unsigned __int128)x * f->barrett) >> 64);
    uint64_t r = x - q * f->a;
    uint64_t c = r >= f->a;
    r -= c ? f->a : 0;
    q += c;
    c = r >= f->a;
    r -= c ? f->a : 0;
    q += c;
    *rem = r;
    return q;
}

static inline uint64_t zb_mod(const zb_feistel *f, uint64_t x) {
    uint64_t q = (uint64_t)(((unsigned __int128)x * f->barrett) >> 64);
    uint64_t r = x - q * f->a;
    r = r >= f->a ? r - f->a : r;
    return r >= f->a ? r - f->a : r;
}

/* (l + v) mod a for l < a, any v: exact, never wraps. */
static inline uint64_t zb_addmod(const zb_feistel *f, uint64_t l, uint64_t v) {
    uint64_t s = l + zb_mod(f, v); /* < 2a <= 2**33 */
    return s >= f->a ? s - f->a : s;
}

/* (r - v) mod a for r < a, any v. */
static inline uint64_t zb_submod(const zb_feistel *f, uint64_t r, uint64_t v) {
    uint64_t m = zb_mod(f, v);
    return r >= m ? r - m : r + f->a - m;
}

static inline uint64_t zb_isqrt_ceil(uint64_t n) {
    uint64_t r = 0;
    /* bit-by-bit integer square root: exact for every 64-bit n */
    uint64_t rem = n, bit = (uint64_t)1 << 62;
    while (bit > rem) bit >>= 2;
    while (bit) {
        if (rem >= r + bit) {
            rem -= r + bit;
            r = (r >> 1) + bit;
        } else {
            r >>= 1;
        }
        bit >>= 2;
    }
    return r * r == n ? r : r + 1;
}

static int zb_feistel_simd_available(void);

static inline void zb_feistel_setup(zb_feistel *f, uint64_t n, uint64_t rounds, uint64_t seed) {
    uint64_t a = zb_isqrt_ceil(n);
    f->simd = zb_feistel_simd_available();
    f->n = n;
    f->a = a ? a : 1;
    f->rounds = rounds;
    f->barrett = UINT64_MAX / f->a;
    for (uint64_t j = 0; j < rounds; j++)
        zb_speck_expand(seed, j, f->keys + j * ZB_SPECK_ROUNDS);
}

/* One pass of the Feistel network over [0, a*a). */
static inline uint64_t zb_fe(const zb_feistel *f, uint64_t m) {
    uint64_t l, r = zb_divmod(f, m, &l), t;
    for (uint64_t j = 0; j < f->rounds; j++) {
        t = zb_addmod(f, l, zb_speck_encrypt(f->keys + j * ZB_SPECK_ROUNDS, r));
        l = r;
        r = t;
    }
    return (f->rounds & 1) ? f->a * l + r : f->a * r + l;
}

static inline uint64_t zb_fe_inv(const zb_feistel *f, uint64_t c) {
    uint64_t l, r, t;
    if (f->rounds & 1)
        l = zb_divmod(f, c, &r);
    else
        r = zb_divmod(f, c, &l);
    for (uint64_t j = f->rounds; j >= 1; j--) {
        t = zb_submod(f, r, zb_speck_encrypt(f->keys + (j - 1) * ZB_SPECK_ROUNDS, l));
        r = l;
        l = t;
    }
    return f->a * r + l;
}

static inline uint64_t zb_feistel_encrypt(const zb_feistel *f, uint64_t m) {
    uint64_t c = zb_fe(f, m);
    while (c >= f->n) c = zb_fe(f, c);
    return c;
}

static inline uint64_t zb_feistel_decrypt(const zb_feistel *f, uint64_t c) {
    uint64_t m = zb_fe_inv(f, c);
    while (m >= f->n) m = zb_fe_inv(f, m);
    return m;
}

/* Portable bulk path: ZB_PORTABLE_LANES positions side by side, Speck on u32 lane arrays the
 * compiler vectorizes at the baseline ISA, F mod a by the scalar reciprocal. */
ZB_FEISTEL_INLINE void zb_speck_portable(const uint32_t *k, const uint64_t *in, uint64_t *out) {
    uint32_t x[ZB_PORTABLE_LANES], y[ZB_PORTABLE_LANES];
    for (int l = 0; l < ZB_PORTABLE_LANES; l++) {
        y[l] = (uint32_t)in[l];
        x[l] = (uint32_t)(in[l] >> 32);
    }
    for (int i = 0; i < ZB_SPECK_ROUNDS; i++) {
        const uint32_t ki = k[i];
        for (int l = 0; l < ZB_PORTABLE_LANES; l++) {
            uint32_t xl = ZB_ROR32(x[l], 8) + y[l];
            xl ^= ki;
            y[l] = ZB_ROL32(y[l], 3) ^ xl;
            x[l] = xl;
        }
    }
    for (int l = 0; l < ZB_PORTABLE_LANES; l++)
        out[l] = (uint64_t)y[l] | ((uint64_t)x[l] << 32);
}

/* v[0..LANES) <- P(v) (or P^-1) in place; every v[i] < n on entry. */
ZB_FEISTEL_INLINE void zb_portable_lanes(const zb_feistel *f, uint64_t *v, int inverse) {
    uint64_t L[ZB_PORTABLE_LANES], R[ZB_PORTABLE_LANES], F[ZB_PORTABLE_LANES];
    const uint64_t a = f->a;
    int l;
    if (!inverse) {
        for (l = 0; l < ZB_PORTABLE_LANES; l++) R[l] = zb_divmod(f, v[l], &L[l]);
        for (uint64_t j = 0; j < f->rounds; j++) {
            zb_speck_portable(f->keys + j * ZB_SPECK_ROUNDS, R, F);
            for (l = 0; l < ZB_PORTABLE_LANES; l++) {
                uint64_t t = zb_addmod(f, L[l], F[l]);
                L[l] = R[l];
                R[l] = t;
            }
        }
        if (f->rounds & 1)
            for (l = 0; l < ZB_PORTABLE_LANES; l++) v[l] = a * L[l] + R[l];
        else
            for (l = 0; l < ZB_PORTABLE_LANES; l++) v[l] = a * R[l] + L[l];
        for (l = 0; l < ZB_PORTABLE_LANES; l++)
            while (v[l] >= f->n) v[l] = zb_fe(f, v[l]);
    } else {
        if (f->rounds & 1)
            for (l = 0; l < ZB_PORTABLE_LANES; l++) L[l] = zb_divmod(f, v[l], &R[l]);
        else
            for (l = 0; l < ZB_PORTABLE_LANES; l++) R[l] = zb_divmod(f, v[l], &L[l]);
        for (uint64_t j = f->rounds; j >= 1; j--) {
            zb_speck_portable(f->keys + (j - 1) * ZB_SPECK_ROUNDS, L, F);
            for (l = 0; l < ZB_PORTABLE_LANES; l++) {
                uint64_t t = zb_submod(f, R[l], F[l]);
                R[l] = L[l];
                L[l] = t;
            }
        }
        for (l = 0; l < ZB_PORTABLE_LANES; l++) v[l] = a * R[l] + L[l];
        for (l = 0; l < ZB_PORTABLE_LANES; l++)
            while (v[l] >= f->n) v[l] = zb_fe_inv(f, v[l]);
    }
}


/* Bulk paths: 0 portable (any CPU), 1 AVX2 + FMA, 2 AVX-512 (F, DQ, BW, VL). */
#define ZB_PATH_PORTABLE 0
#define ZB_PATH_AVX2 1
#define ZB_PATH_AVX512 2

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define ZB_HAVE_SIMD_PATHS 1
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#define ZB_SIMD_NAME avx512
#define ZB_SIMD_TARGET_STR "avx512f,avx512dq,avx512bw,avx512vl,fma"
#define ZB_SW 16
#include "_feistel_simd.h"
#define ZB_SIMD_NAME avx2
#define ZB_SIMD_TARGET_STR "avx2,fma"
#define ZB_SW 8
#include "_feistel_simd.h"
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/* The widest path this CPU runs (checked once). */
static int zb_feistel_simd_available(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
            __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
            __builtin_cpu_supports("fma"))
            cached = ZB_PATH_AVX512;
        else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
            cached = ZB_PATH_AVX2;
        else
            cached = ZB_PATH_PORTABLE;
    }
    return cached;
}
#else
#define ZB_HAVE_SIMD_PATHS 0
static int zb_feistel_simd_available(void) { return ZB_PATH_PORTABLE; }
#endif

static void zb_feistel_block_portable(const zb_feistel *f, uint64_t *v, int inverse) {
    for (int h = 0; h < ZB_FEISTEL_LANES; h += ZB_PORTABLE_LANES)
        zb_portable_lanes(f, v + h, inverse);
}

/* ZB_FEISTEL_LANES positions v[] <- P(v) (or P^-1), in place, on the best path. */
static inline void zb_feistel_block(const zb_feistel *f, uint64_t *v, int inverse) {
#if ZB_HAVE_SIMD_PATHS
    if (f->simd == ZB_PATH_AVX512) {
        zb_simd_block_avx512(f, v, inverse);
        return;
    }
    if (f->simd == ZB_PATH_AVX2) {
        zb_simd_block_avx2(f, v, inverse);
        return;
    }
#endif
    zb_feistel_block_portable(f, v, inverse);
}

static void zb_feistel_fill_range(const zb_feistel *f, uint64_t start, uint64_t count,
                                  int64_t *out, int inverse) {
    uint64_t v[ZB_FEISTEL_LANES];
    uint64_t i = 0;
    for (; i + ZB_FEISTEL_LANES <= count; i += ZB_FEISTEL_LANES) {
        for (int l = 0; l < ZB_FEISTEL_LANES; l++) v[l] = start + i + (uint64_t)l;
        zb_feistel_block(f, v, inverse);
        for (int l = 0; l < ZB_FEISTEL_LANES; l++) out[i + l] = (int64_t)v[l];
    }
    for (; i < count; i++)
        out[i] = (int64_t)(inverse ? zb_feistel_decrypt(f, start + i) : zb_feistel_encrypt(f, start + i));
}

static int zb_feistel_map(const zb_feistel *f, const int64_t *positions, uint64_t count,
                          int64_t *out, int inverse) {
    uint64_t v[ZB_FEISTEL_LANES];
    uint64_t i = 0;
    for (; i + ZB_FEISTEL_LANES <= count; i += ZB_FEISTEL_LANES) {
        for (int l = 0; l < ZB_FEISTEL_LANES; l++) {
            int64_t p = positions[i + l];
            if (p < 0 || (uint64_t)p >= f->n) return ZB_E_INDEX;
            v[l] = (uint64_t)p;
        }
        zb_feistel_block(f, v, inverse);
        for (int l = 0; l < ZB_FEISTEL_LANES; l++) out[i + l] = (int64_t)v[l];
    }
    for (; i < count; i++) {
        int64_t p = positions[i];
        if (p < 0 || (uint64_t)p >= f->n) return ZB_E_INDEX;
        out[i] = (int64_t)(inverse ? zb_feistel_decrypt(f, (uint64_t)p) : zb_feistel_encrypt(f, (uint64_t)p));
    }
    return ZB_OK;
}

/* Counter-mode draws and epoch keys, from the same Speck64/128 primitive.
 *
 *   zb_random_draws(k0, k1, counters, count, n, out)
 *     pre:  n >= 1; k0, k1 expanded from (seed, ZB_DOMAIN_DRAW_HI) and (seed, ZB_DOMAIN_DRAW_LO);
 *           counters[i] >= 0.  out may alias counters.
 *     post: out[i] = draw number c = counters[i] of the stream: the 128-bit value
 *           x = E_k0(c) * 2**64 + E_k1(c) scaled to [0, n) as
 *           floor(x * n / 2**128): uniform to within n / 2**128 <= 2**-65, and any draw is
 *           computable alone (no state carried from draw to draw).
 *   zb_epoch_seed(k, epoch) = E_k(epoch), k expanded from (seed, ZB_DOMAIN_EPOCH): a bijection
 *     of epochs for a fixed seed, so two epochs of one run never share a permutation.
 * The domain words sit in the key's high half, above any Feistel round number (< 2**11). */
#define ZB_DOMAIN_EPOCH 0x7a62657063680000ULL   /* "zbepch" */
#define ZB_DOMAIN_DRAW_HI 0x7a62647261770001ULL /* "zbdraw" 1 */
#define ZB_DOMAIN_DRAW_LO 0x7a62647261770002ULL /* "zbdraw" 2 */

static void zb_random_draws(const uint32_t *k0, const uint32_t *k1, const int64_t *counters,
                            uint64_t count, uint64_t n, int64_t *out) {
    for (uint64_t i = 0; i < count; i++) {
        uint64_t c = (uint64_t)counters[i];
        uint64_t hi = zb_speck_encrypt(k0, c), lo = zb_speck_encrypt(k1, c);
        unsigned __int128 plo = (unsigned __int128)lo * n;
        unsigned __int128 phi = (unsigned __int128)hi * n + (uint64_t)(plo >> 64);
        out[i] = (int64_t)(uint64_t)(phi >> 64);
    }
}

static inline uint64_t zb_epoch_seed(const uint32_t *k, uint64_t epoch) {
    return zb_speck_encrypt(k, epoch);
}

#endif /* ZB_FEISTEL_H */
