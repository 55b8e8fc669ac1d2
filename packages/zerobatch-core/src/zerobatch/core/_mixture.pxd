# C-level mixture kernel: the picks of a mixture order counted (contract in _mixture.pyx).

from libc.stdint cimport int64_t

# n picks of K sources by the largest-error rule (constant weights: err = w[k] * t - since[k];
# moving weights: target[k] += w[k], err = target[k] - since[k]); since[winner] += 1. With
# watch >= 0, a pick of source `watch` whose count before it (base + since[watch]) equals
# want[j] (ascending) sets out[j] = the pick's index. Returns t after the picks; *matched =
# the targets found.
cdef int64_t zb_mixture_walk(const double *w, int64_t *since, double *target, int64_t K, int64_t t,
                             int64_t n, bint moving, int64_t watch, int64_t base, const int64_t *want,
                             int64_t nwant, int64_t *out, int64_t *matched) noexcept nogil
