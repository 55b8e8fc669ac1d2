"""``zerobatch plan`` is exact where it says so: for a job read from SeaweedFS by 4 rank
processes on 2 hosts (a cache folder and a launch each, a counting proxy each), the requests
and bytes each host sent equal the plan's for that host, step by step in total; the
dataset's shards are spread over prefixes and the plan's per-prefix counts add up."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("obstore")

from s3kit import FaultProxy, new_bucket, options, upload  # noqa: E402
from zbtest import launch_env, start_together  # noqa: E402

from zerobatch.adapters.plan import Job, Network, plan  # noqa: E402
from zerobatch.writers.tokstream import TokenStreamWriter  # noqa: E402

pytestmark = pytest.mark.slow

#: One rank: reads its rows of each step when its turn comes (the ranks of a host in rank
#: order, as the plan counts them; the hosts at once).
RANK = r"""
import json, os, sys, time
from zerobatch.readers.tokstream import TokenStreamReader
url, opts, cache, plan_file, rank, per_host, length = sys.argv[1:]
rank, per_host, length = int(rank), int(per_host), int(length)
steps = json.load(open(plan_file))[str(rank)]
folder = os.path.dirname(plan_file)
host, local = divmod(rank, per_host)
r = TokenStreamReader(url, storage_options=json.loads(opts), cache_dir=cache)
for s, starts in enumerate(steps):
    turn = os.path.join(folder, f"turn-{host}-{s}-{local}")
    while not os.path.exists(turn):
        time.sleep(0.002)
    r.windows(starts, length)
    nxt = os.path.join(folder, f"turn-{host}-{s}-{local + 1}" if local + 1 < per_host else f"turn-{host}-{s + 1}-0")
    open(nxt, "w").close()
