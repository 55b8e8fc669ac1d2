"""The processes of one host share one fetch of each object range (SeaweedFS, a real object
store, behind the counting proxy): started together, as a job's ranks start, they read the
manifest once, each shard's digests and pages once, each block of data once; without the
shared cache folder each fetches for itself. Every process's windows equal the local copy's."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("obstore")

from s3kit import FaultProxy, new_bucket, options, upload  # noqa: E402
from zbtest import launch_env, start_together  # noqa: E402

from zerobatch.readers.tokstream import TokenStreamReader  # noqa: E402
from zerobatch.writers.tokstream import TokenStreamWriter  # noqa: E402

pytestmark = pytest.mark.slow

#: One rank: wait for the start signal, open the dataset, read its share of two shuffled steps.
RANK = r"""
import json, os, sys, time
import numpy as np
from zerobatch.readers.tokstream import TokenStreamReader
url, opts, cache, go, rank, nproc, out = sys.argv[1:]
rank, nproc = int(rank), int(nproc)
while not os.path.exists(go):
    time.sleep(0.002)
r = TokenStreamReader(url, storage_options=json.loads(opts), cache_dir=cache)
rng = np.random.default_rng(7)
got = []
for step in range(2):
    starts = np.sort(rng.integers(0, r.num_tokens - 200, 32 * nproc))[rank::nproc]
    got.append([starts.tolist(), r.windows(starts, 200).tolist()])
    got.append(r.boundaries(starts[:4], 199)[0].tolist())
json.dump({"steps": got, "requests": r.store.requests}, open(out, "w"))
"""


def build(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    with TokenStreamWriter(folder, vocab_size=50257, shard_tokens=60_000, eod_token=0, checksum_block=4096) as w:
        for _ in range(400):
            w.add_document(rng.integers(1, 50257, int(rng.integers(50, 1500))))
    return folder


@pytest.fixture(scope="module")
def dataset(seaweed_endpoint, tmp_path_factory):
    folder = build(tmp_path_factory.mktemp("host") / "ds")
    bucket = new_bucket(seaweed_endpoint)
    url = f"s3://{bucket}/corpora/ds"
    upload(folder, url, options(seaweed_endpoint))
    return folder, url


def run_host(url: str, endpoint: str, caches: list[Path], tmp: Path, *, launch: str | None) -> list[dict]:
    """One process per cache folder of ``caches``, started at once as a host's ranks start
    (``launch``: their shared ``ZEROBATCH_RUN_ID``); their results."""
    script = tmp / "rank.py"
    script.write_text(RANK)
    go = tmp / "go"
    env = launch_env(**({"ZEROBATCH_RUN_ID": launch} if launch else {}))
    n = len(caches)
    procs = [subprocess.Popen([sys.executable, str(script), url, json.dumps(options(endpoint)), str(cache), str(go),
                               str(k), str(n), str(tmp / f"out{k}.json")], env=env) for k, cache in enumerate(caches)]
    start_together(procs, [go], settle=3.0)     # every process imported and waiting, then all at once
    go.unlink()
    return [json.loads((tmp / f"out{k}.json").read_text()) for k in range(n)]


def duplicates(requests: list[tuple[str, str, str]]) -> dict[str, int]:
    """GETs of a (path, range) asked before, by object name."""
    seen: collections.Counter = collections.Counter()
    dup: collections.Counter = collections.Counter()
    for method, path, rng in requests:
        if method != "GET":
            continue
        key = (path.split("?")[0], rng)
        if seen[key]:
            dup[key[0].rsplit("/", 1)[-1]] += 1
        seen[key] += 1
    return dict(dup)


def test_the_processes_of_a_host_fetch_each_range_once(dataset, seaweed_endpoint, tmp_path):
    folder, url = dataset
    local = TokenStreamReader(folder)
    proxy = FaultProxy(seaweed_endpoint)
    nproc = 4
    # one host: one cache folder, one launch
    shared = run_host(url, proxy.url, [tmp_path / "cache"] * nproc, tmp_path, launch="job-1")
    gets = [r for r in proxy.requests if r[0] == "GET"]
    assert duplicates(gets) == {}, duplicates(gets)
    assert sum(1 for _, p, _ in gets if p.endswith("/manifest.json")) == 1
    for out in shared:
        for starts, windows in out["steps"][::2]:
            assert np.array_equal(np.asarray(windows), local.windows(starts, 200))
    # the same start without sharing (a cache folder each, no launch): every process fetches
    # the manifest and every shard's digests for itself
    n_shared = len(gets)
    proxy.requests.clear()
    alone = run_host(url, proxy.url, [tmp_path / f"own{k}" for k in range(nproc)], tmp_path, launch=None)
    gets = [r for r in proxy.requests if r[0] == "GET"]
    dup = duplicates(gets)
    assert dup.get("manifest.json") == nproc - 1 and dup.get("checksums.bin", 0) >= nproc - 1, dup
    assert len(gets) > n_shared + sum(dup.values()) // 2
    assert [o["steps"] for o in alone] == [o["steps"] for o in shared]


def test_blocks_fetched_by_another_process_between_the_look_and_the_lock_are_not_fetched_again(
        dataset, seaweed_endpoint, tmp_path, monkeypatch):
    # Process A finds a shard's blocks missing for sure (no copy yet), and before it takes their
    # lock, process B fetches them, writes them to the host's copy and lets go. A must look again
    # once it holds the lock, and read B's copy: no second GET of those bytes. (Both readers
    # live in this process here; B runs inside A's look, so the order is fixed.)
    folder, url = dataset
    monkeypatch.setenv("ZEROBATCH_RUN_ID", "toctou")
    proxy = FaultProxy(seaweed_endpoint)
    cache = tmp_path / "cache"
    a = TokenStreamReader(url, storage_options=options(proxy.url), cache_dir=cache)
    b = TokenStreamReader(url, storage_options=options(proxy.url), cache_dir=cache)
    starts = np.array([1000, 5000, 20_000], np.int64)
    shards = a._shards
    look = type(shards)._missing_for_sure
    after_b: list[int] = []

    def look_then_b_fetches(self, k, fname, blocks):
        missing = look(self, k, fname, blocks)
        if self is shards and not after_b:
            b.windows(starts, 200)
            after_b.append(len(proxy.requests))
        return missing

    monkeypatch.setattr(type(shards), "_missing_for_sure", look_then_b_fetches)
    got = a.windows(starts, 200)
    assert after_b, "A never looked for missing blocks"
    assert np.array_equal(got, TokenStreamReader(folder).windows(starts, 200))
    again = [r for r in proxy.requests[after_b[0]:] if r[0] == "GET" and "tokens.bin" in r[1]]
    assert again == [], again
