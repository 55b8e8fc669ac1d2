"""TOKSTREAM writer: documents, metadata spans and codecs, shards, assembly, refusals."""

from __future__ import annotations

import json
import os
import pickle
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

from zerobatch.formats import tokstream as T
from zerobatch.formats.errors import ConfigError, FormatError, LimitExceededError, NotFoundError
from zerobatch.readers.tokstream import TokenStreamReader
from zerobatch.writers.tokstream import ShardWriter, TokenStreamWriter, assemble, serialize_metadata


def docs(n_docs: int, seed: int = 0, vocab: int = 50257, max_len: int = 300) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(1, max_len))) for _ in range(n_docs)]


def test_round_trip_without_metadata(tmp_path):
    ds = docs(50)
    with TokenStreamWriter(tmp_path / "d", vocab_size=50257, shard_tokens=2000, eod_token=50256) as w:
        for t in ds:
            w.add_document(t)
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert m["token_dtype"] == "uint16" and m["metadata"] is False and m["eod_token"] == 50256
    assert m["num_tokens"] == sum(map(len, ds)) and m["num_documents"] == 50
    assert len(m["shards"]) > 1 and all(s["num_tokens"] >= 2000 for s in m["shards"][:-1])
    shard = tmp_path / "d" / m["shards"][0]["name"]
    assert sorted(os.listdir(shard)) == ["checksums.bin", "documents.index", "shard.json", "tokens.bin"]
    # the payload is a plain NumPy array from byte 0; the trailer follows it
    n0 = m["shards"][0]["num_tokens"]
    first = np.memmap(shard / "tokens.bin", dtype="<u2", mode="r", shape=(n0,))
    assert (first[: len(ds[0])] == ds[0]).all()
    assert os.path.getsize(shard / "tokens.bin") == 2 * n0 + T.TRAILER_SIZE
    starts = np.fromfile(shard / "documents.index", dtype="<u8")[:-4]
    assert starts[0] == 0 and starts[-1] == n0
    with TokenStreamReader(tmp_path / "d") as r:
        assert r.num_documents == 50
        for i, t in enumerate(ds):
            assert (r.document(i) == t).all()


def test_vocabulary_decides_the_dtype(tmp_path):
    with TokenStreamWriter(tmp_path / "a", vocab_size=65536) as w:
        w.add_document([65535, 0])
    with TokenStreamWriter(tmp_path / "b", vocab_size=65537) as w:
        w.add_document([65536, 0])
    assert json.loads((tmp_path / "a/manifest.json").read_text())["token_dtype"] == "uint16"
    assert json.loads((tmp_path / "b/manifest.json").read_text())["token_dtype"] == "uint32"
    with TokenStreamReader(tmp_path / "b") as r:
        assert r.document(0).tolist() == [65536, 0]


def read_blob(shard_dir, k):
    idx = np.fromfile(shard_dir / "metadata.index", dtype="<u8")
    data = (shard_dir / "metadata.bin").read_bytes()
    return data[idx[k]:idx[k + 1]]


def test_metadata_spans_and_ids(tmp_path):
    with ShardWriter(tmp_path, "s0", vocab_size=1000, metadata=True) as w:
        w.add_document(np.arange(10), {"doc": 0}, spans=[(2, 4, {"c": "a"}), (6, 7, {"c": "b"})])
        w.add_document(np.arange(5), None, spans=[(1, 3, [1, 2])])
        w.add_document(np.arange(3))
    rec = np.fromfile(tmp_path / "s0/tokens.bin", dtype=[("token", "<u2"), ("metadata_id", "<u4")], count=18)
    ids = rec["metadata_id"].tolist()
    none = T.NO_METADATA
    assert ids[:10] == [0, 0, 1, 1, 0, 0, 2, 0, 0, 0]
    assert ids[10:15] == [none, 3, 3, none, none]
    assert ids[15:] == [none] * 3
    assert [json.loads(read_blob(tmp_path / "s0", k)) for k in range(4)] == [{"doc": 0}, {"c": "a"}, {"c": "b"}, [1, 2]]
    entry = json.loads((tmp_path / "s0/shard.json").read_text())["shard"]
    assert entry["num_metadata"] == 4 and entry["files"]["metadata.index"]["size"] == 5 * 8


