"""LLMBATCH: open, read, convert, stream an epoch, write. Public API only.

Two sizes where it matters: ``cache`` reads one batch again and again (it stays in the CPU
caches: the per-call overhead shows), ``memory`` cycles through a 256 MiB file (larger than
the caches: memory bandwidth shows). Each ``Bare*`` benchmark is the plain NumPy operation the
zerobatch one is compared with, measured beside it so a ratio can be read off one run.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import torch

from zerobatch.adapters.torch import BatchNativeLoader
from zerobatch.batch_loader import BatchFileReader  # the reader with the seed's read_batch_torch
from zerobatch.writers.llmbatch import write_batch_dataset, write_batch_file

BS, SL = 32, 512
SIZES = {"cache": 64, "memory": 4096}  # batches of 64 KiB: 4 MiB and 256 MiB files


def _records(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 50257, size=(n, SL), dtype=np.uint32)


def _make_files() -> dict[str, str]:
    paths = {}
    for name, nb in SIZES.items():
        path = os.path.abspath(f"llmbatch_{name}.batch")
        rng = np.random.default_rng(1)
        write_batch_dataset(path, (rng.integers(0, 50257, size=(BS * 64, SL), dtype=np.uint32)
                                   for _ in range(nb // 64)), nb * BS, BS, SL, seed=42)
        paths[name] = path
    return paths


class OpenFile:
    """Open and validate a file (header, trailer checksum), and open to first batch."""

    def setup_cache(self):
        return _make_files()

    def time_open(self, paths):
        BatchFileReader(paths["memory"]).close()

    def time_open_to_first_batch(self, paths):
        with BatchFileReader(paths["memory"]) as r:
            r.read_batch_torch(0)

    def time_loader_open_to_first_batch(self, paths):
        loader = BatchNativeLoader(paths["memory"])
        it = iter(loader)
        next(it)
        it.close()
        loader.close()


# Benchmark state built on first use and kept for the process. asv re-runs ``setup`` before
# every timed call when a class defines one (and then times single calls), which would
# measure a cold, freshly opened reader; per-call micro-benchmarks therefore keep no setup.
_STATE: dict = {}


class _ReadState:
    def __init__(self, path: str, size: str) -> None:
        self.reader = BatchFileReader(path)
        nb = self.reader.num_batches
        self.reader.read_batches(np.arange(nb))  # verify once, as a reader that has seen the epoch has
        self.index = itertools.cycle(range(nb) if size == "memory" else [5])
        self.out64 = torch.empty((BS, SL), dtype=torch.int64)
        self.views = [self.reader.read_batch(i) for i in range(nb)]


def _read_state(paths, size) -> _ReadState:
    key = ("read", paths[size])
    st = _STATE.get(key)
    if st is None:
        st = _STATE[key] = _ReadState(paths[size], size)
    return st


class ReadBatch:
    """One 32 x 512 batch: the view, int64, int32 and out= paths."""

    params = ["cache", "memory"]
    param_names = ["size"]

    def setup_cache(self):
        return _make_files()

    def time_read_batch(self, paths, size):
        st = _read_state(paths, size)
        st.reader.read_batch(next(st.index))

    def time_read_batch_torch_int64(self, paths, size):
        st = _read_state(paths, size)
        st.reader.read_batch_torch(next(st.index))

    def time_read_batch_torch_int32(self, paths, size):
        st = _read_state(paths, size)
        st.reader.read_batch_torch(next(st.index), dtype=torch.int32)

    def time_read_batch_torch_out(self, paths, size):
        st = _read_state(paths, size)
        st.reader.read_batch_torch(next(st.index), out=st.out64)

    def time_bare_astype_int64(self, paths, size):
        """Reference: a bare NumPy uint32 -> int64 conversion of the same batch."""
        st = _read_state(paths, size)
        st.views[next(st.index)].astype(np.int64)


def _epoch_loader(paths) -> BatchNativeLoader:
    key = ("epoch", paths["memory"])
    loader = _STATE.get(key)
    if loader is None:
        loader = _STATE[key] = BatchNativeLoader(paths["memory"], block_size=256, seed=42)
        for _ in loader:  # the first epoch verifies the checksums
            pass
        loader.epochs = itertools.count(1)
    return loader


class Epoch:
    """A full epoch through BatchNativeLoader (read-ahead threads) over 4096 batches."""

    timeout = 600

    def setup_cache(self):
        return _make_files()

    def _epoch(self, paths):
        loader = _epoch_loader(paths)
        loader.set_epoch(next(loader.epochs))
        for _ in loader:
            pass
        return len(loader) * BS * SL

    def time_epoch(self, paths):
        self._epoch(paths)

    def track_ns_per_token(self, paths):
        # asv's gate reads every benchmark as lower-is-better, so throughputs are tracked
        # as their inverse (time per unit of work) and a slowdown reads as a regression
        import time

        self._epoch(paths)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            tokens = self._epoch(paths)
            best = min(best, (time.perf_counter() - t0) * 1e9 / tokens)
        return best

    track_ns_per_token.unit = "ns/token"

    def time_epoch_int32(self, paths):
        loader = BatchNativeLoader(_epoch_loader(paths).reader, block_size=256, seed=42, dtype=torch.int32)
        for _ in loader:
            pass


class Write:
    """Writer throughput on 16 MiB of tokens (8192 records of 512)."""

    timeout = 300
    number = 1
    repeat = (3, 10, 30.0)

    def setup(self):
        self.records = _records(8192)
        self.path = os.path.abspath("write_bench.batch")

    def teardown(self):
        if os.path.exists(self.path):
            os.unlink(self.path)

    def time_write_batch_file(self):
        write_batch_file(self.path, self.records, BS, SL, seed=42)

    def time_write_batch_dataset(self):
        write_batch_dataset(self.path, iter(self.records), len(self.records), BS, SL, seed=42)

    def track_write_batch_file_ms_per_mib(self):
        # lower is better, as asv's gate reads every benchmark (the inverse of MiB/s)
        import time

        t0 = time.perf_counter()
        write_batch_file(self.path, self.records, BS, SL, seed=42)
        return (time.perf_counter() - t0) * 1e3 / (self.records.nbytes / 2**20)

    track_write_batch_file_ms_per_mib.unit = "ms/MiB"
