"""MixtureOrder: exact proportions at every step, per-source orders with cycling, exact
resume, resume after reweighting or adding a source, rank sharding, bad inputs; its former
name MixtureSchedule still works."""

from __future__ import annotations

import json

import numpy as np
import pytest

from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.samplers import MixtureOrder, MixtureSampler, Schedule

SOURCES = [("web", 1000, 0.6), ("code", 300, 0.3), ("books", 7, 0.1)]


def test_proportions_are_exact_at_every_step():
    for sources in (SOURCES, [("a", 10, 1), ("b", 10, 1)], [("a", 5, 3), ("b", 50, 5), ("c", 9, 0.25)]):
        m = MixtureOrder(sources, seed=1)
        src, _ = m.take(5000)
        w = np.array([s[2] for s in sources], float)
        w /= w.sum()
        counts = np.zeros(len(sources))
        for t, k in enumerate(src.tolist(), start=1):
            counts[k] += 1
            assert np.all(np.abs(counts - w * t) < 1.0), (t, counts, w * t)


def test_each_source_follows_its_own_order_and_cycles_when_small():
    m = MixtureOrder(SOURCES, seed=3)
    src, items = m.take(3000)
    books = items[src == 2]
    assert len(books) == 300
    for e in range(len(books) // 7):                       # every epoch of 7 is a permutation
        assert sorted(books[e * 7:(e + 1) * 7].tolist()) == list(range(7))
    assert books[:7].tolist() != books[7:14].tolist()      # a fresh permutation each epoch
    web = items[src == 0]
    assert len(web) == 1800
    assert sorted(web[:1000].tolist()) == list(range(1000))      # epoch 0: every item once
    assert len(set(web[1000:].tolist())) == 800                  # epoch 1 so far: no repeats
    plain = MixtureOrder(SOURCES, seed=3, shuffle=False)
    s2, i2 = plain.take(100)
    assert i2[s2 == 0].tolist() == list(range(int((s2 == 0).sum())))


def test_take_in_pieces_equals_take_at_once_and_state_resumes_exactly():
    whole = MixtureOrder(SOURCES, seed=5).take(1000)
    m = MixtureOrder(SOURCES, seed=5)
    parts = [m.take(n) for n in (1, 0, 99, 400)]
    state = json.loads(json.dumps(m.state_dict()))
    again = MixtureOrder(SOURCES, seed=5)
    again.load_state_dict(state)
    parts.append(again.take(500))
    assert np.concatenate([p[0] for p in parts]).tolist() == whole[0].tolist()
    assert np.concatenate([p[1] for p in parts]).tolist() == whole[1].tolist()


def test_resume_after_reweighting_continues_every_source_and_repeats_nothing():
    m = MixtureOrder(SOURCES, seed=7)
    src1, items1 = m.take(900)
    state = m.state_dict()
    new = MixtureOrder([("web", 1000, 0.2), ("code", 300, 0.7), ("books", 7, 0.1)], seed=7)
    new.load_state_dict(state)
    src2, items2 = new.take(200)
    for k, (name, size, _) in enumerate(SOURCES):
        seq = np.concatenate([items1[src1 == k], items2[src2 == k]])
        reference = MixtureOrder([(name, size, 1.0)], seed=7).take(len(seq))[1]
        assert seq.tolist() == reference.tolist(), name   # the same order, continued, nothing repeated
    counts = np.bincount(src2, minlength=3)
    assert abs(counts[1] - 140) < 1 and abs(counts[0] - 40) < 1   # the new weights from the change on


def test_adding_and_removing_sources():
    m = MixtureOrder(SOURCES[:2], seed=9)
    _, _ = m.take(100)
    state = m.state_dict()
    grown = MixtureOrder([*SOURCES, ("math", 50, 0.5)], seed=9)
    grown.load_state_dict(state)
    assert grown.consumed[:2] == m.consumed and grown.consumed[2:] == [0, 0]
    src, _ = grown.take(100)
    assert set(src.tolist()) == {0, 1, 2, 3}
    shrunk = MixtureOrder([SOURCES[1]], seed=9)
    shrunk.load_state_dict(state)
    assert shrunk.consumed == [m.consumed[1]]


def test_ranks_split_each_global_batch_without_overlap():
    ranks = [MixtureOrder(SOURCES, seed=2) for _ in range(4)]
    glob = MixtureOrder(SOURCES, seed=2)
    for _ in range(5):
        want = glob.take(4 * 8)
        got = [r.batch(8, rank=i, world_size=4) for i, r in enumerate(ranks)]
        assert np.concatenate([g[0] for g in got]).tolist() == want[0].tolist()
        assert np.concatenate([g[1] for g in got]).tolist() == want[1].tolist()


def test_bad_inputs():
    for sources in ([], [("a", 0, 1)], [("a", 5, 0)], [("a", 5, float("nan"))], [("a", 5, 1), ("a", 6, 1)],
                    [("", 5, 1)], [("a", 5)], [("a", 5, True)]):
        with pytest.raises(ConfigError):
            MixtureOrder(sources)
    m = MixtureOrder(SOURCES, seed=1)
    m.take(10)
    state = m.state_dict()
    with pytest.raises(StateError):
        MixtureOrder(SOURCES, seed=2).load_state_dict(state)
    with pytest.raises(StateError, match="items"):
        MixtureOrder([("web", 999, 0.6), ("code", 300, 0.3), ("books", 7, 0.1)], seed=1).load_state_dict(state)
    bad = json.loads(json.dumps(state))
    bad["steps"] += 1
    with pytest.raises(StateError, match="add up"):
        MixtureOrder(SOURCES, seed=1).load_state_dict(bad)
    bad["sources"]["web"]["consumed"] = -1
    with pytest.raises(StateError):
        MixtureOrder(SOURCES, seed=1).load_state_dict(bad)
    with pytest.raises(StateError):
        MixtureOrder(SOURCES, seed=1).load_state_dict({"other": 1})


def test_former_name_is_the_same_class_and_loads_its_states():
    """``MixtureSchedule`` (the name until the vocabulary review) is ``MixtureOrder``: old
    code, pickles and saved states that name it keep working. It is an order, not a Schedule:
    the Schedule over it is MixtureSampler, whose state nests the order's under "mixture"."""
    import pickle

    import zerobatch.samplers.mixture as mixture_module
    from zerobatch.samplers import MixtureSchedule

    assert MixtureSchedule is MixtureOrder is mixture_module.MixtureSchedule
    old = MixtureSchedule(SOURCES, seed=4)
    old.take(37)
    new = MixtureOrder(SOURCES, seed=4)
    new.load_state_dict(json.loads(json.dumps(old.state_dict())))
    assert np.array_equal(np.stack(new.take(50)), np.stack(old.take(50)))
    assert pickle.loads(pickle.dumps(old)).state_dict() == old.state_dict()
    assert not isinstance(new, Schedule)
    sampler = MixtureSampler(new, 4)
    assert isinstance(sampler, Schedule) and sampler.mixture is new and sampler.schedule is new
    assert sampler.state_dict()["mixture"] == new.state_dict()
