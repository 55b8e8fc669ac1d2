"""End-to-end tokens/s of 32 x 512 int64 shuffled batches: the zerobatch loader against the
loaders people use, each fed the same tokens in its own format, in one run on this machine;
and the step time the zerobatch loader adds to a training loop of fixed compute.

    pip install mosaicml-streaming litdata grain array-record   # the peers (not test deps)
    python tools/compare_loaders.py [--tokens 16777216] [--batches 400]

Peers:
- ``torch.utils.data.DataLoader`` over a per-sample ``Dataset`` of a ``np.memmap`` (0 and 2
  worker processes), the usual hand-written baseline;
- MosaicML ``StreamingDataset`` over MDS shards (``ndarray:uint32`` column), in a DataLoader;
- LitData ``StreamingDataset`` with its ``TokensLoader(block_size=512)`` over ``optimize``'d
  chunks, in its ``StreamingDataLoader``;
- Grain ``MapDataset`` over an ArrayRecord file (``group_size:1``), shuffled, batched (the
  raw records of a batch decoded in one call), ``to_iter_dataset`` with read threads.
Each peer is measured with 0 and 2 workers (threads for Grain); every loader runs in
interleaved rounds and its best round is kept. Every loader converts to ``int64`` tensors
(or arrays for Grain). Files are in the page cache (warm), and each loader's first pass over
the data is not timed (steady state: zerobatch verifies checksums on first read).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

SEQ, BS = 512, 32


def _steady(make_iter: Callable[[], Iterator[Any]], batches: int, warmup: int) -> float:
    """Tokens/s over ``batches`` batches after ``warmup`` batches (one whole pass over the
    data: zerobatch checks each batch's checksum the first time it is read, and every loader
    has its page-cache mappings and buffers in place after one pass)."""
    it = make_iter()
    for _ in range(warmup):
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        b = next(it)
    dt = time.perf_counter() - t0
    assert tuple(b.shape) == (BS, SEQ), b.shape
    del it
    return batches * BS * SEQ / dt


def _cycle(make: Callable[[], Any]) -> Callable[[], Iterator[Any]]:
    def gen() -> Iterator[Any]:
        while True:
            yield from make()
    return gen


# ---------------------------------------------------------------------------------------------
# the data, in every format


def write_all(root: str, tokens: np.ndarray) -> dict[str, str]:
    rows = tokens.reshape(-1, SEQ)
    paths = {}
    raw = os.path.join(root, "tokens.u32")
    tokens.tofile(raw)
    paths["memmap"] = raw

    from zerobatch.writers.llmbatch import write_batch_file
    from zerobatch.writers.tokstream import TokenStreamWriter
    paths["llmbatch"] = os.path.join(root, "data.batch")
    write_batch_file(paths["llmbatch"], rows, BS, SEQ, seed=0)
    paths["tokstream"] = os.path.join(root, "tokstream")
    with TokenStreamWriter(paths["tokstream"], vocab_size=50257, shard_tokens=1 << 24) as w:
        for i in range(0, rows.shape[0], 64):
            w.add_document(rows[i:i + 64].reshape(-1))

    _stub_torchvision()
    from streaming import MDSWriter
    paths["mds"] = os.path.join(root, "mds")
    with MDSWriter(out=paths["mds"], columns={"tokens": f"ndarray:uint32:{SEQ}"}, size_limit=1 << 26) as w:
        for row in rows:
            w.write({"tokens": row})

    from litdata import TokensLoader, optimize
    paths["litdata"] = os.path.join(root, "litdata")
    bounds = np.linspace(0, tokens.size, 9).astype(int).tolist()
    optimize(fn=_litdata_part, inputs=[(raw, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)],
             output_dir=paths["litdata"], chunk_size=(SEQ + 1) * 4096, item_loader=TokensLoader(),
             num_workers=1, mode="overwrite")

    from array_record.python.array_record_module import ArrayRecordWriter
    paths["arrayrecord"] = os.path.join(root, "data.array_record")
    w = ArrayRecordWriter(paths["arrayrecord"], "group_size:1")
    for row in rows:
        w.write(row.tobytes())
    w.close()
    return paths


def _litdata_part(arg: tuple[str, int, int]) -> Iterator[torch.Tensor]:
    """LitData ``optimize`` input: one part of the token file (module level: it is pickled)."""
    path, a, b = arg
    yield torch.from_numpy(np.fromfile(path, np.uint32, count=b - a, offset=4 * a).astype(np.int32))


def _stub_torchvision() -> None:
    """MosaicML streaming imports torchvision for its vision datasets only; the PyPI torchvision
    does not load beside this machine's CPU torch, so give it an empty stand-in."""
    try:
        import torchvision  # noqa: F401
        return
    except Exception:  # noqa: BLE001 - any import failure
        pass
    import importlib.machinery
    for name in ("torchvision", "torchvision.datasets", "torchvision.transforms",
                 "torchvision.transforms.functional"):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = mod
    sys.modules["torchvision.datasets"].VisionDataset = object  # type: ignore[attr-defined]
    sys.modules["torchvision.datasets"].CIFAR10 = object  # type: ignore[attr-defined]
    sys.modules["torchvision.transforms.functional"].to_tensor = None  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# the loaders


