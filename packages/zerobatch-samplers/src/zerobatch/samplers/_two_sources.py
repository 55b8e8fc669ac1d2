"""Two sources under constant weights: the picks of the mixture rule in closed form.

:class:`~zerobatch.samplers.MixtureOrder` picks, at pick ``t`` of a stretch of constant weights,
source 1 when ``fl(w1 * t) - s1 > fl(w0 * t) - s0`` (``fl``: the double the float product
rounds to; ``s_k``: the picks of source ``k`` so far, ``s0 + s1 = t - 1``). Once both counts
are at least 4 each subtraction is exact (Sterbenz: ``fl(w t)`` is within 1 of ``s``, so within
a factor 2), and the rule is exactly::

    pick source 1  <=>  s1 < F(t) = (A(t) - B(t) + t - 1) / 2,   A = fl(w1 t), B = fl(w0 t)

``F`` increases by ``(A(t) - A(t-1) - B(t) + B(t-1) + 1) / 2``: ``w1`` within two units in the
last place of ``t``; while that stays inside ``[0, 1]`` the count after ``t`` picks is
``s1(t) = ceil(F(t))`` (by induction: ``s1(t-1) = ceil(F(t-1))`` and ``F`` grows by at most 1).
So the counts after any number of picks, and the pick that took any count, are computed
without making the picks: the comparisons are made exactly on the doubles' integer and
fractional parts (each exact once ``A, B >= 1``). Where a condition does not hold (a weight
within rounding of 0, the first picks of a stretch, a state the formula does not reproduce),
the compiled walk makes the picks one by one, so the result is always the rule's.

``tests/core/test_mixture_walk.py`` checks it against the walk, pick for pick.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = ["walk_two"]

#: Picks made one by one at most while waiting for the closed form's conditions (both counts
#: at least 2, both products at least 1, the state matching the formula).
MAX_LEAD_IN = 1 << 20


def _exceeds(w0: float, w1: float, t: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``A(t) - B(t) > m`` exactly (``t`` with ``A, B >= 1``): the products' integer parts
    compared as integers, their fractional parts (exact, and exactly subtracted) break ties."""
    td = t.astype(np.float64)
    a, b = w1 * td, w0 * td
    ai, bi = np.floor(a), np.floor(b)
    di = ai.astype(np.int64) - bi.astype(np.int64) - m
    df = (a - ai) - (b - bi)
    return (di >= 1) | ((di == 0) & (df > 0))


def _count1(w0: float, w1: float, t: int) -> int:
    """``ceil(F(t))``: the smallest integer ``c`` with ``F(t) <= c`` (exact rationals)."""
    f = (Fraction(w1 * float(t)) - Fraction(w0 * float(t)) + t - 1) / 2
    return max(0, math.ceil(f))


def _usable(w0: float, w1: float, t_end: int) -> bool:
    """The closed form holds up to pick ``t_end``: the weights sum to 1 within rounding and
    each exceeds, with a margin, the rounding of products up to ``t_end``."""
    if t_end >= 1 << 52 or not abs(w0 + w1 - 1.0) <= 2.0 ** -40:
        return False
    ulp = 2.0 ** (max(t_end, 1).bit_length() - 52)
    return min(w0, w1) > 16 * ulp


