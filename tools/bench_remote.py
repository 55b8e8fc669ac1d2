#!/usr/bin/env python3
"""Checksum granularity and object storage: what small checksum blocks (TOKSTREAM version 2)
change, locally and from an S3 API server.

    python tools/bench_remote.py [--tokens 134217728] [--shards 1024] [--latency 0.02]
                                 [--bandwidth 100e6] [--steps 40] [--json PATH]

Part 1, local, cold random windows: one dataset written twice, with 16 MiB checksum chunks
(what version 1 always used) and with 1 KiB blocks (version 2's default). For each, fresh
readers (nothing checked yet) with the files evicted from the page cache read one batch of 32
random 2049-token windows: the time, and the bytes hashed per byte delivered (the checks'
read amplification); ``verify=False`` as the floor.

Part 2, remote: a dataset of ``--shards`` shards on moto's S3 server (127.0.0.1) behind a
proxy that adds ``--latency`` seconds to every request and caps each response at
``--bandwidth`` bytes/s, read with a cold cache by the zerobatch Loader (``TokenWindows``,
batches of 32 x 2048 next-token windows, shuffled): the time to the first batch (open
included), the steady-state tokens per second over ``--steps`` steps, the bytes fetched per
byte delivered and the requests per step; for both checksum granularities. moto is a Python
server (a few hundred requests per second on this machine): the steady state is the server's
ceiling, not the client's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np
from benchmark import evict  # tools/benchmark.py: drop files from the page cache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

BS, SEQ = 32, 2048


def write(folder: str, tokens: int, shards: int, block: int, seed: int = 0) -> None:
    from zerobatch.writers.tokstream import TokenStreamWriter
    rng = np.random.default_rng(seed)
    per_shard = max(1, tokens // shards)
    with TokenStreamWriter(folder, vocab_size=50257, shard_tokens=per_shard, checksum_block=block,
                           eod_token=50256) as w:
        done = 0
        while done < tokens:
            n = int(min(tokens - done, rng.integers(200, 4000)))
            w.add_document(rng.integers(0, 50256, n, dtype=np.uint16))
            done += n


def _blocks_touched(r: Any, starts: np.ndarray, length: int, block: int) -> int:
    """Checksum blocks under the windows (each hashed once by a fresh reader's first read)."""
    seen = set()
    size = r.itemsize
    for s in starts.tolist():
        for pos in (s, s + length - 1):
            k = int(np.searchsorted(r.cum_tokens, pos, side="right")) - 1
            seen.add((k, (pos - int(r.cum_tokens[k])) * size // block))
        k0 = int(np.searchsorted(r.cum_tokens, s, side="right")) - 1
        k1 = int(np.searchsorted(r.cum_tokens, s + length - 1, side="right")) - 1
        if k0 == k1:
            a = (s - int(r.cum_tokens[k0])) * size // block
            b = (s + length - 1 - int(r.cum_tokens[k0])) * size // block
            seen.update((k0, x) for x in range(a, b + 1))
    return len(seen)


def local_part(root: str, tokens: int, repeats: int = 5) -> dict[str, Any]:
    from zerobatch.readers.tokstream import TokenStreamReader
    out: dict[str, Any] = {}
    for name, block in (("16 MiB chunks (v1)", 1 << 24), ("1 KiB blocks (v2)", 1 << 10)):
        folder = os.path.join(root, f"local-{block}")
        write(folder, tokens, max(1, tokens // (1 << 26)), block)
        for verify in (True, False):
            times = []
            hashed = 0
            rng = np.random.default_rng(1)
            for _ in range(repeats):
                evict(folder)
                r = TokenStreamReader(folder, verify=verify)
                starts = rng.integers(0, r.num_tokens - SEQ - 1, BS)
                t = time.perf_counter()
                r.windows(starts, SEQ + 1)
                times.append(time.perf_counter() - t)
                checked = _blocks_touched(r, starts, SEQ + 1, block) if verify else 0
                hashed += checked * block
                r.close()
            key = name if verify else f"{name}, verify=False"
            if not verify and block != 1 << 24:
                continue
            delivered = repeats * BS * (SEQ + 1) * 2
            out[key] = {"batch_s": float(np.median(times)), "hashed_per_delivered": hashed / delivered}
    return out


def remote_part(root: str, tokens: int, shards: int, latency: float, bandwidth: float,
                steps: int) -> dict[str, Any]:
    from s3kit import FaultProxy, moto_server, new_bucket, options, upload

    from zerobatch.adapters.torch import Loader, TokenWindows
    from zerobatch.readers.tokstream import TokenStreamReader
    endpoint = moto_server()
    out: dict[str, Any] = {}
    for name, block in (("16 MiB chunks (v1)", 1 << 24), ("1 KiB blocks (v2)", 1 << 10)):
        folder = os.path.join(root, f"remote-{block}")
        write(folder, tokens, shards, block, seed=2)
        url = f"s3://{new_bucket(endpoint)}/ds"
        t = time.perf_counter()
        upload(folder, url, options(endpoint))
        up = time.perf_counter() - t
        proxy = FaultProxy(endpoint, latency=latency, bandwidth=bandwidth)
        cache = os.path.join(root, f"cache-{block}")
        try:
            t0 = time.perf_counter()
            reader = TokenStreamReader(url, storage_options=options(proxy.url), cache_dir=cache)
            ld = Loader(TokenWindows(reader, SEQ), batch_size=BS, seed=3, num_threads=2, prefetch=8)
            it = iter(ld)
            next(it)
            first = time.perf_counter() - t0
            req0, got0 = reader.store.requests, reader.store.bytes_fetched
            t1 = time.perf_counter()
            n = 0
            for _ in it:
                n += 1
                if n == steps:
                    break
            steady = time.perf_counter() - t1
            delivered = (n + 1) * BS * (SEQ + 1) * 2
            out[name] = {
                "shards": len(reader.manifest.shards), "upload_s": up,
                "first_batch_s": first, "steady_tokens_per_s": n * BS * SEQ / steady,
                "fetched_per_delivered": reader.store.bytes_fetched / delivered,
                "requests_per_step": (reader.store.requests - req0) / max(n, 1),
                "requests_first_batch": req0, "bytes_first_batch": got0,
            }
            ld.close()
            reader.close()
        finally:
            proxy.close()
            shutil.rmtree(cache, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1 << 27, help="tokens of the local dataset")
    ap.add_argument("--remote-tokens", type=int, default=1 << 25, help="tokens of the remote dataset")
    ap.add_argument("--shards", type=int, default=1024)
    ap.add_argument("--latency", type=float, default=0.02)
    ap.add_argument("--bandwidth", type=float, default=100e6)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip-local", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="zb-bench-remote-")
    try:
        res: dict[str, Any] = {"conditions": vars(a)}
        if not a.skip_local:
            res["local"] = local_part(root, a.tokens)
            print(f"local, cold: one batch of {BS} random {SEQ + 1}-token windows, fresh reader, files evicted")
            for k, v in res["local"].items():
                print(f"  {k:32s} {v['batch_s'] * 1000:8.1f} ms   hashed/delivered {v['hashed_per_delivered']:8.1f}")
        res["remote"] = remote_part(root, a.remote_tokens, a.shards, a.latency, a.bandwidth, a.steps)
        print(f"remote: moto S3 on 127.0.0.1 behind a proxy adding {a.latency * 1000:.0f} ms per request, "
              f"{a.bandwidth / 1e6:.0f} MB/s per response; cold cache; Loader(TokenWindows) {BS} x {SEQ}, shuffled")
        for k, v in res["remote"].items():
            print(f"  {k:20s} shards {v['shards']}  first batch {v['first_batch_s']:6.2f} s  "
                  f"steady {v['steady_tokens_per_s'] / 1e6:6.2f} M tokens/s  fetched/delivered "
                  f"{v['fetched_per_delivered']:6.2f}  requests/step {v['requests_per_step']:5.1f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
