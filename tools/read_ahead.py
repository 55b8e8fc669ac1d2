#!/usr/bin/env python3
"""What read-ahead threads gain: the zerobatch loader with 0, 1 and 2 read-ahead threads on
every source, measured as a training loop sees it.

    python tools/read_ahead.py [--tokens 8388608] [--step-ms 20] [--steps 150] [--big-tokens 268435456]

For each source (LLMBATCH batches, TOKSTREAM windows, windows with document boundaries,
padded documents, LLMCHNK records, ZRECORD records), all 32 x 512 int64 batches, shuffled:

- ``loop``: a loop of ``--steps`` steps of fixed compute (a single-threaded matmul, GIL
  released as in a real step) with a ``next()`` per step: the time the loader adds to the
  bare loop, in % (measured interleaved with the bare loop), and the time spent inside
  ``next()`` as % of the bare loop;
- ``alone``: batches per second with no compute (the loader's own speed).

Then a cold start with checksums: a fresh reader over ``--big-tokens`` tokens (every 16 MiB
chunk of ``tokens.bin`` checked on first touch), random next-token windows: the time until
each of the first 8 batches and the process's peak memory, with 0, 1 and 2 threads. A thread
waiting for its batch must not hash chunks for later steps, so batch 2 comes about as
quickly as batch 1.

Prints a table per part; ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
from benchmark import evict  # tools/benchmark.py, beside this script: drop files from the page cache

BS, SEQ = 32, 512
THREADS = (0, 1, 2)


def write_data(root: str, n_tokens: int) -> dict[str, str]:
    from zerobatch.formats.zrecord import FieldSpec
    from zerobatch.writers.llmbatch import write_batch_file
    from zerobatch.writers.llmchnk import write_chunk_file
    from zerobatch.writers.tokstream import TokenStreamWriter
    from zerobatch.writers.zrecord import ZRecordWriter

    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50257, n_tokens, dtype=np.uint32)
    lengths = np.minimum(rng.lognormal(6.0, 1.0, n_tokens // 100).astype(np.int64) + 1, 4096)
    lengths = lengths[np.cumsum(lengths) <= n_tokens]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    p = {k: os.path.join(root, k) for k in ("llmbatch", "tokstream", "llmchnk", "zrecord")}
    records = n_tokens // SEQ
    write_batch_file(p["llmbatch"], tokens[:records * SEQ].reshape(records, SEQ), BS, SEQ, seed=1)
    with TokenStreamWriter(p["tokstream"], vocab_size=50257, shard_tokens=1 << 22) as w:
        for a, n in zip(starts.tolist(), lengths.tolist(), strict=True):
            w.add_document(tokens[a:a + n])
    docs = [tokens[a:a + n] for a, n in zip(starts.tolist(), lengths.tolist(), strict=True)]
    write_chunk_file(p["llmchnk"], docs)
    with ZRecordWriter(p["zrecord"], [FieldSpec("tokens", "u32", None, "raw")]) as w:
        w.extend(d[:SEQ] for d in docs)
    return p


def make_loader(p: dict[str, str], kind: str, threads: int) -> Any:
    from zerobatch.adapters.torch import (LLMBatchSource, LLMChunkSource, Loader, RecordFields, TokenDocuments,
                                          TokenWindows)
    if kind == "llmbatch":
        return Loader(LLMBatchSource(p["llmbatch"]), seed=1, num_threads=threads)
    if kind == "windows":
        src: Any = TokenWindows(p["tokstream"], SEQ)
    elif kind == "windows+boundaries":
        src = TokenWindows(p["tokstream"], SEQ, boundaries=True)
    elif kind == "documents":
        src = TokenDocuments(p["tokstream"], SEQ + 1)
    elif kind == "llmchnk":
        src = LLMChunkSource(p["llmchnk"], SEQ, mask=True)
    else:
        src = RecordFields(p["zrecord"], pad_to=SEQ, token_fields=["tokens"])
    return Loader(src, batch_size=BS, seed=1, num_threads=threads)


def endless(p: dict[str, str], kind: str, threads: int) -> Any:
    ld = make_loader(p, kind, threads)
    while True:
        yield from ld


def compute(step_ms: float) -> Any:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    reps, per = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ a
        dt = time.perf_counter() - t0
        if dt >= 0.05:
            per = dt / reps
            break
        reps *= 2
    n = max(1, round(step_ms / 1000 / per))

    def step() -> None:
        for _ in range(n):
            a @ a
    return step


def loop(p: dict[str, str], kind: str, threads: int, step: Any, steps: int, cold_cache: bool = False
         ) -> tuple[float, float]:
    if cold_cache:
        evict(os.path.dirname(p["tokstream"]))
    it = endless(p, kind, threads)
    next(it)
    bare = loaded = in_next = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        bare += time.perf_counter() - t0
        t0 = time.perf_counter()
        next(it)
        t1 = time.perf_counter()
        step()
        loaded += time.perf_counter() - t0
        in_next += t1 - t0
    it.close()
    return 100 * (loaded - bare) / bare, 100 * in_next / bare


def alone(p: dict[str, str], kind: str, threads: int, batches: int = 150) -> float:
    it = endless(p, kind, threads)
    for _ in range(10):
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    dt = time.perf_counter() - t0
    it.close()
    return batches / dt


COLD = r"""
import json, resource, sys, time
from zerobatch.adapters.torch import Loader, TokenWindows
ld = Loader(TokenWindows(sys.argv[1], 512), batch_size=32, seed=7, num_threads=int(sys.argv[2]))
t0 = time.perf_counter()
it = iter(ld)
times = []
for _ in range(8):
    next(it)
    times.append(time.perf_counter() - t0)