def walk_two(walk: Any, w: list[float], since: np.ndarray, t: int, n: int, watch: int | None = None,
             base: int = 0, want: np.ndarray | None = None, found: np.ndarray | None = None) -> int:
    """``n`` picks of two sources under constant weights ``w``, as ``walk`` (the compiled
    :func:`~zerobatch.core.mixture_walk`) makes them: ``since`` updated in place, ``t``
    after them returned; with ``watch``, ``found[j]`` = the index (in these picks) of the pick
    that took count ``want[j]`` (``base + since[watch]`` before it) of source ``watch``."""
    w0, w1 = float(w[0]), float(w[1])
    watching = watch is not None and want is not None and found is not None

    def by_walk(count: int, done: int) -> int:
        nonlocal t
        if watching:
            part = np.full(want.size, -1, np.int64)
            t, _ = walk(w, since, None, t, count, False, watch, base, want, part)
            hit = (part >= 0) & (found < 0)
            found[hit] = part[hit] + done
        else:
            t, _ = walk(w, since, None, t, count, False)
        return count

    if not _usable(w0, w1, t + n):
        by_walk(n, 0)
        return t
    # lead in, one pick at a time (compiled), until the formula holds
    done = 0
    need = int(2.0 / min(w0, w1)) + 2
    while done < n:
        if min(int(since[0]), int(since[1])) >= 4 and t >= need and int(since[1]) == _count1(w0, w1, t):
            break
        if done >= MAX_LEAD_IN:
            by_walk(n - done, done)
            return t
        step = min(n - done, max(64, need - t))
        done += by_walk(step, done)
    left = n - done
    if left <= 0:
        return t
    t0, end = t, t + left
    if watching:
        _find(w0, w1, since, t0, end, watch, base, want, found, done)
    s1 = _count1(w0, w1, end)
    since[1] = s1
    since[0] = end - s1
    return end


def _find(w0: float, w1: float, since: np.ndarray, t0: int, end: int, watch: int, base: int, want: np.ndarray,
          found: np.ndarray, done: int) -> None:
    """The picks (in ``(t0, end]``) that took each wanted count of source ``watch``: the
    smallest ``t`` with that source's count after ``t`` picks past it. Source 1's count after
    ``t`` picks is ``ceil(F(t))``, source 0's ``t - ceil(F(t))``, both non-decreasing: the
    first ``t`` is found among a few candidates around its estimate (exact comparisons), or
    by bisection."""
    start_count = int(since[watch])
    final1 = _count1(w0, w1, end)
    final = final1 if watch == 1 else end - final1
    c = want - base                          # counts within this stretch
    todo = np.flatnonzero((found < 0) & (c >= start_count) & (c < final))
    if not todo.size:
        return
    cs = c[todo]
    weight = w1 if watch == 1 else w0

    def reached(tt: np.ndarray, cc: np.ndarray) -> np.ndarray:
        """Source ``watch`` has taken count ``cc`` within the first ``tt`` picks."""
        if watch == 1:                      # ceil(F(t)) >= c + 1  <=>  F(t) > c
            return _exceeds(w0, w1, tt, 2 * cc - tt + 1)
        return ~_exceeds(w0, w1, tt, tt - 2 * cc - 1)   # t - ceil(F(t)) >= c + 1  <=>  F(t) <= t - c - 1

    guess = np.floor((cs + 0.5) / weight).astype(np.int64)
    offsets = np.arange(-4, 5, dtype=np.int64)
    cand = np.clip(guess[:, None] + offsets[None, :], t0, end)
    ok = np.zeros(cand.shape, bool)
    inside = cand > t0
    ok[inside] = reached(cand[inside], np.broadcast_to(cs[:, None], cand.shape)[inside])
    first = np.argmax(ok, axis=1)
    got = ok[np.arange(cs.size), first]
    # bracketed: true at the candidate, false just before it (or it is the stretch's start)
    prev = cand[np.arange(cs.size), first] - 1
    before_ok = prev <= t0
    check = ~before_ok & got
    if check.any():
        before_ok[check] = ~reached(prev[check], cs[check])
    exact = got & before_ok
    tstar = cand[np.arange(cs.size), first]
    for i in np.flatnonzero(~exact).tolist():            # (rare) bisection, exact comparisons
        lo, hi = t0, end                                  # reached(lo) false, reached(hi) true
        cc = np.asarray([cs[i]])
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if mid > t0 and reached(np.asarray([mid]), cc)[0]:
                hi = mid
            else:
                lo = mid
        tstar[i] = hi
    found[todo] = tstar - t0 - 1 + done
