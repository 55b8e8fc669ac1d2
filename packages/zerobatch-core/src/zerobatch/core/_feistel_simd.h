/* One vector bulk path of the Feistel permutation, instantiated per ISA by _feistel.h.
 *
 * Included (no include guard, on purpose) with:
 *   ZB_SIMD_NAME        token suffix of every name defined here (avx512, avx2)
 *   ZB_SIMD_TARGET_STR  the target attribute string the functions are compiled for
 *   ZB_SW               32-bit lanes per Speck vector (16 for zmm, 8 for ymm)
 * Defines ZB_S(zb_simd_block)(f, v, inverse): ZB_FEISTEL_LANES positions v[] <- P(v) or
 * P^-1(v) in place, every v[i] < n on entry; identical results to the portable path.
 *
 * Every Feistel half (L, R) and round sum is below a < 2**32, so lanes hold u32 halves and
 * the Speck block of a round is (R, 0); its output words are F's high and low halves.
 * F mod a needs no 64-bit division: h = Fh mod a, then r = (h * 2**32 + Fl) mod a, each
 * quotient estimated in double precision (within 2**-19 of the truth, so rounding to nearest
 * gives the floor or one more) and each remainder computed exactly: q*a is split as
 * q*ahi + q*alo (ahi = a's bits above 16) so every product and difference is an exact
 * double, FMA or not. Remainders in (-a, 2a) are folded into [0, a) by arithmetic alone
 * (k = round(d/a - 1/2 + 1/(2a)) in {-1, 0, 1}; the margin 1/(2a) >= 2**-33 dwarfs the
 * rounding error), with no compares, so no lane is ever scalarized. u32 <-> double go
 * through the 2**52 bias trick (exact below 2**32; AVX2 has no unsigned conversions).
 * Two or four independent Speck vectors are in flight to hide the rounds' latency. */

#define ZB_CAT_(a, b) a##_##b
#define ZB_CAT(a, b) ZB_CAT_(a, b)
#define ZB_S(name) ZB_CAT(name, ZB_SIMD_NAME)
#define ZB_SIMD_FN static inline __attribute__((always_inline, target(ZB_SIMD_TARGET_STR)))
#define ZB_NV (ZB_FEISTEL_LANES / ZB_SW)

typedef uint32_t ZB_S(zb_vw) __attribute__((vector_size(ZB_SW * 4)));
typedef uint32_t ZB_S(zb_vh) __attribute__((vector_size(ZB_SW * 2)));
typedef uint64_t ZB_S(zb_vq) __attribute__((vector_size(ZB_SW * 4)));
typedef double ZB_S(zb_vd) __attribute__((vector_size(ZB_SW * 4)));

typedef struct {
    ZB_S(zb_vd) a, ahi, alo, inv, bias;
} ZB_S(zb_modc);

ZB_SIMD_FN ZB_S(zb_vd) ZB_S(zb_tod)(ZB_S(zb_vh) x) {
    ZB_S(zb_vq) w = __builtin_convertvector(x, ZB_S(zb_vq)) | 0x4330000000000000ULL;
    return (ZB_S(zb_vd))w - 4503599627370496.0;
}

ZB_SIMD_FN ZB_S(zb_vh) ZB_S(zb_tou)(ZB_S(zb_vd) d) {
    return __builtin_convertvector((ZB_S(zb_vq))(d + 4503599627370496.0), ZB_S(zb_vh));
}

/* x + 1.5 * 2**52 - 1.5 * 2**52 rounds |x| < 2**51 to nearest (not folded: no fast-math). */
ZB_SIMD_FN ZB_S(zb_vd) ZB_S(zb_round)(ZB_S(zb_vd) x) {
    return (x + 6755399441055744.0) - 6755399441055744.0;
}

ZB_SIMD_FN ZB_S(zb_vd) ZB_S(zb_reduce)(ZB_S(zb_vd) d, const ZB_S(zb_modc) *c) {
    return d - c->a * ZB_S(zb_round)(d * c->inv + c->bias);
}

/* (base +/- ((fh << 32 | fl) mod a)) mod a, base < a. */
ZB_SIMD_FN ZB_S(zb_vh) ZB_S(zb_mod)(ZB_S(zb_vh) base, ZB_S(zb_vh) fh, ZB_S(zb_vh) fl,
                                    const ZB_S(zb_modc) *c, int subtract) {
    ZB_S(zb_vd) hi = ZB_S(zb_tod)(fh), lo = ZB_S(zb_tod)(fl);
    ZB_S(zb_vd) q = ZB_S(zb_round)(hi * c->inv);
    ZB_S(zb_vd) h = ZB_S(zb_reduce)(hi - q * c->a, c);      /* q * a < 2**33: exact */
    ZB_S(zb_vd) hs = h * 4294967296.0;                       /* 32 significant bits */
    q = ZB_S(zb_round)((hs + lo) * c->inv);
    ZB_S(zb_vd) r = ZB_S(zb_reduce)(((hs - q * c->ahi) - q * c->alo) + lo, c);
    ZB_S(zb_vd) b = ZB_S(zb_tod)(base);
    return ZB_S(zb_tou)(ZB_S(zb_reduce)(subtract ? b - r : b + r, c));
}

