"""loader.metrics() against counts measured independently: requests and bytes at the test
server's proxy, for a dataset read from SeaweedFS; and the Prometheus endpoint that publishes
them, scraped over loopback."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from zbtest import token_stream

torch = pytest.importorskip("torch")
pytest.importorskip("obstore")

from s3kit import FaultProxy, new_bucket, options, upload  # noqa: E402

from zerobatch.adapters.metrics import format_metrics  # noqa: E402
from zerobatch.adapters.torch import Loader, TokenWindows  # noqa: E402
from zerobatch.readers.tokstream import TokenStreamReader  # noqa: E402


def test_storage_metrics_equal_the_servers_counts(seaweed_endpoint, tmp_path):
    folder, _ = token_stream(tmp_path / "ds", n_tokens=40_000)
    bucket = new_bucket(seaweed_endpoint)
    url = f"s3://{bucket}/ds"
    upload(Path(folder), url, options(seaweed_endpoint))
    proxy = FaultProxy(seaweed_endpoint)
    proxy.add("503", 2)                    # two throttled answers: retried, and counted as such
    source = TokenWindows(TokenStreamReader(url, storage_options=options(proxy.url), cache_dir=tmp_path / "cache"), 64)
    loader = Loader(source, batch_size=8, seed=2, num_threads=2)
    it = iter(loader)
    for _ in range(25):
        next(it)
    it.close()                             # read-ahead stopped: nothing in flight
    m = loader.metrics()
    gets = [r for r in proxy.requests if r[0] == "GET"]
    assert proxy.injected == {"503": 2} and m["retries"] == 2
    assert m["requests"] + m["retries"] == len(gets) > 2
    assert m["bytes_transferred"] == proxy.bytes_sent >= m["bytes_fetched"]
    assert m["checked_bytes"] >= m["bytes_fetched"] - 4096      # every fetched block was hashed
    assert m["steps"] == 25 and m["items"] == 200
    line = format_metrics(m)
    assert f"store {int(m['requests'])} requests, 2 retries" in line
    # a second pass over the same steps is served by the cache: hits, no new requests
    n = len(proxy.requests)
    again = Loader(TokenWindows(TokenStreamReader(url, storage_options=options(proxy.url),
                                                  cache_dir=tmp_path / "cache"), 64), batch_size=8, seed=2, num_threads=0)
    it = iter(again)
    for _ in range(5):
        next(it)
    m2 = again.metrics()
    assert m2["cache_hit_bytes"] > 0
    assert m2["requests"] == len(proxy.requests) - n == 1       # its manifest only


def test_prometheus_endpoint_publishes_the_metrics(tmp_path):
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry

    from zerobatch.adapters.metrics import serve_prometheus
    folder, _ = token_stream(tmp_path / "ds", n_tokens=20_000)
    loader = Loader(TokenWindows(folder, 32), batch_size=4, seed=1, num_threads=2)
    it = iter(loader)
    for _ in range(12):
        next(it)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve_prometheus(loader, port, addr="127.0.0.1", registry=CollectorRegistry())
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'zerobatch_loader_steps_total{rank="0"} 12.0' in text
    assert 'zerobatch_loader_items_total{rank="0"} 48.0' in text
    assert "# TYPE zerobatch_loader_wait_seconds_p99 gauge" in text
    it.close()
