"""The compiled walk of a mixture's picks equals its twin and the Python rule of
MixtureOrder, pick for pick (float operations included: weights like 1/3 round)."""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobatch.core._kernels import compiled, twin
from zerobatch.samplers import MixtureOrder, WeightSchedule

weights = st.lists(st.sampled_from([1.0, 2.0, 3.0, 1 / 3, 0.1, 0.7, 5.5, 1e-3]), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(weights, st.integers(0, 200), st.booleans(), st.integers(0, 50), st.integers(0, 4))
def test_compiled_walk_equals_its_twin(w, n, moving, t, watch):
    total = sum(w)
    w = [x / total for x in w]
    rng = np.random.default_rng(n)
    since = rng.integers(0, 5, len(w)).astype(np.int64)
    target = rng.random(len(w)) if moving else None
    watch = watch if watch < len(w) else -1
    wanted = np.sort(rng.choice(60, 10, replace=False)).astype(np.int64)
    outs = []
    for kernel in (compiled("mixture"), twin("mixture")):
        s, tg = since.copy(), None if target is None else target.copy()
        found = np.full(wanted.size, -1, np.int64)
        res = kernel.mixture_walk(w, s, tg, t, n, moving, watch, 3, wanted, found)
        outs.append((res, s.tolist(), None if tg is None else tg.tolist(), found.tolist()))
    assert outs[0] == outs[1]


@settings(max_examples=40, deadline=None)
@given(weights, st.lists(st.integers(1, 30), min_size=1, max_size=25), st.sampled_from([None, "constant", "linear"]),
       st.integers(0, 2**32))
def test_skip_steps_is_take_step_without_the_items(w, sizes, interpolation, seed):
    names = [f"s{k}" for k in range(len(w))]
    sched = None
    if interpolation is not None:
        sched = WeightSchedule([(0, list(reversed(w))), (4, w), (9, [1.0] * len(w))], interpolation=interpolation)
    mix = MixtureOrder([(n, 7 + 3 * k, x) for k, (n, x) in enumerate(zip(names, w))], seed=seed,
                       weight_schedule=sched)
    ref = copy.deepcopy(mix)
    taken = np.concatenate([ref.take_step(g)[0] for g in sizes])
    k = len(w) - 1
    counts = np.arange(0, 50, 2)
    found = mix.skip_steps(sizes, watch=k, counts=counts)
    assert mix.state_dict() == ref.state_dict()
    mine = np.flatnonzero(taken == k)
    assert found.tolist() == [int(mine[c]) if c < mine.size else -1 for c in counts]


two_weights = st.one_of(st.sampled_from([0.5, 1 / 3, 0.1, 0.7, 1e-3, 0.999, 0.3, 2 / 7]), st.floats(1e-4, 1 - 1e-4))


@settings(max_examples=80, deadline=None)
@given(two_weights, st.integers(0, 3000), st.integers(1, 200_000), st.sampled_from([None, 0, 1]), st.integers(0, 2**32))
def test_two_sources_in_closed_form_are_the_walk(w1, lead, n, watch, seed):
    """The closed form of two sources under constant weights (zerobatch.samplers._two_sources)
    gives the counts and the watched picks of the compiled walk, from any state."""
    from zerobatch.samplers._two_sources import walk_two
    walk = compiled("mixture").mixture_walk
    w = [1 - w1, w1]
    total = sum(w)
    w = [x / total for x in w]
    since = np.zeros(2, np.int64)
    t, _ = walk(w, since, None, 0, lead, False)          # a state the rule reached
    rng = np.random.default_rng(seed)
    want = np.unique(rng.integers(0, lead + n, 40)).astype(np.int64)
    a, b = since.copy(), since.copy()
    fa, fb = np.full(want.size, -1, np.int64), np.full(want.size, -1, np.int64)
    if watch is None:
        ta, _ = walk(w, a, None, t, n, False)
        tb = walk_two(walk, w, b, t, n)
    else:
        ta, _ = walk(w, a, None, t, n, False, watch, 3, want, fa)
        tb = walk_two(walk, w, b, t, n, watch, 3, want, fb)
    assert (ta, a.tolist(), fa.tolist()) == (tb, b.tolist(), fb.tolist())


def test_two_sources_in_closed_form_far_into_a_run():
    """10**8 picks (a long run's mixture) in closed form equal the walk's, watched counts too."""
    from zerobatch.samplers._two_sources import walk_two
    walk = compiled("mixture").mixture_walk
    for w1 in (0.3, 1 / 3):
        w = [1 - w1, w1]
        want = np.arange(5, 3 * 10**7, 999_983, dtype=np.int64)
        a, b = np.zeros(2, np.int64), np.zeros(2, np.int64)
        fa, fb = np.full(want.size, -1, np.int64), np.full(want.size, -1, np.int64)
        ta, _ = walk(w, a, None, 0, 10**8, False, 1, 0, want, fa)
        tb = walk_two(walk, w, b, 0, 10**8, 1, 0, want, fb)
        assert (ta, a.tolist(), fa.tolist()) == (tb, b.tolist(), fb.tolist())
