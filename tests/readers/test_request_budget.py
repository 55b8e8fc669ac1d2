"""Request budgets per prefix (core.remote.RequestBudget): shared by the processes of a host,
never exceeded, emptied by throttling; shards spread over prefixes by the writer, found by
the reader from the manifest and counted against their own prefix."""

from __future__ import annotations

import bisect
import multiprocessing as mp
import time

import numpy as np
import pytest

from zerobatch.core.remote import RequestBudget, RequestBudgets, default_request_rate, hosts_of_job, prefix_of
from zerobatch.formats.errors import ConfigError
from zerobatch.readers.tokstream import TokenStreamReader
from zerobatch.writers.tokstream import TokenStreamWriter, spread_tag


def _take(path: str, n: int, q: mp.Queue) -> None:
    b = RequestBudget(path, 40.0, 10.0)
    out = []
    for _ in range(n):
        b.take()
        out.append(time.monotonic())
    q.put(out)


def test_processes_sharing_a_budget_stay_under_its_rate_together(tmp_path):
    """3 processes, 30 requests each, one bucket of 40/s (burst 10): no second holds more
    than rate + burst of them, and the 90 take at least (90 - burst) / rate seconds; with a
    bucket each they would take a third of that."""
    path = str(tmp_path / "budget" / "state")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_take, args=(path, 30, q)) for _ in range(3)]
    for p in procs:
        p.start()
    stamps = sorted(t for _ in procs for t in q.get(timeout=60))
    for p in procs:
        p.join(30)
    assert len(stamps) == 90
    # sleeps only ever lengthen the span: these bounds cannot fail on a slow machine
    assert stamps[-1] - stamps[0] >= (90 - 10 - 1) / 40
    assert max(bisect.bisect_left(stamps, t + 1.0) - i for i, t in enumerate(stamps)) <= 40 + 10


def test_throttling_empties_the_bucket_and_bad_rates_are_refused(tmp_path, monkeypatch):
    b = RequestBudget(str(tmp_path / "s"), 100.0, 5.0)
    assert b.take() == 0.0
    b.penalize()                       # a 503: the host waits a burst's worth
    assert b.take() >= (5 + 1) / 100 * 0.9
    with pytest.raises(ConfigError):
        RequestBudget(None, 0)
    monkeypatch.setenv("ZEROBATCH_REQUEST_RATE", "fast")
    with pytest.raises(ConfigError) as e:
        default_request_rate()
    assert e.value.field == "ZEROBATCH_REQUEST_RATE"
    monkeypatch.setenv("ZEROBATCH_REQUEST_RATE", "0")
    assert default_request_rate() is None
    monkeypatch.delenv("ZEROBATCH_REQUEST_RATE")
    monkeypatch.setenv("WORLD_SIZE", "64")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert hosts_of_job() == 8 and default_request_rate() == 5500 / 8


def test_spread_shards_read_alike_and_count_against_their_prefixes(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 1000, int(rng.integers(10, 400))) for _ in range(200)]
    for name, spread in (("plain", 0), ("spread", 2)):
        with TokenStreamWriter(tmp_path / name, vocab_size=1000, shard_tokens=4000, spread=spread) as w:
            for d in docs:
                w.add_document(d)
    plain, spread = TokenStreamReader(tmp_path / "plain"), TokenStreamReader(tmp_path / "spread")
    names = [e.name for e in spread.manifest.shards]
    assert all(n == f"{spread_tag(n[3:], 2)}_shard-{k:05d}" for k, n in enumerate(names))
    assert [prefix_of(f"{n}/tokens.bin") for n in names] == [n[:2] for n in names]
    assert len({n[:2] for n in names}) > 3 and prefix_of("shard-00001/tokens.bin") == ""
    starts = np.arange(0, plain.num_tokens - 50, 37)
    assert np.array_equal(plain.windows(starts, 50), spread.windows(starts, 50))
    budgets = RequestBudgets(str(tmp_path / "cache"), "s3://b/ds", 10.0)
    assert budgets.bucket(f"{names[0]}/tokens.bin") is budgets.bucket(f"{names[0]}/checksums.bin")
    assert budgets.bucket(f"{names[0]}/tokens.bin").path != budgets.bucket("manifest.json").path
    with pytest.raises(ConfigError):
        TokenStreamWriter(tmp_path / "bad", vocab_size=10, spread=5)


def test_a_reader_keeps_to_its_budget_and_backs_off_on_slowdown(seaweed_endpoint, tmp_path, monkeypatch):
    """On SeaweedFS behind the proxy: a reader limited to 10 requests a second sends no more
    than rate + burst in any second, and a 503 SlowDown makes it wait (the whole budget backs
    off) before it retries; its windows equal the local copy's."""
    pytest.importorskip("obstore")
    from s3kit import FaultProxy, new_bucket, options, upload
    rng = np.random.default_rng(1)
    with TokenStreamWriter(tmp_path / "ds", vocab_size=50257, shard_tokens=20_000, checksum_block=1024) as w:
        for _ in range(400):
            w.add_document(rng.integers(1, 50257, int(rng.integers(100, 900))))
    bucket = new_bucket(seaweed_endpoint)
    upload(tmp_path / "ds", f"s3://{bucket}/ds", options(seaweed_endpoint))
    proxy = FaultProxy(seaweed_endpoint)
    monkeypatch.setenv("ZEROBATCH_REQUEST_RATE", "10")
    local = TokenStreamReader(tmp_path / "ds")
    with TokenStreamReader(f"s3://{bucket}/ds", storage_options=options(proxy.url), cache_dir=tmp_path / "c") as r:
        assert r.store.budgets is not None and r.store.budgets.rate == 10
        for start in np.sort(rng.choice(r.num_tokens - 300, 36, replace=False)).tolist():
            assert np.array_equal(r.windows([start], 300), local.windows([start], 300))   # a request or more each
        stamps = sorted(proxy.times)
        assert len(stamps) > 30
        # sleeps only ever lengthen the span: these bounds cannot fail on a slow machine
        assert max(bisect.bisect_left(stamps, t + 1.0) - i for i, t in enumerate(stamps)) <= 10 + 10
        assert stamps[-1] - stamps[0] >= (len(stamps) - 10 - 1) / 10
        waited = r.store.budgets.waited
        proxy.add("503", 1)
        t0 = time.monotonic()
        r.windows([int(r.num_tokens) - 301], 300)       # a block not held: a request, refused once
        assert proxy.injected == {"503": 1}
        assert r.store.budgets.waited > waited and time.monotonic() - t0 >= 10 / 10 * 0.9
