"""A pre-flight plan of a training job's object-storage traffic, from the job's real schedule.

zerobatch's order is a pure function of the seed, the dataset and the batch geometry, so the
requests a job will send are not estimated from an average cost per sample (MosaicML's
simulator) or simulated with random draws: :func:`plan` walks the very items every rank will
read, step by step, and replays what the remote reader does with them on each host:

- a host is the ``world_size / hosts`` consecutive ranks that share one cache folder (the
  processes of one machine): each byte range is fetched once per host
  (:class:`~zerobatch.readers.remote.HostLocks`), by the first rank that needs it;
- a TOKSTREAM shard touched for the first time on a host costs one request of its top-level
  digests with the pages of digests under the blocks read (one range of ``checksums.bin``,
  :mod:`zerobatch.readers._tokstream_remote`), and its blocks come in the same round;
- the blocks a rank reads and its host does not hold are fetched as ranges of whole checksum
  blocks, ranges less than :data:`~zerobatch.core.remote.COALESCE_BYTES` apart in one request
  (obstore's rule, :func:`zerobatch.core.remote._requests`); a page of digests not held yet is
  fetched likewise, but pages alone (no shard opened in the call) are merged only when at most
  a page apart;
- every launch reads the manifest once per host (:func:`~zerobatch.readers.remote.launch_shared`).

So requests and bytes per host and per step are what the reader sends when each rank reads its
steps in order (the proxy counts of ``tests/readers/test_plan.py`` equal them). The loader's
read-ahead fetches several steps of a rank at once: it sends the same bytes in as many requests
or fewer (ranges of neighbouring steps may merge), and the plan is an upper bound on its
requests. Retries add requests the plan cannot know. Only token windows (``TokenWindows``, the
pretraining read) are planned; documents, packed rows and mixtures are not yet.

Timing is a model, stated with its inputs: a request costs ``latency``; a host receives
``bandwidth`` bytes a second; a process keeps ``fetch_threads`` requests in flight; each host
sends at most its share of a prefix's limit (``rate / hosts`` requests a second per prefix, after
a burst of one second of it: :class:`~zerobatch.core.remote.RequestBudget`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from zerobatch.formats.errors import ConfigError

__all__ = ["Job", "Network", "plan"]


@dataclasses.dataclass(frozen=True)
class Job:
    """The training job: ``seq_len`` tokens a window (``next_token``: one more read),
    ``batch_size`` windows per rank and step, ``world_size`` ranks on ``hosts`` hosts, steps
    ``[start, start + steps)`` of the shuffled (``shuffle``, ``seed``) or sequential order."""

    seq_len: int
    batch_size: int
    world_size: int
    hosts: int
    steps: int
    start: int = 0
    seed: int = 42
    shuffle: bool = True
    stride: int | None = None
    next_token: bool = True

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "world_size", "hosts", "steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}", field=name)
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ConfigError(f"start must be a step number >= 0, got {self.start!r}", field="start")
        if self.world_size % self.hosts:
            raise ConfigError(f"hosts: {self.world_size} ranks do not split evenly over {self.hosts} hosts",
                              field="hosts")


@dataclasses.dataclass(frozen=True)
class Network:
    """The store and the links: seconds per request (``latency``), bytes a second into a host
    (``bandwidth``, ``None``: unbounded), requests a second a prefix serves (``rate``: S3's
    published 5,500 GET/s), seconds a training step takes (``step_time``), requests in flight
    per process (``fetch_threads``) and the price of 1,000 GET requests (S3 Standard's in
    us-east-1, USD)."""

    latency: float = 0.02
    bandwidth: float | None = None
    rate: float = 5500.0
    step_time: float = 1.0
    fetch_threads: int = 32
    price_per_1k: float = 0.0004

    def __post_init__(self) -> None:
        for name in ("latency", "rate", "step_time", "price_per_1k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ConfigError(f"{name} must be a number >= 0, got {v!r}", field=name)
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise ConfigError(f"bandwidth must be > 0 bytes a second, got {self.bandwidth!r}", field="bandwidth")


def _merge(starts: np.ndarray, stops: np.ndarray, groups: np.ndarray,
           gaps: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint ranges sorted by ``(group, start)``, each group one call's, merged as obstore
    merges a call's ranges (a gap of at most ``gaps[i]``, the call's, default
    ``COALESCE_BYTES``): ``(group, bytes)`` of each request sent (a merged request's bytes
    include its gaps)."""
    from zerobatch.core.remote import COALESCE_BYTES
    if not starts.size:
        e = np.zeros(0, np.int64)
        return e, e
    gap = COALESCE_BYTES if gaps is None else gaps[1:]
    new = np.ones(starts.size, bool)
    new[1:] = (groups[1:] != groups[:-1]) | (starts[1:] - stops[:-1] > gap)
    first = np.flatnonzero(new)
    return groups[first], np.maximum.reduceat(stops, first) - starts[first]


