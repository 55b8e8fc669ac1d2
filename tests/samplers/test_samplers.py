"""Block-shuffle order, rank sharding and the resume state."""

from __future__ import annotations

import json

import numpy as np
import pytest

from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.samplers import BlockShuffleOrder, OrderState, RankShard, check_rank, check_seed, state_from_json, state_to_json


@pytest.mark.parametrize("n, block", [(0, 4), (1, 4), (10, 4), (16, 4), (1000, 256), (1000, 1), (7, 100)])
def test_block_shuffle_is_whole_ascending_blocks_in_a_permuted_order(n, block):
    o = BlockShuffleOrder(n, block, seed=42)
    order = o.epoch_order(0).tolist()
    assert sorted(order) == list(range(n))
    perm = np.random.default_rng(42 ^ 0).permutation(o.num_blocks).tolist()
    assert order == [i for b in perm for i in range(b * block, min((b + 1) * block, n))]
    # inside each block the items are consecutive and ascending
    pos = 0
    for b in perm:
        size = min(block, n - b * block)
        assert order[pos:pos + size] == list(range(b * block, b * block + size))
        pos += size


def test_block_shuffle_epochs_seeds_and_determinism():
    o = BlockShuffleOrder(10000, 16, seed=7)
    e0, e1 = o.epoch_order(0), o.epoch_order(1)
    assert not (e0 == e1).all()
    assert (BlockShuffleOrder(10000, 16, seed=7).epoch_order(1) == e1).all()
    assert not (BlockShuffleOrder(10000, 16, seed=8).epoch_order(1) == e1).all()
    # seed ^ epoch, as the seed describes: (seed 7, epoch 1) and (seed 6, epoch 0) share an order
    assert (BlockShuffleOrder(10000, 16, seed=6).epoch_order(0) == e1).all()
    assert (BlockShuffleOrder(10, 4, shuffle=False).epoch_order(3) == np.arange(10)).all()
    assert (o.items(1, [5, 0, 9999]) == e1[[5, 0, 9999]]).all()
    with pytest.raises(IndexError):
        o.items(0, [10000])


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, float("nan"), float("inf"), True, "1", None])
def test_bad_seeds_are_refused(bad):
    with pytest.raises(ConfigError, match="seed"):
        check_seed(bad)
    with pytest.raises(ConfigError):
        BlockShuffleOrder(10, 2, seed=bad)


def test_rank_checks():
    assert check_rank(0, 1) == (0, 1)
    for rank, world in [(1, 1), (-1, 2), (0, 0), (True, 2), (0, 1.0)]:
        with pytest.raises(ConfigError):
            check_rank(rank, world)


@pytest.mark.parametrize("n", [0, 1, 5, 16, 17, 100, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("drop_last", [True, False])
def test_rank_partition_is_disjoint_covering_and_even(n, world, drop_last):
    shards = [RankShard(n, r, world, drop_last) for r in range(world)]
    steps = {s.num_steps for s in shards}
    assert len(steps) == 1  # every rank takes the same number of steps
    (k,) = steps
    got = [s.positions(0, k).tolist() for s in shards]
    flat = sorted(p for g in got for p in g)
    if drop_last:
        assert k == n // world
        assert flat == list(range(k * world))  # disjoint, and only the tail < world is dropped
        assert shards[0].dropped == n - k * world
    else:
        assert k == -(-n // world)
        assert set(flat) == set(range(n)) and len(flat) == k * world  # covering, padding wraps
        assert shards[0].padding == k * world - n < world
    for r, g in enumerate(got):
        assert all(p % world == r for p in g) or not drop_last  # round robin


def test_rank_shard_resume_positions():
    # 2 ranks consumed 3 steps (6 positions); 3 ranks continue from position 6
    s = RankShard(20, 1, 3, True, start=6)
    assert s.num_steps == 4 and s.positions(0, 4).tolist() == [7, 10, 13, 16]
    assert s.consumed_after(4) == 18
    with pytest.raises(IndexError):
        s.positions(3, 2)
    assert RankShard(20, 0, 3, True, start=20).num_steps == 0


def test_state_round_trip_and_validation():
    s = OrderState("llmbatch/block-shuffle", 42, 3, 96, 1000, "abc", {"block_size": 256, "shuffle": True})
    d = s.to_dict()
    text = state_to_json(d)
    assert OrderState.from_dict(state_from_json(text)) == s
    assert json.loads(text) == d
    s.check_fits(s, max_consumed=1000)
    for field, value in [("kind", "x"), ("seed", 43), ("num_items", 999), ("fingerprint", "abd")]:
        other = OrderState(**{**s.__dict__, field: value})
        with pytest.raises(StateError, match=field) as info:
            other.check_fits(s, max_consumed=1000)
        assert info.value.field == field
    with pytest.raises(StateError, match="block_size"):
        OrderState(**{**s.__dict__, "params": {"block_size": 128, "shuffle": True}}).check_fits(s, max_consumed=1000)
    with pytest.raises(StateError, match="shuffle"):
        OrderState(**{**s.__dict__, "params": {"block_size": 256, "shuffle": 1}}).check_fits(s, max_consumed=1000)
    with pytest.raises(StateError, match="consumed"):
        OrderState(**{**s.__dict__, "consumed": 1001}).check_fits(s, max_consumed=1000)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("seed"), "seed"),
    (lambda d: d.update(seed=1.5), "seed"),
    (lambda d: d.update(seed=True), "seed"),
    (lambda d: d.update(seed=-1), "seed"),
    (lambda d: d.update(epoch="3"), "epoch"),
    (lambda d: d.update(consumed=None), "consumed"),
    (lambda d: d.update(zerobatch_state=1), "zerobatch_state"),
    (lambda d: d.update(zerobatch_state=3), "zerobatch_state"),
    (lambda d: d.pop("global_batch_size"), "global_batch_size"),
    (lambda d: d.update(global_batch_size=0), "global_batch_size"),
    (lambda d: d.update(global_batch_size=2.0), "global_batch_size"),
    (lambda d: d.update(zerobatch_state=True), "zerobatch_state"),
    (lambda d: d.update(kind=3), "kind"),
    (lambda d: d.update(params=[]), "params"),
])
def test_malformed_states(mutate, field):
    d = OrderState("k", 1, 0, 0, 10).to_dict()
    mutate(d)
    with pytest.raises(StateError) as info:
        OrderState.from_dict(d)
    assert info.value.field == field


@pytest.mark.parametrize("text", ['{"a": 1, "a": 2}', '{"seed": NaN}', '{"seed": Infinity}', "[1]", "{",
                                  b"\xff\xfe", "x" * 70000, "[" * 100000 + "]" * 100000])
def test_state_json_parsing_is_strict(text):
    with pytest.raises(StateError):
        state_from_json(text)
