"""The Feistel permutation: gfc compatibility, bijectivity, both bulk paths, the pure-Python
twin, and the cases where gfc itself stops being a bijection."""

from __future__ import annotations

import math
import pickle
import random

import numpy as np
import pytest

import zerobatch.core._reference as ref
from zerobatch.core import FeistelPermutation, epoch_seed, random_draws
from zerobatch.core._feistel import available_paths
from zerobatch.formats.errors import ConfigError

pygfc = pytest.importorskip("pygfc")

#: Every bulk path this CPU runs; the tests compare each with pygfc and with the others.
PATHS = available_paths()

SEEDS = [0, 1, 42, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15]


def gfc_side(n: int) -> int:
    """gfc's a: ceil(sqrt(n)) in double precision, as gfc_init computes it."""
    return int(math.ceil(math.sqrt(float(n))))


def exact_side(n: int) -> int:
    r = math.isqrt(n)
    return r if r * r == n else r + 1


def sample_positions(n: int, k: int, rng: random.Random) -> list[int]:
    edges = [0, 1, n // 2, n - 2, n - 1]
    return sorted({p for p in edges if 0 <= p < n} | {rng.randrange(n) for _ in range(k)})


# ---------------------------------------------------------------------------------------
# gfc compatibility


def gfc_cases() -> list[tuple[int, int, int]]:
    rng = random.Random(20261121)
    sizes = [1, 2, 3, 4, 5, 10, 17, 100, 255, 256, 257, 1000, 4096, 65535, 65536, 65537,
             10**6 + 3, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**33 + 12345,
             10**12 + 39, 2**40, 2**44 - 7, 2**48 + 1, 2**50 + 17, 2**52 - 1]
    sizes += [rng.randrange(2, 2**52) for _ in range(20)]
    # above 2**52 where gfc's double-precision side is still the exact one
    sizes += [k * k for k in (2**27 - 3, 2**30 + 7, 3037000499)] + [2**60, 2**62, 2**63 - 2**40]
    cases = []
    for i, n in enumerate(sizes):
        cases.append((n, [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16][i % 11], SEEDS[i % len(SEEDS)]))
    return cases


@pytest.mark.parametrize("n, rounds, seed", gfc_cases())
def test_matches_pygfc_bit_for_bit(n, rounds, seed):
    assert gfc_side(n) == exact_side(n), "case chosen where gfc is exact"
    g = pygfc.Permutation(n, rounds, seed)
    p = FeistelPermutation(n, rounds, seed)
    rng = random.Random(n ^ seed)
    pos = sample_positions(n, 300, rng)
    want = [g[i] for i in pos]
    want_inv = [g.inv(i) for i in pos]
    assert [p[i] for i in pos] == want
    assert [p.inverse(i) for i in pos] == want_inv
    for path in PATHS:
        p._use_path(path)
        assert p.take(pos).tolist() == want
        assert p.take(pos, inverse=True).tolist() == want_inv
    first = min(n, 200)
    assert p.range(0, first).tolist() == [g[i] for i in range(first)]
    assert len(p) == len(g) == n


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1000, 4097])
@pytest.mark.parametrize("rounds", [0, 1, 4, 6])
def test_whole_small_permutations_match_pygfc(n, rounds):
    g = pygfc.Permutation(n, rounds, 1234)
    p = FeistelPermutation(n, rounds, 1234)
    assert p.range(0, n).tolist() == list(g)
    assert list(p) == list(g)


def test_rounds_zero_is_the_identity():
    assert FeistelPermutation(1000, 0, 5).range(0, 1000).tolist() == list(range(1000))


# ---------------------------------------------------------------------------------------
# bijectivity


