"""The zerobatch command on URLs, against a real S3 API server (moto, 127.0.0.1): convert to
s3://, then inspect, verify, head, stats and bench read it there; other formats are refused
by name."""

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
    r = zb(environ, "convert", str(tmp_path / "tok.npy"), f"{url}.batch", "--to", "llmbatch", "--eod-id", "0")
    assert r.returncode == 1 and "--to tokstream" in r.stderr
    assert "testing" not in r.stderr
