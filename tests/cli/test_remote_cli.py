"""The zerobatch command on URLs, against a real S3 API server (moto, 127.0.0.1): convert to
s3:// (TOKSTREAM, LLMBATCH, LLMCHNK), then inspect, verify, head, stats and bench read every
format there but ZRECORD, which is refused by name."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from s3kit import new_bucket  # noqa: E402


@pytest.fixture(scope="module")
def env(tmp_path_factory, s3_endpoint):
    endpoint = s3_endpoint
    return {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
            "ZEROBATCH_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}, endpoint


def zb(env, *args):
    return subprocess.run([sys.executable, "-m", "zerobatch.cli", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_convert_to_a_url_then_every_reading_command(env, tmp_path):
    environ, endpoint = env
    tokens = np.random.default_rng(0).integers(1, 1000, 40_000).astype(np.uint16)
    tokens[::101] = 0
    np.save(tmp_path / "tok.npy", tokens)
    url = f"s3://{new_bucket(endpoint)}/corpus"
    r = zb(environ, "convert", str(tmp_path / "tok.npy"), url, "--to", "tokstream", "--eod-id", "0", "--quiet")
    assert r.returncode == 0 and url in r.stdout, r.stderr
    r = zb(environ, "convert", str(tmp_path / "tok.npy"), url, "--to", "tokstream", "--eod-id", "0", "--quiet")
    assert r.returncode == 1 and "--overwrite" in r.stderr
    r = zb(environ, "inspect", url)
    assert r.returncode == 0 and "TOKSTREAM v2" in r.stdout and "40000" in r.stdout and "1 KiB block" in r.stdout
    r = zb(environ, "verify", url)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    r = zb(environ, "head", url, "-n", "2")
    assert r.returncode == 0 and "document 1" in r.stdout
    r = zb(environ, "stats", url)
    assert r.returncode == 0 and "tokens: 40,000" in r.stdout, r.stdout + r.stderr
    r = zb(environ, "bench", url, "--trials", "2", "--reads", "5", "--seq-len", "64", "--batch-size", "4")
    assert r.returncode == 0, r.stderr
    # nothing there; another format at a URL; no secret in any message
    r = zb(environ, "inspect", url + "-missing")
    assert r.returncode == 1 and "no dataset at this URL" in r.stderr
    r = zb(environ, "convert", str(tmp_path / "tok.npy"), f"{url}.bin", "--to", "megatron", "--eod-id", "0")
    assert r.returncode == 1 and "--to tokstream or zrecord or llmbatch or llmchnk" in r.stderr
    assert "testing" not in r.stderr
    # a ZRECORD store goes up write-once (commit.zr last) and every reading command takes it
    r = zb(environ, "convert", str(tmp_path / "tok.npy"), f"{url}.zr", "--to", "zrecord", "--eod-id", "0", "--quiet")
    assert r.returncode == 0 and f"{url}.zr" in r.stdout, r.stdout + r.stderr
    r = zb(environ, "convert", str(tmp_path / "tok.npy"), f"{url}.zr", "--to", "zrecord", "--eod-id", "0", "--quiet")
    assert r.returncode == 1 and "write-once" in r.stderr
    for cmd in (["inspect"], ["verify"], ["head", "-n", "2"], ["stats"]):
        r = zb(environ, cmd[0], f"{url}.zr", *cmd[1:])
        assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: 398 records" in zb(environ, "verify", f"{url}.zr").stdout   # 397 EOD tokens
    # single-file formats go up as one object each, and read back from there
    for to, suffix in (("llmbatch", "batch"), ("llmchnk", "chunk")):
        dst = f"{url}.{suffix}"
        r = zb(environ, "convert", str(tmp_path / "tok.npy"), dst, "--to", to, "--eod-id", "0", "--quiet",
               *(["--seq-len", "64", "--batch-size", "4"] if to == "llmbatch" else []))
        assert r.returncode == 0 and dst in r.stdout, r.stdout + r.stderr
        r = zb(environ, "convert", str(tmp_path / "tok.npy"), dst, "--to", to, "--eod-id", "0", "--quiet",
               *(["--seq-len", "64", "--batch-size", "4"] if to == "llmbatch" else []))
        assert r.returncode == 1 and "--overwrite" in r.stderr
        r = zb(environ, "verify", dst)
        assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_every_reading_command_on_llmbatch_llmchnk_and_features_at_urls(env, tmp_path):
    from s3kit import options, upload

    from zerobatch.writers.features import write_feature_matrix
    from zerobatch.writers.llmbatch import write_batch_file
    from zerobatch.writers.llmchnk import write_chunk_file
    environ, endpoint = env
    rng = np.random.default_rng(1)
    root = tmp_path / "up"
    root.mkdir()
    write_batch_file(root / "t.batch", rng.integers(0, 50000, (64, 32), dtype=np.uint32), 8, 32, seed=0)
    write_chunk_file(root / "t.chunk", [rng.integers(0, 50000, int(n)).astype(np.uint32)
                                        for n in rng.integers(1, 100, 50)], seq_len=64)
    write_feature_matrix(root / "feat", {"a": rng.normal(0, 1, (300, 4)), "b": rng.normal(0, 1, (200, 4))})
    url = f"s3://{new_bucket(endpoint)}/files"
    upload(root, url, options(endpoint))
    for name, kind in (("t.batch", "LLMBATCH"), ("t.chunk", "LLMCHNK"), ("feat", "feature")):
        r = zb(environ, "inspect", f"{url}/{name}")
        assert r.returncode == 0 and kind.lower() in r.stdout.lower(), r.stdout + r.stderr
        r = zb(environ, "verify", f"{url}/{name}")
        assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    r = zb(environ, "head", f"{url}/t.chunk", "-n", "2")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    r = zb(environ, "stats", f"{url}/t.batch")
    assert r.returncode == 0 and "2,048" in r.stdout, r.stdout + r.stderr
    r = zb(environ, "bench", f"{url}/t.batch", "--trials", "2", "--reads", "3")
    assert r.returncode == 0, r.stderr
