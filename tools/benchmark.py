"""zerobatch and the loaders people use, side by side, in one run on the same tokens: a table
and a PNG chart.

    pip install datasets mosaicml-streaming litdata grain array-record matplotlib   # the peers
    python tools/benchmark.py [--tokens 16777216] [--batches 200] [--out docs/benchmarks]

Workloads (every batch 32 x 512 ``int64``, as torch tensors; Grain's as NumPy arrays):

- **in order**: the records of a token file front to back;
- **shuffled**: the same records in a random order;
- **windows**: random next-token windows: 513 tokens from any position, handed out as
  ``(x, y)`` (nanoGPT's ``get_batch``); peers without arbitrary-offset access are left out;
- **padded rows**: one short document (7 to 512 tokens) per row, padded to 512 with a mask;
  tokens/s counts the padding too (about 49 % of the tokens). Whole variable-length documents
  (longer than a row, packed without padding) are a different workload, not measured here.

Each in two page-cache states: **warm** (files read once before; best of ``--rounds``
interleaved rounds of ``--batches`` batches after 20 warm-up batches) and **cold** (every data
file evicted with ``posix_fadvise(DONTNEED)`` right before; the first ``--batches`` batches
of a fresh loader, start-up included). The **memory-bandwidth limit** of the machine is
measured too: a ``uint32`` to ``int64`` conversion of a 256 MiB array, the least work any
loader handing out ``int64`` from ``uint32`` storage must do per token.

Peers:
- nanoGPT's approach: a ``np.memmap`` per batch, per-sample slices, ``torch.stack``;
- ``torch.utils.data.DataLoader`` over a per-sample ``Dataset`` of a ``np.memmap``, 0 and 2
  worker processes;
- Hugging Face ``datasets`` (Arrow), through a DataLoader (batched ``__getitems__``);
- MosaicML ``StreamingDataset`` (MDS shards) in a DataLoader, 0 and 2 workers;
- LitData ``StreamingDataset`` (``TokensLoader`` for token blocks), 0 and 2 workers;
- Grain ``MapDataset`` over ArrayRecord, 2 read threads;
- zerobatch: ``Loader`` over LLMBATCH, TOKSTREAM windows or documents, LLMCHNK records.

Last, a training loop of fixed compute (``--step-ms``, ``--steps``) measures the step time the
zerobatch loader adds.

A peer that is not installed is skipped (and said so).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
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
#: One document of 7-512 tokens per row, padded to 512 (not whole variable-length documents).
PADDED = "padded rows"
WORKLOADS = ("in order", "shuffled", "windows", PADDED)


# ---------------------------------------------------------------------------------------------
# data in every format


def make_documents(n_tokens: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(7, SEQ + 1, size=n_tokens // ((SEQ + 7) // 2) + 1)
    lengths = lengths[np.cumsum(lengths) <= n_tokens]
    return rng.integers(0, 50257, size=int(lengths.sum()), dtype=np.uint32), lengths.astype(np.int64)


def write_all(root: str, tokens: np.ndarray, doc_tokens: np.ndarray, doc_lengths: np.ndarray,
              have: set[str]) -> dict[str, Any]:
    rows = tokens.reshape(-1, SEQ)
    ends = np.cumsum(doc_lengths)
    docs = [doc_tokens[e - n:e] for e, n in zip(ends.tolist(), doc_lengths.tolist(), strict=False)]
    p: dict[str, Any] = {"docs_offsets": np.concatenate([[0], ends])}
    p["memmap"] = os.path.join(root, "tokens.u32")
    tokens.tofile(p["memmap"])
    p["doc_memmap"] = os.path.join(root, "docs.u32")
    doc_tokens.tofile(p["doc_memmap"])

    from zerobatch.writers.llmbatch import write_batch_file
    from zerobatch.writers.llmchnk import write_chunk_file
    from zerobatch.writers.tokstream import TokenStreamWriter
    p["llmbatch"] = os.path.join(root, "data.batch")
    write_batch_file(p["llmbatch"], rows, BS, SEQ, seed=0)
    p["tokstream"] = os.path.join(root, "tokstream")
    with TokenStreamWriter(p["tokstream"], vocab_size=50257, shard_tokens=1 << 24) as w:
        for i in range(0, rows.shape[0], 64):
            w.add_document(rows[i:i + 64].reshape(-1))
    p["doc_tokstream"] = os.path.join(root, "doc_tokstream")
    with TokenStreamWriter(p["doc_tokstream"], vocab_size=50257, shard_tokens=1 << 24) as w:
        for d in docs:
            w.add_document(d)
    p["llmchnk"] = os.path.join(root, "docs.chunk")
    write_chunk_file(p["llmchnk"], docs, seq_len=SEQ)

    if "datasets" in have:
        import datasets
        p["hf"] = os.path.join(root, "hf")
        datasets.Dataset.from_dict({"tokens": rows}).save_to_disk(p["hf"])
        p["hf_docs"] = os.path.join(root, "hf_docs")
        datasets.Dataset.from_dict({"tokens": [d.tolist() for d in docs]}).save_to_disk(p["hf_docs"])
    if "streaming" in have:
        _stub_torchvision()
        from streaming import MDSWriter
        p["mds"] = os.path.join(root, "mds")
        with MDSWriter(out=p["mds"], columns={"tokens": f"ndarray:uint32:{SEQ}"}, size_limit=1 << 26) as w:
            for row in rows:
                w.write({"tokens": row})
        p["mds_docs"] = os.path.join(root, "mds_docs")
        with MDSWriter(out=p["mds_docs"], columns={"tokens": "ndarray:uint32"}, size_limit=1 << 26) as w:
            for d in docs:
                w.write({"tokens": d})
    if "litdata" in have:
        from litdata import TokensLoader, optimize
        p["litdata"] = os.path.join(root, "litdata")
        bounds = np.linspace(0, tokens.size, 9).astype(int).tolist()
        optimize(fn=_litdata_part, inputs=[(p["memmap"], a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=False)],
                 output_dir=p["litdata"], chunk_size=(SEQ + 1) * 4096, item_loader=TokensLoader(),
                 num_workers=1, mode="overwrite")
    if "grain" in have:
        from array_record.python.array_record_module import ArrayRecordWriter
        p["arrayrecord"] = os.path.join(root, "data.array_record")
        w = ArrayRecordWriter(p["arrayrecord"], "group_size:1")
        for row in rows:
            w.write(row.tobytes())
        w.close()
        p["arrayrecord_docs"] = os.path.join(root, "docs.array_record")
        w = ArrayRecordWriter(p["arrayrecord_docs"], "group_size:1")
        for d in docs:
            w.write(d.tobytes())
        w.close()
    return p


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
                 "torchvision.transforms.functional", "torchvision.io"):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = mod
    # Hugging Face datasets' torch formatter checks every value against torchvision.io.VideoReader
    sys.modules["torchvision.io"].VideoReader = type("VideoReader", (), {})  # type: ignore[attr-defined]
    sys.modules["torchvision.datasets"].VisionDataset = object  # type: ignore[attr-defined]
    sys.modules["torchvision.datasets"].CIFAR10 = object  # type: ignore[attr-defined]
    sys.modules["torchvision.transforms.functional"].to_tensor = None  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# helpers


def _cycle(make: Callable[[], Any]) -> Iterator[Any]:
    while True:
        yield from make()


def pad_batch(seqs: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    out = np.zeros((len(seqs), SEQ), np.int64)
    mask = np.zeros((len(seqs), SEQ), bool)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
        mask[i, :len(s)] = True
    return torch.from_numpy(out), torch.from_numpy(mask)


def evict(root: str) -> None:
    """Drop the page cache of every file under ``root`` (clean pages; no root needed)."""
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm(root: str) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(1 << 24):
                    pass


def first_tensor(b: Any) -> Any:
    if isinstance(b, dict):
        return b["input_ids"]
    return b[0] if isinstance(b, (tuple, list)) else b


# ---------------------------------------------------------------------------------------------
# the loaders: make(paths, workload, workers) -> iterator of batches


class Records(torch.utils.data.Dataset):
    def __init__(self, path: str) -> None:
        self.path, self.n, self.mm = path, os.path.getsize(path) // 4 // SEQ, None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint32, mode="r")
        return torch.from_numpy(self.mm[i * SEQ:(i + 1) * SEQ].astype(np.int64))


class Windows(Records):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.n = os.path.getsize(path) // 4 - SEQ

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint32, mode="r")
        w = torch.from_numpy(self.mm[i:i + SEQ + 1].astype(np.int64))
        return w[:-1], w[1:]


class Docs(Records):
    def __init__(self, path: str, offsets: np.ndarray) -> None:
        super().__init__(path)
        self.offsets, self.n = offsets, offsets.size - 1

    def __getitem__(self, i: int) -> np.ndarray:
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint32, mode="r")
        return np.asarray(self.mm[self.offsets[i]:self.offsets[i + 1]])


def torch_dl(p: dict[str, Any], workload: str, workers: int) -> Iterator[Any]:
    if workload == "windows":
        ds: Any = Windows(p["memmap"])
        collate = None
    elif workload == PADDED:
        ds, collate = Docs(p["doc_memmap"], p["docs_offsets"]), pad_batch
    else:
        ds, collate = Records(p["memmap"]), None
    dl = torch.utils.data.DataLoader(ds, batch_size=BS, shuffle=workload != "in order", num_workers=workers,
                                     drop_last=True, persistent_workers=workers > 0, collate_fn=collate)
    return _cycle(lambda: iter(dl))


def nanogpt(p: dict[str, Any], workload: str, workers: int) -> Iterator[Any]:
    """nanoGPT's get_batch: a fresh np.memmap per batch, per-sample slices, torch.stack."""
    n = os.path.getsize(p["memmap"]) // 4
    g = torch.Generator().manual_seed(1)

    def batches() -> Iterator[Any]:
        step = 0
        perm = torch.randperm(n // SEQ, generator=g)
        while True:
            data = np.memmap(p["memmap"], dtype=np.uint32, mode="r")
            if workload == "windows":
                ix = torch.randint(n - SEQ - 1, (BS,), generator=g)
                x = torch.stack([torch.from_numpy(data[i:i + SEQ].astype(np.int64)) for i in ix.tolist()])
                y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + SEQ].astype(np.int64)) for i in ix.tolist()])
                yield x, y
                continue
            k = step % (n // SEQ // BS)
            rows = range(k * BS, (k + 1) * BS) if workload == "in order" else perm[k * BS:(k + 1) * BS].tolist()
            yield torch.stack([torch.from_numpy(data[r * SEQ:(r + 1) * SEQ].astype(np.int64)) for r in rows])
            step += 1
    return batches()


def hf(p: dict[str, Any], workload: str, workers: int) -> Iterator[Any]:
    import datasets
    if workload == PADDED:
        ds = datasets.load_from_disk(p["hf_docs"]).with_format("numpy")
        dl = torch.utils.data.DataLoader(ds, batch_size=BS, shuffle=True, num_workers=workers, drop_last=True,
                                         collate_fn=lambda items: pad_batch([it["tokens"] for it in items]))
    else:
        ds = datasets.load_from_disk(p["hf"]).with_format("torch")
        dl = torch.utils.data.DataLoader(ds, batch_size=BS, shuffle=workload == "shuffled", num_workers=workers,
                                         drop_last=True, collate_fn=lambda items: torch.stack(
                                             [it["tokens"] for it in items]).to(torch.int64))
    return _cycle(lambda: iter(dl))


def mosaic(p: dict[str, Any], workload: str, workers: int) -> Iterator[Any]:
    _stub_torchvision()
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    clean_stale_shared_memory()
    docs = workload == PADDED
    ds = StreamingDataset(local=p["mds_docs" if docs else "mds"], shuffle=workload != "in order", batch_size=BS,
                          shuffle_seed=1)
    collate = (lambda items: pad_batch([it["tokens"] for it in items])) if docs else None
    dl = torch.utils.data.DataLoader(ds, batch_size=BS, num_workers=workers, drop_last=True, collate_fn=collate,
                                     persistent_workers=workers > 0,
                                     multiprocessing_context="fork" if workers else None)
    if docs:
        return _cycle(lambda: iter(dl))
    return _cycle(lambda: (b["tokens"].to(torch.int64) for b in dl))


def litdata(p: dict[str, Any], workload: str, workers: int) -> Iterator[Any]:
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader
    ds = StreamingDataset(p["litdata"], item_loader=TokensLoader(block_size=SEQ), shuffle=workload == "shuffled",
                          drop_last=True)
    dl = StreamingDataLoader(ds, batch_size=BS, num_workers=workers, drop_last=True)
    return _cycle(lambda: (b.to(torch.int64) for b in dl))


def grain_loader(p: dict[str, Any], workload: str, threads: int) -> Iterator[Any]:
    import grain
    docs = workload == PADDED
    src = grain.sources.ArrayRecordDataSource([p["arrayrecord_docs" if docs else "arrayrecord"]])
    ds = grain.MapDataset.source(src)
    if workload != "in order":
        ds = ds.shuffle(seed=1)
    if docs:
        ds = ds.batch(BS, drop_remainder=True, batch_fn=list).map(
            lambda recs: pad_batch([np.frombuffer(r, np.uint32) for r in recs]))
    else:
        ds = ds.batch(BS, drop_remainder=True, batch_fn=list).map(
            lambda recs: np.frombuffer(b"".join(recs), np.uint32).reshape(BS, SEQ).astype(np.int64))
    opts = grain.ReadOptions(num_threads=max(threads, 1), prefetch_buffer_size=256)
    return _cycle(lambda: iter(ds.to_iter_dataset(opts)))


def zb_llmbatch(p: dict[str, Any], workload: str, threads: int) -> Iterator[Any]:
    from zerobatch.adapters.torch import Loader, LLMBatchSource
    ld = Loader(LLMBatchSource(p["llmbatch"]), seed=1, shuffle=workload == "shuffled", num_threads=threads)
    return _cycle(lambda: iter(ld))


def zb_tokstream(p: dict[str, Any], workload: str, threads: int) -> Iterator[Any]:
    from zerobatch.adapters.torch import Loader, TokenDocuments, TokenWindows
    if workload == PADDED:
        src: Any = TokenDocuments(p["doc_tokstream"], SEQ, next_token=False)
    elif workload == "windows":
        src = TokenWindows(p["tokstream"], SEQ, stride=1)
    else:
        src = TokenWindows(p["tokstream"], SEQ, next_token=False)
    ld = Loader(src, batch_size=BS, seed=1, shuffle=workload != "in order", num_threads=threads)
    return _cycle(lambda: iter(ld))


def zb_llmchnk(p: dict[str, Any], workload: str, threads: int) -> Iterator[Any]:
    from zerobatch.adapters.torch import LLMChunkSource, Loader
    ld = Loader(LLMChunkSource(p["llmchnk"], SEQ, mask=True), batch_size=BS, seed=1, num_threads=threads)
    return _cycle(lambda: iter(ld))


# (name, factory, workers, needs, workloads)
LOADERS: list[tuple[str, Callable[..., Iterator[Any]], int, str | None, tuple[str, ...]]] = [
    ("nanoGPT np.memmap + torch.stack", nanogpt, 0, None, ("in order", "shuffled", "windows")),
    ("torch DataLoader, 0 workers", torch_dl, 0, None, WORKLOADS),
    ("torch DataLoader, 2 workers", torch_dl, 2, None, WORKLOADS),
    ("HF datasets (Arrow) + DataLoader", hf, 0, "datasets", ("in order", "shuffled", PADDED)),
    ("MosaicML Streaming, 0 workers", mosaic, 0, "streaming", ("in order", "shuffled", PADDED)),
    ("MosaicML Streaming, 2 workers", mosaic, 2, "streaming", ("in order", "shuffled", PADDED)),
    ("LitData, 0 workers", litdata, 0, "litdata", ("in order", "shuffled")),
    ("LitData, 2 workers", litdata, 2, "litdata", ("in order", "shuffled")),
    ("Grain + ArrayRecord, 2 threads", grain_loader, 2, "grain", ("in order", "shuffled", PADDED)),
    ("zerobatch LLMBATCH", zb_llmbatch, 2, None, ("in order", "shuffled")),
    ("zerobatch TOKSTREAM", zb_tokstream, 2, None, WORKLOADS),
    ("zerobatch LLMCHNK", zb_llmchnk, 2, None, (PADDED,)),
]


def run(make: Callable[[], Iterator[Any]], batches: int, warmup: int) -> float:
    t0 = time.perf_counter()
    it = make()
    for _ in range(warmup):
        next(it)
    if warmup:
        t0 = time.perf_counter()
    for _ in range(batches):
        b = next(it)
    dt = time.perf_counter() - t0
    assert tuple(first_tensor(b).shape) == (BS, SEQ), first_tensor(b).shape
    del it
    return batches * BS * SEQ / dt


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


def bandwidth_limit() -> float:
    """Tokens/s of the least work a loader handing out ``int64`` from ``uint32`` storage does:
    stream a 256 MiB ``uint32`` array (far larger than the caches) batch by batch into a reused,
    cache-resident ``int64`` batch buffer, on every core (NumPy copies without the GIL); best
    of 5."""
    import threading

    src = np.random.default_rng(0).integers(0, 50257, 1 << 26, dtype=np.uint32)
    cores = os.cpu_count() or 1
    piece = BS * SEQ
    parts = np.array_split(np.arange(src.size // piece), cores)

    def work(rows: np.ndarray) -> None:
        out = np.empty(piece, np.int64)
        for r in rows.tolist():
            np.copyto(out, src[r * piece:(r + 1) * piece], casting="unsafe")

    best = 0.0
    for _ in range(5):
        threads = [threading.Thread(target=work, args=(rows,)) for rows in parts]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = max(best, src.size / (time.perf_counter() - t0))
    return best


def machine() -> dict[str, str]:
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions = {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__}
    for mod in ("datasets", "streaming", "litdata", "grain"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - not installed or no version
            pass
    return {"cpu": cpu, "cores": str(os.cpu_count()), "memory": f"{mem:.0f} GiB", "os": platform.platform(),
            **versions}


def chart(results: dict[str, dict[str, dict[str, float]]], limit: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    for ax, wl in zip(axes.flat, WORKLOADS, strict=True):
        names = [n for n, _, _, _, wls in LOADERS if wl in wls and n in results.get(wl, {})]
        y = np.arange(len(names))
        w = [results[wl][n].get("warm", 0) / 1e6 for n in names]
        c = [results[wl][n].get("cold", 0) / 1e6 for n in names]
        ax.barh(y - 0.2, w, 0.4, label="warm page cache", color=["#d62728" if n.startswith("zerobatch") else "#1f77b4"
                                                                for n in names])
        ax.barh(y + 0.2, c, 0.4, label="cold page cache", color="#aaaaaa")
        ax.axvline(limit / 1e6, color="k", ls="--", lw=1, label="memory bandwidth limit")
        ax.set_yticks(y, names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_title(f"{wl}: {BS} x {SEQ} int64 batches")
        ax.set_xlabel("M tokens/s (log)")
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------------------------------------
# --targets: the first-pass figures of the speed issue, every system from a fresh start


#: zerobatch loaders' read-ahead threads in --targets (None: the library's default).
ZB_THREADS: int | None = None


def _targets_data(root: str, n: int) -> dict[str, Any]:
    """The corpus in each layout the targets read: a TOKSTREAM stream (uint16, 1 KiB blocks),
    documents of lognormal lengths (median 600 tokens) as TOKSTREAM and as a flat token file,
    an LLMBATCH file of 32 x 512 batches and a flat uint32 token file."""
    from zerobatch.writers.llmbatch import write_batch_file
    from zerobatch.writers.tokstream import TokenStreamWriter
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, n, dtype=np.uint32)
    lengths = np.exp(rng.normal(np.log(600), 1.1, n // 300)).astype(np.int64).clip(1, 32_768)
    lengths = lengths[np.cumsum(lengths) <= n]
    d: dict[str, Any] = {"tokens": tokens, "lengths": lengths}
    d["memmap"] = os.path.join(root, "tokens.u32")
    tokens.tofile(d["memmap"])
    d["stream"] = os.path.join(root, "stream")
    with TokenStreamWriter(d["stream"], vocab_size=50257, shard_tokens=1 << 24) as w:
        w.add_document(tokens)
    d["docs"] = os.path.join(root, "docs")
    with TokenStreamWriter(d["docs"], vocab_size=50257, shard_tokens=1 << 24) as w:
        w.add_documents(tokens[:int(lengths.sum())], lengths)
    d["docs_memmap"] = os.path.join(root, "docs.u16")
    tokens[:int(lengths.sum())].astype(np.uint16).tofile(d["docs_memmap"])
    d["batch"] = os.path.join(root, "data.batch")
    write_batch_file(d["batch"], tokens.reshape(-1, SEQ), BS, SEQ, seed=0)
    return d


def _w2_systems(d: dict[str, Any], args_batches: int) -> dict[str, Callable[[], Any]]:
    """Random next-token windows, (x, y) int64 32 x 512: each factory opens everything afresh
    and returns ``(iterator, check)`` (``check(k, batch)`` compares step ``k`` with the corpus,
    for the untimed verification pass)."""
    from zerobatch.adapters.torch import Loader, TokenWindows
    tokens = d["tokens"]

    def zb(verify: bool, source: Any = None) -> Any:
        src = source or TokenWindows(d["stream"], SEQ, verify=verify)
        ld = Loader(src, batch_size=BS, seed=11, num_threads=ZB_THREADS)

        def check(k: int, b: Any) -> None:
            starts = ld.order.items(0, np.arange(k * BS, (k + 1) * BS)) * SEQ
            want = tokens[starts[:, None] + np.arange(SEQ + 1)[None, :]]
            assert (b[0].numpy() == want[:, :-1]).all() and (b[1].numpy() == want[:, 1:]).all()
        return iter(ld), check, src

    def windows_at(starts: Any) -> np.ndarray:
        return tokens[np.asarray(starts)[:, None] + np.arange(SEQ + 1)[None, :]]

    def dl() -> Any:
        ds = Windows(d["memmap"])
        loader = torch.utils.data.DataLoader(ds, batch_size=BS, shuffle=True,
                                             generator=torch.Generator().manual_seed(11))
        # the DataLoader's draws replayed: its iterator's base seed, then RandomSampler's permutation
        g = torch.Generator().manual_seed(11)
        torch.empty((), dtype=torch.int64).random_(generator=g)
        order = torch.randperm(len(ds), generator=g).numpy()

        def check(k: int, b: Any) -> None:
            want = windows_at(order[k * BS:(k + 1) * BS])
            assert (b[0].numpy() == want[:, :-1]).all() and (b[1].numpy() == want[:, 1:]).all()
        return iter(loader), check, None

    def nano() -> Any:
        it = nanogpt({"memmap": d["memmap"]}, "windows", 0)
        g = torch.Generator().manual_seed(1)           # nanogpt()'s draws, replayed
        torch.randperm(tokens.size // SEQ, generator=g)
        draws = [torch.randint(tokens.size - SEQ - 1, (BS,), generator=g).numpy() for _ in range(args_batches + 1)]

        def check(k: int, b: Any) -> None:
            want = windows_at(draws[k])
            assert (b[0].numpy() == want[:, :-1]).all() and (b[1].numpy() == want[:, 1:]).all()
        return it, check, None
    return {"torch DataLoader, 0 workers": dl, "nanoGPT np.memmap + torch.stack": nano,
            "zerobatch TokenWindows": lambda: zb(True), "zerobatch TokenWindows, verify=False": lambda: zb(False)}


def _w3_systems(d: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """Whole documents flat, 32 a step: input_ids [1, T] and cu_seqlens (zerobatch adds labels
    and position_ids, or not with ``position_ids=False, next_token=False``)."""
    from zerobatch.adapters.torch import FlatDocuments, Loader
    lengths = d["lengths"]
    ends = np.cumsum(lengths)
    starts = ends - lengths
    flat = d["tokens"][:int(lengths.sum())]

    def zb(verify: bool = True, lean: bool = False, source: Any = None) -> Any:
        src = source or FlatDocuments(d["docs"], verify=verify, position_ids=not lean, next_token=not lean)
        ld = Loader(src, batch_size=BS, seed=11, num_threads=ZB_THREADS)

        def check(k: int, b: Any) -> None:
            docs = ld.order.items(0, np.arange(k * BS, (k + 1) * BS))
            want = np.concatenate([flat[starts[i]:ends[i]] for i in docs])
            cu = np.concatenate([[0], np.cumsum(lengths[docs])])
            assert (b["input_ids"][0].numpy() == want).all() and (b["cu_seqlens"].numpy() == cu).all()
            if "labels" in b:
                lab = np.append(want[1:], -100)
                lab[cu[1:] - 1] = -100
                assert (b["labels"][0].numpy() == lab).all()
        return iter(ld), check, src

    def peer() -> Any:
        mm = np.memmap(d["docs_memmap"], dtype=np.uint16, mode="r")
        order = np.random.default_rng(11).permutation(lengths.size)

        def steps() -> Iterator[Any]:
            for k in range(lengths.size // BS):
                idx = order[k * BS:(k + 1) * BS]
                pieces = [torch.from_numpy(mm[starts[i]:ends[i]].astype(np.int64)) for i in idx.tolist()]
                cu = torch.zeros(len(pieces) + 1, dtype=torch.int32)
                cu[1:] = torch.cumsum(torch.tensor([p.numel() for p in pieces]), 0)
                yield {"input_ids": torch.cat(pieces)[None, :], "cu_seqlens": cu}

        def check(k: int, b: Any) -> None:
            idx = order[k * BS:(k + 1) * BS]
            assert (b["input_ids"][0].numpy() == np.concatenate([flat[starts[i]:ends[i]] for i in idx])).all()
        return steps(), check, None
    return {"np.memmap, a slice per document + torch.cat": peer, "zerobatch FlatDocuments": lambda: zb(),
            "zerobatch FlatDocuments, lean (no labels, no positions)": lambda: zb(lean=True),
            "zerobatch FlatDocuments, verify=False": lambda: zb(verify=False)}


def _w1_systems(d: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """Pre-formed 32 x 512 batches in the block-shuffle order of BatchNativeLoader(seed=11): the
    seed's reader design (``mm[a:b]`` -> ``np.frombuffer`` -> ``astype(int64)`` ->
    ``torch.from_numpy``, tools/compare_llmbatch.py) against the loader, int64 and int32 views."""
    from compare_llmbatch import SeedReader

    from zerobatch.adapters.torch import BatchNativeLoader, LLMBatchSource, Loader
    order_of = BatchNativeLoader(d["batch"], seed=11)
    order = order_of.order.items(0, np.arange(order_of.source.num_items))
    order_of.close()

    padded = SeedReader(d["batch"]).padded_batch_bytes

    def file_batch(k: int) -> np.ndarray:
        """Step ``k``'s batch read straight from the file's bytes (the layout of the spec)."""
        return np.fromfile(d["batch"], np.uint32, count=BS * SEQ, offset=4096 + int(order[k]) * padded)

    def seed() -> Any:
        r = SeedReader(d["batch"])

        def check(k: int, b: Any) -> None:
            assert b.dtype == torch.int64 and (b.numpy().reshape(-1) == file_batch(k)).all()
        return (r.read_batch_torch(int(i)) for i in order), check, None

    def zb(dtype: Any, source: Any = None) -> Any:
        src = source or LLMBatchSource(d["batch"])
        ld = Loader(src, seed=11, dtype=dtype, num_threads=ZB_THREADS)

        def check(k: int, b: Any) -> None:
            assert b.dtype == dtype and (b.numpy().reshape(-1) == file_batch(k)).all()
        return iter(ld), check, src
    return {"seed reader design, int64": seed, "zerobatch BatchNativeLoader, int64": lambda: zb(torch.int64),
            "zerobatch BatchNativeLoader, int32 views": lambda: zb(torch.int32)}


def _real_tokens(b: Any) -> int:
    x = b["input_ids"] if isinstance(b, dict) else (b[0] if isinstance(b, (tuple, list)) else b)
    return int(x.numel())


def targets(args: argparse.Namespace) -> None:
    """The figures of the speed-with-every-byte-checked issue: first passes (a fresh loader and
    a fresh dataset for every system in every round, nothing checked before), rounds
    interleaved, each figure a ratio within its round (median over rounds), and a second pass
    of every zerobatch loader over its already-checked source; every batch of every system is
    then compared with the corpus in an untimed pass of the same loader, same seed."""
    import statistics
    root = tempfile.mkdtemp(prefix="zb-targets-", dir=os.environ.get("ZB_BENCH_DIR"))
    try:
        n = args.tokens // (SEQ * 64) * SEQ * 64
        d = _targets_data(root, n)
        print(f"{n:,} tokens; {d['lengths'].size:,} documents (median 600 tokens); {args.batches} steps a pass, "
              f"{args.rounds} rounds", flush=True)
        work = {"W1 pre-batched": _w1_systems(d), "W2 random windows": _w2_systems(d, args.batches),
                "W3 whole documents": _w3_systems(d)}
        rates: dict[str, dict[str, list[float]]] = {w: {} for w in work}
        steps_of: dict[str, dict[str, list[float]]] = {w: {} for w in work}
        for rnd in range(args.rounds):
            for wl, systems in work.items():
                names = list(systems)
                names = names[rnd % len(names):] + names[:rnd % len(names)]      # rotate who goes first
                for name in names:
                    try:
                        it, _, src = systems[name]()
                    except TypeError as exc:         # an option an older zerobatch lacks (a baseline run)
                        if rnd == 0:
                            print(f"{wl} / {name}: skipped ({exc})", flush=True)
                        continue
                    first = next(it)                 # opening and the first step are not timed
                    toks = 0
                    t0 = time.perf_counter()
                    for _ in range(args.batches):
                        toks += _real_tokens(next(it))
                    dt = time.perf_counter() - t0
                    rates[wl].setdefault(name, []).append(toks / dt)
                    steps_of[wl].setdefault(name, []).append(dt / args.batches)
                    del it, first
                    if src is not None:             # the same steps again, over the checked source
                        it = _second(systems, name, src)
                        next(it)
                        toks = 0
                        t0 = time.perf_counter()
                        for _ in range(args.batches):
                            toks += _real_tokens(next(it))
                        dt = time.perf_counter() - t0
                        rates[wl].setdefault(name + " (second pass)", []).append(toks / dt)
                        steps_of[wl].setdefault(name + " (second pass)", []).append(dt / args.batches)
                        del it
                        src.close()
                    gc.collect()
            print(f"round {rnd + 1} of {args.rounds} done", flush=True)
        for wl, systems in work.items():                  # every batch checked, untimed
            for name in systems:
                if name not in rates[wl]:
                    continue
                it, check, src = systems[name]()
                for k in range(args.batches + 1):
                    check(k, next(it))
                if src is not None:
                    src.close()
        print("every batch of every system matched the corpus (an untimed pass of the same loaders)")
        out: dict[str, Any] = {}
        for wl, res in rates.items():
            peers = [k for k in res if not k.startswith("zerobatch")]
            print(f"\n{wl}: M tokens/s and us a step (median of {args.rounds} rounds), ratio to the best peer of "
                  f"each round")
            for name, vals in res.items():
                ratios = [v / max(res[p][r] for p in peers) for r, v in enumerate(vals)]
                per_step = statistics.median(steps_of[wl][name]) * 1e6 if steps_of[wl].get(name) else 0.0
                line = f"  {name:66s} {statistics.median(vals) / 1e6:9.1f} {per_step:8.1f}"
                if name.startswith("zerobatch"):
                    line += f"  {statistics.median(ratios):6.2f}x  ({min(ratios):.2f}-{max(ratios):.2f})"
                print(line)
                out.setdefault(wl, {})[name] = {"rates": vals, "ratios_to_best_peer": ratios}
            for name in res:
                if name.endswith("(second pass)"):
                    first = name[:-len(" (second pass)")]
                    r = [a / b for a, b in zip(res[first], res[name], strict=True)]
                    print(f"  first pass / second pass, {first}: {statistics.median(r):.2f}")
            if wl == "W2 random windows" and "zerobatch TokenWindows, verify=False" in res:
                base = res["zerobatch TokenWindows, verify=False"]
                r = [a / b for a, b in zip(res["zerobatch TokenWindows"], base, strict=True)]
                print(f"  checks on / verify=False: {statistics.median(r):.2f}")
        opens = _open_to_first_batch(d["batch"])
        print(f"\nopen -> first batch (median of 30): BatchFileReader {opens[0]:.3f} ms, "
              f"BatchNativeLoader {opens[1]:.3f} ms")
        out["open_to_first_batch_ms"] = {"reader": opens[0], "loader": opens[1]}
        if args.out:
            with open(args.out + "-targets.json", "w") as f:
                json.dump({"machine": machine(), "tokens": n, "steps": args.batches, "rounds": args.rounds,
                           "results": out}, f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _second(systems: dict[str, Callable[[], Any]], name: str, src: Any) -> Iterator[Any]:
    """A loader of system ``name`` over its source ``src`` (already read once: checked)."""
    from zerobatch.adapters.torch import Loader
    dtype = torch.int32 if "int32" in name else torch.int64
    batch = None if "BatchNative" in name else BS
    return iter(Loader(src, batch_size=batch, seed=11, dtype=dtype, num_threads=ZB_THREADS))


def _open_to_first_batch(path: str) -> tuple[float, float]:
    import statistics

    from zerobatch.adapters.torch import BatchNativeLoader
    from zerobatch.batch_loader import BatchFileReader

    def reader() -> float:
        t0 = time.perf_counter()
        with BatchFileReader(path) as r:
            r.read_batch_torch(0)
            return time.perf_counter() - t0

    def loader() -> float:
        t0 = time.perf_counter()
        ld = BatchNativeLoader(path)
        it = iter(ld)
        next(it)
        dt = time.perf_counter() - t0
        del it
        ld.close()
        return dt
    reader(), loader()
    return (1e3 * statistics.median(reader() for _ in range(30)), 1e3 * statistics.median(loader() for _ in range(30)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1 << 24)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", help="run only loaders whose name contains this")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--out", help="write OUT.json, OUT.png and OUT-table.md")
    ap.add_argument("--step-ms", type=float, default=50.0, help="training-loop simulation: compute per step")
    ap.add_argument("--steps", type=int, default=100, help="training-loop simulation: steps (0: skip it)")
    ap.add_argument("--threads", type=int, default=None,
                    help="--targets: zerobatch's read-ahead threads (default: the library's, CPUs - 1 up to 2)")
    ap.add_argument("--targets", action="store_true",
                    help="the first-pass figures instead (W1 pre-batched, W2 random windows, W3 whole documents, "
                         "open -> first batch): every system from a fresh start, --rounds interleaved rounds "
                         "(use 5), --batches steps a pass")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if args.targets:
        global ZB_THREADS
        ZB_THREADS = args.threads
        targets(args)
        return
    workloads = [w.strip() for w in args.workloads.split(",")]
    have = set()
    for mod in ("datasets", "streaming", "litdata", "grain"):
        try:
            if mod == "streaming":
                _stub_torchvision()
            __import__(mod)
            have.add(mod)
        except Exception as exc:  # noqa: BLE001
            print(f"skipping {mod}: {type(exc).__name__}: {exc}")
    info = machine()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    limit = bandwidth_limit()
    print(f"memory-bandwidth limit (256 MiB of uint32 streamed into a reused int64 batch, every core): "
          f"{limit / 1e6:,.0f} M tokens/s", flush=True)
    root = tempfile.mkdtemp(prefix="zb-benchmark-", dir=os.environ.get("ZB_BENCH_DIR"))
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        n = args.tokens // (SEQ * 64) * SEQ * 64
        tokens = np.random.default_rng(0).integers(0, 50257, size=n, dtype=np.uint32)
        doc_tokens, doc_lengths = make_documents(n)
        t0 = time.perf_counter()
        paths = write_all(root, tokens, doc_tokens, doc_lengths, have)
        print(f"{n:,} tokens ({doc_lengths.size:,} documents for the padded-rows workload) written in every format in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        plan = [(wl, name, make, workers) for wl in workloads for name, make, workers, needs, wls in LOADERS
                if wl in wls and (needs is None or needs in have) and (not args.only or args.only in name)]
        for state in (["warm"] if args.no_cold else ["warm", "cold"]):
            rounds = args.rounds if state == "warm" else 1
            for rnd in range(rounds):
                for wl, name, make, workers in plan:
                    if state == "warm":
                        if rnd == 0:
                            warm(root)
                    else:
                        evict(root)
                    try:
                        rate = run(lambda m=make, w=wl, k=workers: m(paths, w, k), args.batches,
                                   20 if state == "warm" else 0)
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        print(f"{wl} / {name}: failed: {type(exc).__name__}: {exc}", flush=True)
                        continue
                    finally:
                        gc.collect()
                    slot = results.setdefault(wl, {}).setdefault(name, {})
                    slot[state] = max(slot.get(state, 0.0), rate)
                    print(f"{state} {rnd + 1}: {wl:10s} {name:40s} {rate / 1e6:10.1f} M tokens/s", flush=True)
        lines = ["| workload | loader | warm M tokens/s | cold M tokens/s | warm vs fastest peer |",
                 "| --- | --- | ---: | ---: | ---: |"]
        for wl in workloads:
            res = results.get(wl, {})
            peers = [v.get("warm", 0) for k, v in res.items() if not k.startswith("zerobatch")]
            top = max(peers) if peers else 0
            for name, v in res.items():
                ratio = f"{v.get('warm', 0) / top:.1f}x" if top and name.startswith("zerobatch") else ""
                lines.append(f"| {wl} | {name} | {v.get('warm', 0) / 1e6:,.1f} | "
                             f"{v['cold'] / 1e6:,.1f} | {ratio} |" if "cold" in v else
                             f"| {wl} | {name} | {v.get('warm', 0) / 1e6:,.1f} | | {ratio} |")
        lines.append(f"| all | memory-bandwidth limit (uint32 -> int64) | {limit / 1e6:,.0f} | | |")
        table = "\n".join(lines)
        print("\n" + table)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out + ".json", "w") as f:
                json.dump({"machine": info, "tokens": n, "batches": args.batches, "rounds": args.rounds,
                           "limit": limit, "results": results}, f, indent=1)
            with open(args.out + "-table.md", "w") as f:
                f.write(table + "\n")
            try:
                chart(results, limit, args.out + ".png")
                print(f"wrote {args.out}.png")
            except ImportError:
                print("no matplotlib: chart skipped")
        if args.steps:
            share, added = simulate(paths, args.step_ms, args.steps)
            print(f"\ntraining loop, {args.step_ms:.0f} ms compute per step, {args.steps} steps, TOKSTREAM windows: "
                  f"time in next() {share:.3f} % of the step, total added {added:+.2f} %")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
