"""The picks of a mixture order, counted: the twin of ``_mixture.pyx`` (the same Python
float operations as :class:`zerobatch.samplers.MixtureOrder`'s own pick loops)."""

from __future__ import annotations

from typing import Any

import numpy as np

from zerobatch.formats.errors import ConfigError

__all__ = ["mixture_walk"]


def mixture_walk(weights: Any, since: np.ndarray, target: np.ndarray | None, t: int, n: int, moving: bool,
                 watch: int = -1, base: int = 0, targets: Any = None, found: np.ndarray | None = None) -> tuple[int, int]:
    """Make ``n`` picks of a mixture order, counting them (see the compiled twin)."""
    w = [float(x) for x in np.asarray(weights, dtype=np.float64)]
    K = len(w)
    if K < 1 or since.shape[0] != K or n < 0:
        raise ConfigError(f"mixture_walk: {K} weights and {since.shape[0]} counts, {n} picks", field="weights")
    if moving and (target is None or len(target) != K):
        raise ConfigError("mixture_walk: moving weights need a target of one entry a source", field="target")
    want = [] if watch < 0 else [int(x) for x in np.asarray(targets, dtype=np.int64)]
    if watch >= 0 and (watch >= K or found is None or found.shape[0] < len(want)):
        raise ConfigError(f"mixture_walk: watch {watch} needs targets and found", field="watch")
    s = [int(x) for x in since]
    tg = None if not moving else [float(x) for x in target]
    j = hits = 0
    for i in range(n):
        if moving:
            for k in range(K):
                tg[k] += w[k]
            best, best_err = 0, tg[0] - s[0]
            for k in range(K):
                err = tg[k] - s[k]
                if err > best_err:
                    best, best_err = k, err
        else:
            t += 1
            best, best_err = 0, w[0] * t - s[0]
            for k in range(K):
                err = w[k] * t - s[k]
                if err > best_err:
                    best, best_err = k, err
        if best == watch:
            while j < len(want) and want[j] < base + s[best]:
                j += 1
            if j < len(want) and want[j] == base + s[best]:
                found[j] = i
                j += 1
                hits += 1
        s[best] += 1
    since[:] = s
    if moving:
        target[:] = tg
    return t, hits
