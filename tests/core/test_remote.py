"""zerobatch.core.remote against a real S3 API server (moto, 127.0.0.1) and, for the faults a
real server does not produce on demand, the fault-injecting proxy in front of it."""

from __future__ import annotations

import os
import pickle
import sys

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from s3kit import FaultProxy, new_bucket, options  # noqa: E402

from zerobatch.core.remote import ObjectStore, RetryPolicy, is_url, local_path, redact  # noqa: E402
from zerobatch.formats.errors import (ConfigError, NotFoundError, ReadError, TruncatedError,  # noqa: E402
                                      ZerobatchError)

FAST = RetryPolicy(attempts=6, base_delay=0.01, max_delay=0.05, deadline=30)


@pytest.fixture(scope="module")
def endpoint(s3_endpoint):
    return s3_endpoint


@pytest.fixture
def proxy(endpoint):
    p = FaultProxy(endpoint)
    yield p
    p.close()


@pytest.fixture
def blob(endpoint):
    """(bucket, payload) with the payload at key ``a/blob.bin``."""
    bucket = new_bucket(endpoint)
    data = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    ObjectStore(f"s3://{bucket}", options(endpoint)).put("a/blob.bin", data)
    return bucket, data


def test_urls_and_paths():
    assert is_url("s3://b/k") and is_url("gs://b") and is_url("az://c/x") and is_url("https://h/p")
    assert is_url("file:///tmp/x") and not is_url("/tmp/x") and not is_url("s3:/b") and not is_url(3)
    assert local_path("file:///tmp/a%20b") == "/tmp/a b" and local_path("/x") == "/x"
    with pytest.raises(ConfigError):
        local_path("file://otherhost/x")
    # user information and query strings (signatures, SAS tokens) never reach a message
    assert redact("https://user:pw@host:9000/p/q?sig=SECRET#f") == "https://host:9000/p/q"
    assert redact("az://container/path?sv=2020&sig=abc") == "az://container/path"
    with pytest.raises(ConfigError):
        ObjectStore("/local/path")


def test_reads_are_exact(endpoint, blob):
    bucket, data = blob
    store = ObjectStore(f"s3://{bucket}/a", options(endpoint))
    assert store.head("blob.bin") == len(data) and store.head("missing") is None
    assert store.get("blob.bin", limit=1 << 20) == data
    starts, stops = [0, 10, 70_000, 299_990], [5, 20_000, 70_001, 300_000]
    parts = store.get_ranges("blob.bin", starts, stops)
    assert [bytes(p) for p in parts] == [data[a:b] for a, b in zip(starts, stops, strict=False)]
    # two ranges less than 64 KiB apart cost one request, far ones one each
    before = store.requests
    store.get_ranges("blob.bin", [0, 100_000], [10, 100_010])
    assert store.requests - before == 2
    with pytest.raises(NotFoundError) as info:
        store.get("nothing.bin", limit=10)
    assert info.value.path == f"s3://{bucket}/a/nothing.bin"
    with pytest.raises(ZerobatchError) as info:
        store.get("blob.bin", limit=100)
    assert "exceeds the limit" in str(info.value)
    # a range past the end of the object: the object is shorter than its dataset says
    with pytest.raises(TruncatedError) as info:
        ObjectStore(f"s3://{bucket}/a", options(endpoint), retry=FAST).get_range("blob.bin", 299_000, 300_100)
    assert info.value.path.endswith("a/blob.bin") and "300100" in info.value.field


def test_writes_list_and_delete(endpoint):
    bucket = new_bucket(endpoint)
    store = ObjectStore(f"s3://{bucket}/p", options(endpoint))
    store.put("x/1.bin", b"one")
    store.put("x/2.bin", memoryview(b"two!"))
    assert sorted(store.list("x/")) == [("x/1.bin", 3), ("x/2.bin", 4)]
    store.delete("x/1.bin")
    store.delete("x/1.bin")            # nothing there: no error
    assert store.list("x/") == [("x/2.bin", 4)]


@pytest.mark.parametrize("kind", ["503", "500", "429", "reset", "short"])
def test_every_fault_heals_by_retry(endpoint, blob, proxy, kind):
    bucket, data = blob
    store = ObjectStore(f"s3://{bucket}/a", options(proxy.url), retry=FAST)
    proxy.add(kind, 2)
    assert bytes(store.get_range("blob.bin", 1000, 9000)) == data[1000:9000]
    assert proxy.injected == {kind: 2}
    proxy.add(kind, 2)
    assert store.get("blob.bin", limit=1 << 20) == data
    assert proxy.injected == {kind: 4}
    # the store counts the attempts made again; the proxy sees each failed one repeated
    assert store.retries == 4 and store.requests == 2
    assert sum(proxy.retries()) == 4


def test_a_timeout_is_retried(endpoint, blob, proxy):
    bucket, data = blob
    store = ObjectStore(f"s3://{bucket}/a", options(proxy.url, client_options={"timeout": "1s"}), retry=FAST)
    proxy.add("delay", 1, seconds=3)
    assert bytes(store.get_range("blob.bin", 0, 100)) == data[:100]
    assert proxy.injected == {"delay": 1} and len(proxy.requests) >= 2


def test_after_the_retry_budget_a_typed_error_names_the_url_and_range(endpoint, blob, proxy):
    bucket, _ = blob
    store = ObjectStore(f"s3://{bucket}/a", options(proxy.url, secret_access_key="SECRET-KEY-VALUE"),
                        retry=RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02))
    proxy.add("503", 3)
    with pytest.raises(ReadError) as info:
        store.get_range("blob.bin", 4096, 8192)
    err = info.value
    assert err.path == f"s3://{bucket}/a/blob.bin" and err.field == "bytes [4096, 8192)"
    assert "3 tries" in err.message
    assert proxy.injected == {"503": 3}
    # no secret in any message or representation
    for text in (str(err), repr(err), repr(store), str(pickle.loads(pickle.dumps(err)))):
        assert "SECRET-KEY-VALUE" not in text


def test_bad_storage_options_are_a_config_error(endpoint):
    with pytest.raises(ConfigError) as info:
        ObjectStore("s3://b", {"no_such_option": "x", "secret_access_key": "SECRET-KEY-VALUE"}).head("k")
    assert "SECRET-KEY-VALUE" not in str(info.value) and info.value.field == "storage_options"


def test_the_environment_gives_credentials_and_endpoint(endpoint, blob, monkeypatch):
    bucket, data = blob
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    assert bytes(ObjectStore(f"s3://{bucket}").get_range("a/blob.bin", 5, 50)) == data[5:50]


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_a_forked_child_is_refused_not_hung_and_a_pickled_store_works(endpoint, blob):
    bucket, data = blob
    store = ObjectStore(f"s3://{bucket}/a", options(endpoint))
    assert bytes(store.get_range("blob.bin", 0, 10)) == data[:10]     # obstore ran in this process
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            try:
                store.get_range("blob.bin", 100, 200)
                os.write(w, b"hung-or-read")
            except ConfigError as exc:
                os.write(w, b"refused" if exc.field == "multiprocessing_context" else b"other")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 64)
    os.waitpid(pid, 0)
    assert got == b"refused"
    # pickled (what a spawned or forkserver worker receives): its own client there
    clone = pickle.loads(pickle.dumps(store))
    assert bytes(clone.get_range("blob.bin", 7, 9)) == data[7:9]
