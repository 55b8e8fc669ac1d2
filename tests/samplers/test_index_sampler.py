"""Index orders and IndexSampler: documented sequences, O(1) seeks, rank partitions, exact
resume across world sizes, and the state's refusals."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.samplers import (
    BlockShuffleOrder,
    FeistelPermutation,
    GlobalRandomOrder,
    IndexSampler,
    RandomOrder,
    SequentialOrder,
    SlidingOrder,
    epoch_seed,
    random_draws,
    state_from_json,
    state_to_json,
)


def batches(sampler, k=None):
    it = iter(sampler)
    if k is not None:
        it = itertools.islice(it, k)
    return [b.tolist() for b in it]


def make_order(kind, n, seed=7):
    return {
        "sequential": lambda: SequentialOrder(n),
        "global-random": lambda: GlobalRandomOrder(n, seed=seed),
        "block-shuffle": lambda: BlockShuffleOrder(n, 4, seed=seed),
        "sliding": lambda: SlidingOrder(n),
        "random": lambda: RandomOrder(n, seed=seed),
    }[kind]()


EPOCH_KINDS = ["sequential", "global-random", "block-shuffle"]
ALL_KINDS = EPOCH_KINDS + ["sliding", "random"]

# ---------------------------------------------------------------------------------------
# documented sequences


def test_sequential_keep_drop_pad():
    assert batches(IndexSampler(SequentialOrder(10), 4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batches(IndexSampler(SequentialOrder(10), 4, tail="drop")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert batches(IndexSampler(SequentialOrder(10), 4, tail="pad")) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    s = IndexSampler(SequentialOrder(10), 4, tail="pad")
    assert len(s) == 3 and s.padding == 2 and s.dropped == 0 and s.epoch_positions == 12
    s = IndexSampler(SequentialOrder(10), 4, tail="drop")
    assert len(s) == 2 and s.dropped == 2 and s.padding == 0
    # the same in every epoch
    s = IndexSampler(SequentialOrder(5), 2, epoch=3)
    assert batches(s) == [[0, 1], [2, 3], [4]]


def test_sliding_wraps_the_ring():
    s = IndexSampler(SlidingOrder(10), 4)
    assert batches(s, 6) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9],
                             [0, 1, 2, 3]]
    assert batches(IndexSampler(SlidingOrder(3), 5), 2) == [[0, 1, 2, 0, 1], [2, 0, 1, 2, 0]]
    with pytest.raises(TypeError):
        len(s)
    assert s.steps_per_epoch is None


def test_random_draws_are_counter_based_with_replacement():
    s = IndexSampler(RandomOrder(50, seed=3), 8)
    got = batches(s, 100)
    assert got[7] == random_draws(3, np.arange(56, 64), 50).tolist()
    flat = sum(got, [])
    assert min(flat) >= 0 and max(flat) < 50 and len(set(flat)) == 50     # all items drawn
    assert any(len(set(b)) < len(b) for b in got)                         # with replacement
    assert s.batch(10**12).tolist() == random_draws(3, np.arange(8 * 10**12, 8 * 10**12 + 8), 50).tolist()
    assert batches(IndexSampler(RandomOrder(50, seed=4), 8), 1) != got[:1]


def test_global_random_is_a_fresh_feistel_permutation_per_epoch():
    n = 1000
    order = GlobalRandomOrder(n, seed=11, rounds=6)
    s = IndexSampler(order, 64)
    e0 = sum(batches(s), [])
    s.set_epoch(1)
    e1 = sum(batches(s), [])
    assert sorted(e0) == sorted(e1) == list(range(n))
    assert e0 != e1
    assert e0 == FeistelPermutation(n, 6, epoch_seed(11, 0)).range(0, n).tolist()
    assert e1 == FeistelPermutation(n, 6, epoch_seed(11, 1)).range(0, n).tolist()


def test_block_shuffle_sampler_is_the_loaders_order():
    order = BlockShuffleOrder(103, 8, seed=5)
    s = IndexSampler(order, 10, epoch=2)
    assert sum(batches(s), []) == order.epoch_order(2).tolist()


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_empty_space_and_batches_larger_than_the_space(kind):
    s = IndexSampler(make_order(kind, 0), 4)
    assert batches(s) == [] and s.steps_per_epoch == 0 and len(s) == 0
    s = IndexSampler(make_order(kind, 3), 5)
    got = batches(s, 3)
    if kind in EPOCH_KINDS:
        assert len(got) == 1 and sorted(got[0]) == [0, 1, 2]
        assert batches(IndexSampler(make_order(kind, 3), 5, tail="drop")) == []
        padded = batches(IndexSampler(make_order(kind, 3), 5, tail="pad"))
        assert len(padded) == 1 and len(padded[0]) == 5 and set(padded[0]) == {0, 1, 2}
    else:
        assert len(got) == 3 and all(len(b) == 5 for b in got)


# ---------------------------------------------------------------------------------------
# seeks


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("world_size", [1, 3])
def test_seek_equals_stepping(kind, world_size):
    for rank in range(world_size):
        s = IndexSampler(make_order(kind, 157), 5, rank=rank, world_size=world_size, tail="keep")
        stepped = batches(s, 40)
        for k in range(len(stepped)):
            assert s.batch(k).tolist() == stepped[k]
        buf = np.full(5, -1, dtype=np.int64)
        view = s.batch(3, out=buf)
        assert view.base is buf or view is buf
        assert view.tolist() == stepped[3]


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_seek_then_iterate_equals_stepping_then_iterating(kind):
    for k in range(0, 9):
        stepped = IndexSampler(make_order(kind, 100), 12, rank=1, world_size=2)
        it = iter(stepped)
        for _ in range(min(k, 5 if kind in EPOCH_KINDS else k)):
            next(it)
        sought = IndexSampler(make_order(kind, 100), 12, rank=1, world_size=2)
        sought.seek(min(k, 5) if kind in EPOCH_KINDS else k)
        assert sought.state_dict() == stepped.state_dict()
        assert batches(sought, 3) == batches(stepped, 3)
    with pytest.raises(IndexError):
        IndexSampler(SequentialOrder(100), 12).seek(10)


def test_batches_into_a_callers_buffer():
    s = IndexSampler(SequentialOrder(10), 4)
    buf = np.empty(4, dtype=np.int64)
    seen = []
    for b in s.batches(out=buf):
        assert np.shares_memory(b, buf)
        seen.append(b.tolist())
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# ---------------------------------------------------------------------------------------
# partitions over ranks


@pytest.mark.parametrize("kind", EPOCH_KINDS)
@pytest.mark.parametrize("tail", ["keep", "drop", "pad"])
def test_rank_partitions_are_disjoint_covering_and_even(kind, tail):
    for n, w, b in itertools.product([0, 1, 7, 24, 100, 257], [1, 2, 3, 4, 8], [1, 3, 8]):
        per_rank = [batches(IndexSampler(make_order(kind, n), b, rank=r, world_size=w, tail=tail))
                    for r in range(w)]
        steps = {len(x) for x in per_rank}
        assert len(steps) == 1, "every rank takes the same number of steps"
        s0 = IndexSampler(make_order(kind, n), b, rank=0, world_size=w, tail=tail)
        assert steps == {len(s0)}
        items = sorted(i for x in per_rank for batch in x for i in batch)
        g = b * w
        if tail == "keep":
            assert items == list(range(n))
        elif tail == "drop":
            assert items == sorted(make_order(kind, n).items(0, np.arange(n // g * g)).tolist())
            assert len(set(items)) == len(items)
        else:
            assert set(items) == set(range(n)) and len(items) == len(s0) * g
            assert len(items) - n == s0.padding
        # the step's global batch, in rank-major round robin, is the order's next G positions
        order = make_order(kind, n)
        for step in range(len(s0)):
            pos = s0.positions(step)
            if tail != "pad":
                assert ((pos - step * g) % w == 0).all() and (pos >= step * g).all()
        if tail == "drop" and n:
            glob = [i for step in range(len(s0)) for j in range(b) for r in range(w)
                    for i in [per_rank[r][step][j]]]
            assert glob == order.items(0, np.arange(len(s0) * g)).tolist()


# ---------------------------------------------------------------------------------------
# resume


def global_steps(kind, n, g, tail, epoch=0, start_state=None, world_size=1, steps=None):
    """The global batches (the union of every rank's batch, as sorted lists) from a state."""
    samplers = []
    for r in range(world_size):
        order = make_order(kind, n)
        if start_state is None:
            s = IndexSampler(order, global_batch_size=g, rank=r, world_size=world_size, tail=tail, epoch=epoch)
        else:
            s = IndexSampler.from_state(order, start_state, rank=r, world_size=world_size)
        samplers.append(s)
    its = [iter(s) for s in samplers]
    out = []
    for _ in itertools.count() if steps is None else range(steps):
        try:
            parts = [next(it).tolist() for it in its]
        except StopIteration:
            break
        out.append(sorted(sum(parts, [])))
    return out, samplers


@pytest.mark.parametrize("kind, tail", [(k, t) for k in EPOCH_KINDS for t in ("keep", "drop", "pad")]
                         + [("sliding", "keep"), ("random", "keep")])
def test_resume_from_every_step_on_every_world_size(kind, tail):
    n, g = 100, 24
    horizon = 7                      # steps compared (endless streams never end)
    full, _ = global_steps(kind, n, g, tail, steps=horizon)
    total = len(full)
    for k in range(total + 1):
        _, runners = global_steps(kind, n, g, tail, world_size=2, steps=k)
        state = json.loads(state_to_json(runners[0].state_dict()))
        assert runners[1].state_dict()["consumed"] == state["consumed"]
        for w in (1, 2, 3, 4, 8):
            rest, _ = global_steps(kind, n, g, tail, start_state=state, world_size=w, steps=horizon - k)
            assert rest == full[k:], (k, w)


@pytest.mark.parametrize("kind", EPOCH_KINDS)
def test_resume_at_epoch_boundaries_and_after_a_previous_resume(kind):
    n, g = 50, 8
    ref = []
    for e in range(3):
        steps, _ = global_steps(kind, n, g, "pad", epoch=e)
        ref.append(steps)
    assert ref[0] != ref[1] or kind == "sequential"
    # run epoch 0 whole on 4 ranks, save at its very end
    _, runners = global_steps(kind, n, g, "pad", world_size=4)
    state = runners[0].state_dict()
    assert state["epoch"] == 0 and state["consumed"] == 56
    resumed = IndexSampler.from_state(make_order(kind, n), state, rank=0, world_size=1)
    assert batches(resumed) == []                     # epoch 0 is done
    # the training loop moves on: set_epoch(1) starts epoch 1 from its beginning
    got, runners = [], []
    for r in range(2):
        s = IndexSampler.from_state(make_order(kind, n), state, rank=r, world_size=2)
        s.set_epoch(1)
        runners.append(s)
    its = [iter(s) for s in runners]
    for _ in range(3):
        got.append(sorted(sum((next(it).tolist() for it in its), [])))
    state2 = runners[1].state_dict()
    assert state2["epoch"] == 1 and state2["consumed"] == 24
    # second resume, on 8 ranks, finishes epoch 1 exactly
    rest, _ = global_steps(kind, n, g, "pad", start_state=state2, world_size=8)
    assert got + rest == ref[1]
    # set_epoch on the current epoch keeps the position (a resumed loop calls it as usual)
    s = IndexSampler.from_state(make_order(kind, n), state2, rank=0, world_size=1)
    s.set_epoch(1)
    assert s.consumed == 24 and s.step == 3


def test_state_is_small_json_and_explicit():
    s = IndexSampler(GlobalRandomOrder(10**12, seed=5), 16, rank=1, world_size=4, tail="drop",
                     fingerprint="abc")
    for _ in itertools.islice(iter(s), 3):
        pass
    d = s.state_dict()
    text = state_to_json(d)
    assert len(text) < 400
    assert d["seed"] == 5 and d["epoch"] == 0 and d["consumed"] == 3 * 64
    assert d["num_items"] == 10**12 and d["global_batch_size"] == 64
    assert d["fingerprint"] == "abc" and d["kind"] == "global-random"
    assert d["params"] == {"rounds": 6, "tail": "drop"}
    assert state_from_json(text) == d


@pytest.mark.parametrize("change, field", [
    (lambda: (GlobalRandomOrder(101, seed=5), {}), "num_items"),
    (lambda: (GlobalRandomOrder(100, seed=6), {}), "seed"),
    (lambda: (GlobalRandomOrder(100, seed=5, rounds=8), {}), "rounds"),
    (lambda: (SequentialOrder(100), {}), "kind"),
    (lambda: (GlobalRandomOrder(100, seed=5), {"fingerprint": "other"}), "fingerprint"),
    (lambda: (GlobalRandomOrder(100, seed=5), {"tail": "pad"}), "tail"),
])
def test_states_that_do_not_fit_are_refused(change, field):
    s = IndexSampler(GlobalRandomOrder(100, seed=5), 4, world_size=2, rank=0, fingerprint="abc")
    next(iter(s))
    state = s.state_dict()
    order, kwargs = change()
    kwargs = {"batch_size": 4, "world_size": 2, "rank": 0, "fingerprint": "abc", **kwargs}
    other = IndexSampler(order, **kwargs)
    with pytest.raises(StateError) as info:
        other.load_state_dict(state)
    assert info.value.field == field


@pytest.mark.parametrize("tail", ["keep", "drop", "pad"])
def test_another_global_batch_continues_from_the_same_position(tail):
    """The one resume rule (zerobatch.samplers.schedule): a state saved with a global batch of
    8 continues with 10 from exactly its position: the epoch's items, the consumed ones
    first, none again and none skipped (but what the tail drops or pads)."""
    order = GlobalRandomOrder(100, seed=5)
    s = IndexSampler(order, 4, world_size=2, rank=0, tail=tail, fingerprint="abc")
    it = iter(s)
    for _ in range(3):
        next(it)
    state = s.state_dict()
    assert state["consumed"] == 24
    ranks = [IndexSampler(order, 5, world_size=2, rank=r, tail=tail, fingerprint="abc") for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
        assert r.consumed == 24 and r.offset == 4
    rest = [np.concatenate(b) for b in zip(*[list(r) for r in ranks], strict=True)]
    got = np.concatenate(rest) if rest else np.empty(0, np.int64)
    full = order.items(0, np.arange(100))
    if tail == "keep":
        assert sorted(got) == sorted(full[24:])
    elif tail == "drop":
        assert sorted(got) == sorted(full[24:24 + (76 // 10) * 10])
    else:
        # padded to whole steps with the epoch's first positions (re-read items, as pad does)
        assert sorted(got) == sorted(np.concatenate([full[24:], full[:4]])) and len(got) == 80
    assert all(r.steps_left() == 0 for r in ranks)


def test_position_refusals():
    s = IndexSampler(SequentialOrder(100), 8)
    good = s.state_dict()
    with pytest.raises(StateError) as info:
        IndexSampler.from_state(SequentialOrder(100), good, rank=0, world_size=3)
    assert info.value.field == "global_batch_size" and "cannot be split over 3" in str(info.value)
    for consumed in (101, 2**62):
        with pytest.raises(StateError) as info:
            s.load_state_dict({**good, "consumed": consumed})
        assert info.value.field == "consumed"
    with pytest.raises(StateError, match="whole number") as info:
        s.load_state_dict({**good, "consumed": 12})
    assert info.value.field == "consumed"
    s.load_state_dict({**good, "consumed": 100})      # the kept tail ends the epoch
    assert batches(s) == []
    stream = IndexSampler(SlidingOrder(10), 4)
    with pytest.raises(StateError) as info:
        stream.load_state_dict({**stream.state_dict(), "epoch": 2})
    assert info.value.field == "epoch"


def test_argument_errors():
    for kwargs, field in [({}, "batch_size"), ({"batch_size": 2, "global_batch_size": 4}, "batch_size"),
                          ({"batch_size": 0}, "batch_size"), ({"batch_size": True}, "batch_size"),
                          ({"global_batch_size": 6, "world_size": 4, "rank": 0}, "global_batch_size"),
                          ({"batch_size": 2, "tail": "wrap"}, "tail"),
                          ({"batch_size": 2, "rank": 2, "world_size": 2}, "rank"),
                          ({"batch_size": 2, "epoch": -1}, "epoch")]:
        with pytest.raises(ConfigError) as info:
            IndexSampler(SequentialOrder(10), **kwargs)
        assert info.value.field == field
    with pytest.raises(ConfigError, match="tail"):
        IndexSampler(SlidingOrder(10), 2, tail="drop")
    with pytest.raises(ConfigError):
        IndexSampler(range(10), 2)
    with pytest.raises(IndexError):
        IndexSampler(SequentialOrder(10), 4).batch(3)
    with pytest.raises(ConfigError):
        IndexSampler(SequentialOrder(10), 4).batch(0, out=np.empty(3, np.int64))
    with pytest.raises(ConfigError):
        SequentialOrder(10).items(0, [1.5])
    with pytest.raises(IndexError):
        SequentialOrder(10).items(0, [10])


def test_rank_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    s = IndexSampler(SequentialOrder(16), 2)
    assert (s.rank, s.world_size, s.global_batch_size) == (2, 4, 8)
    assert batches(s) == [[2, 6], [10, 14]]


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_samplers_pickle_with_their_position(kind):
    import pickle

    s = IndexSampler(make_order(kind, 100), 6, rank=1, world_size=2, tail="keep")
    it = iter(s)
    next(it)
    next(it)
    clone = pickle.loads(pickle.dumps(s))
    assert clone.state_dict() == s.state_dict()
    assert batches(clone, 4) == batches(s, 4)