ZB_SIMD_FN void ZB_S(zb_speck)(const uint32_t *k, ZB_S(zb_vw) *x, ZB_S(zb_vw) *y) {
    for (int i = 0; i < ZB_SPECK_ROUNDS; i++) {
        for (int q = 0; q < ZB_NV; q++) {
            x[q] = ((x[q] >> 8) | (x[q] << 24)) + y[q];
            x[q] ^= k[i];
            y[q] = ((y[q] << 3) | (y[q] >> 29)) ^ x[q];
        }
    }
}

ZB_SIMD_FN void ZB_S(zb_lanes)(const zb_feistel *f, uint64_t *v, int inverse) {
    uint32_t Lw[ZB_FEISTEL_LANES], Rw[ZB_FEISTEL_LANES];
    const uint64_t a = f->a;
    const double ad = (double)a;
    ZB_S(zb_modc) c;
    c.a = (ZB_S(zb_vd)){0} + ad;
    c.ahi = (ZB_S(zb_vd)){0} + (double)(a & ~(uint64_t)0xffff);
    c.alo = (ZB_S(zb_vd)){0} + (double)(a & 0xffff);
    c.inv = (ZB_S(zb_vd)){0} + 1.0 / ad;
    c.bias = (ZB_S(zb_vd)){0} + (-0.5 + 0.5 / ad);
    uint64_t rem;
    int l, q;
    for (l = 0; l < ZB_FEISTEL_LANES; l++) {
        uint64_t quo = zb_divmod(f, v[l], &rem);
        if (inverse && (f->rounds & 1)) {
            Lw[l] = (uint32_t)quo;
            Rw[l] = (uint32_t)rem;
        } else {
            Rw[l] = (uint32_t)quo;
            Lw[l] = (uint32_t)rem;
        }
    }
    ZB_S(zb_vw) L[ZB_NV], R[ZB_NV], X[ZB_NV], Y[ZB_NV];
    __builtin_memcpy(L, Lw, sizeof L);
    __builtin_memcpy(R, Rw, sizeof R);
    for (uint64_t s = 0; s < f->rounds; s++) {
        const uint32_t *k = f->keys + (inverse ? f->rounds - 1 - s : s) * ZB_SPECK_ROUNDS;
        for (q = 0; q < ZB_NV; q++) {
            X[q] = (ZB_S(zb_vw)){0};
            Y[q] = inverse ? L[q] : R[q];
        }
        ZB_S(zb_speck)(k, X, Y);
        for (q = 0; q < ZB_NV; q++) {
            ZB_S(zb_vh) base[2], fh[2], fl[2], t[2];
            ZB_S(zb_vw) T;
            __builtin_memcpy(base, inverse ? &R[q] : &L[q], sizeof base);
            __builtin_memcpy(fh, &X[q], sizeof fh);
            __builtin_memcpy(fl, &Y[q], sizeof fl);
            t[0] = ZB_S(zb_mod)(base[0], fh[0], fl[0], &c, inverse);
            t[1] = ZB_S(zb_mod)(base[1], fh[1], fl[1], &c, inverse);
            __builtin_memcpy(&T, t, sizeof T);
            if (inverse) {
                R[q] = L[q];
                L[q] = T;
            } else {
                L[q] = R[q];
                R[q] = T;
            }
        }
    }
    __builtin_memcpy(Lw, L, sizeof L);
    __builtin_memcpy(Rw, R, sizeof R);
    if (!inverse && (f->rounds & 1))
        for (l = 0; l < ZB_FEISTEL_LANES; l++) v[l] = a * Lw[l] + Rw[l];
    else
        for (l = 0; l < ZB_FEISTEL_LANES; l++) v[l] = a * Rw[l] + Lw[l];
    for (l = 0; l < ZB_FEISTEL_LANES; l++)
        while (v[l] >= f->n) v[l] = inverse ? zb_fe_inv(f, v[l]) : zb_fe(f, v[l]);
}

__attribute__((target(ZB_SIMD_TARGET_STR)))
static void ZB_S(zb_simd_block)(const zb_feistel *f, uint64_t *v, int inverse) {
    ZB_S(zb_lanes)(f, v, inverse);
}

#undef ZB_NV
#undef ZB_SIMD_FN
#undef ZB_S
#undef ZB_CAT
#undef ZB_CAT_
#undef ZB_SIMD_NAME
#undef ZB_SIMD_TARGET_STR
#undef ZB_SW
