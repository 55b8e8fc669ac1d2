"""The packing planner (zerobatch.core.pack_plan) against its pure-Python twin, and the
properties of every plan: each document token in exactly one piece, rows of 1..capacity
tokens, concat rows full but the last, and first-fit / best-fit rows no two of which (in one
window) would fit in one row; best-fit decreasing never pads more than first-fit in total
over many draws."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobatch.core import _packing
from zerobatch.core._twins import packing as twin
from zerobatch.formats.errors import ConfigError

ALGORITHMS = ("concat", "first-fit", "best-fit")

plans = st.tuples(st.lists(st.integers(0, 300), max_size=80), st.integers(1, 64), st.integers(1, 30),
                  st.sampled_from(ALGORITHMS))


def check_plan(lengths, capacity, buffer, algorithm, plan) -> None:
    row_ptr, doc, off, n = plan
    lengths = np.asarray(lengths, np.int64)
    rows = row_ptr.size - 1
    assert row_ptr[0] == 0 and (np.diff(row_ptr) >= 1).all() and row_ptr[-1] == doc.size
    fill = np.add.reduceat(n, row_ptr[:-1]) if rows else np.zeros(0, np.int64)
    assert (fill >= 1).all() and (fill <= capacity).all()
    assert (n >= 1).all()
    # every token of every document exactly once: the pieces of a document tile [0, L)
    covered = np.zeros(int(lengths.sum()), np.int64)
    base = np.concatenate([[0], np.cumsum(lengths)])
    for d, a, k in zip(doc.tolist(), off.tolist(), n.tolist(), strict=True):
        assert 0 <= a and a + k <= lengths[d]
        covered[base[d] + a: base[d] + a + k] += 1
    assert (covered == 1).all()
    assert int(fill.sum()) == int(lengths.sum())
    if algorithm == "concat":
        assert (fill[:-1] == capacity).all()
        return
    # a row holds documents of one window; a document's pieces: its full rows, then its rest
    window = doc // buffer
    for r in range(rows):
        assert np.unique(window[row_ptr[r]:row_ptr[r + 1]]).size == 1
    # no two rows of one window (other than full-document rows) fit in one
    part = [r for r in range(rows) if fill[r] < capacity]
    by_window: dict[int, list[int]] = {}
    for r in part:
        by_window.setdefault(int(window[row_ptr[r]]), []).append(int(fill[r]))
    for fills in by_window.values():
        fills.sort()
        if len(fills) > 1:
            assert fills[0] + fills[1] > capacity


@settings(max_examples=300, deadline=None)
@given(plans)
def test_the_compiled_planner_equals_its_twin_and_every_plan_holds(case):
    lengths, capacity, buffer, algorithm = case
    got = _packing.pack_plan(lengths, capacity, buffer, algorithm)
    want = twin.pack_plan(lengths, capacity, buffer, algorithm)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == np.int64 and np.array_equal(a, b)
    check_plan(lengths, capacity, buffer, algorithm, got)


def test_best_fit_decreasing_pads_less_than_first_fit_on_a_realistic_mix():
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.normal(np.log(600), 1.0, 20_000)).astype(np.int64).clip(1, 32_768)
    pad = {}
    for algorithm in ("first-fit", "best-fit"):
        row_ptr, *_ = _packing.pack_plan(lengths, 2049, 1024, algorithm)
        pad[algorithm] = (row_ptr.size - 1) * 2049 - int(lengths.sum())
    assert pad["best-fit"] < pad["first-fit"] / 5


@pytest.mark.parametrize("mod", [_packing, twin])
def test_bad_arguments_are_refused(mod):
    with pytest.raises(ConfigError, match="negative"):
        mod.pack_plan([3, -1], 8)
    with pytest.raises(ConfigError, match="capacity"):
        mod.pack_plan([3], 0)
    with pytest.raises(ConfigError, match="buffer"):
        mod.pack_plan([3], 8, 0)
    with pytest.raises(ConfigError, match="algorithm"):
        mod.pack_plan([3], 8, 4, "worst-fit")
    row_ptr, doc, off, n = mod.pack_plan([], 8)
    assert row_ptr.tolist() == [0] and doc.size == off.size == n.size == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 90), min_size=1, max_size=40), st.integers(2, 40), st.integers(1, 9),
       st.sampled_from(ALGORITHMS), st.sampled_from([np.int64, np.int32]), st.sampled_from([np.int64, np.int32]),
       st.booleans(), st.booleans())
def test_the_compiled_row_layout_equals_its_twin(lengths, capacity, buffer, algorithm, dtype, pos_dtype, labels,
                                                 boundaries):
    row_ptr, doc, off, n = _packing.pack_plan(lengths, capacity, buffer, algorithm)
    rows = row_ptr.size - 1
    if rows == 0:
        return
    which = np.repeat(np.arange(rows), np.diff(row_ptr))
    flat = np.arange(int(n.sum()), dtype=dtype) + 5
    seq = capacity - 1 if labels else capacity
    outs = []
    for mod in (_packing, twin):
        arrays = (np.empty((rows, capacity), dtype), np.empty((rows, capacity), np.int32),
                  np.empty((rows, capacity), pos_dtype), np.empty((rows, capacity), np.bool_),
                  np.empty((rows, capacity - 1), dtype) if labels else None)
        cu, longest = mod.pack_rows(flat, n, which, seq, *arrays, pad_id=-3, mask_boundaries=boundaries)
        outs.append((arrays, cu.copy(), longest))
    (a, cu_a, la), (b, cu_b, lb) = outs
    for x, y in zip(a, b, strict=True):
        assert (x is None and y is None) or np.array_equal(x, y)
    assert np.array_equal(cu_a, cu_b) and la == lb and cu_a[-1] == rows * seq


@pytest.mark.parametrize("mod", [_packing, twin])
def test_a_layout_the_rows_cannot_hold_is_refused(mod):
    def arrays(n, cap):
        return (np.empty((n, cap), np.int64), np.empty((n, cap), np.int32), np.empty((n, cap), np.int64),
                np.empty((n, cap), np.bool_))
    flat = np.arange(10)
    for lens, rows in (([5, 5], [0, 2]), ([5, 5], [1, 0]), ([9, 1], [0, 1]), ([5, 5], [0, 0])):
        with pytest.raises(ConfigError):
            mod.pack_rows(flat, lens, rows, 4, *arrays(2, 6))
    with pytest.raises(ConfigError, match="flat"):
        mod.pack_rows(flat, [5, 4], [0, 1], 4, *arrays(2, 6))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=20), st.sampled_from([np.int64, np.int32]),
       st.sampled_from([np.int64, np.int32, None]), st.booleans())
def test_the_compiled_flat_layout_equals_its_twin(lengths, dtype, pos_dtype, labels):
    tokens = np.arange(sum(lengths), dtype=dtype) * 3 + 1
    got = []
    for mod in (_packing, twin):
        pos = None if pos_dtype is None else np.full(tokens.size, -9, pos_dtype)
        lab = np.full(tokens.size, -9, dtype) if labels else None
        mod.flat_layout(tokens, lengths, pos, lab)
        got.append((pos, lab))
    assert (pos_dtype is None and got[0][0] is None and got[1][0] is None) or np.array_equal(got[0][0], got[1][0])
    assert (got[0][1] is None and got[1][1] is None) or np.array_equal(got[0][1], got[1][1])
    if labels:
        ends = np.cumsum(np.array(lengths, dtype=np.int64))[np.array(lengths, dtype=np.int64) > 0]
        want = np.append(tokens[1:], -100)[:tokens.size].astype(dtype)
        want[ends - 1] = -100
        assert np.array_equal(got[0][1], want)
    with pytest.raises(ConfigError):
        _packing.flat_layout(tokens, [*lengths, 1], np.empty(tokens.size, np.int64))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 90), min_size=1, max_size=40), st.integers(2, 40), st.integers(1, 9),
       st.sampled_from(ALGORITHMS), st.sampled_from([np.int64, np.int32]), st.booleans(), st.booleans(),
       st.booleans())
def test_labels_from_label_values_in_both_layouts_equal_the_twin_and_the_masked_tokens(
        lengths, capacity, buffer, algorithm, dtype, hf, boundaries, values):
    # label values (the tokens, -100 where a loss mask is off) laid out as next-token labels or
    # in Hugging Face's layout: the labels of the tokens, then masked where the values are -100
    row_ptr, doc, off, n = _packing.pack_plan(lengths, capacity, buffer, algorithm)
    rows = row_ptr.size - 1
    if rows == 0:
        return
    which = np.repeat(np.arange(rows), np.diff(row_ptr))
    flat = np.arange(int(n.sum()), dtype=dtype) + 5
    keep = np.random.default_rng(int(n.sum())).integers(0, 2, flat.size)
    lv = np.where(keep != 0, flat, -100).astype(dtype) if values else None
    outs = []
    for mod in (_packing, twin):
        arrays = (np.empty((rows, capacity), dtype), np.empty((rows, capacity), np.int32),
                  np.empty((rows, capacity), np.int64), np.empty((rows, capacity), np.bool_),
                  np.empty((rows, capacity if hf else capacity - 1), dtype))
        mod.pack_rows(flat, n, which, capacity - 1, *arrays, mask_boundaries=boundaries, label_values=lv)
        outs.append(arrays)
    for x, y in zip(*outs, strict=True):
        assert np.array_equal(x, y)
    tokens, seg, _, mask, labels = outs[0]
    if hf:
        want = np.where(mask, tokens, -100)
        if boundaries:
            want[(seg != np.roll(seg, 1, axis=1)) | (np.arange(capacity) == 0)] = -100
    else:
        plain = np.empty((rows, capacity - 1), dtype)
        _packing.pack_rows(flat, n, which, capacity - 1, np.empty_like(tokens), np.empty_like(seg),
                           np.empty((rows, capacity), np.int64), np.empty_like(mask), plain,
                           mask_boundaries=boundaries)
        want = plain
    if values:
        k = np.zeros(mask.shape, np.int64)
        k[mask] = keep
        want = want.copy()
        want[(k if hf else k[:, 1:]) == 0] = -100
    assert np.array_equal(labels, want)


@pytest.mark.parametrize("mod", [_packing, twin])
def test_label_values_and_labels_that_do_not_fit_are_refused(mod):
    arrays = (np.empty((2, 6), np.int64), np.empty((2, 6), np.int32), np.empty((2, 6), np.int64),
              np.empty((2, 6), np.bool_))
    with pytest.raises(ConfigError, match="labels"):
        mod.pack_rows(np.arange(10), [5, 5], [0, 1], 5, *arrays, np.empty((2, 4), np.int64))
    with pytest.raises(ConfigError, match="label_values"):
        mod.pack_rows(np.arange(10), [5, 5], [0, 1], 5, *arrays, np.empty((2, 5), np.int64),
                      label_values=np.arange(9))
