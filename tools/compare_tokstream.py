#!/usr/bin/env python3
"""Compare TOKSTREAM random windows with the per-sample ``np.memmap`` approach, in one run.

Builds a dataset of ``--tokens`` uint16 tokens in 16 shards (documents of 1-4096 tokens), then
times, interleaved, the fastest of ``--repeat`` rounds of ``--batches`` batches each:

1. ``TokenStreamReader.windows`` of ``seq_len + 1`` tokens at random starts into a reused
   ``int64`` (or ``int32``) buffer whose next-token ``x, y`` tensor views are made once
   (no copy), on one thread and split over two;
2. the same workload done the usual way: ``np.memmap`` of the token file, per sample
   ``x = mm[s:s+L].astype(int64)``, ``y = mm[s+1:s+L+1].astype(int64)``, ``torch.stack``;
3. a bare NumPy ``uint32 -> int64`` conversion of as many tokens (``np.copyto`` from a
   cache-resident array into a preallocated one, so that no allocation is timed): the floor
   any copy-out has to pay;
4. windows plus their document-boundary outputs (``boundaries`` after ``windows``, and
   ``windows_with_boundaries`` in one pass; full, lean with ``int32`` positions and no
   segment ids, and ``cu_seqlens`` alone), and the mmap and pread backends side by side;
5. on a second dataset with per-token metadata (document-level objects and span-level
   concepts, 6-byte records): plain windows, windows with their metadata in one pass
   (``windows_metadata(..., out=)``: tokens, per-token ids numbered over the batch, and the
   distinct blobs located; objects decoded only when touched), and with every object
   decoded from JSON;
6. large batches (256 x 2048) on one thread and split over two.

Every figure is a ratio taken within this one run (machines here are shared and noisy).
OpenBLAS threads are limited to one: NumPy's idle BLAS workers otherwise spin on the
second core of this 2-core machine and skew every timing.

Usage::

    python tools/compare_tokstream.py [--tokens 67108864] [--repeat 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import shutil
import tempfile
import time

import numpy as np
import torch

from zerobatch.readers.tokstream import TokenStreamReader
from zerobatch.writers.tokstream import TokenStreamWriter


def build(folder: str, tokens: int) -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 50257, tokens).astype(np.uint16)
    cuts = np.cumsum(rng.integers(1, 4097, tokens // 2048 + 2))
    cuts = np.concatenate([[0], cuts[cuts < tokens], [tokens]])
    with TokenStreamWriter(folder, vocab_size=50257, shard_tokens=max(tokens // 16, 1)) as w:
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            w.add_document(data[a:b])


def build_metadata(folder: str, tokens: int) -> None:
    rng = np.random.default_rng(2)
    data = rng.integers(0, 50257, tokens).astype(np.uint16)
    cuts = np.cumsum(rng.integers(1, 4097, tokens // 2048 + 2))
    cuts = np.concatenate([[0], cuts[cuts < tokens], [tokens]])
    with TokenStreamWriter(folder, vocab_size=50257, metadata=True, shard_tokens=max(tokens // 16, 1)) as w:
        for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
            n = int(b - a)
            spans = [(n // 3, n // 3 + 10, {"concept": f"c{i % 1000}"})] if n > 40 else []
            w.add_document(data[a:b], {"source": "web", "doc": i}, spans=spans)


def timed(cases: dict, repeat: int, batches: int) -> dict[str, float]:
    """Fastest of ``repeat`` interleaved rounds, per batch, in seconds."""
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(repeat):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / batches)
    return best


def report(title: str, tag: str, best: dict[str, float], results: dict[str, float], width: int = 26) -> None:
    """Print one table of per-batch times and keep them under ``tag``."""
    print(title)
    for name, t in best.items():
        results[f"{tag}_{name}_us"] = t * 1e6
        print(f"  {name:{width}s} {t * 1e6:9.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1 << 26)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="zb-tokstream-")
    results: dict[str, float] = {}
    try:
        folder = os.path.join(tmp, "d")
        build(folder, args.tokens)
        r1 = TokenStreamReader(folder)
        r2 = TokenStreamReader(folder, num_threads=2)
        rp = TokenStreamReader(folder, backend="pread")
        shard0 = os.path.join(folder, r1.manifest.shards[0].name, "tokens.bin")
        n0 = r1.manifest.shards[0].num_tokens
        mm = np.memmap(shard0, dtype=np.uint16, mode="r", shape=(n0,))
        rng = np.random.default_rng(1)
        for B, L in ((32, 512), (8, 2048)):
            starts = [rng.integers(0, n0 - L - 1, B) for _ in range(args.batches)]
            out64 = np.empty((B, L + 1), dtype=np.int64)
            out32 = np.empty((B, L + 1), dtype=np.int32)
            src = rng.integers(0, 50257, B * (L + 1)).astype(np.uint32)

            # the caller's buffer is wrapped once: x and y stay zero-copy views of it, and
            # each batch overwrites it in place (a loader rotates a few such buffers)
            views = {id(o): (torch.from_numpy(o)[:, :-1], torch.from_numpy(o)[:, 1:]) for o in (out64, out32)}

            def zb(reader: TokenStreamReader, out: np.ndarray, starts=starts, L=L, views=views) -> None:
                x, y = views[id(out)]
                for st in starts:
                    reader.windows(st, L + 1, out=out)

            pos_buf = np.empty((B, L), dtype=np.int64)
            seg_buf = np.empty((B, L), dtype=np.int32)
            cu_buf = np.empty(B * L + 1, dtype=np.int32)

            pos32_buf = np.empty((B, L), dtype=np.int32)

            def zb_bounds(starts=starts, L=L, pos_buf=pos_buf, seg_buf=seg_buf, cu_buf=cu_buf,
                          out64=out64) -> None:
                for st in starts:
                    r1.windows(st, L + 1, out=out64)
                    r1.boundaries(st, L, position_ids=pos_buf, segment_ids=seg_buf, cu_seqlens=cu_buf)

            def zb_bounds_lean(starts=starts, L=L, pos32_buf=pos32_buf, cu_buf=cu_buf, out64=out64) -> None:
                for st in starts:
                    r1.windows(st, L + 1, out=out64)
                    r1.boundaries(st, L, position_ids=pos32_buf, cu_seqlens=cu_buf, segments=False)

            def zb_fused(starts=starts, L=L, pos_buf=pos_buf, seg_buf=seg_buf, cu_buf=cu_buf, out64=out64) -> None:
                for st in starts:
                    r1.windows_with_boundaries(st, L + 1, out=out64, position_ids=pos_buf, segment_ids=seg_buf,
                                               cu_seqlens=cu_buf)

            def zb_fused_lean(starts=starts, L=L, pos32_buf=pos32_buf, cu_buf=cu_buf, out64=out64) -> None:
                for st in starts:
                    r1.windows_with_boundaries(st, L + 1, out=out64, position_ids=pos32_buf, cu_seqlens=cu_buf,
                                               segments=False)

            def zb_fused_cu(starts=starts, L=L, cu_buf=cu_buf, out64=out64) -> None:
                for st in starts:
                    r1.windows_with_boundaries(st, L + 1, out=out64, cu_seqlens=cu_buf, position_dtype=None,
                                               segments=False)

            def naive(starts=starts, L=L) -> None:
                for st in starts:
                    xs = [torch.from_numpy(mm[s:s + L].astype(np.int64)) for s in st]
                    ys = [torch.from_numpy(mm[s + 1:s + L + 1].astype(np.int64)) for s in st]
                    torch.stack(xs), torch.stack(ys)

            dst = np.empty(src.shape, np.int64)

            def bare(starts=starts, src=src, dst=dst) -> None:
                for _ in starts:
                    np.copyto(dst, src, casting="unsafe")

            cases = {
                "zb_int64": lambda out64=out64: zb(r1, out64),
                "zb_int32": lambda out32=out32: zb(r1, out32),
                "zb_int64_2threads": lambda out64=out64: zb(r2, out64),
                "zb_int64_pread": lambda out64=out64: zb(rp, out64),
                "zb_int64_with_boundaries": zb_bounds,
                "zb_int64_with_lean_boundaries": zb_bounds_lean,
                "zb_int64_fused_boundaries": zb_fused,
                "zb_int64_fused_lean_boundaries": zb_fused_lean,
                "zb_int64_fused_cu_seqlens_only": zb_fused_cu,
                "naive_memmap_stack": naive,
                "bare_convert": bare,
            }
            best = timed(cases, args.repeat, args.batches)
            report(f"random windows {B}x{L} (+1 token for next-token pairs), per batch:", f"{B}x{L}", best, results)
            print(f"  -> vs naive memmap + torch.stack: {best['naive_memmap_stack'] / best['zb_int64']:.1f}x faster"
                  f" (int64 pairs)")
            print(f"  -> rate vs bare uint32->int64 conversion: {best['bare_convert'] / best['zb_int64']:.2f}"
                  f" (1 thread), {best['bare_convert'] / best['zb_int64_2threads']:.2f} (reader with 2 threads:"
                  f" batches under 64 Ki tokens stay on one)")
            print(f"  -> windows + boundaries, two calls: {best['zb_int64_with_boundaries'] / best['zb_int64']:.2f}x "
                  f"the cost of plain windows (int64 positions + segment ids + cu_seqlens), "
                  f"{best['zb_int64_with_lean_boundaries'] / best['zb_int64']:.2f}x (int32 positions + cu_seqlens); "
                  f"one pass (windows_with_boundaries): {best['zb_int64_fused_boundaries'] / best['zb_int64']:.2f}x, "
                  f"{best['zb_int64_fused_lean_boundaries'] / best['zb_int64']:.2f}x; cu_seqlens + max_seqlen only: "
                  f"{best['zb_int64_fused_cu_seqlens_only'] / best['zb_int64']:.2f}x")
        # large batches: the reader splits them over its threads
        B, L, nb = 256, 2048, max(args.batches // 10, 4)
        starts = [rng.integers(0, r1.num_tokens - L - 1, B) for _ in range(nb)]
        out = np.empty((B, L + 1), dtype=np.int64)
        src = rng.integers(0, 50257, B * (L + 1)).astype(np.uint32)
        dst = np.empty(src.shape, np.int64)
        best = timed({
            "zb_int64": lambda: [r1.windows(st, L + 1, out=out) for st in starts],
            "zb_int64_2threads": lambda: [r2.windows(st, L + 1, out=out) for st in starts],
            "bare_convert": lambda: [np.copyto(dst, src, casting="unsafe") for _ in starts],
        }, args.repeat, nb)
        report(f"random windows {B}x{L} (+1), per batch, whole dataset:", f"{B}x{L}", best, results)
        print(f"  -> rate vs bare conversion: {best['bare_convert'] / best['zb_int64']:.2f} (1 thread), "
              f"{best['bare_convert'] / best['zb_int64_2threads']:.2f} (2 threads)")

        # per-token metadata
        mfolder = os.path.join(tmp, "m")
        build_metadata(mfolder, args.tokens)
        rm = TokenStreamReader(mfolder)
        B, L = 32, 512
        starts = [rng.integers(0, rm.num_tokens - L - 1, B) for _ in range(args.batches)]
        out = np.empty((B, L + 1), dtype=np.int64)
        ids = np.empty((B, L + 1), dtype=np.int32)
        distinct = []

        def with_metadata(decode_all: bool) -> None:
            for st in starts:
                m = rm.windows_metadata(st, L + 1, ids=ids, out=out)
                if decode_all:
                    list(m.objects)
                else:
                    distinct.append(len(m.objects))

        best = timed({
            "zb_int64": lambda: [rm.windows(st, L + 1, out=out) for st in starts],
            "zb_int64_with_metadata": lambda: with_metadata(False),
            "zb_int64_with_metadata_decoded": lambda: with_metadata(True),
        }, args.repeat, args.batches)
        report(f"random windows {B}x{L} (+1) with per-token metadata (6-byte records; "
               f"{np.mean(distinct):.0f} distinct objects per batch), per batch:", f"meta_{B}x{L}", best, results, 32)
        print(f"  -> windows + metadata (ids numbered over the batch, blobs located, decoded on access): "
              f"{best['zb_int64_with_metadata'] / best['zb_int64']:.2f}x the cost of plain windows; "
              f"every object decoded from JSON: {best['zb_int64_with_metadata_decoded'] / best['zb_int64']:.2f}x")
        for r in (r1, r2, rp, rm):
            r.close()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