def _sizes_up_to_2_16() -> list[int]:
    """Every n in [0, 2**12]; for each bit width above (to 2**16, where the permutation's
    domain and its cycle-walking change) the first and last eight sizes and 16 drawn ones.
    (Every n to 2**16, 2**31 elements, took 80 s of a CI worker for the same widths.)"""
    rng = np.random.default_rng(16)
    sizes = set(range(0, (1 << 12) + 1))
    for bits in range(13, 17):
        lo, hi = 1 << (bits - 1), 1 << bits
        sizes.update(range(lo + 1, lo + 9))
        sizes.update(range(hi - 7, hi + 1))
        sizes.update(rng.integers(lo + 1, hi + 1, 16).tolist())
    return sorted(sizes)


def test_bijection_for_every_width_up_to_2_16():
    """Every n in [0, 2**12] and the edges and a sample of every width to 2**16, each with one
    of several seeds and round counts, in full."""
    seeds, rounds = SEEDS, [0, 1, 2, 3, 5, 6, 8]
    buf = np.empty(1 << 16, dtype=np.int64)
    seen = np.zeros(1 << 16, dtype=bool)
    for n in _sizes_up_to_2_16():
        p = FeistelPermutation(n, rounds[n % len(rounds)], seeds[n % len(seeds)])
        v = p.fill(buf[:n])
        assert n == 0 or (v.min() >= 0 and v.max() < n), n
        s = seen[:n]
        s[:] = False
        s[v] = True
        assert s.all(), f"n={n} is not a bijection"


@pytest.mark.parametrize("seed", [0, 7, 2**64 - 1])
@pytest.mark.parametrize("rounds", [1, 2, 3, 6, 9])
def test_bijection_and_inverse_both_paths(seed, rounds):
    for n in list(range(0, 300)) + [1023, 1024, 1025, 4096, 20000, 65536]:
        p = FeistelPermutation(n, rounds, seed)
        fwd = {}
        for path in PATHS:
            p._use_path(path)
            fwd[path] = v = p.range(0, n)
            assert sorted(v.tolist()) == list(range(n))
            assert (p.take(v, inverse=True) == np.arange(n)).all()
            assert (p.range(0, n, inverse=True)[v] == np.arange(n)).all()
        assert all((fwd[path] == fwd["portable"]).all() for path in PATHS)


@pytest.mark.parametrize("n", [2**32 + 15, 10**13 + 1, 2**52 - 3, 2**52 + 1, 2**56 + 5, 2**62 + 3, 2**63 - 1])
def test_bijection_by_sampling_for_large_n(n):
    p = FeistelPermutation(n, 6, 99)
    rng = np.random.default_rng(n % 2**32)
    starts = [0, n - 200_000, int(rng.integers(0, n - 200_000))]
    for start in starts:
        for path in PATHS:
            p._use_path(path)
            v = p.range(start, start + 200_000)
            assert v.min() >= 0 and v.max() < n
            assert np.unique(v).size == v.size          # injective on the window
            assert (p.take(v, inverse=True) == np.arange(start, start + 200_000)).all()
    j = rng.integers(0, n, 10_000)
    assert (p.take(p.take(j, inverse=True)) == j).all()       # surjective on the sample
    assert p.side ** 2 >= n > (p.side - 1) ** 2


# ---------------------------------------------------------------------------------------
# where gfc is wrong