@pytest.mark.parametrize("codec, obj, decode", [
    ("numpy", np.arange(6, dtype=np.float32).reshape(2, 3), lambda b: np.load(__import__("io").BytesIO(b))),
    ("bytes", b"\x00\x01raw", bytes),
    ("pickle", {"set": {1, 2}}, pickle.loads),
])
def test_codecs(tmp_path, codec, obj, decode):
    with ShardWriter(tmp_path, "s", vocab_size=10, metadata=True, codec=codec) as w:
        w.add_document([1, 2, 3], obj)
    got = decode(read_blob(tmp_path / "s", 0))
    assert (got == obj).all() if isinstance(obj, np.ndarray) else got == obj
    assert json.loads((tmp_path / "s/shard.json").read_text())["codec"] == codec


def test_serializer_refusals():
    with pytest.raises(ConfigError):
        serialize_metadata({"x": float("nan")}, "json")
    with pytest.raises(ConfigError):
        serialize_metadata(object(), "json")
    with pytest.raises(ConfigError):
        serialize_metadata(np.array([object()]), "numpy")
    with pytest.raises(ConfigError):
        serialize_metadata(1, "yaml")


def test_bad_documents_are_refused_and_nothing_half_written(tmp_path):
    w = ShardWriter(tmp_path, "s", vocab_size=100, metadata=True)
    for bad, exc in [([], ConfigError), ([1.5], ConfigError), ([[1, 2]], ConfigError), ([100], LimitExceededError),
                     ([-1], LimitExceededError), (np.array([2**40]), LimitExceededError)]:
        with pytest.raises(exc):
            w.add_document(bad)
    for spans in ([(0, 5, 1)], [(2, 1, 1)], [(0, 2, 1), (1, 3, 1)], [(0, 1)], [(True, 2, 1)]):
        with pytest.raises(ConfigError):
            w.add_document([1, 2, 3], spans=spans)
    w.add_document([1, 2, 3])
    entry = w.close()
    assert entry.num_documents == 1 and entry.num_tokens == 3
    plain = ShardWriter(tmp_path, "p", vocab_size=100)
    with pytest.raises(ConfigError, match="metadata"):
        plain.add_document([1], {"a": 1})
    plain.abort()
    assert not any(f for f in os.listdir(tmp_path / "p"))


def test_argument_refusals(tmp_path):
    for kwargs in ({"vocab_size": 0}, {"vocab_size": 2**32 + 1}, {"vocab_size": True},
                   {"vocab_size": 10, "eod_token": 10}, {"vocab_size": 10, "codec": "yaml"}):
        with pytest.raises((ConfigError, LimitExceededError)):
            ShardWriter(tmp_path, "s", **kwargs)
    for name in ("", "a/b", "../x", ".hidden", "x" * 200):
        with pytest.raises(ConfigError):
            ShardWriter(tmp_path, name, vocab_size=10)
    with ShardWriter(tmp_path, "dup", vocab_size=10) as w:
        w.add_document([1])
    with pytest.raises(ConfigError, match="already exists"):
        ShardWriter(tmp_path, "dup", vocab_size=10)
    with pytest.raises(ConfigError):
        TokenStreamWriter(tmp_path / "x", vocab_size=10, shard_tokens=0)


def test_an_exception_aborts_the_shard(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path, "s", vocab_size=10) as w:
            w.add_document([1, 2])
            raise RuntimeError("boom")
    assert os.listdir(tmp_path / "s") == []


def _write_part(args):
    folder, name, seed = args
    with ShardWriter(folder, name, vocab_size=50257, metadata=True) as w:
        for k, t in enumerate(docs(20, seed)):
            w.add_document(t, {"part": name, "doc": k})
    return name


