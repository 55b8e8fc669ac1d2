#!/usr/bin/env python3
"""Project a pretraining job's object-storage traffic at 1,024-16,384 ranks with ``zerobatch plan``.

The dataset is a manifest alone (nothing else is read by a plan): ``--tokens`` tokens in
shards of ``--shard-tokens`` (the writers' default 2**28: 512 MiB of uint16 each), 1 KiB
checksum blocks (the default), documents of ``--doc-tokens``; once with its shards under one
prefix and once spread over 256 (``convert --spread 2``). It is served by a local folder as an
object store (``dir://``), so the plan opens it exactly as it would a bucket.

Usage::

    python tools/plan_scale.py [--tokens 1e12] [--steps 20] [--step-time 2.0] [--json out.json]

Prints a table: per world size, the requests and bytes a step, fetched/delivered, the busiest
prefix's requests a second against S3's 5,500, the first step's and a warm restart's requests
and expected seconds, the cache each host needs, and the request cost per 1,000 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from zerobatch.formats import tokstream as T
from zerobatch.writers.tokstream import manifest_of, spread_tag


def fake_manifest(folder: str, tokens: int, shard_tokens: int, doc_tokens: int, spread: int) -> str:
    """A manifest of ``tokens`` in shards of ``shard_tokens`` (no shard files: a plan reads
    the manifest alone); the dataset's ``dir://`` URL."""
    block = T.DEFAULT_CHECKSUM_BLOCK
    shards = max(1, tokens // shard_tokens)
    records = []
    for k in range(shards):
        name = f"shard-{k:05d}"
        if spread:
            name = f"{spread_tag(name, spread)}_{name}"
        docs = shard_tokens // doc_tokens
        size, index = 2 * shard_tokens, 8 * (docs + 1)
        d = 8 * (T.num_chunks(size, block) + T.num_chunks(index, block))
        t = 8 * T.num_chunks(d, block)
        entry = T.ShardEntry(name, os.urandom(16).hex(), shard_tokens, docs, 0, {
            "tokens.bin": T.FileEntry(size, "0" * 16), "documents.index": T.FileEntry(index, "0" * 16),
            "checksums.bin": T.FileEntry(d + t, "0" * 16)})
        rec = {"format": T.FORMAT_NAME, "version": 2, "token_dtype": "uint16", "vocab_size": 50257,
               "metadata": False, "eod_token": 0, "codec": None, "checksum_block": block, "shard": entry.to_dict()}
        records.append((name, json.dumps(rec).encode(), name))
    m = manifest_of(records)
    where = os.path.join(folder, "bucket", f"ds{spread}")
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, T.MANIFEST_NAME), "w") as f:
        json.dump(m.to_dict(), f)
    return f"dir://bucket/ds{spread}"


def main(argv: list[str] | None = None) -> int:
    from zerobatch.adapters.plan import Job, Network, plan
    from zerobatch.readers.tokstream import TokenStreamReader
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=float, default=1e12)
    ap.add_argument("--shard-tokens", type=int, default=T.DEFAULT_SHARD_TOKENS)
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--ranks-per-host", type=int, default=8)
    ap.add_argument("--worlds", default="1024,4096,16384")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-time", type=float, default=2.0)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--bandwidth", type=float, default=12.5e9, help="bytes a second into a host (100 Gbit/s)")
    ap.add_argument("--json", help="write every plan's summary here")
    args = ap.parse_args(argv)
    rows, out = [], []
    with tempfile.TemporaryDirectory(prefix="zb-plan-scale-") as tmp:
        opts = {"root": tmp}
        for spread in (0, 2):
            url = fake_manifest(tmp, int(args.tokens), args.shard_tokens, args.doc_tokens, spread)
            reader = TokenStreamReader(url, storage_options=opts, cache_dir=os.path.join(tmp, "cache"))
            for world in (int(w) for w in args.worlds.split(",")):
                job = Job(seq_len=args.seq_len, batch_size=args.batch_size, world_size=world,
                          hosts=world // args.ranks_per_host, steps=args.steps, seed=7)
                net = Network(latency=args.latency_ms / 1000, bandwidth=args.bandwidth, step_time=args.step_time)
                t0 = time.perf_counter()
                p = plan(reader, job, net)
                dt = time.perf_counter() - t0
                p.pop("steps")
                p["per_host"] = {k: [min(v), max(v)] for k, v in p["per_host"].items()}
                p["seconds_to_plan"] = dt
                out.append(p)
                tot, first, warm = p["total"], p["first_step"], p["restart"]["warm"]
                rows.append((world, job.hosts, "256" if spread else "1", f"{tot['requests_per_step']:,.0f}",
                             f"{tot['bytes'] / job.steps / 2**20:,.0f}", f"{tot['fetched_over_delivered']:.2f}",
                             f"{p['budget']['peak_per_prefix']:,.0f}", f"{first['requests']:,}",
                             f"{first['expected_seconds']:.2f}", f"{warm['requests']:,}",
                             f"{warm['expected_seconds']:.2f}",
                             f"{p['cache']['working_set_per_host_max'] / 2**20:,.1f}",
                             f"{tot['requests_per_step'] * 1000 / 1000 * net.price_per_1k:,.2f}", f"{dt:.1f}"))
            reader.close()
    head = ("ranks", "hosts", "prefixes", "req/step", "MiB/step", "fetched/delivered", "peak req/s/prefix",
            "first step req", "first step s", "warm restart req", "warm restart s", "cache/host MiB",
            "$ per 1k steps", "plan s")
    print(f"{args.tokens:.3g} tokens in shards of {args.shard_tokens:,} tokens, windows of {args.seq_len}, "
          f"{args.batch_size} per rank, {args.ranks_per_host} ranks a host, steps of {args.step_time} s, "
          f"{args.latency_ms} ms a request, {args.bandwidth / 1e9:g} GB/s a host; S3's limit 5,500 GET/s a prefix")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