print(json.dumps({"times": times, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def cold(folder: str, threads: int) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-c", COLD, folder, str(threads)], capture_output=True, text=True,
                       check=True)
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 23)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--big-tokens", type=int, default=1 << 28)
    ap.add_argument("--cold-cache", action="store_true", help="evict the data from the page cache before each loop")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="zb-readahead-")
    out: dict[str, Any] = {"cpus": os.cpu_count(), "step_ms": a.step_ms, "cold_cache": a.cold_cache, "loop": {},
                           "alone": {}, "cold": {}}
    try:
        p = write_data(root, a.tokens)
        step = compute(a.step_ms)
        kinds = ["llmbatch", "windows", "windows+boundaries", "documents", "llmchnk", "zrecord"]
        print(f"training loop: {a.steps} steps of {a.step_ms:.0f} ms compute, 32 x 512 int64 batches, "
              f"{os.cpu_count()} CPUs; added % of the bare loop (in next() %) / batches per second alone")
        print(f"{'source':20s}" + "".join(f"{f'{t} threads':>26s}" for t in THREADS))
        for kind in kinds:
            cells = []
            for t in THREADS:
                added, nxt = loop(p, kind, t, step, a.steps, a.cold_cache)
                rate = alone(p, kind, t)
                out["loop"].setdefault(kind, {})[t] = {"added_pct": added, "in_next_pct": nxt}
                out["alone"].setdefault(kind, {})[t] = rate
                cells.append(f"{added:+6.2f}% ({nxt:5.2f}%) {rate:7.0f}/s")
            print(f"{kind:20s}" + "".join(f"{c:>26s}" for c in cells))
        if a.big_tokens:
            from zerobatch.writers.tokstream import TokenStreamWriter

            big = os.path.join(root, "big")
            rng = np.random.default_rng(2)
            with TokenStreamWriter(big, vocab_size=50257, shard_tokens=1 << 26) as w:
                for _ in range(a.big_tokens >> 24):
                    w.add_document(rng.integers(0, 50257, 1 << 24, dtype=np.uint32))
            print(f"\ncold start with checksums: {a.big_tokens:,} tokens, random windows; seconds until "
                  "batches 1, 2, 4, 8 and peak memory")
            for t in THREADS:
                r = cold(big, t)
                out["cold"][t] = r
                ts = r["times"]
                print(f"  {t} threads: {ts[0]:.3f} {ts[1]:.3f} {ts[3]:.3f} {ts[7]:.3f} s, {r['peak_mib']:.0f} MiB")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
