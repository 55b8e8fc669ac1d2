"""Statistical quality of the Feistel shuffle, with numpy.random.Generator.permutation as the
yardstick: the same statistics computed on both, and a deliberately weak Feistel (one or two
rounds) as a negative control that the statistics do catch."""

from __future__ import annotations

import numpy as np
import pytest

from zerobatch.samplers import FeistelPermutation

# statistics over millions of draws: minutes in the pure-Python twin
pytestmark = pytest.mark.compiled

N = 1000          # items per permutation
S = 3000          # permutations (seeds)
BINS = 10


def feistel_matrix(rounds: int, n: int = N, s: int = S) -> np.ndarray:
    out = np.empty((s, n), dtype=np.int64)
    for k in range(s):
        FeistelPermutation(n, rounds, 0x5DEECE66D * (k + 1) % 2**64).fill(out[k])
    return out


def numpy_matrix(n: int = N, s: int = S) -> np.ndarray:
    rng = np.random.default_rng(12345)
    return np.stack([rng.permutation(n) for _ in range(s)])


def position_uniformity(m: np.ndarray) -> float:
    """Sum over positions of the chi-square of where that position lands (10 value bins)."""
    s, n = m.shape
    bins = m * BINS // n                                   # (s, n) value bin per seed
    counts = np.zeros((n, BINS))
    for b in range(BINS):
        counts[:, b] = (bins == b).sum(axis=0)
    expected = s / BINS
    return float(((counts - expected) ** 2 / expected).sum())


def neighbour_table(m: np.ndarray) -> np.ndarray:
    """Joint histogram of (bin of p[i], bin of p[i+1]) pooled over positions and seeds."""
    n = m.shape[1]
    a = (m[:, :-1] * BINS // n).ravel()
    b = (m[:, 1:] * BINS // n).ravel()
    return np.bincount(a * BINS + b, minlength=BINS * BINS).astype(float)


def difference_table(m: np.ndarray) -> np.ndarray:
    """Histogram of the step to the next value, (p[i+1] - p[i]) mod n, in bins of 10."""
    n = m.shape[1]
    d = (m[:, 1:] - m[:, :-1]) % n
    return np.bincount((d // 10).ravel(), minlength=n // 10).astype(float)


def homogeneity(t1: np.ndarray, t2: np.ndarray) -> float:
    """Two-sample chi-square statistic (df = cells - 1) that two tables share a distribution."""
    total = t1 + t2
    e1 = total * t1.sum() / total.sum()
    e2 = total * t2.sum() / total.sum()
    mask = total > 0
    return float((((t1 - e1) ** 2 / e1)[mask]).sum() + (((t2 - e2) ** 2 / e2)[mask]).sum())


@pytest.fixture(scope="module")
def yardstick():
    return numpy_matrix()


@pytest.fixture(scope="module")
def feistel6():
    return feistel_matrix(6)


def test_positions_are_uniformly_spread(yardstick, feistel6):
    df = N * (BINS - 1)                    # sum of N chi-squares with BINS - 1 dof each
    band = 6 * np.sqrt(2 * df)             # 6 sigma
    ours, theirs = position_uniformity(feistel6), position_uniformity(yardstick)
    assert abs(theirs - df) < band, "the yardstick itself must sit inside the band"
    assert abs(ours - df) < band, (ours, theirs, df)
    # negative control: one Feistel round leaves p[i] // a == i // a
    assert position_uniformity(feistel_matrix(1, s=300)) > df * 5


def test_neighbours_are_uncorrelated(yardstick, feistel6):
    """Where neighbours land (joint value bins) and how far apart (the difference mod n)
    follow numpy's distributions. The difference is the sharp one: it sees the row
    structure of a Feistel network with too few rounds (4 rounds fail it at this sample
    size, 5 are borderline, the default 6 pass)."""
    for table, cells in ((neighbour_table, BINS * BINS), (difference_table, N // 10)):
        df = cells - 1
        band = df + 6 * np.sqrt(2 * df)
        stat = homogeneity(table(feistel6), table(yardstick))
        assert stat < band, (table.__name__, stat)
        # control: two independent halves of the yardstick agree with each other
        assert homogeneity(table(yardstick[: S // 2]), table(yardstick[S // 2:])) < band
    band = N // 10 - 1 + 6 * np.sqrt(2 * (N // 10 - 1))
    assert homogeneity(difference_table(feistel_matrix(4)), difference_table(yardstick)) > band


def test_lag_correlation_and_spread_in_one_large_permutation():
    n = 1 << 20
    p = FeistelPermutation(n, 6, 2026).range(0, n).astype(np.float64)
    q = np.random.default_rng(2026).permutation(n).astype(np.float64)
    bound = 6 / np.sqrt(n)
    for v in (p, q):
        for lag in (1, 2, 7, 1024):
            r = np.corrcoef(v[:-lag], v[lag:])[0, 1]
            assert abs(r) < bound, (lag, r)
        # the first half of positions spreads evenly over the value range (64 bins)
        counts = np.bincount((v[: n // 2] * 64 // n).astype(np.int64), minlength=64)
        expected = n / 2 / 64
        chi2 = ((counts - expected) ** 2 / expected).sum()
        assert chi2 < 63 + 6 * np.sqrt(2 * 63), chi2
