# distutils: extra_compile_args = -ffp-contract=off
# The picks of a mixture order (zerobatch.samplers.MixtureOrder): which source each sample
# comes from, by the "largest sampling error first" rule, counted only (no item computed),
# so a run's mixture state at any step is a walk of compiled picks rather than of Python ones
# (provenance: the trace of step N of a long run; a document's steps in a mixture).
#
# Contract
#   mixture_walk(weights, since, target, t, n, moving, watch, base, targets, found)
#     Makes n picks exactly as MixtureOrder._pick (moving=False) or _pick_moving (True) does,
#     with the same double-precision operations in the same order (no contraction into fused
#     multiply-adds: -ffp-contract=off), so every pick is the one Python makes:
#       constant: t += 1; err_k = weights[k] * t - since[k]; the first largest err_k wins
#       moving:   target[k] += weights[k]; err_k = target[k] - since[k]; the first largest wins
#     and since[winner] += 1. When watch >= 0, a pick of source `watch` whose count before it
#     (base + since[watch]) equals targets[j] (ascending) records found[j] = the pick's index
#     in this call (0-based); returns (t after the picks, targets found in this call).
#     pre:  weights, since (and target when moving) of one length K >= 1; targets ascending.

from libc.stdint cimport int64_t

import numpy as np

from zerobatch.formats.errors import ConfigError

__all__ = ["mixture_walk"]


def mixture_walk(weights, since, target, int64_t t, int64_t n, bint moving, int watch=-1, int64_t base=0,
                 targets=None, found=None):
    """Make ``n`` picks of a mixture order, counting them (see the module contract).

    Args:
        weights: ``float64 [K]`` weights of the picks.
        since: ``int64 [K]`` picks of each source in the current stretch (updated in place).
        target: ``float64 [K]`` summed weights while the weights move (updated in place), or
            ``None`` for constant weights.
        t: picks made in the stretch so far (constant weights).
        n: picks to make.
        moving: the rule of moving weights.
        watch, base, targets, found: record where source ``watch``'s count ``base +
            since[watch]`` reaches each of ``targets`` (ascending) into ``found``.

    Returns:
        ``(t, matched)``: the stretch's picks after these, and how many targets were found.

    Raises:
        ConfigError: arrays of different lengths, an empty mixture, or a negative ``n``.
    """
    cdef const double[::1] w = np.ascontiguousarray(weights, dtype=np.float64)
    cdef int64_t[::1] s = since
    cdef int64_t K = w.shape[0]
    if K < 1 or s.shape[0] != K or n < 0:
        raise ConfigError(f"mixture_walk: {K} weights and {s.shape[0]} counts, {n} picks", field="weights")
    cdef double[::1] tg
    if moving:
        if target is None or len(target) != K:
            raise ConfigError("mixture_walk: moving weights need a target of one entry a source", field="target")
        tg = target
    cdef const int64_t[::1] want = np.zeros(1, np.int64)
    cdef int64_t[::1] out = np.zeros(1, np.int64)
    cdef int64_t nwant = 0
    if watch >= 0:
        if watch >= K or targets is None or found is None:
            raise ConfigError(f"mixture_walk: watch {watch} needs targets and found", field="watch")
        want = np.ascontiguousarray(targets, dtype=np.int64)
        out = found
        nwant = want.shape[0]
        if out.shape[0] < nwant:
            raise ConfigError("mixture_walk: found is shorter than targets", field="found")
    cdef int64_t matched = 0
    cdef double *tp = &tg[0] if moving else NULL
    cdef const int64_t *wp = &want[0] if nwant else NULL
    cdef int64_t *op = &out[0] if nwant else NULL
    with nogil:
        t = zb_mixture_walk(&w[0], &s[0], tp, K, t, n, moving, watch, base, wp, nwant, op, &matched)
    return t, matched


cdef inline int64_t _walk2(double w0, double w1, int64_t *since, int64_t t, int64_t n) noexcept nogil:
    # two sources, constant weights, nothing watched: the same comparison without a branch
    # (the picks are as good as random to a branch predictor), the counts in registers
    cdef int64_t s0 = since[0], s1 = since[1], i, b
    cdef double td
    for i in range(n):
        t += 1
        td = <double>t
        b = (w1 * td - <double>s1) > (w0 * td - <double>s0)
        s1 += b
        s0 += 1 - b
    since[0] = s0
    since[1] = s1
    return t


cdef inline int64_t _walk2_watch(double w0, double w1, int64_t *since, int64_t t, int64_t n, int64_t watch,
                                 int64_t base, const int64_t *want, int64_t nwant, int64_t *out,
                                 int64_t *matched) noexcept nogil:
    # _walk2, recording where source `watch` reaches each wanted count: short of the next
    # wanted count the picks run unwatched, in chunks that cannot reach it (the count grows
    # by at most one a pick); at it, pick by pick until `watch` takes it
    cdef int64_t s0 = since[0], s1 = since[1], i = 0, b, j = 0, chunk, k, cnt, hits = 0
    cdef double td
    while i < n:
        cnt = base + (s1 if watch == 1 else s0)
        while j < nwant and want[j] < cnt:
            j += 1
        if j < nwant and want[j] == cnt:
            chunk = 1
        elif j < nwant:
            chunk = want[j] - cnt
            if chunk > n - i:
                chunk = n - i
        else:
            chunk = n - i
        for k in range(chunk):
            t += 1
            td = <double>t
            b = (w1 * td - <double>s1) > (w0 * td - <double>s0)
            if j < nwant and b == watch and want[j] == cnt:
                out[j] = i + k
                j += 1
                hits += 1
            s1 += b
            s0 += 1 - b
        i += chunk
    since[0] = s0
    since[1] = s1
    matched[0] = hits
    return t


cdef int64_t zb_mixture_walk(const double *w, int64_t *since, double *target, int64_t K, int64_t t,
                             int64_t n, bint moving, int64_t watch, int64_t base, const int64_t *want,
                             int64_t nwant, int64_t *out, int64_t *matched) noexcept nogil:
    cdef int64_t i, k, best, j = 0, hits = 0
    cdef double err, best_err
    if K == 2 and not moving:
        if watch < 0:
            return _walk2(w[0], w[1], since, t, n)
        return _walk2_watch(w[0], w[1], since, t, n, watch, base, want, nwant, out, matched)
    for i in range(n):
        if moving:
            for k in range(K):
                target[k] = target[k] + w[k]
            best = 0
            best_err = target[0] - <double>since[0]
            for k in range(1, K):
                err = target[k] - <double>since[k]
                if err > best_err:
                    best = k
                    best_err = err
        else:
            t += 1
            best = 0
            best_err = w[0] * <double>t - <double>since[0]
            for k in range(1, K):
                err = w[k] * <double>t - <double>since[k]
                if err > best_err:
                    best = k
                    best_err = err
        if best == watch:
            while j < nwant and want[j] < base + since[best]:
                j += 1
            if j < nwant and want[j] == base + since[best]:
                out[j] = i
                j += 1
                hits += 1
        since[best] += 1
    matched[0] = hits
    return t
