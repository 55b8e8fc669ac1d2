#!/usr/bin/env python3
"""Compare the Feistel shuffle with the precomputed permutation, in one run.

The seed (``../shared/seeds/003_*.txt``) weighs two ways to shuffle an epoch without
replacement: precompute ``numpy.random.default_rng(seed).permutation(n)`` (O(n) memory, and
nothing can be read until all of it exists), or compute each position on the fly with a
Feistel network (O(1) memory, the first batch at once). This prints, from one process on one
machine at one moment:

1. bulk Feistel indices/s on one core (6 rounds, 2**38 items) on every bulk path the CPU runs
   (portable, AVX2, AVX-512), beside numpy's permutation rate at ``--numpy-log2``;
2. the cost of one scalar ``p[i]`` from Python;
3. time and memory to the first batch of 1024 indices of a 2**38-item epoch, against
   precomputing a ``2**numpy_log2`` permutation (and what 2**38 would need);
4. pygfc's scalar call beside ours, when pygfc is installed.

Times are the fastest of ``--repeat`` runs. Memory is the tracemalloc peak of the step
(NumPy reports its buffers to tracemalloc).

Usage::

    python tools/compare_samplers.py [--numpy-log2 28] [--repeat 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
import timeit
import tracemalloc

import numpy as np

from zerobatch.core._feistel import available_paths
from zerobatch.samplers import FeistelPermutation, GlobalRandomOrder, IndexSampler

N_BIG = 2**38
BATCH = 1024


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numpy-log2", type=int, default=28, help="size of the precomputed permutation (log2)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    results: dict[str, float] = {}

    count = 1 << 24
    out = np.empty(count, dtype=np.int64)
    perm = FeistelPermutation(N_BIG, 6, 7)
    best_path = perm.path
    for path in available_paths():
        perm._use_path(path)
        results[f"feistel_{path}_indices_per_s"] = count / best(lambda: perm.fill(out, 12345), args.repeat)
    perm._use_path(best_path)
    results["feistel_indices_per_s"] = results[f"feistel_{best_path}_indices_per_s"]
    pos = np.random.default_rng(0).integers(0, N_BIG, count)
    results["feistel_take_indices_per_s"] = count / best(lambda: perm.take(pos, out), args.repeat)


    n_np = 1 << args.numpy_log2
    np_time = best(lambda: np.random.default_rng(1).permutation(n_np), max(1, args.repeat // 2))
    results["numpy_permutation_indices_per_s"] = n_np / np_time
    results["numpy_first_batch_s"] = np_time
    results["numpy_first_batch_bytes"] = peak_bytes(lambda: np.random.default_rng(1).permutation(n_np)[:BATCH])

    calls = 200_000
    results["feistel_scalar_call_s"] = min(timeit.repeat(lambda: perm[123456789], number=calls, repeat=args.repeat)) / calls

    def first_batch():
        IndexSampler(GlobalRandomOrder(N_BIG, seed=1), BATCH).batch(0)

    results["feistel_first_batch_s"] = best(first_batch, args.repeat * 20)
    results["feistel_first_batch_bytes"] = peak_bytes(first_batch)

    try:
        import pygfc
    except ImportError:
        pygfc = None
    if pygfc is not None:
        g = pygfc.Permutation(N_BIG, 6, 7)
        results["pygfc_scalar_call_s"] = min(timeit.repeat(lambda: g[123456789], number=calls, repeat=args.repeat)) / calls

    print(f"Feistel permutation, 6 rounds, n = 2**38 (bulk paths on this CPU: {', '.join(available_paths())})")
    for path in available_paths():
        print(f"  bulk fill, {path:9s} path  {results[f'feistel_{path}_indices_per_s'] / 1e6:8.1f} M indices/s (one core)")
    print(f"  take (random positions)    {results['feistel_take_indices_per_s'] / 1e6:8.1f} M indices/s")
    print(f"  numpy permutation(2**{args.numpy_log2})  {results['numpy_permutation_indices_per_s'] / 1e6:8.1f} M indices/s"
          f"   ratio Feistel/numpy = {results['feistel_indices_per_s'] / results['numpy_permutation_indices_per_s']:.2f}")
    print(f"  scalar p[i] from Python    {results['feistel_scalar_call_s'] * 1e9:8.0f} ns"
          + (f"   (pygfc: {results['pygfc_scalar_call_s'] * 1e9:.0f} ns)" if pygfc is not None else ""))
    print(f"First batch of {BATCH} shuffled indices")
    print(f"  Feistel, epoch of 2**38    {results['feistel_first_batch_s'] * 1e6:8.1f} us   "
          f"{results['feistel_first_batch_bytes'] / 1024:8.1f} KiB peak")
    print(f"  numpy, epoch of 2**{args.numpy_log2}     {results['numpy_first_batch_s'] * 1e6:8.0f} us   "
          f"{results['numpy_first_batch_bytes'] / 2**20:8.1f} MiB peak"
          f"   ratio {results['numpy_first_batch_s'] / results['feistel_first_batch_s']:.0f}x slower")
    print(f"  numpy, epoch of 2**38      needs {N_BIG * 8 / 2**40:.0f} TiB of int64 indices "
          f"(~{N_BIG / results['numpy_permutation_indices_per_s'] / 3600:.1f} h at the rate above)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
