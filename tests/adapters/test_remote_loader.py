"""The torch Loader over a TOKSTREAM dataset on a real S3 API server (moto, 127.0.0.1): the
same batches as over the local copy, the same state (one build id), resume across the two, and
DataLoader worker processes (forkserver, what ``loader.dataloader()`` picks for URLs)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")
torch = pytest.importorskip("torch")

from s3kit import new_bucket, options, upload  # noqa: E402

from zerobatch.adapters.torch import Loader, TokenDocuments, TokenWindows  # noqa: E402
from zerobatch.readers.tokstream import TokenStreamReader  # noqa: E402
from zerobatch.writers.tokstream import TokenStreamWriter  # noqa: E402

SEQ = 64


@pytest.fixture(scope="module")
def remote(tmp_path_factory, s3_endpoint):
    endpoint = s3_endpoint
    tmp = tmp_path_factory.mktemp("rl")
    rng = np.random.default_rng(5)
    with TokenStreamWriter(tmp / "ds", vocab_size=1000, shard_tokens=4000, eod_token=0) as w:
        for _ in range(150):
            w.add_document(rng.integers(1, 1000, int(rng.integers(5, 300))))
    url = f"s3://{new_bucket(endpoint)}/ds"
    upload(tmp / "ds", url, options(endpoint))
    return tmp / "ds", url, options(endpoint), tmp / "cache"


def reader(url, opts, cache):
    return TokenStreamReader(url, storage_options=opts, cache_dir=cache)


def ids(batch):
    x, y = batch
    return x[:, 0].tolist()


def test_the_same_batches_state_and_resume_as_the_local_copy(remote):
    folder, url, opts, cache = remote
    local = Loader(TokenWindows(folder, SEQ), batch_size=8, seed=4, num_threads=2)
    far = Loader(TokenWindows(reader(url, opts, cache), SEQ), batch_size=8, seed=4, num_threads=2)
    want = [b for b in local]
    got = [b for b in far]
    assert len(got) == len(want) > 10
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want, strict=False))
    # a state saved on the local copy resumes on the remote one, and the other way round
    it = iter(local)
    head = [next(it) for _ in range(5)]
    state = local.state_dict()
    far2 = Loader(TokenWindows(reader(url, opts, cache), SEQ), batch_size=8, seed=4)
    far2.load_state_dict(state)
    rest = list(far2)
    assert [ids(b) for b in head + rest] == [ids(b) for b in want]
    # one state for both copies (the build id, not the location, names the data)
    far3 = Loader(TokenWindows(reader(url, opts, cache), SEQ), batch_size=8, seed=4)
    far3.load_state_dict(state)
    assert far3.state_dict() == state


def test_documents_from_the_store(remote):
    folder, url, opts, cache = remote
    a = list(Loader(TokenDocuments(folder, 80), batch_size=4, seed=1))
    b = list(Loader(TokenDocuments(reader(url, opts, cache), 80), batch_size=4, seed=1))
    assert len(a) == len(b) and all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b, strict=False))


def test_dataloader_workers_read_the_store(remote):
    folder, url, opts, cache = remote
    want = [ids(b) for b in Loader(TokenWindows(folder, SEQ), batch_size=8, seed=7)]
    ld = Loader(TokenWindows(reader(url, opts, cache), SEQ), batch_size=8, seed=7)
    dl = ld.dataloader(num_workers=2)
    assert dl.multiprocessing_context is not None
    assert dl.multiprocessing_context.get_start_method() == "forkserver"
    assert [ids(b) for b in dl] == want


def test_int32_views_of_a_batch_file_at_a_url(tmp_path, s3_endpoint):
    # the int32 path of a file at a URL: each batch fetched and checked, then handed out as a view
    from zerobatch.adapters.torch import BatchFileReader, LLMBatchSource
    from zerobatch.writers.llmbatch import write_batch_file
    (tmp_path / "up").mkdir()
    write_batch_file(tmp_path / "up" / "t.batch", np.random.default_rng(2).integers(0, 50000, (4 * 30, 16),
                                                                                    dtype=np.uint32), 4, 16, seed=1)
    url = f"s3://{new_bucket(s3_endpoint)}"
    upload(tmp_path / "up", url, options(s3_endpoint))
    local = list(Loader(LLMBatchSource(tmp_path / "up" / "t.batch", block_size=4), dtype=torch.int32, seed=3))
    far_reader = BatchFileReader(f"{url}/t.batch", storage_options=options(s3_endpoint), cache_dir=tmp_path / "cache")
    far = list(Loader(LLMBatchSource(far_reader, block_size=4), dtype=torch.int32, seed=3, num_threads=2))
    assert len(local) == len(far) == 30
    assert all(a.dtype == b.dtype == torch.int32 and a.shape == b.shape == (4, 16) and torch.equal(a, b)
               for a, b in zip(local, far, strict=True))
