"""The torch Loader: overhead per batch, end-to-end tokens/s per source, and a training-loop
simulation (how much the loader adds to a step of fixed compute). Public API only.

Every source serves the same 8M tokens as 32 x 512 ``int64`` batches, shuffled.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from zerobatch.adapters.torch import Loader, LLMBatchSource, RecordFields, TokenDocuments, TokenWindows
from zerobatch.formats import zrecord as Z
from zerobatch.samplers import SlidingOrder
from zerobatch.writers.llmbatch import write_batch_file
from zerobatch.writers.tokstream import TokenStreamWriter
from zerobatch.writers.zrecord import ZRecordWriter

BS, SL = 32, 512
NUM_TOKENS = 1 << 23
BATCHES = 64                       # batches per timed call (1M tokens)
SOURCES = ["llmbatch", "windows", "documents", "zrecord"]

torch.set_num_threads(1)


def _tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 50257, size=NUM_TOKENS, dtype=np.uint32)


def _make() -> dict[str, str]:
    tokens = _tokens()
    paths = {}
    batch = os.path.abspath("loader.batch")
    write_batch_file(batch, tokens.reshape(-1, SL), BS, SL, seed=0)
    paths["llmbatch"] = batch
    folder = os.path.abspath("loader.tokstream")
    with TokenStreamWriter(folder, vocab_size=50257, shard_tokens=1 << 21) as w:
        for doc in tokens.reshape(-1, SL):       # documents of exactly one sequence
            w.add_document(doc)
    paths["tokstream"] = folder
    store = os.path.abspath("loader.zrecord")
    with ZRecordWriter(store, [Z.FieldSpec("tokens", "u32", (SL,))], chunk_size=4096) as w:
        w.extend({"tokens": row} for row in tokens.reshape(-1, SL))
        w.commit()
    paths["zrecord"] = store
    return paths


def _source(paths: dict[str, str], kind: str):
    if kind == "llmbatch":
        return LLMBatchSource(paths["llmbatch"])
    if kind == "windows":
        return TokenWindows(paths["tokstream"], SL, next_token=False)
    if kind == "documents":
        return TokenDocuments(paths["tokstream"], SL, next_token=False)
    return RecordFields(paths["zrecord"], token_fields=["tokens"])


def _endless(paths: dict[str, str], kind: str, **kw) -> Loader:
    """A loader that never ends (a sliding ring over the items), so a timed call can always
    take the next batches."""
    source = _source(paths, kind)
    return Loader(source, batch_size=BS, order=SlidingOrder(source.num_items), **kw)


class EndToEnd:
    """``BATCHES`` batches of 32 x 512 int64 through the loader (1M tokens per call: tokens/s
    is 2**20 / the time)."""

    params = SOURCES
    param_names = ["source"]
    timeout = 300

    def setup_cache(self):
        return _make()

    def setup(self, paths, kind):
        self.loader = _endless(paths, kind, prefetch=16)
        self.it = iter(self.loader)
        next(self.it)

    def teardown(self, paths, kind):
        self.loader.close()

    def time_batches(self, paths, kind):
        it = self.it
        for _ in range(BATCHES):
            next(it)


class Overhead:
    """What ``next()`` costs when the batch is already read (the queue is full)."""

    params = ["llmbatch", "windows"]
    param_names = ["source"]

    def setup_cache(self):
        return _make()

    def setup(self, paths, kind):
        self.loader = _endless(paths, kind, prefetch=256)
        self.it = iter(self.loader)
        next(self.it)

    def teardown(self, paths, kind):
        self.loader.close()

    def track_next_when_ready(self, paths, kind):
        it = self.it
        best = float("inf")
        for _ in range(5):
            time.sleep(0.05)                 # let read-ahead fill the queue
            t0 = time.perf_counter()
            for _ in range(32):
                next(it)
            best = min(best, (time.perf_counter() - t0) / 32)
        return best * 1e6

    track_next_when_ready.unit = "us"


class TrainingLoop:
    """A loop whose step is fixed compute (a matmul of about 5 ms on one thread, GIL
    released as in real training): the loop's time with the loader over its time without,
    measured back to back (1.00 = the loader adds nothing; 1.02 = 2 % added step time).
    A ratio near 1, not a percentage near 0, so the regression gate compares like with like."""

    params = ["llmbatch", "windows"]
    param_names = ["source"]
    timeout = 300

    def setup_cache(self):
        return _make()

    def setup(self, paths, kind):
        self.loader = _endless(paths, kind, prefetch=8)
        self.a = torch.randn(384, 384)
        n = 1
        while True:                            # calibrate: about 5 ms of compute
            t0 = time.perf_counter()
            for _ in range(n):
                self.a @ self.a
            if time.perf_counter() - t0 > 0.005:
                break
            n *= 2
        self.reps = n

    def teardown(self, paths, kind):
        self.loader.close()

    def _compute(self):
        for _ in range(self.reps):
            self.a @ self.a

    def track_step_time_ratio(self, paths, kind):
        steps = 40
        it = iter(self.loader)
        next(it)
        bare = loaded = 0.0
        for _ in range(steps):                 # interleaved: a burst of noise hits both
            t0 = time.perf_counter()
            self._compute()
            bare += time.perf_counter() - t0
            t0 = time.perf_counter()
            batch = next(it)
            batch.sum()
            self._compute()
            loaded += time.perf_counter() - t0
        return loaded / bare

    track_step_time_ratio.unit = "ratio"


class NpyFolderGetBatch:
    """The seed's npy-folder ``DatasetLoader.get_batch()``: 32 x 512 (x, y) from memory-mapped
    uint16 ``.npy`` files (four of 2M tokens)."""

    def setup_cache(self):
        folder = os.path.abspath("loader.npy")
        os.makedirs(folder, exist_ok=True)
        rng = np.random.default_rng(0)
        for k in range(4):
            np.save(os.path.join(folder, f"part_{k}.npy"), rng.integers(0, 50257, 1 << 21, dtype=np.uint16))
        return folder

    def setup(self, folder):
        from zerobatch.adapters.torch import DatasetLoader
        self.loader = DatasetLoader(BS, SL, 0, 1, folder, "cpu")

    def time_get_batch(self, folder):
        self.loader.get_batch()
