"""A Mixture of two TOKSTREAM datasets read from SeaweedFS (a real object store on 127.0.0.1):
the same steps as the mixture of their local copies, resumed exactly across the two, and read
ahead (Mixture.prepare hints each dataset's reader, so the loop's later steps are fetched while
it is away)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("obstore")
torch = pytest.importorskip("torch")

from s3kit import FaultProxy, new_bucket, options, upload  # noqa: E402

from zerobatch.adapters.torch import Loader, Mixture, TokenWindows  # noqa: E402
from zerobatch.readers.tokstream import TokenStreamReader  # noqa: E402
from zerobatch.writers.tokstream import TokenStreamWriter  # noqa: E402

pytestmark = pytest.mark.slow


def build(folder: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    with TokenStreamWriter(folder, vocab_size=30_000, shard_tokens=20_000, checksum_block=1024) as w:
        for _ in range(120):
            w.add_document(rng.integers(1, 30_000, int(rng.integers(20, 900))))
    return folder


def mixture(a, b) -> Mixture:
    return Mixture([("web", TokenWindows(a, 48), 0.7), ("code", TokenWindows(b, 48), 0.3)], seed=9)


def test_a_remote_mixture_reads_and_resumes_as_the_local_one(seaweed_endpoint, tmp_path):
    local = [build(tmp_path / "web", 1), build(tmp_path / "code", 2)]
    bucket = new_bucket(seaweed_endpoint)
    urls = [f"s3://{bucket}/web", f"s3://{bucket}/code"]
    for folder, url in zip(local, urls, strict=True):
        upload(folder, url, options(seaweed_endpoint))
    proxy = FaultProxy(seaweed_endpoint)

    def remote(cache: str) -> Mixture:
        return mixture(*(TokenStreamReader(u, storage_options=options(proxy.url), cache_dir=tmp_path / cache)
                         for u in urls))
    kw = dict(batch_size=8, num_threads=2, prefetch=4)
    steps = 40
    it = iter(Loader(mixture(*map(str, local)), **kw))
    want = [torch.cat([x, y[:, -1:]], 1) for x, y in (next(it) for _ in range(steps))]

    far = Loader(remote("c1"), **kw)
    it = iter(far)
    got = [torch.cat([x, y[:, -1:]], 1) for x, y in (next(it) for _ in range(3))]
    before = len(proxy.requests)
    time.sleep(1.5)                      # the loop is away: read-ahead fetches the next steps
    ahead = len(proxy.requests) - before
    got += [torch.cat([x, y[:, -1:]], 1) for x, y in (next(it) for _ in range(17))]
    state = far.state_dict()
    it.close()
    assert ahead > 0
    paths = {p.split("?")[0].split("/")[2] for _, p, _ in proxy.requests}
    assert {"web", "code"} <= paths, paths              # both datasets fetched

    # resumed from the remote loader's state: on the local copies, and remotely with a cold cache
    for source in (mixture(*map(str, local)), remote("c2")):
        again = Loader(source, **kw)
        again.load_state_dict(state)
        it = iter(again)
        rest = [torch.cat([x, y[:, -1:]], 1) for x, y in (next(it) for _ in range(steps - 20))]
        it.close()
        for k, (a, b) in enumerate(zip(got + rest, want, strict=True)):
            assert torch.equal(a, b), k
