"""``zerobatch plan``: a pre-flight of a training job's object-storage traffic from its real
schedule (:mod:`zerobatch.adapters.plan`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from zerobatch.formats.errors import ConfigError

__all__ = ["add_plan", "cmd_plan"]

HELP = ("Compute, before a run, what a training job reading DATASET (a TOKSTREAM folder or URL; only its manifest "
        "is read) will ask of its object store: from the exact order every rank reads (token windows of --seq-len, "
        "--batch-size per rank, --world-size ranks on --hosts hosts, --steps steps), the requests and bytes per step, "
        "host and prefix, the peak requests per second per prefix against the store's limit, the cache each host "
        "needs, the first step's requests and expected time, a whole-fleet restart's burst (cold and warm cache) and "
        "the request cost. Requests and bytes are what the readers send (each host fetches a range once; the "
        "loader's read-ahead can only merge requests); times follow the stated model.",
        "zerobatch plan s3://bucket/corpus --seq-len 2048 --batch-size 8 --world-size 1024 --hosts 128 --steps 100 "
        "--latency-ms 20 --bandwidth 12.5e9 --step-time 2")


def add_plan(sub: Any) -> None:
    s = sub.add_parser("plan", help="a job's object-storage requests, bytes and cache, from its exact schedule")
    s.add_argument("dataset", help="a TOKSTREAM dataset (folder or URL)")
    s.add_argument("--seq-len", type=int, required=True, help="tokens per training sequence")
    s.add_argument("--batch-size", type=int, required=True, help="sequences per rank and step")
    s.add_argument("--world-size", type=int, required=True, help="ranks of the job")
    s.add_argument("--hosts", type=int, required=True, help="hosts the ranks run on (one cache folder each)")
    s.add_argument("--steps", type=int, required=True, help="steps to plan")
    s.add_argument("--start", type=int, default=0, help="the first step (a resumed run's; default 0)")
    s.add_argument("--seed", type=int, default=42, help="the loader's seed (default 42)")
    s.add_argument("--no-shuffle", action="store_true", help="the sequential order")
    s.add_argument("--stride", type=int, help="tokens between window starts (default --seq-len)")
    s.add_argument("--latency-ms", type=float, default=20.0, help="milliseconds per request (default 20)")
    s.add_argument("--bandwidth", type=float, help="bytes a second into a host (default: unbounded)")
    s.add_argument("--request-limit", type=float, default=5500.0,
                   help="GET requests a second one prefix serves (default S3's 5,500)")
    s.add_argument("--step-time", type=float, default=1.0, help="seconds a training step takes (default 1)")
    s.add_argument("--fetch-threads", type=int, default=32, help="requests in flight per process (default 32)")
    s.add_argument("--price-per-1k-requests", type=float, default=0.0004,
                   help="USD per 1,000 GET requests (default S3 Standard's, 0.0004)")
    s.add_argument("--json", action="store_true", help="print the whole plan as JSON (every step and host)")
    s.add_argument("--plot", metavar="PNG", help="draw requests and bytes per step into this PNG (needs matplotlib)")
    s.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from zerobatch.adapters.plan import Job, Network, plan

    job = Job(seq_len=args.seq_len, batch_size=args.batch_size, world_size=args.world_size, hosts=args.hosts,
              steps=args.steps, start=args.start, seed=args.seed, shuffle=not args.no_shuffle, stride=args.stride)
    net = Network(latency=args.latency_ms / 1000.0, bandwidth=args.bandwidth, rate=args.request_limit,
                  step_time=args.step_time, fetch_threads=args.fetch_threads, price_per_1k=args.price_per_1k_requests)
    out = plan(args.dataset, job, net)
    if args.plot:
        _plot(out, args.plot)
    if args.json:
        print(json.dumps(out))
    else:
        print(_text(out))
    return 0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"


def _text(out: dict[str, Any]) -> str:
    job, tot, first, budget = out["job"], out["total"], out["first_step"], out["budget"]
    hosts = out["per_host"]
    warm = out["restart"]["warm"]
    lines = [
        f"plan: {out['dataset']}: {out['shards']} shards over {out['prefixes']} prefixes, blocks of {out['block']} B",
        f"job: windows of {job['seq_len']} tokens, {job['batch_size']} per rank, {job['world_size']} ranks on "
        f"{job['hosts']} hosts, steps {job['start']}..{job['start'] + job['steps'] - 1}",
        f"total: {tot['requests']:,} requests, {_size(tot['bytes'])} fetched for {_size(tot['delivered_bytes'])} "
        f"delivered ({tot['fetched_over_delivered']:.2f}x), {tot['requests_per_step']:,.1f} requests a step, "
        f"${tot['cost_usd']:,.4f} in requests",
        f"per host: {min(hosts['requests']):,}-{max(hosts['requests']):,} requests, "
        f"{_size(min(hosts['bytes']))}-{_size(max(hosts['bytes']))}; cache working set up to "
        f"{_size(out['cache']['working_set_per_host_max'])}",
        f"per prefix: peak {budget['peak_per_prefix']:,.0f} requests/s against a limit of "
        f"{budget['limit_per_prefix']:,.0f} ({'within' if budget['within'] else 'OVER: expect 503 SlowDown'}); "
        f"each host's share {budget['per_host_share']:,.1f}/s",
        f"first step: {first['requests']:,} requests ({first['requests_per_host_max']:,} from the busiest host, "
        f"{_size(first['bytes_per_host_max'])}), about {first['expected_seconds']:.2f} s "
        f"(budget wait {first['budget_wait_seconds']:.2f} s)",
        f"restart of the whole fleet: cold {first['requests']:,} requests, about {first['expected_seconds']:.2f} s; "
        f"warm (digests cached) {warm['requests']:,} requests, about {warm['expected_seconds']:.2f} s",
    ]
    return "\n".join(lines)


def _plot(out: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'zerobatch-cli[plot]'", field="plot") from None
    steps = [s["step"] for s in out["steps"]]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(steps, [s["requests"] for s in out["steps"]], label="requests (fleet)")
    ax1.plot(steps, [s["max_prefix_requests_per_s"] for s in out["steps"]], label="busiest prefix, requests/s")
    ax1.axhline(out["budget"]["limit_per_prefix"], color="red", linestyle="--", label="prefix limit")
    ax1.set_ylabel("requests")
    ax1.legend()
    ax2.plot(steps, [s["bytes"] / 2**20 for s in out["steps"]], label="MiB fetched (fleet)")
    ax2.set_ylabel("MiB")
    ax2.set_xlabel("step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