def test_parallel_processes_write_shards_then_assemble(tmp_path):
    folder = str(tmp_path / "d")
    os.makedirs(folder)
    jobs = [(folder, f"part-{k}", k) for k in range(4)]
    with ProcessPoolExecutor(2) as pool:
        names = list(pool.map(_write_part, jobs))
    manifest = assemble(folder)
    assert [s.name for s in manifest.shards] == sorted(names)
    with TokenStreamReader(folder) as r:
        want = np.concatenate([np.concatenate(docs(20, k)) for k in range(4)])
        assert r.num_tokens == want.size and r.num_documents == 80
        assert (r.windows([0], want.size)[0] == want).all()
    # an explicit order is kept; assembling never reads token data
    os.truncate(os.path.join(folder, "part-2", "tokens.bin"), 10)
    manifest = assemble(folder, ["part-3", "part-0", "part-1", "part-2"])
    assert [s.name for s in manifest.shards] == ["part-3", "part-0", "part-1", "part-2"]


def test_assemble_refusals(tmp_path):
    folder = tmp_path / "d"
    with pytest.raises((NotFoundError, FileNotFoundError)):
        assemble(folder)
    with ShardWriter(folder, "a", vocab_size=100) as w:
        w.add_document([1])
    with ShardWriter(folder, "b", vocab_size=200) as w:
        w.add_document([1])
    with pytest.raises(FormatError) as info:
        assemble(folder)
    assert info.value.field == "vocab_size"
    unfinished = ShardWriter(folder, "c", vocab_size=100)
    unfinished.add_document([1])
    with pytest.raises(NotFoundError):
        assemble(folder, ["a", "c"])
    unfinished.abort()
    (folder / "a" / "shard.json").write_text("{")
    with pytest.raises(FormatError):
        assemble(folder, ["a"])


def test_large_documents_cross_checksum_chunks(tmp_path):
    big = np.arange(10_000, dtype=np.int64) % 50000
    with ShardWriter(tmp_path, "s", vocab_size=50000, checksum_block=4096) as w:
        w.add_document(big)
        w.add_document(big[:7])
    entry = json.loads((tmp_path / "s/shard.json").read_text())["shard"]
    payload = (tmp_path / "s/tokens.bin").read_bytes()[:-T.TRAILER_SIZE]
    from zerobatch.core import xxh3_64
    digests = [xxh3_64(payload[i:i + 4096]) for i in range(0, len(payload), 4096)]
    assert entry["files"]["tokens.bin"]["xxh3"] == f"{xxh3_64(np.array(digests, '<u8').tobytes()):016x}"


def test_add_documents_cuts_the_same_shards_as_add_document(tmp_path):
    """Documents added many at a time (any cuts between calls) land in the same shards, with
    the same tokens and boundaries, as one add_document call each."""
    from zerobatch.readers.tokstream import TokenStreamReader
    from zerobatch.writers.tokstream import TokenStreamWriter

    rng = np.random.default_rng(0)
    for trial in range(12):
        lens = rng.integers(1, 300, int(rng.integers(1, 300)))
        toks = rng.integers(0, 1000, int(lens.sum())).astype(np.uint32)
        shard_tokens = int(rng.integers(1, 3000))
        bounds = np.concatenate([[0], np.cumsum(lens)])
        with TokenStreamWriter(tmp_path / f"a{trial}", vocab_size=1000, shard_tokens=shard_tokens) as w:
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                w.add_document(toks[a:b])
        cuts = sorted(set(rng.integers(0, lens.size + 1, 4).tolist()) | {0, lens.size})
        with TokenStreamWriter(tmp_path / f"b{trial}", vocab_size=1000, shard_tokens=shard_tokens) as w:
            for c0, c1 in zip(cuts[:-1], cuts[1:], strict=True):
                w.add_documents(toks[bounds[c0]:bounds[c1]], lens[c0:c1])
        with TokenStreamReader(tmp_path / f"a{trial}") as ra, TokenStreamReader(tmp_path / f"b{trial}") as rb:
            assert [(e.num_tokens, e.num_documents) for e in ra.manifest.shards] == \
                [(e.num_tokens, e.num_documents) for e in rb.manifest.shards], trial
            assert [ra.document(i).tolist() for i in range(ra.num_documents)] == \
                [rb.document(i).tolist() for i in range(rb.num_documents)]
    with TokenStreamWriter(tmp_path / "bad", vocab_size=10) as w:
        with pytest.raises(ConfigError, match="lengths"):
            w.add_documents(np.arange(5, dtype=np.uint32), [2, 2])
        with pytest.raises(LimitExceededError):
            w.add_documents(np.array([3, 12], np.uint32), [2])
        w.add_document([1])
