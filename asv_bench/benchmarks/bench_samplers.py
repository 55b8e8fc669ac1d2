"""Samplers: the Feistel permutation (bulk, scalar, time to first batch, memory) against the
precomputed permutation (``numpy.random.Generator.permutation``), and one step of every
order through ``IndexSampler``. Public API only.

Read indices/s as ``2**20 / time`` for the ``*_1m`` benchmarks (one core, GIL released). The
``FirstBatch`` pair is the seed's comparison: a Feistel epoch of 2**38 items yields its first
batch in microseconds and a few KiB, while precomputing even 2**28 positions takes seconds
and 2 GiB.
"""

from __future__ import annotations

import numpy as np

from zerobatch.core._feistel import available_paths
from zerobatch.samplers import (
    BlockShuffleOrder,
    FeistelPermutation,
    GlobalRandomOrder,
    IndexSampler,
    RandomOrder,
    SequentialOrder,
    SlidingOrder,
)

M = 1 << 20


class FeistelBulk:
    """Fill 2**20 indices of a 2**38-item permutation (6 rounds), on the best bulk path."""

    def setup(self):
        self.perm = FeistelPermutation(2**38, 6, 7)
        self.out = np.empty(M, dtype=np.int64)
        self.positions = np.random.default_rng(0).integers(0, 2**38, M)

    def time_fill_range_1m(self):
        self.perm.fill(self.out, 123456789)

    def time_take_positions_1m(self):
        self.perm.take(self.positions, self.out)

    def time_inverse_take_1m(self):
        self.perm.take(self.positions, self.out, inverse=True)

    def time_numpy_permutation_1m(self):
        np.random.default_rng(0).permutation(M)


class FeistelPaths:
    """The same fill on every bulk path this CPU runs (portable, AVX2, AVX-512)."""

    params = list(available_paths())
    param_names = ["path"]

    def setup(self, path):
        self.perm = FeistelPermutation(2**38, 6, 7)
        self.perm._use_path(path)
        self.out = np.empty(M, dtype=np.int64)

    def time_fill_range_1m(self, path):
        self.perm.fill(self.out, 123456789)


class FeistelScalar:
    """One ``p[i]`` and one ``p.inverse(j)`` from Python (includes the call overhead)."""

    def setup(self):
        self.perm = FeistelPermutation(2**38, 6, 7)

    def time_getitem(self):
        self.perm[123456789]

    def time_inverse(self):
        self.perm.inverse(123456789)


class FirstBatch:
    """Time and memory to the first batch of 1024 indices of a shuffled epoch."""

    number = 1
    repeat = (1, 3, 30.0)
    warmup_time = 0.0
    timeout = 300

    def time_feistel_first_batch_2_38(self):
        IndexSampler(GlobalRandomOrder(2**38, seed=1), 1024).batch(0)

    def peakmem_feistel_first_batch_2_38(self):
        IndexSampler(GlobalRandomOrder(2**38, seed=1), 1024).batch(0)

    def time_numpy_permutation_2_28(self):
        np.random.default_rng(1).permutation(2**28)[:1024]

    def peakmem_numpy_permutation_2_28(self):
        np.random.default_rng(1).permutation(2**28)[:1024]


class SamplerStep:
    """One step (a batch of 1024 indices on rank 3 of 8) of every order, at a far step."""

    params = ["sequential", "sliding", "random", "global-random", "block-shuffle"]
    param_names = ["order"]

    def setup(self, kind):
        n = 2**32
        order = {
            "sequential": lambda: SequentialOrder(n),
            "sliding": lambda: SlidingOrder(n),
            "random": lambda: RandomOrder(n, seed=3),
            "global-random": lambda: GlobalRandomOrder(n, seed=3),
            "block-shuffle": lambda: BlockShuffleOrder(2**22, 256, seed=3),
        }[kind]()
        self.sampler = IndexSampler(order, 1024, rank=3, world_size=8)
        self.out = np.empty(1024, dtype=np.int64)
        self.sampler.batch(100, out=self.out)      # warm the per-epoch caches

    def time_batch(self, kind):
        self.sampler.batch(100, out=self.out)
