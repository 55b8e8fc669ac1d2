"""A new storage scheme is one class: ``dir://bucket/prefix`` (core.remote.DirectoryStore, a
local folder served as an object store through obstore's LocalStore) is registered in one line,
and every reader, writer and loader then reads and writes there through the one fetch-and-check
path (sparse copies in the cache, ranges checked against the dataset's digests), with no other
edit. A byte changed in a stored object is found by that path on a real store, no proxy."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("obstore")

from zerobatch.core.remote import DirectoryStore, is_url, open_store  # noqa: E402
from zerobatch.formats.errors import ConfigError, IntegrityError  # noqa: E402
from zerobatch.readers.llmbatch import BatchFileReader  # noqa: E402
from zerobatch.readers.tokstream import TokenStreamReader  # noqa: E402
from zerobatch.readers.zrecord import ZRecordStore  # noqa: E402
from zerobatch.writers.llmbatch import write_batch_file  # noqa: E402
from zerobatch.writers.tokstream import TokenStreamWriter  # noqa: E402


def upload(folder, url, opts):
    store = open_store(url, opts)
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            store.put(os.path.relpath(path, folder).replace(os.sep, "/"), path)


@pytest.fixture()
def served(tmp_path):
    objects = tmp_path / "objects"
    objects.mkdir()
    return {"root": str(objects)}, tmp_path


def docs(n=60, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 5000, int(rng.integers(5, 200))) for _ in range(n)]


def test_the_scheme_is_one_registered_class(served):
    opts, _ = served
    assert is_url("dir://bucket/ds") and isinstance(open_store("dir://bucket/ds", opts), DirectoryStore)
    with pytest.raises(ConfigError, match="root"):
        open_store("dir://bucket/ds", {})


def test_tokstream_written_and_read_at_a_dir_url_as_locally(served):
    opts, tmp = served
    with TokenStreamWriter(tmp / "local", vocab_size=5000, shard_tokens=1500) as w:
        for d in docs():
            w.add_document(d)
    url = "dir://bucket/corpus"
    with TokenStreamWriter(url, vocab_size=5000, shard_tokens=1500, storage_options=opts) as w:
        for d in docs():
            w.add_document(d)
    local = TokenStreamReader(tmp / "local")
    far = TokenStreamReader(url, storage_options=opts, cache_dir=tmp / "cache")
    assert far.remote and far.access.fetched and far.manifest.build_id == local.manifest.build_id
    starts = np.random.default_rng(1).integers(0, local.num_tokens - 64, 50)
    assert (far.windows(starts, 64) == local.windows(starts, 64)).all()
    assert far.store.requests > 0

    from zerobatch.adapters.torch import Loader, TokenWindows
    want = [x.clone() for x, _ in Loader(TokenWindows(tmp / "local", 32), batch_size=8, seed=2)]
    got = [x.clone() for x, _ in Loader(TokenWindows(far, 32), batch_size=8, seed=2)]
    assert len(got) == len(want) and all((a == b).all() for a, b in zip(got, want, strict=True))


def test_a_changed_byte_in_a_stored_object_is_refused_by_the_fetch_path(served):
    opts, tmp = served
    with TokenStreamWriter(tmp / "local", vocab_size=5000, shard_tokens=100_000) as w:
        for d in docs():
            w.add_document(d)
    upload(tmp / "local", "dir://bucket/ds", opts)
    [tokens] = [os.path.join(r, n) for r, _, ns in os.walk(os.path.join(opts["root"], "bucket", "ds"))
                for n in ns if n == "tokens.bin"]
    with open(tokens, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x40]))
    far = TokenStreamReader("dir://bucket/ds", storage_options=opts, cache_dir=tmp / "cache")
    with pytest.raises(IntegrityError, match="did not match") as e:
        far.windows(np.array([0]), 64)
    assert "dir://bucket/ds" in str(e.value) and "tokens.bin" in str(e.value)


def test_llmbatch_and_zrecord_at_a_dir_url(served):
    opts, tmp = served
    rng = np.random.default_rng(4)
    write_batch_file(tmp / "train.batch", rng.integers(0, 9000, (64, 16), dtype=np.uint32), 4, 16, seed=1)
    upload(tmp, "dir://bucket/files", {**opts})
    local = BatchFileReader(tmp / "train.batch")
    far = BatchFileReader("dir://bucket/files/train.batch", storage_options=opts, cache_dir=tmp / "cache")
    assert far.access.fetched and far.num_batches == local.num_batches
    assert all((np.asarray(far[k]) == np.asarray(local[k])).all() for k in range(local.num_batches))

    from zerobatch.formats.zrecord import FieldSpec
    from zerobatch.writers.zrecord import ZRecordWriter
    with ZRecordWriter(tmp / "store", [FieldSpec("tokens", "u16", None, "flate")]) as w:
        for d in docs(30):
            w.append({"tokens": d.astype(np.uint16)})
    upload(tmp / "store", "dir://bucket/store", opts)
    zl, zf = ZRecordStore(tmp / "store"), ZRecordStore("dir://bucket/store", storage_options=opts,
                                                         cache_dir=tmp / "cache2")
    assert zf.remote and len(zf) == len(zl) == 30
    idx = np.array([3, 17, 0, 29])
    got, want = zf.gather(idx, ["tokens"]), zl.gather(idx, ["tokens"])
    assert all((np.asarray(got["tokens"][i]) == np.asarray(want["tokens"][i])).all() for i in range(idx.size))
