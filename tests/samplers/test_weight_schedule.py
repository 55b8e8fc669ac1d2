"""Step-keyed mixture weights (WeightSchedule): within each stretch of constant weights the
proportions are exact to one sample, linear stretches follow the moving weights, and a run
stopped and resumed at any step (right before and after every change point, on another world
size, through the loader) continues exactly as an uninterrupted one; a state saved without a
schedule loads into a run with one, which applies from the state's step."""

from __future__ import annotations

import numpy as np
import pytest

from zerobatch.formats.errors import ConfigError
from zerobatch.samplers import MixtureSampler, MixtureOrder, WeightSchedule

SOURCES = [("web", 1000, 1.0), ("code", 300, 1.0), ("math", 50, 1.0)]
G = 12


def schedule(interpolation="constant"):
    return WeightSchedule([(5, {"web": 0.8, "code": 0.2}), (9, {"web": 0.2, "code": 0.3, "math": 0.5}),
                           (15, [1, 1, 2])], interpolation=interpolation)


def run(sched_kw, steps, world=1):
    """Every rank's (source, item) per step, merged into global steps."""
    out = []
    for r in range(world):
        s = MixtureSampler(MixtureOrder(SOURCES, seed=3, **sched_kw), global_batch_size=G, rank=r,
                           world_size=world)
        out.append([(p.sources.reshape(-1).tolist(), p.items.reshape(-1).tolist())
                    for _, p in zip(range(steps), s.plan(), strict=False)])
    return [(sum((o[i][0] for o in out), []), sum((o[i][1] for o in out), [])) for i in range(steps)]


@pytest.mark.parametrize("interpolation", ["constant", "linear"])
def test_the_proportions_follow_the_schedule(interpolation):
    sched = MixtureOrder(SOURCES, seed=1, weight_schedule=schedule(interpolation))
    picks = [np.bincount(sched.take_step(G)[0], minlength=3) for _ in range(24)]
    if interpolation == "constant":
        for a, b, w in ((0, 5, [1 / 3] * 3), (5, 9, [0.8, 0.2, 0]), (9, 15, [0.2, 0.3, 0.5]), (15, 24, [.25, .25, .5])):
            got = np.sum(picks[a:b], axis=0)
            assert (np.abs(got - np.array(w) * G * (b - a)) < 1).all(), (a, got)
    else:
        # between steps 9 and 15 the weights move from (0.2, 0.3, 0.5) to (0.25, 0.25, 0.5)
        want = np.zeros(3)
        for t in range(9, 15):
            f = (t - 9) / 6
            want += G * (np.array([0.2, 0.3, 0.5]) + (np.array([0.25, 0.25, 0.5]) - [0.2, 0.3, 0.5]) * f)
        assert (np.abs(np.sum(picks[9:15], axis=0) - want) < 1).all()
        got = np.sum(picks[5:9], axis=0)        # 0.8/0.2 -> 0.2/0.3/0.5 linearly over steps 5..8
        assert got[0] > got[1] and got[2] > 0


@pytest.mark.parametrize("interpolation", ["constant", "linear"])
@pytest.mark.parametrize("w_from, w_to", [(1, 1), (2, 3), (4, 1)])
def test_resume_at_every_step_equals_an_uninterrupted_run(interpolation, w_from, w_to):
    kw = {"weight_schedule": schedule(interpolation)}
    steps = 20
    want = run(kw, steps, world=1)
    assert run(kw, steps, world=w_from) == want
    for k in (0, 1, 4, 5, 6, 8, 9, 10, 14, 15, 16, 19):
        first = MixtureSampler(MixtureOrder(SOURCES, seed=3, **kw), global_batch_size=G, rank=0,
                               world_size=w_from)
        plan = first.plan()
        last = None
        for _ in range(k):
            last = next(plan).after[-1]
        if last is not None:
            first.advance_to(last)                 # what the loader does once steps are delivered
        state = first.state_dict()
        rest = []
        for r in range(w_to):
            s = MixtureSampler(MixtureOrder(SOURCES, seed=3, **kw), global_batch_size=G, rank=r, world_size=w_to)
            s.load_state_dict(state)
            rest.append([(p.sources.reshape(-1).tolist(), p.items.reshape(-1).tolist())
                         for _, p in zip(range(steps - k), s.plan(), strict=False)])
        merged = [(sum((o[i][0] for o in rest), []), sum((o[i][1] for o in rest), [])) for i in range(steps - k)]
        assert merged == want[k:], (k, w_from, w_to)


def test_a_state_without_a_schedule_loads_into_a_run_with_one():
    plain = MixtureSampler(MixtureOrder(SOURCES, seed=3), global_batch_size=G)
    plan = plain.plan()
    for _ in range(7):
        last = next(plan).after[-1]
    plain.advance_to(last)
    state = plain.state_dict()
    sched = MixtureSampler(MixtureOrder(SOURCES, seed=3, weight_schedule=schedule()), global_batch_size=G)
    sched.load_state_dict(state)
    assert sched.state_dict()["mixture"]["step"] == 7
    steps = [p.sources.reshape(-1) for _, p in zip(range(2), sched.plan(), strict=False)]
    assert all(np.bincount(s, minlength=3)[2] == 0 for s in steps)          # step 7, 8: weights 0.8/0.2/0
    consumed = state["mixture"]["sources"]
    after = sched.state_dict()["mixture"]["sources"]
    assert after["web"]["consumed"] >= consumed["web"]["consumed"]           # every source continues


def test_bad_schedules_are_refused():
    with pytest.raises(ConfigError, match="increase"):
        WeightSchedule([(5, [1, 1, 1]), (5, [1, 2, 1])])
    with pytest.raises(ConfigError, match="interpolation"):
        WeightSchedule([(0, [1, 1, 1])], interpolation="cubic")
    with pytest.raises(ConfigError, match="not a source"):
        MixtureOrder(SOURCES, weight_schedule=WeightSchedule([(0, {"books": 1})]))
    with pytest.raises(ConfigError, match="non-negative"):
        MixtureOrder(SOURCES, weight_schedule=WeightSchedule([(0, [0, 0, 0])]))