r.close()
"""


@pytest.fixture(scope="module")
def dataset(seaweed_endpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan") / "ds"
    rng = np.random.default_rng(3)
    # 512-byte blocks: a shard's digests span several pages, so a step's pages of one shard
    # come in one call with gaps between them (merged when at most a page apart)
    with TokenStreamWriter(folder, vocab_size=50257, shard_tokens=100_000, eod_token=0, checksum_block=512,
                           spread=1) as w:
        for _ in range(600):
            w.add_document(rng.integers(1, 50257, int(rng.integers(50, 1500))))
    bucket = new_bucket(seaweed_endpoint)
    url = f"s3://{bucket}/corpora/ds"
    upload(folder, url, options(seaweed_endpoint))
    return folder, url


def test_the_plan_equals_the_requests_and_bytes_each_host_sent(dataset, seaweed_endpoint, tmp_path):
    from zerobatch.adapters._loader import BaseLoader
    from zerobatch.adapters.sources.tokstream import TokenWindows
    folder, url = dataset
    job = Job(seq_len=300, batch_size=4, world_size=4, hosts=2, steps=6, seed=5)
    expected = plan(str(folder), job, Network(latency=0.02))
    assert expected["prefixes"] > 2 and expected["total"]["requests"] > 20
    # every rank's rows, as the loader plans them
    source = TokenWindows(str(folder), job.seq_len)
    rows = {}
    for rank in range(job.world_size):
        sched = BaseLoader(source, job.batch_size, world_size=job.world_size, rank=rank, seed=job.seed,
                           num_threads=0).schedule
        steps = []
        for page in sched.plan(0, 1):
            for items in page.items:
                steps.append((items * job.seq_len).tolist())
                if len(steps) == job.steps:
                    break
            if len(steps) == job.steps:
                break
        rows[str(rank)] = steps
    plan_file = tmp_path / "rows.json"
    plan_file.write_text(json.dumps(rows))
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    proxies = [FaultProxy(seaweed_endpoint) for _ in range(job.hosts)]
    per_host = job.world_size // job.hosts
    procs = []
    for rank in range(job.world_size):
        host = rank // per_host
        env = launch_env(ZEROBATCH_RUN_ID=f"plan-host-{host}")
        procs.append(subprocess.Popen([sys.executable, str(script), url, json.dumps(options(proxies[host].url)),
                                       str(tmp_path / f"cache{host}"), str(plan_file), str(rank), str(per_host),
                                       str(job.seq_len + 1)], env=env))
    # all opened (the manifest: one request per host), then each host's first rank's turn
    start_together(procs, [tmp_path / f"turn-{host}-0-0" for host in range(job.hosts)])
    for host, proxy in enumerate(proxies):
        gets = [r for r in proxy.requests if r[0] == "GET"]
        assert len(proxy.requests) == len(gets)            # nothing but GETs: no listing, no HEAD
        assert len(gets) == expected["per_host"]["requests"][host], (host, len(gets), expected["per_host"])
        assert proxy.bytes_sent == expected["per_host"]["bytes"][host], (host, proxy.bytes_sent)
    assert sum(p["requests"] for p in expected["per_prefix"].values()) == expected["total"]["requests"]
    assert expected["total"]["requests"] == sum(s["requests"] for s in expected["steps"])


def test_the_command_prints_the_plan_as_text_json_and_a_plot(tmp_path):
    """``zerobatch plan`` on a local dataset (only its manifest is read): the JSON's totals add
    up over steps, hosts and prefixes; more hosts fetch more (each its own copy); a spread
    dataset's peak per prefix is lower; bad jobs are one-line errors."""
    from zerobatch.cli.main import main
    rng = np.random.default_rng(2)
    docs = [rng.integers(1, 50257, int(rng.integers(50, 1500))) for _ in range(300)]
    for name, spread in (("one", 0), ("many", 1)):
        with TokenStreamWriter(tmp_path / name, vocab_size=50257, shard_tokens=20_000, spread=spread) as w:
            for d in docs:
                w.add_document(d)
    args = ["--seq-len", "256", "--batch-size", "2", "--world-size", "8", "--steps", "6"]

    def run(*argv: str) -> tuple[int, str, str]:
        import contextlib
        import io
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(argv))
        return rc, out.getvalue(), err.getvalue()

    plans = {}
    for name in ("one", "many"):
        for hosts in ("1", "4"):
            rc, out, _ = run("plan", str(tmp_path / name), *args, "--hosts", hosts, "--json")
            assert rc == 0
            plans[name, hosts] = p = json.loads(out)
            assert p["total"]["requests"] == sum(s["requests"] for s in p["steps"]) == sum(p["per_host"]["requests"])
            assert p["total"]["bytes"] == sum(p["per_host"]["bytes"])
            assert sum(v["requests"] for v in p["per_prefix"].values()) == p["total"]["requests"]
            assert p["first_step"]["requests"] == p["steps"][0]["requests"] >= p["restart"]["warm"]["requests"]
    assert plans["one", "4"]["total"]["bytes"] > plans["one", "1"]["total"]["bytes"]
    assert plans["many", "4"]["prefixes"] > 2 and plans["one", "4"]["prefixes"] == 1
    assert plans["many", "4"]["budget"]["peak_per_prefix"] < plans["one", "4"]["budget"]["peak_per_prefix"]
    # same order, same bytes: spreading renames objects, it does not change what is read
    assert plans["many", "4"]["total"]["delivered_bytes"] == plans["one", "4"]["total"]["delivered_bytes"]
    rc, out, _ = run("plan", str(tmp_path / "one"), *args, "--hosts", "2", "--plot", str(tmp_path / "p.png"))
    assert rc == 0 and "first step:" in out and "per prefix: peak" in out
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, _, err = run("plan", str(tmp_path / "one"), *args, "--hosts", "3")
    assert rc == 1 and "hosts" in err and "\n" == err[-1] and err.count("\n") == 1
    rc, _, err = run("plan", str(tmp_path / "nothing"), *args, "--hosts", "1")
    assert rc == 1 and "manifest.json" in err
