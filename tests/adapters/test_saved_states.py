"""Resume states saved by an earlier release load and continue exactly (tests/saved_states.py)."""

from __future__ import annotations

import json

import pytest
import saved_states

CASES = json.loads(saved_states.CASES.read_text())["cases"]
PARAMS = [pytest.param(case, k, id=f"{case['name']}-{k}") for case in CASES for k in range(len(case["resumed"]))]


@pytest.mark.parametrize(("case", "k"), PARAMS)
def test_saved_state_continues_exactly(case: dict, k: int) -> None:
    resumed = case["resumed"][k]
    obj = saved_states.build(case, resumed["config"])
    try:
        obj.load_state_dict(json.loads(json.dumps(case["state"])))
        got = saved_states._batches(obj, case, case.get("next"))
    finally:
        if hasattr(obj, "close"):
            obj.close()
    assert len(got) == len(resumed["next"])
    assert got == resumed["next"]


def test_every_case_is_recorded() -> None:
    assert {c["name"] for c in CASES} == {c["name"] for c in saved_states.CASE_SPECS}