class PerSample(torch.utils.data.Dataset):
    def __init__(self, path: str) -> None:
        self.path = path
        self.n = os.path.getsize(path) // 4 // SEQ
        self.mm: np.memmap | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint32, mode="r")
        return torch.from_numpy(self.mm[i * SEQ:(i + 1) * SEQ].astype(np.int64))


def torch_dataloader(paths: dict[str, str], workers: int) -> Callable[[], Iterator[Any]]:
    ds = PerSample(paths["memmap"])
    return _cycle(lambda: iter(torch.utils.data.DataLoader(ds, batch_size=BS, shuffle=True, num_workers=workers,
                                                           drop_last=True, persistent_workers=workers > 0)))


def mosaic(paths: dict[str, str], workers: int) -> Callable[[], Iterator[Any]]:
    _stub_torchvision()
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    clean_stale_shared_memory()
    ds = StreamingDataset(local=paths["mds"], shuffle=True, batch_size=BS, shuffle_seed=1)
    dl = torch.utils.data.DataLoader(ds, batch_size=BS, num_workers=workers, drop_last=True,
                                     persistent_workers=workers > 0,
                                     multiprocessing_context="fork" if workers else None)
    return _cycle(lambda: (b["tokens"].to(torch.int64) for b in dl))


def litdata(paths: dict[str, str], workers: int) -> Callable[[], Iterator[Any]]:
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader
    ds = StreamingDataset(paths["litdata"], item_loader=TokensLoader(block_size=SEQ), shuffle=True, drop_last=True)
    dl = StreamingDataLoader(ds, batch_size=BS, num_workers=workers, drop_last=True)
    return _cycle(lambda: (b.to(torch.int64) for b in dl))


def grain_loader(paths: dict[str, str], threads: int) -> Callable[[], Iterator[Any]]:
    import grain
    src = grain.sources.ArrayRecordDataSource([paths["arrayrecord"]])
    # Batch the raw records first, then decode a whole batch at once (cheaper than per record).
    ds = (grain.MapDataset.source(src).shuffle(seed=1).batch(BS, drop_remainder=True, batch_fn=list)
          .map(lambda recs: np.frombuffer(b"".join(recs), np.uint32).reshape(BS, SEQ).astype(np.int64)))
    opts = grain.ReadOptions(num_threads=max(threads, 1), prefetch_buffer_size=256)
    return _cycle(lambda: iter(ds.to_iter_dataset(opts)))


def zerobatch_windows(paths: dict[str, str], threads: int) -> Callable[[], Iterator[Any]]:
    from zerobatch.adapters.torch import Loader, TokenWindows
    ld = Loader(TokenWindows(paths["tokstream"], SEQ, next_token=False), batch_size=BS, seed=1,
                num_threads=max(threads, 1), prefetch=64)
    return _cycle(lambda: iter(ld))


def zerobatch_llmbatch(paths: dict[str, str], threads: int) -> Callable[[], Iterator[Any]]:
    from zerobatch.adapters.torch import Loader, LLMBatchSource
    ld = Loader(LLMBatchSource(paths["llmbatch"]), seed=1, num_threads=max(threads, 1), prefetch=64)
    return _cycle(lambda: iter(ld))


