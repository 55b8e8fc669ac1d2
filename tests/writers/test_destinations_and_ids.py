"""Where writers write, and what identifies what they wrote.

- Every writer given an ``s3://`` or ``gs://`` destination either writes there (the TOKSTREAM
  writer: staged locally, published manifest-last on close, read back from a real S3 server)
  or refuses it with a typed error before any work, and never makes a folder such as
  ``./s3:/bucket/ds`` in the working directory (which a user would take for an upload); a
  ``file://`` URL is a local path.
- Two writes of the same documents with the same options get the same build ids (a loader
  state resumes on a re-tokenized copy); other contents or options, other ids.
- A chat dataset's manifest names its loss mask's build id: another dataset's mask of the
  same geometry, a deleted mask or a mask missing a file is damage, never "no loss mask".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zerobatch.formats.errors import ConfigError, CorruptError, NotFoundError, ZerobatchError


def _writers() -> dict[str, object]:
    from zerobatch.batch_writer import write_batch_file as seed_write_batch_file
    from zerobatch.writers.features import write_feature_matrix
    from zerobatch.writers.llmbatch import LLMBatchWriter, write_batch_dataset, write_batch_file
    from zerobatch.writers.llmchnk import LLMChunkWriter, write_chunk_file
    from zerobatch.writers.tokstream import ShardWriter, TokenStreamWriter, assemble
    from zerobatch.writers.zrecord import ZRecordWriter

    tokens = np.arange(64, dtype=np.uint32).reshape(4, 16)

    def tokstream(dst: str) -> None:
        with TokenStreamWriter(dst, vocab_size=100) as w:
            w.add_document([1, 2, 3])

    def shard(dst: str) -> None:
        with ShardWriter(dst, "s0", vocab_size=100) as w:
            w.add_document([1, 2, 3])

    def llmbatch(dst: str) -> None:
        with LLMBatchWriter(dst + "/x.batch", batch_size=2, seq_len=16) as w:
            w.write_batch(tokens[:2])

    def chunks(dst: str) -> None:
        with LLMChunkWriter(dst + "/x.chnk", seq_len=16) as w:
            w.add(tokens[0])

    def zrecord(dst: str) -> None:
        from zerobatch.formats.zrecord import FieldSpec
        with ZRecordWriter(dst, [FieldSpec("tokens", "u32", None, "raw")]) as w:
            w.append({"tokens": tokens[0]})

    return {
        "TokenStreamWriter": tokstream,
        "ShardWriter": shard,
        "assemble": lambda dst: assemble(dst),
        "LLMBatchWriter": llmbatch,
        "write_batch_file": lambda dst: write_batch_file(dst + "/x.batch", tokens, 2, 16, seed=1),
        "write_batch_dataset": lambda dst: write_batch_dataset(dst + "/x.batch", iter(tokens), 4, 2, 16, 1),
        "batch_writer.write_batch_file": lambda dst: seed_write_batch_file(dst + "/x.batch", tokens, 2, 16, 1),
        "LLMChunkWriter": chunks,
        "write_chunk_file": lambda dst: write_chunk_file(dst + "/x.chnk", list(tokens), seq_len=16),
        "write_feature_matrix": lambda dst: write_feature_matrix(dst, {"a": np.ones((4, 3), np.float32)}),
        "ZRecordWriter": zrecord,
    }


WRITERS = sorted(_writers())


@pytest.mark.parametrize("scheme", ["s3", "gs"])
@pytest.mark.parametrize("writer", WRITERS)
def test_a_writer_given_an_object_store_url_writes_nothing_in_the_working_directory(writer, scheme, tmp_path,
                                                                                   monkeypatch):
    pytest.importorskip("obstore")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    # no server answers here: a writer that tried the network would fail, not hang on a
    # public address (and a refusal comes before any request)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    for k, v in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    write = _writers()[writer]
    with pytest.raises(ZerobatchError) as info:
        write(f"{scheme}://bucket/ds")    # type: ignore[operator]
    assert isinstance(info.value, (ConfigError, OSError)), repr(info.value)
    assert list(work.iterdir()) == [], f"{writer} wrote {list(work.iterdir())} locally"
    if writer != "TokenStreamWriter":
        assert "publish" in str(info.value) and info.value.field is not None


@pytest.mark.parametrize("writer", WRITERS)
def test_a_file_url_is_a_local_path(writer, tmp_path, monkeypatch):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    dst = tmp_path / "out"
    if writer in ("ShardWriter", "assemble"):
        # a shard of a dataset folder; assemble then makes the manifest of what is there
        _writers()["ShardWriter"](f"file://{dst}")    # type: ignore[operator]
    if writer != "ShardWriter":
        dst.mkdir(exist_ok=True) if writer in ("LLMBatchWriter", "write_batch_file", "write_batch_dataset",
                                               "batch_writer.write_batch_file", "LLMChunkWriter",
                                               "write_chunk_file") else None
        _writers()[writer](f"file://{dst}")    # type: ignore[operator]
    assert list(work.iterdir()) == []
    assert any(dst.iterdir())


def test_the_tokstream_writer_publishes_to_a_url_manifest_last(s3_endpoint, tmp_path, monkeypatch):
    from s3kit import CREDENTIALS, new_bucket

    from zerobatch.readers.tokstream import TokenStreamReader
    from zerobatch.writers.tokstream import TokenStreamWriter
    monkeypatch.chdir(tmp_path)
    opts = {**CREDENTIALS, "endpoint": s3_endpoint}
    url = f"s3://{new_bucket(s3_endpoint)}/ds"
    docs = [np.arange(1, n + 1) % 100 for n in (5, 300, 40)]
    with TokenStreamWriter(url, vocab_size=100, shard_tokens=200, storage_options=opts) as w:
        for d in docs:
            w.add_document(d)
    assert list(tmp_path.iterdir()) == []
    with TokenStreamReader(url, **{"storage_options": opts}) as r:
        assert r.num_documents == 3
        for i, d in enumerate(docs):
            np.testing.assert_array_equal(r.document(i), d)
    with pytest.raises(ConfigError, match="already there"):
        TokenStreamWriter(url, vocab_size=100, storage_options=opts)
    # overwrite: the readers see the old dataset until the new manifest is in place
    with TokenStreamWriter(url, vocab_size=100, storage_options=opts, overwrite=True) as w:
        w.add_document([7, 7, 7])
    with TokenStreamReader(url, storage_options=opts) as r:
        assert r.num_documents == 1 and r.document(0).tolist() == [7, 7, 7]
    # an aborted write leaves neither the old dataset changed nor anything local
    with pytest.raises(RuntimeError):
        with TokenStreamWriter(url, vocab_size=100, storage_options=opts, overwrite=True) as w:
            w.add_document([1, 2])
            raise RuntimeError("killed")
    with TokenStreamReader(url, storage_options=opts) as r:
        assert r.document(0).tolist() == [7, 7, 7]
    assert list(tmp_path.iterdir()) == []


def _write(folder: Path, docs, **kw) -> str:
    from zerobatch.writers.tokstream import TokenStreamWriter
    with TokenStreamWriter(folder, vocab_size=1000, shard_tokens=500, **kw) as w:
        for d in docs:
            w.add_document(d)
    return json.loads((folder / "manifest.json").read_text())["build_id"]


def test_equal_writes_get_equal_build_ids_and_other_writes_other_ids(tmp_path):
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 1000, n) for n in rng.integers(1, 300, 20)]
    a = _write(tmp_path / "a", docs)
    assert _write(tmp_path / "b", docs) == a
    assert (tmp_path / "a" / "shard-00000" / "shard.json").read_bytes() == \
        (tmp_path / "b" / "shard-00000" / "shard.json").read_bytes()
    changed = [d.copy() for d in docs]
    changed[7][0] = (changed[7][0] + 1) % 1000
    ids = {a, _write(tmp_path / "c", changed), _write(tmp_path / "d", docs, eod_token=0),
           _write(tmp_path / "e", docs[:-1]), _write(tmp_path / "f", docs, checksum_block=4096),
           _write(tmp_path / "g", docs, build_seed=b"seed")}
    assert len(ids) == 6
    # the seeded id is still derived from the seed and the name alone (distributed
    # preparation binds its parts to their plan and unit by it)
    assert _write(tmp_path / "h", docs[:3], build_seed=b"seed") != _write(tmp_path / "i", docs, build_seed=b"s2")
    shard = json.loads((tmp_path / "g" / "shard-00000" / "shard.json").read_text())["shard"]["build_id"]
    shard_h = json.loads((tmp_path / "h" / "shard-00000" / "shard.json").read_text())["shard"]["build_id"]
    assert shard == shard_h


def test_a_state_saved_on_one_conversion_resumes_on_a_reconversion(tmp_path):
    torch = pytest.importorskip("torch")
    from zerobatch.adapters.torch import Loader, TokenWindows
    rng = np.random.default_rng(4)
    np.save(tmp_path / "t.npy", rng.integers(1, 1000, 20_000).astype(np.uint16))
    for name in ("one", "two"):
        r = subprocess.run([sys.executable, "-m", "zerobatch.cli", "convert", str(tmp_path / "t.npy"),
                            str(tmp_path / name), "--to", "tokstream", "--eod-id", "0", "--quiet"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr

    def loader(name):
        return Loader(TokenWindows(str(tmp_path / name), 64), batch_size=4, shuffle=True, seed=5)
    a = loader("one")
    it = iter(a)
    for _ in range(3):
        next(it)
    state = a.state_dict()
    want = [next(it) for _ in range(3)]
    b = loader("two")
    b.load_state_dict(state)
    got = [x for _, x in zip(range(3), iter(b))]
    for x, y in zip(want, got):
        assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))


def _chat(folder: Path, seed: int, lengths=(30, 50, 70)) -> None:
    from zerobatch.writers.tokstream import TokenStreamWriter
    rng = np.random.default_rng(seed)
    w = TokenStreamWriter(folder, vocab_size=100, shard_tokens=500)
    m = TokenStreamWriter(folder / "loss_mask", vocab_size=2, shard_tokens=500)
    for n in lengths:
        w.add_document(rng.integers(0, 100, n))
        m.add_document(rng.integers(0, 2, n))
    w.close(loss_mask=m.close())


def _verify(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zerobatch.cli", "verify", str(folder)], capture_output=True,
                          text=True, timeout=120)


def test_the_loss_mask_is_bound_to_its_dataset(tmp_path):
    from zerobatch.adapters.sources.tokstream import TokenWindows
    from zerobatch.readers.tokstream import TokenStreamReader, open_loss_mask
    _chat(tmp_path / "a", 0)
    _chat(tmp_path / "b", 1)
    with TokenStreamReader(tmp_path / "a") as r:
        assert r.manifest.loss_mask is not None
        open_loss_mask(r).close()
    assert _verify(tmp_path / "a").returncode == 0

    def damaged(match: str) -> None:
        with TokenStreamReader(tmp_path / "a") as r, pytest.raises(CorruptError, match=match) as info:
            open_loss_mask(r)
        assert info.value.field == "loss_mask"
        with pytest.raises(CorruptError):
            TokenWindows(str(tmp_path / "a"), 16, loss_mask=True)
        v = _verify(tmp_path / "a")
        assert v.returncode == 1 and "loss_mask" in v.stderr, v.stdout + v.stderr

    # another chat dataset's mask of the same geometry
    shutil.rmtree(tmp_path / "a" / "loss_mask")
    shutil.copytree(tmp_path / "b" / "loss_mask", tmp_path / "a" / "loss_mask")
    damaged("not the .* the dataset's manifest names")
    # no mask at all, or its manifest deleted
    shutil.rmtree(tmp_path / "a" / "loss_mask")
    damaged("names a loss mask")
    _chat(tmp_path / "a2", 0)
    os.remove(tmp_path / "a2" / "loss_mask" / "manifest.json")
    shutil.rmtree(tmp_path / "a")
    shutil.copytree(tmp_path / "a2", tmp_path / "a")
    damaged("manifest.json is missing")
    # a file of the mask deleted, or a dangling link in its place
    shutil.rmtree(tmp_path / "a")
    _chat(tmp_path / "a", 0)
    tokens = tmp_path / "a" / "loss_mask" / "shard-00000" / "tokens.bin"
    os.remove(tokens)
    damaged("damaged mask")
    os.symlink(tmp_path / "nowhere", tokens)
    damaged("loss_mask")
    # the manifest's binding damaged: it names a mask that is not there (the tokens still read,
    # as a release before the binding reads them)
    shutil.rmtree(tmp_path / "a")
    _chat(tmp_path / "a", 0)
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    man["loss_mask"]["build_id"] = json.loads((tmp_path / "b" / "loss_mask" / "manifest.json").read_text())["build_id"]
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(man))
    damaged("not the .* the dataset's manifest names")
    with TokenStreamReader(tmp_path / "a") as r:
        assert r.num_documents == 3
    man["loss_mask"] = {"build_id": "not hex"}
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CorruptError, match="loss_mask.build_id"):
        TokenStreamReader(tmp_path / "a")


def test_a_mask_folder_without_a_mask_is_damage_not_absence(tmp_path):
    """A dataset written before masks were bound (its manifest names none) still opens its
    mask by geometry; but a ``loss_mask/`` folder whose manifest is gone is damage."""
    from zerobatch.readers.tokstream import TokenStreamReader, open_loss_mask
    from zerobatch.writers.tokstream import TokenStreamWriter
    for folder in (tmp_path / "old",):
        with TokenStreamWriter(folder, vocab_size=100) as w:
            w.add_document(np.arange(10))
        with TokenStreamWriter(folder / "loss_mask", vocab_size=2) as w:
            w.add_document(np.arange(10) % 2)
    with TokenStreamReader(tmp_path / "old") as r:
        assert r.manifest.loss_mask is None
        open_loss_mask(r).close()
        os.remove(tmp_path / "old" / "loss_mask" / "manifest.json")
        with pytest.raises(CorruptError, match="no readable mask"):
            open_loss_mask(r)
        shutil.rmtree(tmp_path / "old" / "loss_mask")
        with pytest.raises(NotFoundError, match="has no loss mask"):
            open_loss_mask(r)


def test_a_chat_dataset_goes_to_a_url_with_its_mask(s3_endpoint, tmp_path):
    """publish_tokstream takes a chat dataset's mask with it (both datasets' shards, then the
    mask's manifest, then the dataset's); a replacement brings its own mask, and a dataset
    without a mask replacing a chat dataset removes the old one."""
    from s3kit import CREDENTIALS, new_bucket

    from zerobatch.core.remote import ObjectStore
    from zerobatch.readers.tokstream import TokenStreamReader, open_loss_mask
    from zerobatch.writers.remote import publish_tokstream, unique_shard_prefix
    from zerobatch.writers.tokstream import TokenStreamWriter
    opts = {**CREDENTIALS, "endpoint": s3_endpoint}
    url = f"s3://{new_bucket(s3_endpoint)}/chat"

    def chat(folder, seed, prefix="shard-"):
        rng = np.random.default_rng(seed)
        w = TokenStreamWriter(folder, vocab_size=100, shard_tokens=200, prefix=prefix)
        m = TokenStreamWriter(folder / "loss_mask", vocab_size=2, shard_tokens=200, prefix=prefix)
        docs, masks = [], []
        for n in (30, 150, 70, 90):
            docs.append(rng.integers(0, 100, n))
            masks.append(rng.integers(0, 2, n))
            w.add_document(docs[-1])
            m.add_document(masks[-1])
        w.close(loss_mask=m.close())
        return docs, masks

    def read(cache):
        with TokenStreamReader(url, storage_options=opts, cache_dir=tmp_path / cache) as r, open_loss_mask(r) as m:
            return [r.document(i).tolist() for i in range(r.num_documents)], \
                [m.document(i).tolist() for i in range(r.num_documents)]
    docs, masks = chat(tmp_path / "one", 1)
    publish_tokstream(tmp_path / "one", url, storage_options=opts)
    assert read("c1") == ([d.tolist() for d in docs], [m.tolist() for m in masks])
    docs, masks = chat(tmp_path / "two", 2, prefix=unique_shard_prefix())
    publish_tokstream(tmp_path / "two", url, storage_options=opts, overwrite=True)
    assert read("c2") == ([d.tolist() for d in docs], [m.tolist() for m in masks])
    store = ObjectStore(url, opts)
    names = {json.loads((tmp_path / "two" / "manifest.json").read_text())["shards"][k]["name"] for k in range(2)}
    assert {k.partition("/")[0] for k, _ in store.list("")} == names | {"manifest.json", "loss_mask"}
    with TokenStreamWriter(tmp_path / "plain", vocab_size=100, prefix=unique_shard_prefix()) as w:
        w.add_document([1, 2, 3])
    publish_tokstream(tmp_path / "plain", url, storage_options=opts, overwrite=True)
    assert not [k for k, _ in store.list("") if k.startswith("loss_mask/")]
    with TokenStreamReader(url, storage_options=opts, cache_dir=tmp_path / "c3") as r, \
            pytest.raises(NotFoundError, match="has no loss mask"):
        open_loss_mask(r)


def test_the_url_writer_leaves_no_staging_folder(s3_endpoint, tmp_path, monkeypatch):
    import tempfile

    from s3kit import CREDENTIALS, new_bucket

    from zerobatch.writers.tokstream import TokenStreamWriter
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    opts = {**CREDENTIALS, "endpoint": s3_endpoint}
    url = f"s3://{new_bucket(s3_endpoint)}/ds"
    for bad in ({"vocab_size": 0}, {"vocab_size": 10, "codec": "nope", "metadata": True},
                {"vocab_size": 10, "prefix": "bad/"}):
        with pytest.raises(ZerobatchError):
            TokenStreamWriter(url, storage_options=opts, **bad)
        assert list((tmp_path / "tmp").iterdir()) == [], bad
    w = TokenStreamWriter(url, vocab_size=10, storage_options=opts)
    w.add_document([1, 2])
    with pytest.raises(ConfigError, match="publish_tokstream"):
        w.close(loss_mask=object())      # type: ignore[arg-type]
    assert list((tmp_path / "tmp").iterdir()) == []
    with TokenStreamWriter(url, vocab_size=10, storage_options=opts) as w:
        w.add_document([1, 2])
    assert list((tmp_path / "tmp").iterdir()) == []
