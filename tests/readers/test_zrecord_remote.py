"""ZRECORD stores at a URL (read-only), against a real S3 API server (moto on 127.0.0.1):
published with ``commit.zr`` last, opened in two requests, every gather of a shuffled epoch
equal to the local store's, records fetched once by exact byte range (never a whole chunk),
a damaged mirror or a byte flipped in flight healed, a lying object refused with a typed
error naming the URL and the byte range, pickled readers and loader workers, the CLI."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from s3kit import FaultProxy, new_bucket, options  # noqa: E402

from zerobatch.adapters.torch import Loader, RecordFields  # noqa: E402
from zerobatch.core.remote import ObjectStore  # noqa: E402
from zerobatch.formats import zrecord as Z  # noqa: E402
from zerobatch.formats.errors import ConfigError, IntegrityError, NotFoundError  # noqa: E402
from zerobatch.readers.zrecord import ZRecordStore  # noqa: E402
from zerobatch.writers.remote import publish_zrecord  # noqa: E402
from zerobatch.writers.zrecord import ZRecordWriter  # noqa: E402

FIELDS = [Z.FieldSpec("tokens", "u32", compress="raw"), Z.FieldSpec("text", "bytes", compress="flate"),
          Z.FieldSpec("label", "i64", (2,))]
N = 3000


def equal(a, b) -> bool:
    if isinstance(a, np.ndarray) and not a.dtype == object:
        return a.shape == b.shape and bool((a == b).all())
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and
                                                                  np.array_equal(x, y)) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def store(s3_endpoint, tmp_path_factory):
    """A local store of three fields (some records absent), published to a bucket."""
    root = tmp_path_factory.mktemp("zr") / "store"
    rng = np.random.default_rng(1)
    with ZRecordWriter(root, FIELDS, chunk_size=500, chunk_grow_bytes=1 << 20) as w:
        for i in range(N):
            rec = {"tokens": rng.integers(0, 50257, int(rng.integers(1, 400))).astype(np.uint32),
                   "label": [i, -i]}
            if i % 7:
                rec["text"] = (b"record %d " % i) * int(rng.integers(0, 30))
            w.append(rec)
    opts = options(s3_endpoint)
    url = f"s3://{new_bucket(s3_endpoint)}/store"
    sent = publish_zrecord(root, url, storage_options=opts)
    return root, url, opts, sent


def test_every_gather_of_a_shuffled_epoch_equals_the_local_store(store, tmp_path):
    root, url, opts, sent = store
    local = ZRecordStore(root)
    r = ZRecordStore(url, storage_options=opts, cache_dir=tmp_path / "cache", verify=False)
    assert r.remote and not local.remote and r.path == url
    assert r.store.requests == 2                        # meta.json and commit.zr, nothing listed
    assert (len(r), r.keys(), r.fingerprint) == (len(local), local.keys(), local.fingerprint)
    assert r.verify                                     # every byte from a URL is checked
    order = np.random.default_rng(0).permutation(N)
    for idx in np.array_split(order, 40):
        with r.gather(idx) as a, local.gather(idx) as b:
            for name in r.keys():
                assert equal(a[name], b[name]), name
                assert (a.present(name) == b.present(name)).all()
    # each record fetched once, by its own range: what came is the tables and the records
    entries = sum(N * (Z.ENTRY_SIZE + Z.CHECK_SIZE) for _ in FIELDS)
    assert r.store.bytes_fetched <= sent + 8192 and r.store.bytes_fetched >= entries
    before = r.store.requests
    r.gather(order[:100]).release()                     # all held now: no request
    assert r.store.requests == before
    assert r["tokens"][17].tolist() == local["tokens"][17].tolist()
    assert r["label"][-1].tolist() == [N - 1, 1 - N]
    with pytest.raises(IndexError):
        r.gather([N])
    # a few records cost their own bytes, not their chunks
    r2 = ZRecordStore(url, storage_options=opts, cache_dir=tmp_path / "other")
    r2.gather([5, 2900], ["tokens"]).release()
    tok = local.gather([5, 2900], ["tokens"])["tokens"]
    page = Z.ENTRY_SIZE + Z.CHECK_SIZE
    assert r2.store.bytes_fetched <= 8192 + 2 * 4096 * page + sum(t.nbytes + 48 for t in tok)
    # pickled (spawned workers): opened again from the URL with its options
    r3 = pickle.loads(pickle.dumps(r))           # opened on first use, not in unpickling
    assert r3.remote and r3.path == url and r3.__dict__.get("_mirror") is None
    assert r3["tokens"][2999].tolist() == local["tokens"][2999].tolist()
    for s in (r, r2, r3, local):
        s.close()


def test_the_mirror_is_shared_and_a_damaged_one_is_fetched_again(store, tmp_path):
    root, url, opts, _ = store
    local = ZRecordStore(root)
    cache = tmp_path / "cache"
    with ZRecordStore(url, storage_options=opts, cache_dir=cache) as r:
        r.gather(np.arange(N)).release()
    (chunk,) = [p for p in cache.rglob("chunk/1.zr")]
    (table,) = [p for p in cache.rglob("tokens.offset")]
    e = np.fromfile(root / "tokens.offset", Z.ENTRY_DTYPE, count=N)
    i = int(np.flatnonzero(e["chunk"] == 1)[3])
    for path, at in ((chunk, int(e["offset"][i]) + 20), (table, 700 * Z.ENTRY_SIZE + 5)):
        with open(path, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x10]))
    with ZRecordStore(url, storage_options=opts, cache_dir=cache) as r:
        for k in (i, 700):
            assert r["tokens"][k].tolist() == local["tokens"][k].tolist()
    local.close()


def test_a_store_larger_than_the_cache_is_read_within_it(store, tmp_path):
    """A 1 MiB cache and a store of several MiB: the mirror rotates (its chunk copies dropped,
    the store mapped afresh) and stays within the limit, every gather still exact, and the
    zero-copy views of a batch taken before a rotation keep their records."""
    root, url, opts, _ = store
    local = ZRecordStore(root)
    limit = 1 << 20
    r = ZRecordStore(url, storage_options=opts, cache_dir=tmp_path / "cache", cache_limit=limit)
    kept = r.gather(np.arange(50), ["tokens"])
    want = [t.copy() for t in kept["tokens"]]
    for idx in np.array_split(np.random.default_rng(4).permutation(N)[:1500], 15):
        with r.gather(idx) as a, local.gather(idx) as b:
            for name in r.keys():
                assert equal(a[name], b[name]), name
        used = sum(p.stat().st_blocks * 512 for p in (tmp_path / "cache").rglob("*") if p.is_file())
        assert used <= limit
    assert r._mirror.rotations >= 2
    assert all(np.array_equal(x, y) for x, y in zip(kept["tokens"], want, strict=True))   # views intact
    kept.release()
    r.close()
    local.close()
    # read-ahead threads fetching while gathers rotate the mirror: the same epoch as locally
    make = (lambda s: Loader(RecordFields(s, ["label", "tokens"], pad_to=400), batch_size=64, seed=2,
                             shuffle=True, num_threads=2, prefetch=8))
    want = [{k: v.clone() for k, v in b.items()} for b, _ in zip(make(ZRecordStore(root)), range(16), strict=False)]
    src = ZRecordStore(url, storage_options=opts, cache_dir=tmp_path / "c2", cache_limit=limit)
    got = [{k: v.clone() for k, v in b.items()} for b, _ in zip(make(src), range(16), strict=False)]
    assert src._mirror.rotations >= 2 and len(got) == len(want) == 16
    assert all((x[k] == y[k]).all() for x, y in zip(got, want, strict=True) for k in x)


def test_faults_in_flight_heal_and_a_lying_object_is_refused(store, s3_endpoint, tmp_path):
    root, url, opts, _ = store
    local = ZRecordStore(root)
    proxy = FaultProxy(s3_endpoint)
    try:
        with ZRecordStore(url, storage_options=options(proxy.url), cache_dir=tmp_path / "c1") as r:
            proxy.add("corrupt", 1, path="chunk/")
            proxy.add("503", 1, path="tokens.offset")
            proxy.add("reset", 1, path="chunk/")
            got = r.gather([10, 1200, 2500], ["tokens"])["tokens"]
            want = local.gather([10, 1200, 2500], ["tokens"])["tokens"]
            assert equal(got, want)
            assert proxy.injected == {"corrupt": 1, "503": 1, "reset": 1}
    finally:
        proxy.close()
    # a store whose chunk differs from its records' checksums: an IntegrityError naming the
    # chunk's URL and the record's byte range, after its tries; the other records still read
    bad = f"{url}-bad"
    publish_zrecord(root, bad, storage_options=opts)
    e = np.fromfile(root / "tokens.offset", Z.ENTRY_DTYPE, count=N)
    c, off = int(e["chunk"][42]), int(e["offset"][42])
    data = bytearray((root / Z.chunk_name(c)).read_bytes())
    data[off + 30] ^= 1
    ObjectStore(bad, opts).put(Z.chunk_name(c), bytes(data))
    with ZRecordStore(bad, storage_options=opts, cache_dir=tmp_path / "c2") as r:
        assert r["tokens"][41].tolist() == local["tokens"][41].tolist()
        with pytest.raises(IntegrityError) as err:
            r.gather([42], ["tokens"])
        assert f"{bad}/chunk/{c}.zr" in str(err.value) and f"bytes [{off}, " in str(err.value)
    with pytest.raises(NotFoundError) as err:
        ZRecordStore(f"{url}-none", storage_options=opts, cache_dir=tmp_path / "c3")
    assert "meta.json" in str(err.value)
    local.close()


def test_publishing_is_write_once_and_commit_last(store, tmp_path):
    root, url, opts, _ = store
    with pytest.raises(ConfigError, match="write-once"):
        publish_zrecord(root, url, storage_options=opts)
    # a killed upload (everything but commit.zr): no store for a reader; a rerun publishes
    part = f"{url}-part"
    publish_zrecord(root, part, storage_options=opts)
    ObjectStore(part, opts).delete(Z.COMMIT_NAME)
    with pytest.raises(NotFoundError):
        ZRecordStore(part, storage_options=opts, cache_dir=tmp_path / "c")
    publish_zrecord(root, part, storage_options=opts)
    with ZRecordStore(part, storage_options=opts, cache_dir=tmp_path / "c") as r, ZRecordStore(root) as local:
        assert len(r) == N and r["label"][1234].tolist() == local["label"][1234].tolist()
    # chunk files grow in sparse steps locally: only their records go up
    store_objs = dict(ObjectStore(url, opts).list())
    local_chunks = sum(p.stat().st_size for p in (root / "chunk").iterdir())
    assert sum(v for k, v in store_objs.items() if k.startswith("chunk/")) < local_chunks
    assert Z.WRITER_LOCK_NAME not in store_objs


def test_a_loader_over_the_url_and_its_worker_processes(store, tmp_path):
    root, url, opts, _ = store
    want = [b.clone() for b in Loader(RecordFields(root, ["label"]), batch_size=64, seed=3, shuffle=True)]
    src = RecordFields(ZRecordStore(url, storage_options=opts, cache_dir=tmp_path / "cache"), ["label"])
    assert src.remote
    got = [b.clone() for b in Loader(src, batch_size=64, seed=3, shuffle=True)]
    assert len(got) == len(want) and all((x == y).all() for x, y in zip(got, want, strict=True))
    ld = Loader(RecordFields(ZRecordStore(url, storage_options=opts, cache_dir=tmp_path / "c2"), ["label"]),
                batch_size=64, seed=3, shuffle=True)
    dl = ld.dataloader(num_workers=2)
    assert dl.multiprocessing_context.get_start_method() == "forkserver"
    got = [b.clone() for b in dl]
    assert len(got) == len(want) and all((x == y).all() for x, y in zip(got, want, strict=True))


def test_the_cli_reads_and_writes_stores_at_urls(store, tmp_path, monkeypatch, capsys):
    from zerobatch.cli.main import main
    root, url, opts, _ = store
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret_access_key"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", opts["region"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["endpoint"])
    monkeypatch.setenv("ZEROBATCH_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert "ZRECORD" in out and "at a URL" in out and str(N) in out
    assert main(["verify", url]) == 0
    assert main(["head", url, "-n", "2"]) == 0
    np.save(tmp_path / "tok.npy", np.arange(1, 400, dtype=np.uint16) % 50)
    dst = f"{url}-cli"
    assert main(["convert", str(tmp_path / "tok.npy"), dst, "--to", "zrecord", "--eod-id", "0", "--quiet"]) == 0
    with ZRecordStore(dst, cache_dir=tmp_path / "cache") as r:
        assert len(r) == 8 and r["tokens"][1].tolist()[:49] == list(range(1, 50))
    assert main(["convert", str(tmp_path / "tok.npy"), dst, "--to", "zrecord", "--eod-id", "0", "--quiet"]) != 0
    assert "write-once" in capsys.readouterr().err