@pytest.mark.parametrize("k", [2**26, 2**27 + 1, 2**30 + 5, 2**31 - 1, 2**31])
def test_above_2_52_gfc_double_sqrt_breaks_bijectivity_and_ours_does_not(k):
    n = k * k + 1                       # gfc's a = k (rounded sqrt): a*a = n - 1 < n
    assert n >= 2**52
    assert gfc_side(n) == k and exact_side(n) == k + 1
    g = pygfc.Permutation(n, 6, 42)
    x = g[n - 1]                        # the last position lies outside gfc's Feistel domain
    j = g.inv(x)
    assert j != n - 1 and g[j] == x     # two positions share a value: not a bijection
    p = FeistelPermutation(n, 6, 42)
    assert p.side == k + 1
    for i in [0, 1, n - 2, n - 1, k * k - 1, k * k, j]:
        v = p[i]
        assert 0 <= v < n and p.inverse(v) == i
    # where gfc's side is right, the outputs are gfc's (the side is the only difference)
    m = k * k                           # an exact square: gfc and exact agree
    g2, p2 = pygfc.Permutation(m, 6, 42), FeistelPermutation(m, 6, 42)
    assert [g2[i] for i in range(0, m, m // 97)] == [p2[i] for i in range(0, m, m // 97)]


#: (n, rounds, seed, position) where gfc's first round sum L + F_1(R) wraps past 2**64. Found by
#: scanning rows R in [0, a) for F_1(R) > 2**64 - a (one Speck call per row, seed 1 hit after
#: 3e9 rows) and taking L = a - 1, the largest left half.
WRAP_CASE = (2**63 - 1, 6, 1, 4367441591507668499)


def test_gfc_round_sum_wraps_and_ours_does_not():
    """gfc adds L + F_j(R) in uint64_t; when that wraps the round is not invertible, and
    pygfc's inverse no longer undoes its forward map. Ours sums modulo a exactly."""
    n, rounds, seed, m = WRAP_CASE
    # the wrap happens: recompute gfc's rounds with the pure-Python Speck
    a = gfc_side(n)
    keys = [ref.speck_expand(seed, j) for j in range(rounds)]
    wrapped, c = False, m
    while True:
        left, right = c % a, c // a
        for k in keys:
            f = ref.speck_encrypt(k, right)
            wrapped |= left + f >= 2**64
            left, right = right, ((left + f) % 2**64) % a
        c = a * left + right if rounds & 1 else a * right + left
        if c < n:
            break
    assert wrapped
    g = pygfc.Permutation(n, rounds, seed)
    assert g[m] == c
    j = g.inv(g[m])
    assert j != m and g[j] == g[m]                   # two positions, one value: no bijection
    p = FeistelPermutation(n, rounds, seed)
    assert p.inverse(p[m]) == m and p[m] != g[m]


# ---------------------------------------------------------------------------------------
# API


def test_paths():
    assert PATHS[0] == "portable"
    p = FeistelPermutation(100)
    assert p.path == PATHS[-1] and p.simd == (len(PATHS) > 1)
    with pytest.raises(ConfigError):
        p._use_path("sse9")
    p._use_simd(False)
    assert p.path == "portable"


def test_pickle_equality_repr_and_errors():
    p = FeistelPermutation(10**9, 7, 2**64 - 1)
    q = pickle.loads(pickle.dumps(p))
    assert q == p and hash(q) == hash(p) and q[12345] == p[12345] and q.inverse(7) == p.inverse(7)
    assert q != FeistelPermutation(10**9, 7, 0)
    assert "seed=18446744073709551615" in repr(p)
    assert len(FeistelPermutation(2**63 - 1)) == 2**63 - 1
    assert (p[10:20] == p.range(10, 20)).all() and (p[5:50:7] == p.take(np.arange(5, 50, 7))).all()
    for bad, field in [(-1, "n"), (2**63, "n"), (1.0, "n"), (True, "n"), (float("nan"), "n")]:
        with pytest.raises(ConfigError) as info:
            FeistelPermutation(bad)
        assert info.value.field == field
    for bad in (-1, 1025, 2.5, True):
        with pytest.raises(ConfigError, match="rounds"):
            FeistelPermutation(10, bad)
    for bad in (-1, 2**64, 1.5, float("nan"), float("inf"), True, "3", None):
        with pytest.raises(ConfigError, match="seed"):
            FeistelPermutation(10, 6, bad)
    assert FeistelPermutation(10, 6, np.uint64(2**64 - 1)).seed == 2**64 - 1
    small = FeistelPermutation(10, 6, 1)
    for bad in (-1, 10, 2**70, True, 1.0, "1"):
        with pytest.raises(IndexError):
            small[bad]
        with pytest.raises(IndexError):
            small.inverse(bad)
    with pytest.raises(IndexError):
        small.take([0, 10])
    with pytest.raises(IndexError):
        small.take(np.array([2**64 - 1], dtype=np.uint64))
    with pytest.raises(ConfigError):
        small.take([0.5])
    with pytest.raises(IndexError):
        small.range(5, 11)
    with pytest.raises(IndexError):
        small.fill(np.empty(4, np.int64), 7)
    with pytest.raises(ConfigError):
        small.fill(np.empty(4, np.int32))
    with pytest.raises(ConfigError):
        small.take([1, 2], out=np.empty(3, np.int64))
    ro = np.empty(3, np.int64)
    ro.flags.writeable = False
    with pytest.raises(ConfigError):
        small.fill(ro)
    empty = FeistelPermutation(0)
    assert len(empty) == 0 and list(empty) == [] and empty.range(0, 0).size == 0
    assert empty.take([]).size == 0
    with pytest.raises(IndexError):
        empty[0]


def test_take_keeps_shape_and_may_work_in_place():
    p = FeistelPermutation(1000, 6, 3)
    pos = np.arange(600, dtype=np.int64).reshape(20, 30)
    want = p.take(pos)
    assert want.shape == (20, 30)
    assert (want.reshape(-1) == p.range(0, 600)).all()
    flat = pos.reshape(-1).copy()
    assert p.take(flat, out=flat) is flat and (flat == want.reshape(-1)).all()


@pytest.mark.parametrize("call", ["fill", "take"])
def test_bulk_calls_release_the_gil(call):
    """While one thread is inside a bulk call, another keeps running Python code: it counts
    loop turns until the call returns. Were the GIL held, it could not turn at all."""
    import threading

    p = FeistelPermutation(2**40, 16, 1)
    out = np.empty(1 << 22, dtype=np.int64)
    pos = np.arange(1 << 22, dtype=np.int64)
    started, done = threading.Event(), threading.Event()

    def work():
        started.set()
        if call == "fill":
            p.fill(out)
        else:
            p.take(pos, out)
        done.set()

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    turns = 0
    while not done.is_set():
        turns += 1
    t.join()
    assert turns > 10_000


# ---------------------------------------------------------------------------------------
# the pure-Python twin and the draw / epoch-seed kernels


@pytest.mark.parametrize("n, rounds, seed", [(1, 3, 0), (10, 6, 1), (1000, 5, 2**63 + 5), (2**40 + 3, 7, 99),
                                             (2**52 + 1, 6, 42), (2**63 - 1, 2, 2**64 - 1)])
def test_reference_twin_agrees(n, rounds, seed):
    p, q = FeistelPermutation(n, rounds, seed), ref.FeistelPermutation(n, rounds, seed)
    pos = sample_positions(n, 40, random.Random(seed))
    assert [p[i] for i in pos] == [q[i] for i in pos]
    assert [p.inverse(i) for i in pos] == [q.inverse(i) for i in pos]
    assert (p.take(pos) == q.take(pos)).all()
    assert p.side == q.side and len(p) == len(q)


def test_random_draws_and_epoch_seeds():
    ctr = np.concatenate([np.arange(500), np.arange(2**63 - 300, 2**63 - 1)]).astype(np.int64)
    for seed in (0, 5, 2**64 - 1):
        for n in (1, 3, 1000, 2**63 - 1):
            a = random_draws(seed, ctr, n)
            assert (a == ref.random_draws(seed, ctr, n)).all()
            assert a.min() >= 0 and a.max() < n
        assert epoch_seed(seed, 3) == ref.epoch_seed(seed, 3)
    # counter mode: any draw alone equals the same draw in a run
    run = random_draws(9, np.arange(1000), 777)
    assert all(random_draws(9, [c], 777)[0] == run[c] for c in (0, 1, 500, 999))
    assert len({epoch_seed(1, e) for e in range(1000)}) == 1000
    with pytest.raises(ConfigError):
        random_draws(1, [1], 0)
    with pytest.raises(IndexError):
        random_draws(1, [-1], 5)
    with pytest.raises(ConfigError):
        epoch_seed(1, -1)
