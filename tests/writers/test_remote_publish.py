"""Publishing TOKSTREAM datasets to a real S3 API server (moto, 127.0.0.1): a reader sees the
old dataset or the new one whatever upload is cut, a rerun succeeds and leaves no garbage, and
``zerobatch convert ... s3://...`` killed at random points leaves the old dataset or nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from s3kit import new_bucket, options  # noqa: E402

from zerobatch.core.remote import ObjectStore  # noqa: E402
from zerobatch.formats.errors import ConfigError, NotFoundError, WriteError  # noqa: E402
from zerobatch.readers.tokstream import TokenStreamReader  # noqa: E402
from zerobatch.writers.remote import publish_tokstream, unique_shard_prefix  # noqa: E402
from zerobatch.writers.tokstream import TokenStreamWriter  # noqa: E402


@pytest.fixture(scope="module")
def endpoint(s3_endpoint):
    return s3_endpoint


def build(folder, seed):
    rng = np.random.default_rng(seed)
    with TokenStreamWriter(folder, vocab_size=500, shard_tokens=3000, prefix=unique_shard_prefix()) as w:
        for _ in range(60):
            w.add_document(rng.integers(0, 500, int(rng.integers(1, 200))))
    return folder


def everything(url, opts, cache):
    with TokenStreamReader(url, storage_options=opts, cache_dir=cache) as r:
        return r.manifest.build_id, r.windows([0], r.num_tokens)[0].tolist()


def local_everything(folder):
    with TokenStreamReader(folder) as r:
        return r.manifest.build_id, r.windows([0], r.num_tokens)[0].tolist()


def test_an_upload_cut_anywhere_leaves_the_old_dataset_and_a_rerun_succeeds(endpoint, tmp_path, monkeypatch):
    opts = options(endpoint)
    old, new = build(tmp_path / "old", 1), build(tmp_path / "new", 2)
    want_old, want_new = local_everything(old), local_everything(new)
    url = f"s3://{new_bucket(endpoint)}/ds"
    publish_tokstream(old, url, storage_options=opts)
    assert everything(url, opts, tmp_path / "c0") == want_old
    with pytest.raises(ConfigError):
        publish_tokstream(new, url, storage_options=opts)          # no overwrite: refused, nothing sent
    real_put = ObjectStore.put
    puts = []
    monkeypatch.setattr(ObjectStore, "put", lambda self, key, data: (puts.append(key), real_put(self, key, data)))
    publish_tokstream(new, f"s3://{new_bucket(endpoint)}/count", storage_options=opts)
    total = len(puts)
    assert puts[-1] == "manifest.json" and total > 5
    for cut in sorted({0, 1, total // 3, total // 2, total - 2, total - 1}):
        calls = [0]

        def failing(self, key, data, cut=cut, calls=calls):
            if calls[0] == cut:
                raise WriteError("cut", path=key)
            calls[0] += 1
            return real_put(self, key, data)
        monkeypatch.setattr(ObjectStore, "put", failing)
        with pytest.raises(WriteError):
            publish_tokstream(new, url, storage_options=opts, overwrite=True)
        assert everything(url, opts, tmp_path / f"c{cut}") == want_old, cut
    monkeypatch.setattr(ObjectStore, "put", real_put)
    publish_tokstream(new, url, storage_options=opts, overwrite=True)
    assert everything(url, opts, tmp_path / "cn") == want_new
    names = {k.split("/")[0] for k, _ in ObjectStore(url, opts).list("")}
    with TokenStreamReader(new) as r:
        assert names == {s.name for s in r.manifest.shards} | {"manifest.json"}


def test_a_first_upload_cut_leaves_nothing_a_reader_takes_for_a_dataset(endpoint, tmp_path, monkeypatch):
    opts = options(endpoint)
    new = build(tmp_path / "new", 3)
    url = f"s3://{new_bucket(endpoint)}/ds"
    real_put = ObjectStore.put
    calls = [0]

    def failing(self, key, data):
        if calls[0] == 5:
            raise WriteError("cut", path=key)
        calls[0] += 1
        return real_put(self, key, data)
    monkeypatch.setattr(ObjectStore, "put", failing)
    with pytest.raises(WriteError):
        publish_tokstream(new, url, storage_options=opts)
    with pytest.raises(NotFoundError):
        TokenStreamReader(url, storage_options=opts, cache_dir=tmp_path / "c")
    monkeypatch.setattr(ObjectStore, "put", real_put)
    publish_tokstream(new, url, storage_options=opts)
    assert everything(url, opts, tmp_path / "c2") == local_everything(new)


@pytest.mark.slow
def test_convert_to_s3_killed_at_random_points(endpoint, tmp_path):
    opts = options(endpoint)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 800, 300_000).astype(np.uint16)
    tokens[::151] = 0
    np.save(tmp_path / "tok.npy", tokens)
    url = f"s3://{new_bucket(endpoint)}/ds"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    cmd = [sys.executable, "-m", "zerobatch.cli", "convert", str(tmp_path / "tok.npy"), url, "--to", "tokstream",
           "--eod-id", "0", "--shard-tokens", "5000", "--quiet", "--overwrite"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    want = everything(url, opts, tmp_path / "c")
    assert want[1] == tokens.tolist()
    for k, delay in enumerate(rng.uniform(0.3, 2.5, 4).tolist()):
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        got = everything(url, opts, tmp_path / f"c{k}")
        assert got[1] == tokens.tolist()          # the old dataset, or the new one (same tokens, new build)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    final = everything(url, opts, tmp_path / "cf")
    assert final[1] == tokens.tolist()
    with TokenStreamReader(url, storage_options=opts, cache_dir=tmp_path / "cg") as r:
        names = {s.name for s in r.manifest.shards}
    assert {k.split("/")[0] for k, _ in ObjectStore(url, opts).list("")} == names | {"manifest.json"}
