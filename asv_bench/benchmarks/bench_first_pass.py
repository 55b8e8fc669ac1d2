"""A first pass over unchecked data, through the loader, for every kind of step: random
windows, whole documents flat, documents padded to a row, packed rows, and pre-formed batches
(``int64`` copies and ``int32`` views). Public API only.

Single-epoch pre-training reads every byte once, so what a first read costs (its checks: each
checksum block or batch hashed the first time, and the fresh mapping's page faults) is what a
run pays on every step. Each sample here opens a fresh dataset (``number = 1``: asv runs
``setup`` before every sample), so nothing of it was checked before; the ``second`` pass reads
the same steps again through a loader over the same, already-checked source. A regression of
the checks (a Python call per window or per block, say) shows in ``first`` and not in
``second``, where the benchmarks that repeat reads over checked data cannot see it.
"""

from __future__ import annotations

import os

import numpy as np
import torch

import zerobatch.adapters.torch as zt
from zerobatch.adapters.torch import LLMBatchSource, Loader, TokenDocuments, TokenWindows
from zerobatch.writers.llmbatch import write_batch_file
from zerobatch.writers.tokstream import TokenStreamWriter

SEQ, BATCH = 512, 32
STEPS = 64                      # steps per sample (2 Mi tokens of windows)
TOKENS = 1 << 23                # 16 MiB of uint16 tokens: more than a sample touches

SOURCES = ["windows", "flat", "documents", "packed", "batches_int64", "batches_int32"]

torch.set_num_threads(1)


def _make() -> dict[str, str]:
    root = os.path.abspath("first_pass")
    paths = {"stream": os.path.join(root, "stream"), "docs": os.path.join(root, "docs"),
             "batch": os.path.join(root, "data.batch")}
    if os.path.exists(os.path.join(paths["docs"], "manifest.json")):
        return paths
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, TOKENS, dtype=np.uint32)
    lengths = np.exp(rng.normal(np.log(600), 1.1, TOKENS // 300)).astype(np.int64).clip(1, 8192)
    lengths = lengths[np.cumsum(lengths) <= TOKENS]
    with TokenStreamWriter(paths["stream"], vocab_size=50257, shard_tokens=1 << 22) as w:
        w.add_document(tokens)
    with TokenStreamWriter(paths["docs"], vocab_size=50257, shard_tokens=1 << 22) as w:
        ends = np.cumsum(lengths)
        for end, n in zip(ends.tolist(), lengths.tolist(), strict=True):
            w.add_document(tokens[end - n:end])
    write_batch_file(paths["batch"], tokens.reshape(-1, SEQ), BATCH, SEQ, seed=0)
    return paths


def _loader(paths: dict[str, str], kind: str, seed: int, source=None):
    if source is None:
        if kind in ("flat", "packed") and not hasattr(zt, "FlatDocuments"):
            # an older release (the scheduled comparison's base) has no packing sources
            raise NotImplementedError(f"this zerobatch has no {kind} source")
        if kind == "windows":
            source = TokenWindows(paths["stream"], SEQ)
        elif kind == "flat":
            source = zt.FlatDocuments(paths["docs"])
        elif kind == "documents":
            source = TokenDocuments(paths["docs"], SEQ)
        elif kind == "packed":
            source = zt.PackedDocuments(paths["docs"], SEQ)
        else:
            source = LLMBatchSource(paths["batch"])
    dtype = torch.int32 if kind == "batches_int32" else torch.int64
    batch = None if kind.startswith("batches") else BATCH
    return Loader(source, batch_size=batch, seed=seed, dtype=dtype), source


class Pass:
    """``STEPS`` steps through ``Loader`` with its defaults (shuffled, read-ahead threads),
    checks on: on a freshly opened dataset (``first``), or again over the same source once
    checked (``second``)."""

    params = (SOURCES, ["first", "second"])
    param_names = ["source", "pass"]
    number = 1                 # setup (a fresh dataset) before every sample
    repeat = (3, 10, 1.0)      # each sample opens a dataset: few samples keep the gate lean
    warmup_time = 0
    timeout = 300

    def setup_cache(self):
        return _make()

    def setup(self, paths, kind, which):
        self.loader, source = _loader(paths, kind, seed=7)
        if which == "second":
            it = iter(self.loader)
            for _ in range(STEPS):
                next(it)
            it.close()
            self.loader, _ = _loader(paths, kind, seed=7, source=source)
        self.it = None

    def teardown(self, paths, kind, which):
        self.loader.close()

    def time_steps(self, paths, kind, which):
        it = iter(self.loader)
        for _ in range(STEPS):
            next(it)