PEERS = [
    ("torch DataLoader, per-sample Dataset, 0 workers", torch_dataloader, 0),
    ("torch DataLoader, per-sample Dataset, 2 workers", torch_dataloader, 2),
    ("MosaicML StreamingDataset, 0 workers", mosaic, 0),
    ("MosaicML StreamingDataset, 2 workers", mosaic, 2),
    ("LitData StreamingDataset + TokensLoader, 0 workers", litdata, 0),
    ("LitData StreamingDataset + TokensLoader, 2 workers", litdata, 2),
    ("Grain MapDataset over ArrayRecord, 1 thread", grain_loader, 1),
    ("Grain MapDataset over ArrayRecord, 2 threads", grain_loader, 2),
]
OURS = [
    ("zerobatch Loader, TOKSTREAM windows", zerobatch_windows, 1),
    ("zerobatch Loader, LLMBATCH file", zerobatch_llmbatch, 1),
]


def simulate(paths: dict[str, str], step_ms: float, steps: int) -> tuple[float, float]:
    """A loop of ``steps`` steps of fixed compute (a single-threaded matmul loop, GIL released
    as in a real step): returns (time inside ``next()`` as % of the bare step, and the total
    added time in % of the bare loop, compute measured right before)."""
    from zerobatch.adapters.torch import Loader, TokenWindows
    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    reps = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ a
        if time.perf_counter() - t0 >= step_ms / 1000:
            break
        reps *= 2
    per = (time.perf_counter() - t0) / reps
    reps = max(1, round(step_ms / 1000 / per))
    ld = Loader(TokenWindows(paths["tokstream"], SEQ, next_token=False), batch_size=BS, seed=1, num_threads=1)
    it = iter(ld)
    next(it)
    bare = loaded = in_next = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ a
        bare += time.perf_counter() - t0
        t0 = time.perf_counter()
        b = next(it)
        t1 = time.perf_counter()
        b.sum()
        for _ in range(reps):
            a @ a
        loaded += time.perf_counter() - t0
        in_next += t1 - t0
    ld.close()
    return 100 * in_next / bare, 100 * (loaded - bare) / bare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1 << 24)
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--only", default=None, help="run only loaders whose name contains this")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = tempfile.mkdtemp(prefix="zb-compare-")
    try:
        tokens = np.random.default_rng(0).integers(0, 50257, size=args.tokens // (SEQ * 64) * SEQ * 64,
                                                   dtype=np.uint32)
        t0 = time.perf_counter()
        paths = write_all(root, tokens)
        print(f"{tokens.size:,} tokens written in every format in {time.perf_counter() - t0:.1f} s "
              f"({os.cpu_count()} CPUs)", flush=True)
        # Interleaved rounds, best per loader: a neighbour's burst on a shared machine does
        # not decide the ranking. Each loader's workers are shut down before the next runs.
        warmup = tokens.size // (BS * SEQ) + 20      # one pass, then into the next
        best: dict[str, float] = {}
        for rnd in range(args.rounds):
            for name, make, workers in PEERS + OURS:
                if args.only and args.only not in name:
                    continue
                try:
                    rate = _steady(make(paths, workers), args.batches, warmup)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"{name}: failed: {type(exc).__name__}: {exc}", flush=True)
                    continue
                finally:
                    gc.collect()
                best[name] = max(best.get(name, 0.0), rate)
                print(f"round {rnd + 1}: {name:55s} {rate / 1e6:10.1f} M tokens/s", flush=True)
        rows = list(best.items())
        print(f"\nbest of {args.rounds} rounds, {args.batches} batches of {BS} x {SEQ} int64 each:")
        for name, rate in rows:
            print(f"  {name:55s} {rate / 1e6:10.1f} M tokens/s")
        peers = [r for n, r in rows if not n.startswith("zerobatch")]
        if peers:
            best = max(peers)
            print(f"\nfastest peer: {best / 1e6:.1f} M tokens/s")
            for n, r in rows:
                if n.startswith("zerobatch"):
                    print(f"{n}: {r / best:.1f}x the fastest peer (target: at least 10x)")
        share, added = simulate(paths, args.step_ms, args.steps)
        print(f"\ntraining loop, {args.step_ms:.0f} ms compute per step, {args.steps} steps: time in next() "
              f"{share:.3f} % of the step, total added {added:+.2f} % (target: under 2 %)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
