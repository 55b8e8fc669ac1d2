"""A fleet on one machine: hosts in network namespaces, each running torchrun with 2
processes, joined by a c10d rendezvous across hosts, training on one dataset read from
SeaweedFS (in the bridge namespace) through the counting proxy. 2 hosts train; one is
SIGKILLed mid-epoch with its processes (the job goes down with it); the job resumes on 3
hosts from its checkpoint. Every step's global batch is the uninterrupted run's (none
repeated, none skipped), and the proxy's log, by the address each request came from, shows
each host fetching each object range once (its cache kept across its restart) and the
manifest once per launch."""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import pytest
from zbtest import REPO, ddp_logged_steps, launch_env, token_stream, uninterrupted_order

pytest.importorskip("obstore")

from fleetkit import Fleet, fleet_or_skip  # noqa: E402
from s3kit import FaultProxy, new_bucket, options, start_weed, upload  # noqa: E402


pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SEQ, G, STEPS, SEED, PER_HOST = 16, 12, 80, 99, 2


@pytest.fixture
def fleet():
    why = fleet_or_skip()
    if why:
        pytest.skip(why)
    f = Fleet(2)
    yield f
    f.close()


def launch(fleet: Fleet, hosts: list[int], url: str, env: dict[str, str], tmp: Path, *, port: int,
           extra: tuple[str, ...] = ()) -> list:
    """torchrun on each of ``hosts`` (2 processes each), host ``hosts[0]`` the rendezvous's."""
    procs = []
    for k in hosts:
        host_env = {**env, "ZEROBATCH_CACHE_DIR": str(tmp / f"cache-host{k}"), "GLOO_SOCKET_IFNAME": "eth0"}
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(hosts)}",
                f"--nproc-per-node={PER_HOST}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={fleet.address(hosts[0])}:{port}", "--rdzv-id=fleet", "--max-restarts=0",
                # the store's host says so: in a namespace the machine's hostname is not its address
                f"--rdzv-conf=is_host={int(k == hosts[0])}",
                f"--local-addr={fleet.address(k)}", str(REPO / "examples" / "ddp_train.py"), url, str(tmp / "ckpt"),
                "--steps", str(STEPS), "--seq-len", str(SEQ), "--global-batch", str(G), "--vocab", "12000",
                "--ckpt-every", "10", "--log-every", "10", "--seed", str(SEED), "--ids-log", str(tmp / "logs"),
                "--resume", *extra]
        out = open(tmp / f"host{k}-{port}.log", "w")
        procs.append(fleet.run(k, argv, env=host_env, stdout=out, stderr=subprocess_stdout()))
    return procs


def subprocess_stdout() -> int:
    import subprocess
    return subprocess.STDOUT


def test_hosts_killed_and_resumed_on_more_hosts_read_each_range_once(fleet, tmp_path):
    data, _ = token_stream(tmp_path / "data", n_tokens=12000)
    server, stop = start_weed(fleet.server_address, fleet.wrap(fleet.bridge))
    try:
        proxy = FaultProxy(server, host=fleet.root_address)
        bucket = new_bucket(server)
        url = f"s3://{bucket}/data"
        upload(Path(data), url, options(server))
        env = launch_env()
        env.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                    "AWS_ENDPOINT_URL": proxy.url, "OMP_NUM_THREADS": "1", "NO_PROXY": "*", "no_proxy": "*"})
        # 2 hosts: host 1 is lost mid-epoch (SIGKILL, its processes with it); the job goes down
        # (its first rank kills the host's process group, torchrun and both ranks, after step 35)
        first = launch(fleet, [0, 1], url, env, tmp_path, port=29411,
                       extra=("--die-at", "35", "--die-rank", str(PER_HOST), "--die-host"))
        assert first[1].wait(300) != 0, (tmp_path / "host1-29411.log").read_text()[-3000:]
        time.sleep(1.0)
        fleet.kill(first[0])           # the job goes down with its host (as a scheduler takes it down)
        # what each host fetched but had not yet in its cache when it went down (in flight at
        # the kill): the one thing it may fetch again
        lost = {fleet.address(k): not_held(proxy, fleet.address(k), data, tmp_path / f"cache-host{k}")
                for k in (0, 1)}
        # the job again, on 3 hosts (host 2 new, hosts 0 and 1 with their cache folders)
        fleet.add_host()
        second = launch(fleet, [0, 1, 2], url, env, tmp_path, port=29412)
        for k, p in enumerate(second):
            assert p.wait(600) == 0, (tmp_path / f"host{k}-29412.log").read_text()[-3000:]
    finally:
        stop()
    out = (tmp_path / "host0-29412.log").read_text()
    assert "on 6 process(es)" in out and f"step {STEPS}" in out, out[-3000:]

    # every step's global batch: the uninterrupted run's
    starts, steps = ddp_logged_steps(tmp_path / "logs", STEPS)
    assert starts == [0, 30], starts            # resumed from the checkpoint before the loss
    assert sorted(steps) == list(range(1, STEPS + 1))
    got = [sorted(i for p in steps[s] for i in p) for s in range(1, STEPS + 1)]
    assert got == uninterrupted_order(data, SEQ, G, SEED, STEPS)

    # the proxy's log, by host: each (object, range) once per host, but for what a host had in
    # flight when it was killed (once more); the manifest once per launch. A client's retry of
    # a request that got no whole answer is not a new fetch: those are counted apart.
    by_host: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    retried = collections.Counter()
    for (method, path, rng), client, retry in zip(proxy.requests, proxy.clients, proxy.retries(), strict=True):
        if method == "GET":
            if retry:
                retried[client] += 1
            else:
                by_host[client][(path.split("?")[0], rng)] += 1
    assert set(by_host) == {fleet.address(k) for k in range(3)}, set(by_host)
    for k in range(3):
        host = fleet.address(k)
        seen = by_host[host]
        manifest = sum(n for (p, _), n in seen.items() if p.endswith("/manifest.json"))
        assert manifest == (1 if k == 2 else 2), (k, manifest)       # one per launch it took part in
        again = {key: n for key, n in seen.items()
                 if n > 1 + (key in lost.get(host, set())) and not key[0].endswith("/manifest.json")}
        assert not again, (k, again)
    print("retried requests by host:", dict(retried), "; in flight at the kill, by host:",
          {h: len(v) for h, v in lost.items()})


def not_held(proxy: FaultProxy, host: str, data: Path, cache: Path) -> set[tuple[str, str]]:
    """The ``(path, range)`` GETs of shard files ``host`` sent so far whose bytes its cache
    copy does not hold (a copy holds a range once its bytes equal the object's)."""
    from zerobatch.readers.tokstream import TokenStreamReader
    build = {e.name: e.build_id for e in TokenStreamReader(data).manifest.shards}
    out = set()
    for (method, path, rng), client in zip(list(proxy.requests), list(proxy.clients)):
        parts = path.split("?")[0].rsplit("/", 2)
        if method != "GET" or client != host or not rng or parts[-2] not in build:
            continue
        a, b = (int(x) for x in rng.removeprefix("bytes=").split("-"))
        want = (Path(data) / parts[-2] / parts[-1]).read_bytes()[a:b + 1]
        copy = cache / "tokstream" / build[parts[-2]] / parts[-1]
        try:
            with open(copy, "rb") as f:
                f.seek(a)
                held = f.read(b + 1 - a) == want
        except FileNotFoundError:
            held = False
        if not held:
            out.add((path.split("?")[0], rng))
    return out
