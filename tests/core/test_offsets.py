"""Offset math and the block-shuffle order kernel against the pure-NumPy twin."""

from __future__ import annotations

import numpy as np
import pytest

from zerobatch.core import _reference as R
from zerobatch.core import block_shuffle_items, llmbatch_batch_offsets
from zerobatch.core._kernels import compiled, twin
from zerobatch.formats.errors import ConfigError


def test_batch_offsets():
    idx = np.array([0, 1, 5, 2**20], dtype=np.int64)
    for impl in (llmbatch_batch_offsets, R.llmbatch_batch_offsets):
        got = impl(idx, 65536, 2**20 + 1)
        assert got.tolist() == [4096 + i * 65536 for i in idx.tolist()]
        assert impl([], 4096, 0).size == 0
        with pytest.raises(IndexError):
            impl([3], 4096, 3)
        with pytest.raises(IndexError):
            impl([-1], 4096, 3)
        with pytest.raises(ConfigError):
            impl([0], 2**40, 2**30)  # the file would not fit in 63 bits
    # offsets past 4 GiB stay exact
    assert llmbatch_batch_offsets([70000], 65536, 70001)[0] == 4096 + 70000 * 65536


@pytest.mark.parametrize("n", [0, 1, 2, 7, 16, 17, 255, 256, 257, 1000])
@pytest.mark.parametrize("block", [1, 3, 16, 256, 5000])
def test_block_shuffle_items_is_the_spelled_out_order(n, block):
    rng = np.random.default_rng(n * 31 + block)
    nblocks = -(-n // block)
    perm = rng.permutation(nblocks).astype(np.int64)
    pos = np.arange(n, dtype=np.int64)
    got = block_shuffle_items(perm, block, n, pos)
    expect = R.block_shuffle_items(perm, block, n, pos)
    assert (got == expect).all()
    assert sorted(got.tolist()) == list(range(n))  # a permutation
    # every block is visited whole and ascending, in perm's order
    spelled = [i for b in perm for i in range(b * block, min((b + 1) * block, n))]
    assert got.tolist() == spelled
    some = rng.integers(0, max(n, 1), size=50) if n else np.zeros(0, np.int64)
    assert (block_shuffle_items(perm, block, n, some) == expect[some]).all()


def test_block_shuffle_items_errors():
    perm = np.array([1, 0], dtype=np.int64)
    for impl in (block_shuffle_items, R.block_shuffle_items):
        with pytest.raises(IndexError):
            impl(perm, 4, 7, [7])
        with pytest.raises(IndexError):
            impl(perm, 4, 7, [-1])
        with pytest.raises(ConfigError, match="expected 2"):
            impl(np.array([0], np.int64), 4, 7, [0])
        with pytest.raises(ConfigError):
            impl(np.array([0, 5], np.int64), 4, 7, [6])
        with pytest.raises(ConfigError):
            impl(perm, 0, 7, [0])


@pytest.mark.parametrize("strict", [True, False])
def test_first_unordered_equals_its_twin(strict):
    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 5, 1000):
        ok = np.cumsum(rng.integers(1 if strict else 0, 5, n)).astype(np.uint64)
        for values in (ok, *(np.concatenate([ok[:k], [ok[k - 1] - (0 if strict else 1)], ok[k + 1:]]).astype(np.uint64)
                             for k in range(1, n, max(1, n // 7)) if ok[k - 1] > 0)):
            got = compiled("offsets").first_unordered(values, strict)
            assert got == twin("offsets").first_unordered(values, strict)
            bad = (values[1:] <= values[:-1]) if strict else (values[1:] < values[:-1])
            assert got == (int(np.argmax(bad)) + 1 if bad.any() else -1)
    with pytest.raises(ConfigError):
        compiled("offsets").first_unordered(np.zeros(3, np.int64))
