# C-level Feistel kernels (implemented in _feistel.h, which states the construction in full):
# gfc's generalized Feistel cipher with Speck64/128 rounds, counter-mode draws and epoch keys.
# Pure functions of their arguments and the expanded keys.

from libc.stdint cimport int64_t, uint32_t, uint64_t

cdef extern from "_feistel.h" nogil:
    ctypedef struct zb_feistel:
        uint64_t n
        uint64_t a
        uint64_t rounds
        uint64_t barrett
        uint32_t *keys
        int simd
    int ZB_SPECK_ROUNDS
    int zb_feistel_simd_available()
    void zb_feistel_setup(zb_feistel *f, uint64_t n, uint64_t rounds, uint64_t seed)
    uint64_t zb_feistel_encrypt(const zb_feistel *f, uint64_t m)
    uint64_t zb_feistel_decrypt(const zb_feistel *f, uint64_t c)
    void zb_feistel_fill_range(const zb_feistel *f, uint64_t start, uint64_t count,
                               int64_t *out, int inverse)
    int zb_feistel_map(const zb_feistel *f, const int64_t *positions, uint64_t count,
                       int64_t *out, int inverse)
    uint64_t ZB_DOMAIN_EPOCH
    uint64_t ZB_DOMAIN_DRAW_HI
    uint64_t ZB_DOMAIN_DRAW_LO
    void zb_speck_expand(uint64_t lo, uint64_t hi, uint32_t *s)
    void zb_random_draws(const uint32_t *k0, const uint32_t *k1, const int64_t *counters,
                         uint64_t count, uint64_t n, int64_t *out)
    uint64_t zb_epoch_seed(const uint32_t *k, uint64_t epoch)
