"""ZRECORD: random gathers of 32 and 256 records of two sizes (raw and flate, 1 and 2
threads), the zero-copy path, append throughput and open time; beside them the same records
read through Google's ArrayRecord (``array-record``, ``group_size:1``) with its batched
``read(indices)``. Public API only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from zerobatch.formats.zrecord import FieldSpec
from zerobatch.readers.zrecord import ZRecordStore
from zerobatch.writers.zrecord import ZRecordWriter

#: record bytes -> records per store (about 16 MiB of payload each)
SIZES = {256: 1 << 16, 16384: 1 << 10}
#: ArrayRecord's writer options: one record per group, compression to match ours
AR_WRITE = {"raw": "group_size:1,uncompressed", "flate": "group_size:1"}
#: ArrayRecord's reader options for random access, serial and with its thread pool
AR_READ = {1: "readahead_buffer_size:0,max_parallelism:0", 2: "readahead_buffer_size:0,max_parallelism:2"}


def records(size: int, n: int, codec: str) -> list[bytes]:
    """``n`` records of ``size`` bytes: random bytes for raw, compressible ones (runs of small
    values, like quantized features) for flate."""
    rng = np.random.default_rng(size)
    if codec == "raw":
        data = rng.integers(0, 256, (n, size), dtype=np.uint8)
    else:
        data = np.repeat(rng.integers(0, 16, (n, size // 8), dtype=np.uint8), 8, axis=1)
    return [row.tobytes() for row in data]


def build(folder: str) -> None:
    for size, n in SIZES.items():
        for codec in ("raw", "flate"):
            recs = records(size, n, codec)
            with ZRecordWriter(os.path.join(folder, f"zr-{size}-{codec}"), [FieldSpec("x", "bytes", None, codec)],
                               chunk_size=1 << 14) as w:
                w.extend(recs)
            ar = ArrayRecordWriter(os.path.join(folder, f"ar-{size}-{codec}"), AR_WRITE[codec])
            for r in recs:
                ar.write(r)
            ar.close()


#: Stores and readers opened by Gather.setup, once per benchmark process.
_OPEN: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def _indices(size: int, batch: int, k: int) -> np.ndarray:
    return np.random.default_rng(k).integers(0, SIZES[size], batch)


class Gather:
    """Random gathers: zerobatch (variable-length bytes field: zero-copy views for raw,
    inflated for flate) against ArrayRecord's batched read of the same records."""

    params = ([256, 16384], ["raw", "flate"], [32, 256], [1, 2])
    param_names = ["record_bytes", "codec", "batch", "threads"]
    timeout = 600

    def setup_cache(self) -> str:
        folder = os.path.abspath("zrecord-gather")  # asv's setup_cache folder, removed after the run
        if not os.path.exists(folder):
            os.mkdir(folder)
            build(folder)
        return folder

    def setup(self, folder: str, size: int, codec: str, batch: int, threads: int) -> None:
        # asv reruns setup before every timed call: open and warm once per process, so each
        # call is timed in the steady state of a long-running loader.
        key = (folder, size, codec, batch, threads)
        if key not in _OPEN:
            store = ZRecordStore(os.path.join(folder, f"zr-{size}-{codec}"), num_threads=threads)
            ar = ArrayRecordReader(os.path.join(folder, f"ar-{size}-{codec}"), AR_READ[threads])
            batches = [_indices(size, batch, k) for k in range(16)]
            lists = [b.tolist() for b in batches]
            for b, lst in zip(batches, lists, strict=True):   # warm both page caches
                store.gather(b).release()
                ar.read(lst)
            _OPEN[key] = (store, ar, batches, lists)
        self.store, self.ar, self.batches, self.lists = _OPEN[key]
        self.k = getattr(self, "k", 0)

    def time_zerobatch(self, folder: str, size: int, codec: str, batch: int, threads: int) -> None:
        self.k = (self.k + 1) & 15
        self.store.gather(self.batches[self.k]).release()

    def time_arrayrecord(self, folder: str, size: int, codec: str, batch: int, threads: int) -> None:
        self.k = (self.k + 1) & 15
        self.ar.read(self.lists[self.k])


class FixedShape:
    """A fixed-shape field gathered into one [batch, record] array (a copy, filled in place)."""

    params = ([32, 256],)
    param_names = ["batch"]

    def setup_cache(self) -> str:
        folder = os.path.abspath("zrecord-fixed")
        shutil.rmtree(folder, ignore_errors=True)
        os.mkdir(folder)
        rng = np.random.default_rng(0)
        with ZRecordWriter(os.path.join(folder, "s"), [FieldSpec("x", "f32", (64, 16)), FieldSpec("y", "i64", ())],
                           chunk_size=1 << 14) as w:
            w.extend({"x": rng.standard_normal((64, 16)).astype(np.float32), "y": i} for i in range(1 << 14))
        return folder

    def setup(self, folder: str, batch: int) -> None:
        key = (folder, batch)
        if key not in _OPEN:
            store = ZRecordStore(os.path.join(folder, "s"), num_threads=1)
            batches = [np.random.default_rng(k).integers(0, 1 << 14, batch) for k in range(16)]
            for b in batches:
                store.gather(b).release()
            _OPEN[key] = (store, batches)
        self.store, self.batches = _OPEN[key]
        self.k = getattr(self, "k", 0)

    def time_gather_stacked(self, folder: str, batch: int) -> None:
        self.k = (self.k + 1) & 15
        self.store.gather(self.batches[self.k]).release()


class Write:
    """Append throughput (records of 4 KiB over two writer threads) and open time."""

    number = 1
    repeat = (1, 5, 30.0)

    def setup(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="zb-asv-zrecord-write-")
        self.recs = records(4096, 4096, "raw")
        with ZRecordWriter(os.path.join(self.folder, "open"), [FieldSpec("x", "bytes")]) as w:
            w.extend(self.recs[:256])
        self.n = 0

    def teardown(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def time_append_4096_records(self) -> None:
        self.n += 1
        with ZRecordWriter(os.path.join(self.folder, f"w{self.n}"), [FieldSpec("x", "bytes")]) as w:
            w.extend(self.recs)

    def track_append_ms_per_mib(self) -> float:
        # lower is better, as asv's gate reads every benchmark (the inverse of MiB/s)
        import time

        t0 = time.perf_counter()
        self.time_append_4096_records()
        return (time.perf_counter() - t0) * 1e3 / (4096 * 4096 / (1 << 20))

    track_append_ms_per_mib.unit = "ms/MiB"

    def time_open(self) -> None:
        ZRecordStore(os.path.join(self.folder, "open")).close()
