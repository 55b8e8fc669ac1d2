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
from zerobatch.readers.llmbatch import BatchFileReader
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


class ReadBatch:
    """One 32 x 512 batch: the view, int64, int32 and out= paths."""

    params = ["cache", "memory"]
    param_names = ["size"]

    def setup_cache(self):
        return _make_files()

    def setup(self, paths, size):
        self.reader = BatchFileReader(paths[size])
        nb = self.reader.num_batches
        for i in range(nb):  # verify once, as a reader that has seen the epoch has
            self.reader.read_batch(i)
        self.index = itertools.cycle(range(nb) if size == "memory" else [5])
        self.out64 = torch.empty((BS, SL), dtype=torch.int64)
        self.views = [self.reader.read_batch(i) for i in range(nb)]

    def teardown(self, paths, size):
        self.reader.close()

    def time_read_batch(self, paths, size):
        self.reader.read_batch(next(self.index))

    def time_read_batch_torch_int64(self, paths, size):
        self.reader.read_batch_torch(next(self.index))

    def time_read_batch_torch_int32(self, paths, size):
        self.reader.read_batch_torch(next(self.index), dtype=torch.int32)

    def time_read_batch_torch_out(self, paths, size):
        self.reader.read_batch_torch(next(self.index), out=self.out64)

    def time_bare_astype_int64(self, paths, size):
        """Reference: a bare NumPy uint32 -> int64 conversion of the same batch."""
        self.views[next(self.index)].astype(np.int64)


class Epoch:
    """A full epoch through BatchNativeLoader (read-ahead threads) over 4096 batches."""

    timeout = 600

    def setup_cache(self):
        return _make_files()

    def setup(self, paths):
        self.loader = BatchNativeLoader(paths["memory"], block_size=256, seed=42)
        for _ in self.loader:  # first epoch verifies the checksums
            pass
        self.epochs = itertools.count(1)
        self.tokens = len(self.loader) * BS * SL

    def teardown(self, paths):
        self.loader.close()

    def _epoch(self):
        self.loader.set_epoch(next(self.epochs))
        for _ in self.loader:
            pass

    def time_epoch(self, paths):
        self._epoch()

    def track_tokens_per_second(self, paths):
        import time

        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            self._epoch()
            best = max(best, self.tokens / (time.perf_counter() - t0))
        return best

    track_tokens_per_second.unit = "tokens/s"

    def time_epoch_int32(self, paths):
        loader = BatchNativeLoader(self.loader.reader, block_size=256, seed=42, dtype=torch.int32)
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

    def track_write_batch_file_mib_per_second(self):
        import time

        t0 = time.perf_counter()
        write_batch_file(self.path, self.records, BS, SL, seed=42)
        return self.records.nbytes / 2**20 / (time.perf_counter() - t0)

    track_write_batch_file_mib_per_second.unit = "MiB/s"
