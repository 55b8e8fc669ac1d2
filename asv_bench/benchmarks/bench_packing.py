"""Packing: the compiled planner over 2**20 document lengths (best-fit decreasing and
first-fit, 4096 documents look-ahead, rows of 2049), and packed rows and whole documents flat
through the loader (32 rows of 2048 per step; a token budget of 32 x 2048 per flat step).
Lengths are lognormal with a median of 600 tokens, at most 32,768, as
``tools/bench_packing.py``. Public API only.
"""

from __future__ import annotations

import os

import numpy as np
import torch

import zerobatch.adapters.torch as zt
import zerobatch.core as zc
from zerobatch.adapters.torch import Loader
from zerobatch.samplers import SlidingOrder
from zerobatch.writers.tokstream import TokenStreamWriter

ROW = 2048
STEP_ROWS = 32
STEPS = 8                      # steps per timed call (about 0.5 M tokens)

torch.set_num_threads(1)


def _needs_packing() -> None:
    """An older release (the base of the scheduled comparison) has no packing: skipped there."""
    if not hasattr(zc, "pack_plan") or not hasattr(zt, "PackedDocuments"):
        raise NotImplementedError("this zerobatch has no packing")


def _lengths(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.exp(rng.normal(np.log(600), 1.1, n)).astype(np.int64).clip(1, 32_768)


class Plan:
    """Planning every row of a million documents (done once when a packed source opens)."""

    params = ["best-fit", "first-fit"]
    param_names = ["algorithm"]

    def setup(self, algorithm):
        _needs_packing()
        self.lengths = _lengths(1 << 20)

    def time_plan_1m_documents(self, algorithm):
        zc.pack_plan(self.lengths, ROW + 1, 4096, algorithm)


class Rows:
    """Steps of packed rows (input_ids, labels, position_ids, segment_ids, mask, cu_seqlens)
    and of whole documents flat (input_ids, labels, position_ids, cu_seqlens)."""

    params = ["packed", "flat"]
    param_names = ["source"]
    timeout = 300

    def setup_cache(self):
        folder = os.path.abspath("packing.tokstream")
        if not os.path.exists(os.path.join(folder, "manifest.json")):
            lengths = _lengths(8192)
            tokens = np.random.default_rng(1).integers(0, 50257, int(lengths.sum()), dtype=np.uint32)
            with TokenStreamWriter(folder, vocab_size=50257, shard_tokens=1 << 22) as w:
                for end, n in zip(np.cumsum(lengths).tolist(), lengths.tolist(), strict=True):
                    w.add_document(tokens[end - n:end])          # (add_documents is newer than 0.1.0)
        return folder

    def setup(self, folder, kind):
        _needs_packing()
        source = (zt.PackedDocuments(folder, ROW) if kind == "packed" else
                  zt.FlatDocuments(folder, STEP_ROWS * ROW))
        per_step = STEP_ROWS if kind == "packed" else 1
        self.loader = Loader(source, batch_size=per_step, order=SlidingOrder(source.num_items), prefetch=4)
        self.it = iter(self.loader)
        next(self.it)

    def teardown(self, folder, kind):
        self.loader.close()

    def time_steps(self, folder, kind):
        it = self.it
        for _ in range(STEPS):
            next(it)
