"""Single-file formats read from a real S3 API server (moto on 127.0.0.1): LLMBATCH files,
LLMCHNK files and feature matrices at a URL deliver the bytes of their local copies (every
batch of a shuffled epoch), cost a few requests to open, fetch each unit once by exact byte
range into the shared cache, heal a damaged cache or a byte flipped in flight, and refuse a
wrong object with a typed error naming the URL."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from s3kit import FaultProxy, new_bucket, options, upload  # noqa: E402

from zerobatch.adapters.torch import FeatureWindows, LLMBatchSource, LLMChunkSource, Loader  # noqa: E402
from zerobatch.core.remote import ObjectStore  # noqa: E402
from zerobatch.formats.errors import ConfigError, IntegrityError, NotFoundError  # noqa: E402
from zerobatch.readers.features import FeatureMatrix  # noqa: E402
from zerobatch.readers.llmbatch import BatchFileReader  # noqa: E402
from zerobatch.readers.llmchnk import LLMChunkReader  # noqa: E402
from zerobatch.writers.features import write_feature_matrix  # noqa: E402
from zerobatch.writers.llmbatch import write_batch_file  # noqa: E402
from zerobatch.writers.llmchnk import write_chunk_file  # noqa: E402


@pytest.fixture(scope="module")
def files(s3_endpoint, tmp_path_factory):
    """Local copies and URLs of one file of each single-file format (and a feature folder)."""
    root = tmp_path_factory.mktemp("files")
    rng = np.random.default_rng(3)
    write_batch_file(root / "train.batch", rng.integers(0, 2**31, (8 * 61, 40), dtype=np.uint32), 8, 40, seed=1)
    write_batch_file(root / "small.batch", rng.integers(0, 50000, (4 * 3, 16), dtype=np.uint32), 4, 16, seed=1)
    recs = [rng.integers(0, 50257, int(rng.integers(1, 300))).astype(np.uint32) for _ in range(500)]
    write_chunk_file(root / "train.chunk", recs, seq_len=128)
    src = {f"k{i}": rng.normal(i, 1, (n, 5)) for i, n in enumerate((3000, 17, 900, 0, 2500))}
    write_feature_matrix(root / "features", src, chunk_rows=512, block_bytes=4096)
    bucket = new_bucket(s3_endpoint)
    upload(root, f"s3://{bucket}/data", options(s3_endpoint))
    return root, f"s3://{bucket}/data", options(s3_endpoint), recs


def test_llmbatch_every_batch_of_a_shuffled_epoch_equals_the_local_file(files, tmp_path):
    root, url, opts, _ = files
    local = BatchFileReader(root / "train.batch")
    r = BatchFileReader(f"{url}/train.batch", storage_options=opts, cache_dir=tmp_path / "cache")
    assert r.remote and not local.remote and r.path == f"{url}/train.batch"
    assert r.store.requests == 3                       # size, header, trailer
    assert (r.num_batches, r.batch_size, r.seq_len, r.fingerprint) == \
        (local.num_batches, local.batch_size, local.seq_len, local.fingerprint)
    order = np.random.default_rng(0).permutation(r.num_batches)
    for i in order[:20].tolist():
        np.testing.assert_array_equal(r.read_batch(i), local.read_batch(i))
        np.testing.assert_array_equal(r.read_batch_numpy(i, np.int32), local.read_batch_numpy(i, np.int32))
    got = r.read_batches(order, np.int64)
    np.testing.assert_array_equal(got, local.read_batches(order, np.int64))
    slot = local.header.padded_batch_bytes
    # each batch fetched once, by its own byte range: what came is what was delivered
    assert r.store.bytes_fetched <= 4096 + local.header.trailer_size + r.num_batches * slot
    assert r.verify().ok
    with pytest.raises(IndexError):
        r.read_batch(r.num_batches)
    # a loader over the URL: the same shuffled epoch as over the local file
    a = [b.clone() for b in Loader(LLMBatchSource(r), batch_size=16,
                                                  seed=5, shuffle=True, drop_last=True)]
    b = [b.clone() for b in Loader(LLMBatchSource(local), batch_size=16, seed=5, shuffle=True,
                                                  drop_last=True)]
    assert len(a) == len(b) > 0 and all((x == y).all() for x, y in zip(a, b, strict=True))
    # pickled (spawned workers): the same file, opened again from the URL with its options
    r2 = pickle.loads(pickle.dumps(r))
    np.testing.assert_array_equal(r2.read_batch(7), local.read_batch(7))
    r.close()
    r2.close()


def test_llmbatch_cache_is_shared_and_a_damaged_copy_is_fetched_again(files, tmp_path):
    root, url, opts, _ = files
    local = BatchFileReader(root / "train.batch")
    cache = tmp_path / "cache"
    with BatchFileReader(f"{url}/train.batch", storage_options=opts, cache_dir=cache) as r:
        r.read_batches(np.arange(r.num_batches))
        first = r.store.bytes_fetched
    (copy,) = [p for p in cache.rglob("file.batch")]
    with BatchFileReader(f"{url}/train.batch", storage_options=opts, cache_dir=cache) as r:
        r.read_batches(np.arange(r.num_batches))
        assert r.store.bytes_fetched < first // 4        # the batches came from the cache
    # a flipped byte in the cached copy of batch 5: found by its checksum and fetched again
    slot = local.header.padded_batch_bytes
    with open(copy, "r+b") as f:
        f.seek(4096 + 5 * slot + 11)
        b = f.read(1)
        f.seek(4096 + 5 * slot + 11)
        f.write(bytes([b[0] ^ 0x40]))
    with BatchFileReader(f"{url}/train.batch", storage_options=opts, cache_dir=cache) as r:
        np.testing.assert_array_equal(r.read_batch(5), local.read_batch(5))
        assert r.store.bytes_fetched < 4096 + local.header.trailer_size + 2 * slot


def test_llmbatch_a_flipped_byte_in_flight_heals_and_a_wrong_object_is_refused(files, s3_endpoint, tmp_path):
    root, url, opts, _ = files
    local = BatchFileReader(root / "train.batch")
    proxy = FaultProxy(s3_endpoint)
    try:
        popts = options(proxy.url)
        with BatchFileReader(f"{url}/train.batch", storage_options=popts, cache_dir=tmp_path / "c1") as r:
            proxy.add("corrupt", 1, path="train.batch")
            np.testing.assert_array_equal(r.read_batch(9), local.read_batch(9))
            assert proxy.injected == {"corrupt": 1}
    finally:
        proxy.close()
    # an object whose batches differ from the checksums it carries: a typed error, URL named
    bad = bytearray((root / "train.batch").read_bytes())
    bad[4096 + 3 * local.header.padded_batch_bytes + 2] ^= 1
    store = ObjectStore(url, opts)
    store.put("bad.batch", bytes(bad))
    with BatchFileReader(f"{url}/bad.batch", storage_options=opts, cache_dir=tmp_path / "c2") as r:
        np.testing.assert_array_equal(r.read_batch(2), local.read_batch(2))
        with pytest.raises(IntegrityError) as e:
            r.read_batch(3)
        assert f"{url}/bad.batch" in str(e.value) and "bytes [" in str(e.value)
        report = r.verify()
        assert report.bad_batches == (3,) and not report.ok
    with pytest.raises(NotFoundError) as e:
        BatchFileReader(f"{url}/missing.batch", storage_options=opts, cache_dir=tmp_path / "c3")
    assert f"{url}/missing.batch" in str(e.value)


def test_llmchnk_records_and_gathers_equal_the_local_file(files, tmp_path):
    root, url, opts, recs = files
    local = LLMChunkReader(root / "train.chunk")
    r = LLMChunkReader(f"{url}/train.chunk", storage_options=opts, cache_dir=tmp_path / "cache")
    assert r.remote and r.store.requests <= 4 and r.fingerprint == local.fingerprint
    for i in (0, 17, 499, -1):
        np.testing.assert_array_equal(r.read_record(i), recs[i])
    idx = np.random.default_rng(1).permutation(500)[:64]
    got, mask = r.gather(idx, 128)
    want, wmask = local.gather(idx, 128)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(mask, wmask)
    # only the records read were fetched (by exact ranges, neighbours coalesced)
    assert r.store.bytes_fetched < (root / "train.chunk").stat().st_size
    a = [x.clone() for x in Loader(LLMChunkSource(r, 64), batch_size=8, seed=2, shuffle=True)]
    b = [x.clone() for x in Loader(LLMChunkSource(local, 64), batch_size=8, seed=2, shuffle=True)]
    assert len(a) == len(b) and all((x == y).all() for x, y in zip(a, b, strict=True))
    assert r.verify().ok
    assert [np.asarray(x).tolist() for x in r] == [x.tolist() for x in recs]
    r2 = pickle.loads(pickle.dumps(r))
    np.testing.assert_array_equal(r2.read_record(3), recs[3])
    r.close()
    r2.close()


def test_feature_windows_equal_the_local_dataset(files, tmp_path):
    root, url, opts, _ = files
    local = FeatureMatrix(root / "features", 32, stride=3, horizon=4)
    fm = FeatureMatrix(f"{url}/features", 32, stride=3, horizon=4, storage_options=opts, cache_dir=tmp_path / "cache")
    assert fm.remote and len(fm) == len(local) and fm.build_id == local.build_id
    assert fm.store.requests == 2
    idx = np.random.default_rng(4).permutation(len(local))[:50]
    x, y = fm.windows(idx)
    lx, ly = local.windows(idx)
    np.testing.assert_array_equal(x, lx)
    np.testing.assert_array_equal(y, ly)
    assert fm.store.requests <= 3            # the blocks of the whole batch in one fetch
    wx, wy = fm.window_at(int(idx[0]))
    np.testing.assert_array_equal(wx, lx[0])
    a = [t[0].clone() for t in Loader(FeatureWindows(fm), batch_size=16, seed=1, shuffle=True)]
    b = [t[0].clone() for t in Loader(FeatureWindows(local), batch_size=16, seed=1, shuffle=True)]
    assert len(a) == len(b) and all((p == q).all() for p, q in zip(a, b, strict=True))
    fm2 = pickle.loads(pickle.dumps(fm))
    np.testing.assert_array_equal(fm2.windows(idx[:3])[0], lx[:3])
    fm.verify()


def test_a_file_without_checksums_is_refused_at_a_url_and_local_paths_as_file_urls(files, tmp_path):
    root, url, opts, recs = files
    write_chunk_file(tmp_path / "plain.chunk", recs[:10], checksums=False)
    ObjectStore(url, opts).put("plain.chunk", str(tmp_path / "plain.chunk"))
    with pytest.raises(ConfigError) as e:
        LLMChunkReader(f"{url}/plain.chunk", storage_options=opts, cache_dir=tmp_path / "c")
    assert e.value.field == "checksums" and f"{url}/plain.chunk" in str(e.value)
    # file:// URLs are local paths
    r = BatchFileReader(f"file://{root / 'small.batch'}")
    assert not r.remote and r.num_batches == 3
    fm = FeatureMatrix(f"file://{root / 'features'}", 8)
    assert not fm.remote and len(fm) > 0


def test_http_urls_read_every_format_from_a_plain_range_server(files, tmp_path):
    """``http(s)://`` datasets: any server that answers HEAD and byte-range GETs (a CDN,
    nginx): here a standard-library one on 127.0.0.1."""
    from s3kit import RangeServer

    from zerobatch.readers.tokstream import TokenStreamReader
    from zerobatch.writers.tokstream import TokenStreamWriter
    root, _, _, recs = files
    with TokenStreamWriter(root / "ts", vocab_size=50257, shard_tokens=4000) as w:
        for r in recs[:100]:
            w.add_document(r.astype(np.uint16) % 50257)
    server = RangeServer(root)
    try:
        cache = tmp_path / "cache"
        ts, lts = TokenStreamReader(f"{server.url}/ts", cache_dir=cache), TokenStreamReader(root / "ts")
        starts = np.random.default_rng(0).integers(0, lts.num_tokens - 100, 16)
        np.testing.assert_array_equal(ts.windows(starts, 100), lts.windows(starts, 100))
        np.testing.assert_array_equal(ts.documents([3, 50, 99])[0], lts.documents([3, 50, 99])[0])
        b = BatchFileReader(f"{server.url}/train.batch", cache_dir=cache)
        np.testing.assert_array_equal(b.read_batches([0, 60, 7]), BatchFileReader(root / "train.batch").read_batches(
            [0, 60, 7]))
        c = LLMChunkReader(f"{server.url}/train.chunk", cache_dir=cache)
        np.testing.assert_array_equal(c.gather([5, 400], 128)[0], LLMChunkReader(root / "train.chunk").gather(
            [5, 400], 128)[0])
        fm = FeatureMatrix(f"{server.url}/features", 16, cache_dir=cache)
        np.testing.assert_array_equal(fm.windows([0, 900])[0], FeatureMatrix(root / "features", 16).windows(
            [0, 900])[0])
        assert all(m in ("GET", "HEAD") for m, _, _ in server.requests)
        assert any(rng.startswith("bytes=") for _, _, rng in server.requests)
        with pytest.raises(NotFoundError):
            TokenStreamReader(f"{server.url}/nothing", cache_dir=cache)
    finally:
        server.close()


def test_worker_processes_read_single_files_from_the_store(files, tmp_path):
    """LLMBATCH, LLMCHNK and feature-matrix sources at a URL in DataLoader worker processes
    (forkserver, which the loader picks for remote sources): the same batches as locally."""
    root, url, opts, _ = files
    for make, name in ((lambda p, **kw: LLMBatchSource(BatchFileReader(p, **kw)), "train.batch"),
                       (lambda p, **kw: LLMChunkSource(LLMChunkReader(p, **kw), 64), "train.chunk"),
                       (lambda p, **kw: FeatureWindows(FeatureMatrix(p, 8, stride=5, **kw)), "features")):
        first = [b for b in Loader(make(root / name), batch_size=16, seed=4)]
        want = [(b[0] if isinstance(b, tuple) else b).clone() for b in first]
        ld = Loader(make(f"{url}/{name}", storage_options=opts, cache_dir=tmp_path / "cache"), batch_size=16, seed=4)
        dl = ld.dataloader(num_workers=2)
        assert dl.multiprocessing_context.get_start_method() == "forkserver"
        got = [(b[0] if isinstance(b, tuple) else b).clone() for b in dl]
        assert len(got) == len(want) and all((x == y).all() for x, y in zip(got, want, strict=True)), name
