"""Provenance: the trace of a step and of documents (zerobatch.adapters.trace), a mixture's
state far into a run (the compiled walk of its picks, and the two-source closed form), and what
exclusions cost the planning of a step. Public API only; ``tools/trace_scale.py`` measures the
same at 10**12 tokens from cold processes.

A TOKSTREAM dataset of 4 Mi tokens in 8,192 documents (asv's cache folder), next-token windows
of 128, a global batch of 256 on 8 ranks.
"""

from __future__ import annotations

import os

import numpy as np

from zerobatch.adapters._loader import BaseLoader
from zerobatch.adapters.sources import TokenWindows
from zerobatch.adapters.trace import Trace
from zerobatch.core import mixture_walk
from zerobatch.samplers import MixtureOrder
from zerobatch.writers.tokstream import TokenStreamWriter

def _build() -> str:
    """4 Mi uint16 tokens in 8,192 documents of 512 (asv's ``setup_cache`` folder, built once)."""
    folder = os.path.abspath("provenance_tokstream")
    if os.path.exists(os.path.join(folder, "manifest.json")):
        return folder
    rng = np.random.default_rng(0)
    with TokenStreamWriter(folder, vocab_size=50257) as w:
        for _ in range(8192):
            w.add_document(rng.integers(0, 50257, 512, dtype=np.uint16))
    return folder


def loader(folder: str) -> BaseLoader:
    return BaseLoader(TokenWindows(folder, 128), global_batch_size=256, rank=0, world_size=8, num_threads=0, seed=3)


class TraceQueries:
    """Forward (every rank's rows of a step) and inverse (a document's steps; 1,000 documents)."""

    def setup_cache(self):
        return _build()

    def setup(self, folder):
        ld = loader(folder)
        self.card = ld.describe(ld.schedule.advanced(len(ld) - 1))
        self.trace = Trace(self.card)
        self.docs = np.random.default_rng(1).choice(8192, 1000, replace=False)

    def time_step_all_ranks(self, folder):
        self.trace.step(100, metadata=False)

    def time_document(self, folder):
        self.trace.document(4321)

    def time_documents_1000(self, folder):
        self.trace.occurrences(self.docs)

    def time_open_card(self, folder):
        Trace(self.card).close()


class MixtureState:
    """A mixture's counts 10**7 samples into a run: two sources (closed form) and three (the
    compiled walk, about 10 ns a sample)."""

    params = [2, 3]
    param_names = ["sources"]

    def setup(self, k):
        self.order = MixtureOrder([(f"s{i}", 1000 + i, 0.5 + i) for i in range(k)], seed=1)
        self.sizes = np.full(10_000, 1000, np.int64)

    def time_skip_10m_samples(self, k):
        m = MixtureOrder([(n, s, w) for n, s, w in zip(self.order.names, self.order.sizes, self.order.weights)],
                         seed=1)
        m.skip_steps(self.sizes)


class WalkKernel:
    """The compiled walk itself: 10**6 picks of three sources."""

    def setup(self):
        self.w = [0.2, 0.3, 0.5]

    def time_walk_1m_picks(self):
        mixture_walk(self.w, np.zeros(3, np.int64), None, 0, 1_000_000, False)


class ExclusionPlanning:
    """Planning 64 steps of rank 0 with and without 1,000 excluded documents (each step's
    whole global batch checked against their windows)."""

    params = [False, True]
    param_names = ["excluded"]

    def setup_cache(self):
        return _build()

    def setup(self, folder, excluded):
        self.ld = loader(folder)
        if excluded:
            self.ld.exclude(np.random.default_rng(2).choice(8192, 1000, replace=False), from_step=0)

    def time_plan_64_steps(self, folder, excluded):
        n = 0
        for page in self.ld.schedule.plan(0, 1):
            n += page.steps
            if n >= 64:
                break