def _first_of(key: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Indices of the lowest rank's entry of each distinct ``key``, sorted by key."""
    order = np.lexsort((rank, key))
    k = key[order]
    keep = np.ones(k.size, bool)
    keep[1:] = k[1:] != k[:-1]
    return order[keep]


class _Held:
    """What the hosts' cache folders hold: keys of (host, shard) opened, of pages of digests
    and of blocks."""

    def __init__(self) -> None:
        e = np.zeros(0, np.int64)
        self.opened, self.pages, self.blocks = e, e, e

    @staticmethod
    def take(held: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(fresh mask of keys, held with them)`` for sorted distinct ``keys`` (``held``
        sorted: a binary search each, and one merge, not a sort of everything held)."""
        at = np.searchsorted(held, keys)
        found = np.zeros(keys.size, bool)
        inside = at < held.size
        found[inside] = held[at[inside]] == keys[inside]
        fresh = ~found
        return fresh, np.insert(held, at[fresh], keys[fresh])


class _Layout:
    """The dataset's geometry as the remote reader fetches it, and one step's requests."""

    def __init__(self, reader: Any, hosts: int, world_size: int) -> None:
        from zerobatch.core.remote import prefix_of
        from zerobatch.formats import tokstream as T
        m = reader.manifest
        self.block, self.isz, self.cum = m.block, reader.itemsize, reader.cum_tokens
        self.n = len(m.shards)
        self.size = np.array([e.files["tokens.bin"].size for e in m.shards], np.int64)
        sizes = [T.digest_sizes(e.files, m.metadata, m.block, m.top_digests) for e in m.shards]
        self.digest = np.array([d for d, _ in sizes], np.int64)
        self.top = np.array([t for _, t in sizes], np.int64)
        prefixes = [prefix_of(f"{e.name}/tokens.bin") for e in m.shards]
        self.names = sorted(set(prefixes) | {""})          # the manifest lives at the root
        self.prefix = np.array([self.names.index(p) for p in prefixes], np.int64)
        self.maxb = int(max(T.num_chunks(int(x), m.block) for x in self.size)) + 1
        self.maxp = int((int(self.digest.max()) + m.block - 1) // m.block) + 1
        self.hosts, self.world, self.per_host = hosts, world_size, world_size // hosts

    def step(self, a: np.ndarray, b: np.ndarray, held: _Held) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """The requests of one step whose rows (row ``i`` read by rank ``i % world``) are the
        token ranges ``[a, b)``: ``(rank, shard, bytes)`` of each request, and the count of
        shards opened; ``held`` updated."""
        n, block = self.n, self.block
        rank = np.arange(a.size, dtype=np.int64) % self.world
        pr, pk, pa, pb = [], [], [], []
        a, b, r = a.astype(np.int64), b.astype(np.int64), rank
        while a.size:                                  # each window's piece in each shard it crosses
            k = np.searchsorted(self.cum, a, side="right") - 1
            cut = np.minimum(b, self.cum[k + 1])
            pr.append(r)
            pk.append(k)
            pa.append(a - self.cum[k])
            pb.append(cut - self.cum[k])
            more = cut < b
            a, b, r = cut[more], b[more], r[more]
        rk, kk = np.concatenate(pr), np.concatenate(pk)
        b0 = np.concatenate(pa) * self.isz // block
        b1 = (np.concatenate(pb) * self.isz - 1) // block
        cnt = b1 - b0 + 1
        rep = np.repeat(np.arange(cnt.size), cnt)
        blk = b0[rep] + (np.arange(rep.size) - np.repeat(np.cumsum(cnt) - cnt, cnt))
        rk, kk = rk[rep], kk[rep]
        sk = (rk // self.per_host) * n + kk             # (host, shard)
        # each block: fetched by the first rank of its host that needs it, if the host lacks it
        i = _first_of(sk * self.maxb + blk, rk)
        rk, kk, blk, sk = rk[i], kk[i], blk[i], sk[i]
        fresh, held.blocks = held.take(held.blocks, sk * self.maxb + blk)
        # pages of digests under them (tokens.bin's digests come first in checksums.bin)
        pkey = sk * self.maxp + blk * 8 // block
        j = _first_of(pkey, rk)
        pkey, prank = pkey[j], rk[j]
        pfresh, held.pages = held.take(held.pages, pkey)
        pkey, prank = pkey[pfresh], prank[pfresh]
        psk = pkey // self.maxp
        # a shard opened on its host: its top level in the request of its first pages' rank
        o = _first_of(psk, prank)
        osk, orank = psk[o], prank[o]
        ofresh, held.opened = held.take(held.opened, osk)
        osk, orank = osk[ofresh], orank[ofresh]
        dk, dr, db = kk[fresh], rk[fresh], blk[fresh]
        pshard, pno, oshard = psk % n, pkey % self.maxp, osk % n
        st = np.concatenate([db * block, pno * block, self.digest[oshard]])
        sp = np.concatenate([np.minimum((db + 1) * block, self.size[dk]),
                             np.minimum((pno + 1) * block, self.digest[pshard]),
                             self.digest[oshard] + self.top[oshard]])
        # a call per (rank, shard, object): tokens.bin's blocks, checksums.bin's pages and top
        gr = np.concatenate([(dr * n + dk) * 2, (prank * n + pshard) * 2 + 1, (orank * n + oshard) * 2 + 1])
        # the store's gap, but a call of pages alone (no shard opened) merges pages at most a
        # page apart (RemoteShard._fetch_claimed_pages)
        from zerobatch.core.remote import COALESCE_BYTES
        gaps = np.full(gr.size, COALESCE_BYTES, np.int64)
        pages_alone = np.zeros(gr.size, bool)
        pages_alone[db.size:db.size + pno.size] = True
        pages_alone &= ~np.isin(gr, (orank * n + oshard) * 2 + 1)
        gaps[pages_alone] = block
        order = np.lexsort((st, gr))
        g, nbytes = _merge(st[order], sp[order], gr[order], gaps[order])
        g //= 2
        return g // n, g % n, nbytes, int(osk.size)


def plan(dataset: Any, job: Job, network: Network | None = None, *,
         storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The requests, bytes and cache of ``job`` reading ``dataset`` (a TOKSTREAM folder or
    URL: its manifest is all that is read), per step, host and prefix, with the first step's
    and a restart's burst and the cost (see the module documentation).

    Raises:
        ConfigError: a job the dataset cannot serve (no window of ``seq_len``), bad numbers.
    """
    from zerobatch.adapters._loader import BaseLoader
    from zerobatch.adapters.sources.tokstream import TokenWindows
    from zerobatch.readers.tokstream import TokenStreamReader

    network = network or Network()
    kw = {} if storage_options is None else {"storage_options": storage_options}
    reader = dataset if isinstance(dataset, TokenStreamReader) else TokenStreamReader(dataset, **kw)
    try:
        if not len(reader.manifest.shards):
            raise ConfigError("the dataset holds no shards: nothing to plan", path=reader.folder, field="shards")
        source = TokenWindows(reader, job.seq_len, next_token=job.next_token, stride=job.stride, verify=False)
        loader = BaseLoader(source, job.batch_size, world_size=job.world_size, rank=0, seed=job.seed,
                            shuffle=job.shuffle, num_threads=0)
        return _plan(reader, source, loader.schedule, job, network)
    finally:
        if not isinstance(dataset, TokenStreamReader):
            reader.close()


def _plan(reader: Any, source: Any, sched: Any, job: Job, network: Network) -> dict[str, Any]:
    lay = _Layout(reader, job.hosts, job.world_size)
    H, W, P = job.hosts, job.world_size, len(lay.names)
    spe = sched.steps_per_epoch
    manifest_bytes = _manifest_size(reader)
    root = lay.names.index("")

    def rows(s: int) -> tuple[np.ndarray, np.ndarray]:
        epoch, within = (0, s) if spe is None else divmod(s, spe)
        sched.set_epoch(epoch)
        _, a, b = source.token_spans(sched.global_items([within])[0])
        return a, b

    def tally(req_rank: np.ndarray, req_shard: np.ndarray, req_bytes: np.ndarray, launch: bool
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        host = req_rank // lay.per_host
        hr = np.bincount(host, minlength=H).astype(np.int64)
        hb = np.bincount(host, weights=req_bytes, minlength=H).astype(np.int64)
        pr = np.bincount(lay.prefix[req_shard], minlength=P).astype(np.int64)
        rr = np.bincount(req_rank, minlength=W).astype(np.int64)
        if launch:                                # the launch reads the manifest once per host
            hr += 1
            hb += manifest_bytes
            pr[root] += H
        return hr, hb, pr, rr

    held = _Held()
    host_req, host_bytes = np.zeros(H, np.int64), np.zeros(H, np.int64)
    prefix_req, prefix_peak = np.zeros(P, np.int64), np.zeros(P)
    steps: list[dict[str, Any]] = []
    first: dict[str, Any] = {}
    for s in range(job.start, job.start + job.steps):
        a, b = rows(s)
        rank, shard, nbytes, opened = lay.step(a, b, held)
        hr, hb, pr, rr = tally(rank, shard, nbytes, s == job.start)
        host_req += hr
        host_bytes += hb
        prefix_req += pr
        rate = pr / network.step_time
        prefix_peak = np.maximum(prefix_peak, rate)
        steps.append({"step": s, "requests": int(hr.sum()), "bytes": int(hb.sum()),
                      "max_host_requests": int(hr.max()), "max_host_bytes": int(hb.max()),
                      "max_prefix_requests_per_s": float(rate.max()), "shards_opened": opened})
        if s == job.start:
            first = _first_step(hr, hb, rr, pr, lay, network)
    # a restart of the whole fleet at the first step with the cache folders kept: the shards
    # the run opened keep their digests (the blocks of other steps are not counted as held:
    # with a shuffled order they are seldom the restart's; an upper bound)
    warm = _Held()
    warm.opened, warm.pages = held.opened, held.pages
    a, b = rows(job.start)
    rank, shard, nbytes, _ = lay.step(a, b, warm)
    hr, hb, pr, rr = tally(rank, shard, nbytes, True)
    warm_first = _first_step(hr, hb, rr, pr, lay, network)
    blocks = np.bincount(held.blocks // lay.maxb // lay.n, minlength=H) * lay.block
    pages = np.bincount(held.pages // lay.maxp // lay.n, minlength=H) * lay.block
    working = blocks + pages
    total_req, total_bytes = int(host_req.sum()), int(host_bytes.sum())
    delivered = job.steps * W * job.batch_size * source.length * lay.isz
    return {
        "dataset": reader.folder, "shards": lay.n, "block": lay.block, "prefixes": P,
        "job": dataclasses.asdict(job), "network": dataclasses.asdict(network),
        "total": {"requests": total_req, "bytes": total_bytes, "delivered_bytes": int(delivered),
                  "fetched_over_delivered": total_bytes / max(1, delivered),
                  "requests_per_step": total_req / job.steps, "cost_usd": total_req / 1000 * network.price_per_1k},
        "per_host": {"requests": host_req.tolist(), "bytes": host_bytes.tolist()},
        "per_prefix": {(p or "(root)"): {"requests": int(prefix_req[i]), "peak_per_second": float(prefix_peak[i])}
                       for i, p in enumerate(lay.names)},
        "budget": {"limit_per_prefix": network.rate, "per_host_share": network.rate / H,
                   "peak_per_prefix": float(prefix_peak.max()), "within": bool(prefix_peak.max() <= network.rate)},
        "cache": {"working_set_per_host_max": int(working.max()), "working_set_per_host_mean": float(working.mean())},
        "first_step": first,
        "restart": {"cold": first, "warm": warm_first},
        "steps": steps,
    }


def _manifest_size(reader: Any) -> int:
    """The bytes of the dataset's manifest (one request per host and launch)."""
    import os

    from zerobatch.formats import tokstream as T
    store = getattr(reader, "_store", None)
    if store is None:
        return os.path.getsize(os.path.join(reader.folder, T.MANIFEST_NAME))
    return int(store.head(T.MANIFEST_NAME) or 0)


def _first_step(hr: np.ndarray, hb: np.ndarray, rr: np.ndarray, pr: np.ndarray, lay: _Layout,
                net: Network) -> dict[str, Any]:
    """The first step of a launch: what it sends and how long its fetch takes (the model of
    the module documentation): the manifest's round trip, then the rounds of requests each
    process keeps ``fetch_threads`` of in flight, the host's bytes over its link, and the wait
    for the host's share of the busiest prefix's budget beyond its burst of one second."""
    H = lay.hosts
    rounds = np.ceil(rr.reshape(H, lay.per_host) / max(1, net.fetch_threads)).max(axis=1)
    link = hb / net.bandwidth if net.bandwidth else np.zeros(H)
    wait = 0.0
    if net.rate:
        share = net.rate / H
        wait = max(0.0, pr.max() / H - share) / share
    t = net.latency * (1 + rounds) + link + wait
    return {"requests": int(hr.sum()), "requests_per_host_max": int(hr.max()), "bytes_per_host_max": int(hb.max()),
            "requests_per_rank_max": int(rr.max()), "fleet_requests_per_prefix_max": int(pr.max()),
            "budget_wait_seconds": float(wait), "expected_seconds": float(t.max())}
