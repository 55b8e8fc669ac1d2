"""TOKSTREAM reader: windows across shards, documents, open-time validation of every file,
token ids checked on first use, and a 10**12-token dataset out of sparse files."""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys

import numpy as np
import pytest

import zerobatch.core._reference as ref
from zerobatch.formats import tokstream as T
from zerobatch.core import xxh3_64
from zerobatch.formats.errors import (ConfigError, CorruptError, FormatError, IntegrityError, NotFoundError,
                                      TruncatedError)
from zerobatch.readers.tokstream import TokenStreamReader
from zerobatch.writers.tokstream import ShardWriter, TokenStreamWriter, assemble


def build(folder, n_docs=60, shard_tokens=700, vocab=50257, metadata=False, seed=0, max_len=300):
    rng = np.random.default_rng(seed)
    ds = [rng.integers(0, vocab, int(rng.integers(1, max_len))) for _ in range(n_docs)]
    with TokenStreamWriter(folder, vocab_size=vocab, metadata=metadata, shard_tokens=shard_tokens) as w:
        for k, t in enumerate(ds):
            w.add_document(t, {"k": k} if metadata else None)
    return ds


@pytest.fixture
def dataset(tmp_path):
    folder = tmp_path / "d"
    ds = build(folder)
    return folder, ds, np.concatenate(ds)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("metadata", [False, True])
@pytest.mark.parametrize("vocab", [1000, 70000])
def test_windows_anywhere_and_across_shards(tmp_path, metadata, vocab, backend):
    folder = tmp_path / "d"
    ds = build(folder, vocab=vocab, metadata=metadata, shard_tokens=300)
    flat = np.concatenate(ds)
    with TokenStreamReader(folder, backend=backend) as r, TokenStreamReader(folder) as mapped:
        assert len(r) == flat.size and len(r.manifest.shards) > 5
        rng = np.random.default_rng(1)
        for length in (1, 17, 513, 1500):          # 1500 spans several shards
            starts = np.concatenate([rng.integers(0, flat.size - length + 1, 50),
                                     r.cum_tokens[1:-1] - length // 2, [0, flat.size - length]])
            starts = np.clip(starts, 0, flat.size - length)
            want = np.stack([flat[s:s + length] for s in starts])
            assert (r.windows(starts, length) == want).all()
            out = np.empty((starts.size, length), dtype=np.int32)
            assert r.windows(starts, length, out=out) is out and (out == want).all()
            twin = np.empty_like(want)
            ref.gather_windows([s.records for s in mapped._shards], r.cum_tokens, r.itemsize,
                               r.token_dtype.itemsize, r.vocab_size, starts, length, twin)
            assert (twin == want).all()
        for i in (0, 1, len(ds) // 2, len(ds) - 1):
            assert (r.document(i) == ds[i]).all()
        assert r.document_span(1) == (ds[0].size, ds[0].size + ds[1].size)
        assert r.window(5, 3).tolist() == flat[5:8].tolist()


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_ranges_with_positions_and_labels_on_every_path(tmp_path, backend):
    # one compiled pass (mapped or pread), a read over more shards than open files (piece by
    # piece, then the layout), and the read-ahead task all give the same documents
    from zerobatch.core.pool import TaskPool
    folder = tmp_path / "d"
    ds = build(folder, n_docs=40, shard_tokens=200, max_len=150)
    flat = np.concatenate(ds)
    with TokenStreamReader(folder, backend=backend, max_open_files=2 if backend == "pread" else None) as r:
        idx = np.array([3, 0, 39, 17, 17, 25])
        a, b = r.document_spans(idx)
        assert [int(y - x) for x, y in zip(a, b, strict=True)] == [ds[i].size for i in idx]
        total = int((b - a).sum())
        want = np.concatenate([ds[i] for i in idx])
        pos_want = np.concatenate([np.arange(ds[i].size) for i in idx])
        lab_want = np.concatenate([np.append(ds[i][1:], -100) for i in idx])
        for starts, stops in ((a, b), (np.array([0]), np.array([flat.size]))):   # the whole stream: 8+ shards
            n = int((stops - starts).sum())
            out, pos, lab = np.empty(n, np.int64), np.empty(n, np.int32), np.empty(n, np.int64)
            assert r.ranges(starts, stops, out=out, position_ids=pos, labels=lab) is out
            if n == total:
                assert (out == want).all() and (pos == pos_want).all() and (lab == lab_want).all()
            else:
                assert (out == flat).all() and (pos == np.arange(n)).all() and lab[-1] == -100
                assert (lab[:-1] == flat[1:]).all()
        pool = TaskPool(1)
        try:
            out, pos, lab = np.empty(total, np.int32), np.empty(total, np.int64), np.empty(total, np.int32)
            assert r.ranges_async(pool, a, b, out, position_ids=pos, labels=lab).wait() is out
            assert (out == want).all() and (pos == pos_want).all() and (lab == lab_want).all()
            with pytest.raises(ConfigError, match="out"):
                r.ranges_async(pool, a, b, np.empty(total + 1, np.int64))
        finally:
            pool.stop()


def test_window_and_document_refusals(dataset):
    folder, ds, flat = dataset
    with TokenStreamReader(folder) as r:
        for starts, length in (([-1], 4), ([flat.size - 3], 4), ([2**62], 4)):
            with pytest.raises(IndexError):
                r.windows(starts, length)
        with pytest.raises(IndexError):
            r.document(len(ds))
        with pytest.raises(ConfigError):
            r.windows([0], 4, out=np.empty((1, 5), np.int64))
        with pytest.raises(ConfigError):
            r.windows([0], 4, dtype=np.float32)
        with pytest.raises(ConfigError):
            r.windows([0.5], 4)
        assert r.windows([], 4).shape == (0, 4)
    with pytest.raises(ConfigError):
        r.windows([0], 4)


def unfit_buffers(shape, dtype):
    ro = np.zeros(shape, dtype)
    ro.flags.writeable = False
    wide = np.zeros((shape[0], shape[1] * 2) if len(shape) == 2 else shape[0] * 2, dtype)
    strided = wide[:, ::2] if len(shape) == 2 else wide[::2]
    return [ro, strided, np.zeros(shape, np.float64), np.zeros(shape, np.uint64), np.zeros(shape, ">i8"),
            np.zeros(shape, dtype).tolist(), np.zeros(int(np.prod(shape)) + 1, dtype), bytearray(8 * int(np.prod(shape)))]


def test_unfit_output_buffers_are_refused_and_nothing_is_written(dataset):
    folder, ds, flat = dataset
    with TokenStreamReader(folder) as r:
        for bad in unfit_buffers((2, 4), np.int64):
            before = np.array(bad, copy=True) if isinstance(bad, np.ndarray) else None
            with pytest.raises(ConfigError):
                r.windows([0, 3], 4, out=bad)
            if before is not None:
                assert (np.asarray(bad) == before).all()
        for name, shape, dtype in (("position_ids", (2, 4), np.int64), ("segment_ids", (2, 4), np.int32),
                                   ("cu_seqlens", (9,), np.int32)):
            for bad in unfit_buffers(shape, dtype):
                with pytest.raises(ConfigError) as e:
                    r.boundaries([0, 3], 4, **{name: bad})
                assert e.value.field == name
        # the same buffers, fit, are filled in place (a 2-D int32 position buffer is fit too)
        pos, seg, cu = np.empty((2, 4), np.int32), np.empty((2, 4), np.int32), np.empty(9, np.int32)
        p, s_, c, m = r.boundaries([0, 3], 4, position_ids=pos, segment_ids=seg, cu_seqlens=cu)
        assert p is pos and s_ is seg and np.shares_memory(c, cu) and m >= 1


# ---------------------------------------------------------------------------------------
# bad input, refused at open (or at first use for token ids), naming the file and field


def shard_dir(folder, k=0):
    m = json.loads((folder / "manifest.json").read_text())
    return folder / m["shards"][k]["name"]


def test_missing_manifest_and_files(dataset, tmp_path):
    folder, _, _ = dataset
    with pytest.raises(NotFoundError):
        TokenStreamReader(tmp_path / "nothing")
    os.remove(shard_dir(folder, 1) / "documents.index")
    with pytest.raises(NotFoundError) as info:
        TokenStreamReader(folder)
    assert info.value.path.endswith("documents.index")


def test_missing_shard_folder(dataset):
    folder, _, _ = dataset
    shutil.rmtree(shard_dir(folder, 2))
    with pytest.raises(NotFoundError):
        TokenStreamReader(folder)


def test_extra_file_in_a_shard(dataset):
    folder, _, _ = dataset
    (shard_dir(folder) / "metadata.bin").write_bytes(b"x")
    with pytest.raises(CorruptError) as info:
        TokenStreamReader(folder)
    assert info.value.field == "files" and info.value.path.endswith("metadata.bin")


@pytest.mark.parametrize("fname", ["tokens.bin", "documents.index"])
def test_sizes_that_disagree_with_the_manifest(dataset, fname):
    folder, _, _ = dataset
    path = shard_dir(folder) / fname
    size = os.path.getsize(path)
    os.truncate(path, size - 2)
    with pytest.raises(TruncatedError) as info:
        TokenStreamReader(folder)
    assert info.value.path == str(path) and info.value.field == "size"
    with open(path, "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(CorruptError) as info:
        TokenStreamReader(folder)
    assert info.value.field == "size"


def test_a_file_from_another_build_is_refused(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    docs = build(a, seed=3)
    # the same documents, one token changed: files of the same sizes, another build
    docs[0] = docs[0].copy()
    docs[0][0] = (docs[0][0] + 1) % 50257
    with TokenStreamWriter(b, vocab_size=50257, shard_tokens=700) as w:
        for t in docs:
            w.add_document(t)
    shutil.copy(shard_dir(b) / "tokens.bin", shard_dir(a) / "tokens.bin")
    with pytest.raises(CorruptError) as info:
        TokenStreamReader(a)
    assert info.value.field == "build_id" and info.value.path.endswith("tokens.bin")
    # the same documents written again make the same build, file for file (ids derive from
    # the contents), so a file of one is a file of the other
    build(c, seed=3)
    build(tmp_path / "d", seed=3)
    for f in sorted(p.name for p in shard_dir(c).iterdir()):
        assert (shard_dir(c) / f).read_bytes() == (shard_dir(tmp_path / "d") / f).read_bytes(), f


def test_damaged_trailer(dataset):
    folder, _, _ = dataset
    path = shard_dir(folder) / "documents.index"
    data = bytearray(path.read_bytes())
    data[-T.TRAILER_SIZE] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptError) as info:
        TokenStreamReader(folder)
    assert info.value.field == "trailer"


def patch_u64(path, index, value):
    with open(path, "r+b") as f:
        f.seek(8 * index)
        f.write(np.array([value], dtype="<u8").tobytes())


@pytest.mark.parametrize("index, value, what", [(0, 1, "documents.index[0]"), (2, 0, "documents.index[2]"),
                                                 (-1, 10**9, "documents.index")])
def test_document_index_must_start_at_zero_increase_and_end_at_the_tokens(dataset, index, value, what):
    folder, _, _ = dataset
    path = shard_dir(folder) / "documents.index"
    entry = json.loads((shard_dir(folder) / "shard.json").read_text())["shard"]
    patch_u64(path, entry["num_documents"] if index == -1 else index, value)
    with pytest.raises(CorruptError) as info:
        TokenStreamReader(folder)
    assert info.value.field == "documents.index" and what in str(info.value)
    assert info.value.path == str(path)


def test_metadata_index_past_metadata_bin(tmp_path):
    folder = tmp_path / "d"
    build(folder, metadata=True)
    d = shard_dir(folder)
    entry = json.loads((d / "shard.json").read_text())["shard"]
    patch_u64(d / "metadata.index", entry["num_metadata"], 10**12)
    with pytest.raises(CorruptError) as info:
        TokenStreamReader(folder)
    assert info.value.field == "metadata.index" and "metadata.bin" in str(info.value)
    patch_u64(d / "metadata.index", entry["num_metadata"], entry["files"]["metadata.bin"]["size"])
    patch_u64(d / "metadata.index", 2, 10**6)
    with pytest.raises(CorruptError, match="metadata.index"):
        TokenStreamReader(folder)


def test_token_ids_at_or_above_the_vocabulary_fail_on_first_use(dataset):
    folder, _, flat = dataset
    path = shard_dir(folder, 1) / "tokens.bin"
    with open(path, "r+b") as f:
        f.seek(2 * 5)
        f.write(np.array([60000], dtype="<u2").tobytes())
    # checksums on (the default): the changed chunk fails its check on first use; opening
    # reads no token, and the other shards still read
    with TokenStreamReader(folder) as r:
        pos = int(r.cum_tokens[1]) + 5
        assert (r.windows([0], 10)[0] == flat[:10]).all()
        with pytest.raises(IntegrityError) as info:
            r.windows([pos - 3], 8)
        assert info.value.field == "xxh3" and info.value.path == str(path) and "block 0" in str(info.value)
        with pytest.raises(IntegrityError):       # a failed chunk stays unchecked: it fails again
            r.windows([pos - 3], 8)
        assert (r.windows([0], 10)[0] == flat[:10]).all()
    # checksums off: the vocabulary check still refuses the id, naming the place
    with TokenStreamReader(folder, verify=False) as r:
        with pytest.raises(CorruptError) as info:
            r.windows([pos - 3], 8)
        assert info.value.field == "token" and info.value.path == str(path)
        assert f"global position {pos}" in str(info.value)


@pytest.mark.parametrize("mutate, field", [
    (lambda m: m.update(version=3), "version"),
    (lambda m: m.update(format="other"), "format"),
    (lambda m: m.update(num_tokens=m["num_tokens"] + 1), "num_tokens"),
    (lambda m: m["shards"][0].update(num_tokens=m["shards"][0]["num_tokens"] + 1), "shards[0].files.tokens.bin.size"),
    (lambda m: m["shards"][1].update(name=m["shards"][0]["name"]), "shards"),
    (lambda m: m.update(token_dtype="uint32"), "token_dtype"),
    (lambda m: m["shards"][0]["files"].pop("documents.index"), "shards[0].files"),
    (lambda m: m["shards"][0].update(build_id="zz"), "shards[0].build_id"),
    (lambda m: m["shards"][0].update(name="../escape"), "shards[0].name"),
    (lambda m: m.update(vocab_size=True), "vocab_size"),
])
def test_manifest_damage(dataset, mutate, field):
    folder, _, _ = dataset
    path = folder / "manifest.json"
    m = json.loads(path.read_text())
    mutate(m)
    path.write_text(json.dumps(m))
    with pytest.raises(FormatError) as info:
        TokenStreamReader(folder)
    assert info.value.field == field and info.value.path == str(path)


@pytest.mark.parametrize("text", ["{", "[]", '{"format": "zerobatch-tokstream", "format": 1}', "\xff",
                                  '{"version": NaN}'])
def test_manifest_garbage(dataset, text):
    folder, _, _ = dataset
    (folder / "manifest.json").write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff" else b"\xff")
    with pytest.raises(FormatError):
        TokenStreamReader(folder)


# ---------------------------------------------------------------------------------------
# scale


ZERO_CHUNK_DIGEST = None


def sparse_shard(folder, name, num_tokens, vocab):
    """A shard of ``num_tokens`` zero tokens (a sparse file: no disk used) in one document,
    with the chunk digests a writer would have recorded."""
    global ZERO_CHUNK_DIGEST
    if ZERO_CHUNK_DIGEST is None:
        ZERO_CHUNK_DIGEST = xxh3_64(bytes(T.CHECKSUM_CHUNK))
    d = folder / name
    d.mkdir(parents=True)
    build_id = os.urandom(16)
    size = 2 * num_tokens
    with open(d / "tokens.bin", "wb") as f:
        f.truncate(size)
        f.seek(size)
        f.write(T.pack_trailer(build_id, T.FILE_KINDS["tokens.bin"]))
    index = np.array([0, num_tokens], dtype="<u8").tobytes()
    with open(d / "documents.index", "wb") as f:
        f.write(index)
        f.write(T.pack_trailer(build_id, T.FILE_KINDS["documents.index"]))
    assert size % T.CHECKSUM_CHUNK == 0
    tok_digests = np.full(size // T.CHECKSUM_CHUNK, ZERO_CHUNK_DIGEST, dtype="<u8")
    idx_digests = np.array([xxh3_64(index)], dtype="<u8")
    sums = np.concatenate([tok_digests, idx_digests]).tobytes()
    assert len(sums) <= T.CHECKSUM_CHUNK          # one page of digests: one top-level digest
    top = np.array([xxh3_64(sums)], dtype="<u8")
    with open(d / "checksums.bin", "wb") as f:
        f.write(sums)
        f.write(top.tobytes())
        f.write(T.pack_trailer(build_id, T.FILE_KINDS["checksums.bin"]))

    def hexsum(digests):
        return f"{xxh3_64(np.asarray(digests, dtype='<u8').tobytes()):016x}"

    entry = T.ShardEntry(name, build_id.hex(), num_tokens, 1, 0, {
        "tokens.bin": T.FileEntry(size, hexsum(tok_digests)),
        "documents.index": T.FileEntry(16, hexsum(idx_digests)),
        "checksums.bin": T.FileEntry(len(sums) + top.nbytes, hexsum(top))})
    record = {"format": T.FORMAT_NAME, "version": 2, "token_dtype": "uint16", "vocab_size": vocab,
              "metadata": False, "eod_token": None, "codec": None, "checksum_block": T.CHECKSUM_CHUNK,
              "shard": entry.to_dict()}
    (d / "shard.json").write_text(json.dumps(record))


def test_a_trillion_tokens_out_of_sparse_files(tmp_path):
    folder = tmp_path / "big"
    with ShardWriter(folder, "a-head", vocab_size=50257, checksum_block=T.CHECKSUM_CHUNK) as w:
        w.add_document(np.arange(100) + 7)
    for name in ("b-huge", "c-huge", "c-huger"):
        sparse_shard(folder, name, 2**39, 50257)   # 1.6e12 tokens in all, 3.3 TB of sparse files
    with ShardWriter(folder, "d-tail", vocab_size=50257, checksum_block=T.CHECKSUM_CHUNK) as w:
        w.add_document(np.arange(100) + 9)
    assemble(folder)
    # opening reads the manifests, the trailers and the index ends: no token data, so its
    # cost does not grow with the token count (bytes read and pages touched, not timed)
    io0, faults0 = read_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    r = TokenStreamReader(folder)
    assert read_bytes() - io0 < 1 << 20
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0 < 2000
    assert r.num_tokens == 3 * 2**39 + 200 >= 10**12 and r.num_documents == 5
    past = 2**40 + 12345
    assert (r.windows([past], 513)[0] == 0).all()
    # a batch of windows anywhere, including across both sparse boundaries
    b1 = int(r.cum_tokens[2])          # the boundary between two sparse shards (2**39 + 100)
    starts = np.array([0, 50, past, b1 - 10, r.num_tokens - 600, r.num_tokens - 513])
    w = r.windows(starts, 513)
    assert (w[0, :100] == np.arange(100) + 7).all() and (w[0, 100:] == 0).all()
    assert (w[-1, -100:] == np.arange(100) + 9).all()
    assert (w[4, :500] == 0).all() and (w[4, 500:] == np.arange(13) + 9).all()
    assert (w[3] == 0).all()
    assert r.document_span(4) == (3 * 2**39 + 100, 3 * 2**39 + 200)
    r.close()


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_windows_split_over_threads_equal_one_thread(tmp_path):
    folder = tmp_path / "d"
    build(folder, n_docs=200, shard_tokens=5000)
    with TokenStreamReader(folder) as one, TokenStreamReader(folder, num_threads=3) as three:
        rng = np.random.default_rng(5)
        # below 64 Ki tokens a batch stays on the calling thread; 400 x 700 is split in four
        for count in (1, 3, 4, 9, 64, 190, 400):
            starts = rng.integers(0, one.num_tokens - 700, count)
            assert (three.windows(starts, 700) == one.windows(starts, 700)).all()
        for bad_at in (0, 399):
            starts = np.zeros(400, np.int64)
            starts[bad_at] = one.num_tokens
            with pytest.raises(IndexError):
                three.windows(starts, 700)


def test_document_boundaries_match_the_twin_and_the_documents(tmp_path):
    folder = tmp_path / "d"
    ds = build(folder, n_docs=120, shard_tokens=400, max_len=90)
    doc_starts = np.concatenate([[0], np.cumsum([len(t) for t in ds])[:-1]])
    with TokenStreamReader(folder) as r:
        twin = ref.WindowGather([s.records for s in r._shards], r.cum_tokens, r.itemsize, 2, r.vocab_size,
                                documents=[s.documents for s in r._shards])
        rng = np.random.default_rng(3)
        for length in (1, 7, 64, 513):
            starts = np.concatenate([rng.integers(0, r.num_tokens - length + 1, 40), [0, r.num_tokens - length],
                                     np.clip(doc_starts[1:6] - 1, 0, r.num_tokens - length)])
            pos, seg, cu, maxlen = r.boundaries(starts, length)
            tpos, tseg, tcu, tmax = twin.boundaries(starts, length)
            assert (pos == tpos).all() and (seg == tseg).all() and (cu == tcu).all() and maxlen == tmax
            assert cu[0] == 0 and cu[-1] == starts.size * length and (np.diff(cu) > 0).all()
            assert maxlen == np.diff(cu).max()
            # a segment restarts exactly where a document starts inside the window
            for w, s in enumerate(starts):
                inside = [d - s for d in doc_starts if s < d < s + length]
                assert np.flatnonzero(pos[w] == 0).tolist() == [0] + inside
        with pytest.raises(IndexError):
            r.boundaries([r.num_tokens - 3], 4)


def test_window_metadata_coalesced_and_zero_copy(tmp_path):
    folder = tmp_path / "d"
    rng = np.random.default_rng(9)
    ds, spans = [], []
    with TokenStreamWriter(folder, vocab_size=1000, metadata=True, shard_tokens=300) as w:
        for k in range(60):
            t = rng.integers(0, 1000, int(rng.integers(5, 60)))
            sp = [(1, 3, {"concept": f"c{k}"})] if k % 3 == 0 else []
            w.add_document(t, {"doc": k} if k % 5 else None, spans=sp)
            ds.append(t)
            spans.append(sp)
    # the expected metadata of every token, from the documents themselves
    want = []
    for k, t in enumerate(ds):
        per = [{"doc": k} if k % 5 else None] * len(t)
        for a, b, obj in spans[k]:
            per[a:b] = [obj] * (b - a)
        want.extend(per)
    for backend in ("mmap", "pread"):
        with TokenStreamReader(folder, backend=backend) as r:
            for start, length in [(0, 50), (r.cum_tokens[1] - 20, 60), (r.num_tokens - 100, 100), (7, 1)]:
                start = int(start)
                meta = r.window_metadata(start, length)
                got = [None if i < 0 else meta.objects[i] for i in meta.ids.tolist()]
                assert got == want[start:start + length]
                # distinct blobs per shard piece (a blob never repeats within one shard's piece)
                assert len(meta.objects) <= len(set(meta.ids.tolist()) - {-1}) + 1
                raw = r.window_metadata(start, length, decode=False)
                assert all(isinstance(b, memoryview) for b in raw.objects)
                assert [json.loads(bytes(b)) for b in raw.objects] == meta.objects
            with pytest.raises(IndexError):
                r.window_metadata(r.num_tokens - 5, 6)


def spans_dataset(folder, n_docs=80, shard_tokens=300, vocab=1000, max_len=60):
    # documents with document-level metadata (4 in 5) and span-level concepts (1 in 3), and
    # the expected metadata object of every token
    rng = np.random.default_rng(9)
    want = []
    with TokenStreamWriter(folder, vocab_size=vocab, metadata=True, shard_tokens=shard_tokens) as w:
        for k in range(n_docs):
            t = rng.integers(0, vocab, int(rng.integers(5, max_len)))
            sp = [(1, 3, {"concept": f"c{k}"})] if k % 3 == 0 else []
            w.add_document(t, {"doc": k} if k % 5 else None, spans=sp)
            per = [{"doc": k} if k % 5 else None] * len(t)
            for a, b, obj in sp:
                per[a:b] = [obj] * (b - a)
            want.extend(per)
    return want


@pytest.fixture(params=["avx512", "portable"])
def meta_path(request):
    # the metadata numbering runs on AVX-512 where the CPU has it; both paths must agree
    from zerobatch.core import PURE_PYTHON

    if PURE_PYTHON:         # the twin has one path
        if request.param == "avx512":
            pytest.skip("the pure-Python twin has one metadata path")
        yield request.param
        return
    from zerobatch.core import _tokstream

    if request.param == "avx512" and _tokstream._meta_path(True) != "avx512":
        pytest.skip("this CPU has no AVX-512BW")
    _tokstream._meta_path(request.param == "avx512")
    yield request.param
    _tokstream._meta_path(True)


@pytest.mark.parametrize("vocab", [1000, 100_000])
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_batch_metadata_deduplicated_over_the_batch(tmp_path, backend, vocab, meta_path):
    folder = tmp_path / "d"
    want = spans_dataset(folder, vocab=vocab, max_len=120)
    flat = np.concatenate([TokenStreamReader(folder).document(i) for i in range(80)])
    rng = np.random.default_rng(4)
    with TokenStreamReader(folder, backend=backend) as r:
        assert r.token_dtype == (np.uint16 if vocab < 2**16 else np.uint32)
        for length in (1, 15, 16, 17, 33, 200, 513):
            starts = np.concatenate([rng.integers(0, r.num_tokens - length + 1, 30),
                                     [0, r.num_tokens - length, int(r.cum_tokens[1]) - 1]])
            starts = np.clip(starts, 0, r.num_tokens - length)
            for dtype in (np.int64, np.int32):
                toks = np.empty((starts.size, length), dtype)
                meta = r.windows_metadata(starts, length, out=toks)
                for row, trow, st in zip(meta.ids.tolist(), toks, starts.tolist(), strict=True):
                    assert [None if i < 0 else meta.objects[i] for i in row] == want[st:st + length]
                    assert (trow == flat[st:st + length]).all()
        for length in (1, 17, 200):
            starts = np.concatenate([rng.integers(0, r.num_tokens - length + 1, 30),
                                     [0, r.num_tokens - length, int(r.cum_tokens[1]) - 1]])
            starts = np.clip(starts, 0, r.num_tokens - length)
            buf = np.full((starts.size, length), 7, np.int32)
            meta = r.windows_metadata(starts, length, ids=buf)
            assert meta.ids is buf and meta.keys.shape == (len(meta.objects), 2)
            for row, st in zip(meta.ids.tolist(), starts.tolist(), strict=True):
                assert [None if i < 0 else meta.objects[i] for i in row] == want[st:st + length]
            # each (shard, id) once in the batch, numbered in order of first appearance
            assert len({tuple(k) for k in meta.keys.tolist()}) == len(meta.objects)
            seen = meta.ids.ravel()[meta.ids.ravel() >= 0]
            assert (np.unique(seen, return_index=True)[0] == np.arange(len(meta.objects))).all()
            firsts = np.unique(seen, return_index=True)[1]
            assert (np.diff(firsts) > 0).all()
            raw = r.windows_metadata(starts, length, decode=False)
            assert [json.loads(bytes(b)) for b in raw.objects] == meta.objects
            assert (raw.keys == meta.keys).all()
        empty = r.windows_metadata(np.zeros(0, np.int64), 5)
        assert empty.ids.shape == (0, 5) and empty.objects == []
        with pytest.raises(IndexError):
            r.windows_metadata([0, r.num_tokens - 4], 5)
        with pytest.raises(ConfigError) as info:
            r.windows_metadata([0], 5, ids=np.empty((1, 5), np.int64))
        assert info.value.field == "ids"


def test_metadata_faults_found_by_the_batch_path_name_the_place(tmp_path, meta_path):
    # a metadata id past the shard's count, or a token past the vocabulary, anywhere in a
    # 16-record block (the AVX-512 path) or in the tail (the portable one)
    for at in (0, 5, 16, 31, 47, 100):
        folder = tmp_path / f"d{at}"
        spans_dataset(folder, n_docs=30, shard_tokens=10**6, max_len=120)
        path = shard_dir(folder) / "tokens.bin"
        with open(path, "r+b") as f:
            f.seek(6 * at + 2)
            f.write(np.array([2**31], dtype="<u4").tobytes())
        with TokenStreamReader(folder) as r:
            with pytest.raises(IntegrityError):      # checksums find it first
                r.windows_metadata([0], 120)
        with TokenStreamReader(folder, verify=False) as r:
            with pytest.raises(CorruptError) as info:
                r.windows_metadata([0], 120, out=np.empty((1, 120), np.int64))
            assert info.value.field == "metadata_id" and f"global position {at} " in str(info.value)
            assert r.windows_metadata([at + 1], 100).ids.shape == (1, 100)
        with open(path, "r+b") as f:
            f.seek(6 * at + 2)
            f.write(np.array([0], dtype="<u4").tobytes())
            f.seek(6 * at)
            f.write(np.array([60000], dtype="<u2").tobytes())
        with TokenStreamReader(folder, verify=False) as r:
            r.windows_metadata([0], 120)            # ids alone read no token
            with pytest.raises(CorruptError) as info:
                r.windows_metadata([0], 120, out=np.empty((1, 120), np.int32))
            assert info.value.field == "token" and f"global position {at} " in str(info.value)


def test_metadata_index_entries_are_checked_when_used(tmp_path, monkeypatch):
    # index files above FULL_INDEX_CHECK_BYTES are checked only at their ends at open: an
    # entry inside them that points past metadata.bin is refused when a window uses it
    import zerobatch.readers._tokstream_shard as rt

    folder = tmp_path / "d"
    spans_dataset(folder, n_docs=10, shard_tokens=10**6)
    patch_u64(shard_dir(folder) / "metadata.index", 1, 10**9)
    monkeypatch.setattr(rt, "FULL_INDEX_CHECK_BYTES", 0)
    with pytest.raises(IntegrityError) as info:      # checksums check index files in full at open
        TokenStreamReader(folder)
    assert info.value.path.endswith("metadata.index")
    with TokenStreamReader(folder, verify=False) as r:
        assert r.windows_metadata([r.num_tokens - 3], 3).objects
        with pytest.raises(CorruptError) as info:
            r.windows_metadata([0], 3)
        assert info.value.field == "metadata.index" and info.value.path.endswith("metadata.index")
        with pytest.raises(CorruptError):
            r.verify_indexes()


def test_metadata_refusals(tmp_path, dataset):
    folder, _, _ = dataset
    with TokenStreamReader(folder) as r:
        with pytest.raises(ConfigError):
            r.window_metadata(0, 10)
    mfolder = tmp_path / "m"
    build(mfolder, metadata=True)
    d = shard_dir(mfolder)
    with open(d / "tokens.bin", "r+b") as f:
        f.seek(2)                            # metadata_id of record 0 (after its u16 token)
        f.write(np.array([10**6], dtype="<u4").tobytes())
    with TokenStreamReader(mfolder, verify=False) as r:
        with pytest.raises(CorruptError) as info:
            r.window_metadata(0, 5)
        assert info.value.field == "metadata_id" and info.value.path.endswith("tokens.bin")


def test_pread_backend_reports_a_file_that_shrank_after_open(dataset):
    folder, _, flat = dataset
    with TokenStreamReader(folder, backend="pread") as r:
        assert (r.windows([3], 20)[0] == flat[3:23]).all()
        path = shard_dir(folder, 1) / "tokens.bin"
        os.truncate(path, 10)
        with pytest.raises(TruncatedError) as info:
            r.windows([int(r.cum_tokens[1]) + 50], 20)
        assert info.value.path == str(path)
    with pytest.raises(ConfigError):
        TokenStreamReader(folder, backend="s3")


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_documents_flat_and_padded(tmp_path, backend):
    folder = tmp_path / "d"
    ds = build(folder, n_docs=80, shard_tokens=500, max_len=120)
    with TokenStreamReader(folder, backend=backend) as r:
        idx = [5, 0, 79, 40, 40]
        flat, offsets = r.documents(idx)
        assert offsets.tolist() == [0] + np.cumsum([len(ds[i]) for i in idx]).tolist()
        for k, i in enumerate(idx):
            assert (flat[offsets[k]:offsets[k + 1]] == ds[i]).all()
        tokens, mask = r.documents(idx, pad_to=64, pad_id=-1, dtype=np.int32)
        assert tokens.shape == (5, 64) and tokens.dtype == np.int32
        for k, i in enumerate(idx):
            n = min(64, len(ds[i]))
            assert mask[k].sum() == n and (tokens[k, :n] == ds[i][:n]).all() and (tokens[k, n:] == -1).all()
        assert r.documents([])[0].size == 0
        with pytest.raises(IndexError):
            r.documents([80])


def test_shuffled_windows_and_documents_through_the_samplers(dataset):
    from zerobatch.samplers import GlobalRandomOrder, IndexSampler

    folder, ds, flat = dataset
    with TokenStreamReader(folder) as r:
        seq = 33
        n = r.num_windows(seq + 1)
        assert n == (flat.size - (seq + 1)) // seq + 1
        sampler = IndexSampler(GlobalRandomOrder(n, seed=4), 8, tail="drop")
        seen = []
        for idx in sampler:
            starts = r.window_starts(idx, seq + 1)
            w = r.windows(starts, seq + 1)
            x, y = w[:, :-1], w[:, 1:]
            assert (x[:, 1:] == y[:, :-1]).all()
            for s, row in zip(starts, w, strict=True):
                assert (row == flat[s:s + seq + 1]).all()
            seen.extend(idx.tolist())
        assert len(set(seen)) == len(seen) == n // 8 * 8
        with pytest.raises(IndexError):
            r.window_starts([n], seq + 1)
        docs = IndexSampler(GlobalRandomOrder(r.num_documents, seed=2), 7)
        got = [i for batch in docs for i in batch.tolist()]
        assert sorted(got) == list(range(len(ds)))
        tokens, offsets = r.documents(got[:7])
        assert (tokens[offsets[0]:offsets[1]] == ds[got[0]]).all()


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_windows_with_boundaries_in_one_pass_match_the_twin(tmp_path, backend):
    folder = tmp_path / "d"
    build(folder, n_docs=120, shard_tokens=400, max_len=90)
    with TokenStreamReader(folder, backend=backend) as r:
        twin = ref.WindowGather([s.records if s.records is not None else np.fromfile(os.path.join(s.path, "tokens.bin"),
                                 dtype=s.dtype, count=s.entry.num_tokens) for s in r._shards],
                                r.cum_tokens, r.itemsize, 2, r.vocab_size, documents=[s.documents for s in r._shards])
        rng = np.random.default_rng(8)
        for length, bl in ((2, None), (65, None), (65, 65), (513, 100)):
            starts = np.concatenate([rng.integers(0, r.num_tokens - length + 1, 30), [0, r.num_tokens - length]])
            for dt, pdt, segs in ((np.int64, np.int64, True), (np.int32, np.int32, False), (np.int64, None, False)):
                got = r.windows_with_boundaries(starts, length, dtype=dt, boundaries_length=bl, position_dtype=pdt,
                                                segments=segs)
                want = twin.gather_with_boundaries(starts, length, np.empty((starts.size, length), dt), bl,
                                                   position_dtype=pdt, segments=segs)
                assert got[0].dtype == dt and (got[1] is None if pdt is None else got[1].dtype == pdt)
                for g, w in zip(got, want, strict=True):
                    assert (g is None and w is None) or (np.asarray(g) == np.asarray(w)).all()
            # boundaries alone, cu_seqlens and max_seqlen only
            pos, seg, cu, mx = r.boundaries(starts, bl or length - 1, position_dtype=None, segments=False)
            assert pos is None and seg is None and (cu == want[3]).all() and mx == want[4]
        with pytest.raises(ConfigError):
            r.windows_with_boundaries([0], 10, boundaries_length=11)
        with pytest.raises(IndexError):
            r.windows_with_boundaries([r.num_tokens - 5], 10)


@pytest.mark.parametrize("vocab", [1000, 100_000])
def test_metadata_ids_match_the_twin(tmp_path, vocab, meta_path):
    folder = tmp_path / "d"
    spans_dataset(folder, vocab=vocab, max_len=150)
    with TokenStreamReader(folder) as r:
        twin = ref.WindowGather([s.records for s in r._shards], r.cum_tokens, r.itemsize, r.token_dtype.itemsize,
                                r.vocab_size, metadata_indexes=[s.metadata_index for s in r._shards])
        rng = np.random.default_rng(3)
        for length in (1, 16, 47, 300):
            starts = rng.integers(0, r.num_tokens - length + 1, 25)
            ids, table = r._gather.metadata_ids(starts, length, None, np.empty((25, length), np.int64))
            tids, ttable = twin.metadata_ids(starts, length)
            assert (ids == tids).all() and (table == ttable).all()


def test_boundaries_into_caller_buffers(dataset):
    folder, _, _ = dataset
    with TokenStreamReader(folder) as r:
        starts = np.array([0, 100, 2000])
        want = r.boundaries(starts, 300)
        pos, seg, cu = np.empty((3, 300), np.int64), np.empty((3, 300), np.int32), np.empty(901, np.int32)
        got = r.boundaries(starts, 300, position_ids=pos, segment_ids=seg, cu_seqlens=cu)
        assert got[0] is pos and got[1] is seg and np.shares_memory(got[2], cu)
        assert all((a == b).all() for a, b in zip(got[:3], want[:3], strict=True)) and got[3] == want[3]
        pos32 = np.empty((3, 300), np.int32)
        lean = r.boundaries(starts, 300, position_ids=pos32, segments=False)
        assert lean[0] is pos32 and (pos32 == want[0]).all() and lean[1] is None and (lean[2] == want[2]).all()
        assert r.boundaries(starts, 300, position_dtype=np.int32)[0].dtype == np.int32
        with pytest.raises(ConfigError):
            r.boundaries(starts, 300, position_ids=np.empty((3, 300), np.float32))
        with pytest.raises(ConfigError):
            r.boundaries(starts, 300, segment_ids=np.empty((3, 299), np.int32))


@pytest.mark.skipif(sys.version_info < (3, 13) and os.environ.get("ZEROBATCH_PUREPYTHON") == "1",
                    reason="the pure-Python mapping keeps a descriptor before Python 3.13")
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_hundreds_of_shards_under_a_small_descriptor_limit(tmp_path, backend):
    """400 shards open and read under RLIMIT_NOFILE = 64: mappings hold no descriptor, and
    the pread backend keeps at most 16 open (a quarter of the limit), least recently used
    closed first; a window over more shards than that is read piece by piece."""
    from zbtest import run_python

    folder = tmp_path / "many"
    build(folder, n_docs=400, shard_tokens=1, max_len=20)
    with TokenStreamReader(folder) as r:
        want_w = r.windows(np.arange(0, r.num_tokens - 50, 7), 50)
        want_long = r.windows([3], 600)          # spans more shards than descriptors
    np.save(tmp_path / "want_w.npy", want_w)
    np.save(tmp_path / "want_long.npy", want_long)
    code = f"""
import os, resource, numpy as np
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from zerobatch.readers.tokstream import TokenStreamReader
r = TokenStreamReader({str(folder)!r}, backend={backend!r})
assert len(r.manifest.shards) == 400
w = r.windows(np.arange(0, r.num_tokens - 50, 7), 50)
assert (w == np.load({str(tmp_path / "want_w.npy")!r})).all()
assert (r.windows([3], 600) == np.load({str(tmp_path / "want_long.npy")!r})).all()
d = r.documents(np.arange(400))[0]
assert d.size == r.num_tokens
assert r.verify().ok
open_fds = len(os.listdir("/proc/self/fd"))
assert open_fds < 30, open_fds
r.close()
print("OK", len(r.manifest.shards), w.shape, open_fds)
"""
    res = run_python(code)
    assert res.returncode == 0, res.stderr
    assert "OK 400" in res.stdout


# -- labels masked by the loss mask, in the token read ----------------------------------------

def build_chat(folder, n_docs=50, shard_tokens=300, vocab=50257, seed=3, max_len=120):
    """Documents of random tokens and a loss mask of random 0/1 runs beside them."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, int(rng.integers(1, max_len))) for _ in range(n_docs)]
    masks = [np.repeat(rng.integers(0, 2, d.size), rng.integers(1, 9, d.size))[:d.size].astype(np.uint16)
             for d in docs]
    w = TokenStreamWriter(folder, vocab_size=vocab, shard_tokens=shard_tokens)
    m = TokenStreamWriter(folder / "loss_mask", vocab_size=2, shard_tokens=shard_tokens)
    for d, k in zip(docs, masks, strict=True):
        w.add_document(d)
        m.add_document(k)
    w.close(loss_mask=m.close())
    return np.concatenate(docs), np.concatenate(masks)


def two_reads(r, starts, length, shift, dtype):
    """The labels the sources made before: the windows, a second read of the mask, a NumPy merge."""
    tokens = r.windows(starts, length, dtype=dtype)
    keep = r.stream("loss_mask").windows(starts, length, dtype=np.int32)
    return np.where(keep[:, shift:] != 0, tokens[:, shift:], -100).astype(dtype)


@pytest.mark.parametrize("backend", ["mmap", "pread", "pread-piecewise"])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_labels_masked_by_the_loss_mask_come_from_the_token_read(tmp_path, backend, dtype):
    from zerobatch.core.pool import TaskPool
    flat, keep = build_chat(tmp_path / "chat")
    opts = {"backend": "mmap"} if backend == "mmap" else {"backend": "pread",
                                                           "max_open_files": 2 if backend == "pread-piecewise" else 64}
    with TokenStreamReader(tmp_path / "chat", **opts) as r:
        assert len(r.manifest.shards) > 5
        rng = np.random.default_rng(2)
        for length in (1, 2, 33, 700):                     # 700: windows over three shards and more
            starts = np.clip(np.concatenate([rng.integers(0, flat.size - length + 1, 20),
                                             r.cum_tokens[1:-1] - length // 2, [0, flat.size - length]]),
                             0, flat.size - length)
            for shift in (1, 0):
                want = two_reads(r, starts, length, shift, dtype)
                assert (want == np.stack([np.where(keep[s + shift:s + length] != 0, flat[s + shift:s + length],
                                                   -100) for s in starts])).all()
                labels = np.full((starts.size, length - shift), 7, dtype)
                out = r.windows(starts, length, dtype=dtype, labels=labels, label_mask="loss_mask",
                                label_shift=shift)
                assert out.dtype == dtype and (out == np.stack([flat[s:s + length] for s in starts])).all()
                assert (labels == want).all(), (length, shift)
                # the labels copy the tokens without a mask
                plain = np.empty_like(labels)
                r.windows(starts, length, dtype=dtype, labels=plain, label_shift=shift)
                assert (plain == out[:, shift:]).all()
            if length > 1:
                labels = np.empty((starts.size, length - 1), dtype)
                got = r.windows_with_boundaries(starts, length, dtype=dtype, labels=labels, label_mask="loss_mask")
                ref_ = r.windows_with_boundaries(starts, length, dtype=dtype)
                assert all(np.array_equal(a, b) for a, b in zip(got[:4], ref_[:4], strict=True)) and got[4] == ref_[4]
                assert (labels == two_reads(r, starts, length, 1, dtype)).all()
                out = np.empty((starts.size, length), dtype)
                labels = np.empty((starts.size, length - 1), dtype)
                assert r.read_into(starts, out, labels=labels, label_mask="loss_mask") is out
                assert (labels == two_reads(r, starts, length, 1, dtype)).all()
        # documents as ranges (one empty), next-token or own labels, with positions
        a, b = r.document_spans([3, 0, 49, 17, 17, 30])
        b[4] = a[4]
        mask = r.stream("loss_mask")
        for shift in (1, 0):
            total = int((b - a).sum())
            labels, pos = np.empty(total, dtype), np.empty(total, np.int64)
            tokens = r.ranges(a, b, dtype=dtype, position_ids=pos, labels=labels, label_mask="loss_mask",
                              label_shift=shift)
            want = []
            for x, y in zip(a.tolist(), b.tolist(), strict=True):
                k = mask.ranges([x], [y], dtype=np.int32)
                lab = np.where(k != 0, flat[x:y], -100)
                want.append(np.append(lab[1:], -100) if shift and y > x else lab)
            assert (tokens == np.concatenate([flat[x:y] for x, y in zip(a, b, strict=True)])).all()
            assert (labels == np.concatenate(want)).all() and (pos == np.concatenate(
                [np.arange(y - x) for x, y in zip(a, b, strict=True)])).all()
            pool = TaskPool(1)
            try:
                out, lab2 = np.empty(total, dtype), np.empty(total, dtype)
                assert r.ranges_async(pool, a, b, out, labels=lab2, label_mask="loss_mask",
                                      label_shift=shift).wait() is out
                assert (out == tokens).all() and (lab2 == labels).all()
                starts = np.array([5, 290, 900])
                out, lab3 = np.empty((3, 40), dtype), np.empty((3, 39), dtype)
                assert r.read_async(pool, starts, out, labels=lab3, label_mask="loss_mask").wait() is out
                assert (lab3 == two_reads(r, starts, 40, 1, dtype)).all()
            finally:
                pool.stop()
        # refusals
        with pytest.raises(ConfigError, match="labels"):
            r.windows([0], 5, label_mask="loss_mask")
        with pytest.raises(ConfigError, match="stream"):
            r.windows([0], 5, labels=np.empty((1, 4), np.int64), label_mask="other")
        if backend != "pread-piecewise":
            with pytest.raises(ConfigError, match="labels"):
                r.windows([0], 5, labels=np.empty((1, 5), np.int64), label_mask="loss_mask")
            with pytest.raises(ConfigError, match="label_shift"):
                r.windows([0], 5, labels=np.empty((1, 3), np.int64), label_mask="loss_mask", label_shift=2)


def test_a_damaged_mask_is_named_by_the_read_that_masks_labels(tmp_path):
    build_chat(tmp_path / "chat")
    mask_shard = sorted((tmp_path / "chat" / "loss_mask").glob("*/tokens.bin"))[2]
    with TokenStreamReader(tmp_path / "chat") as r:
        k = 2
        at = int(r.cum_tokens[k]) + 100                    # in shard 2, block 0 of its mask
    with open(mask_shard, "r+b") as f:
        f.seek(200)
        f.write(b"\x02\x00")                               # a mask value of 2
    with TokenStreamReader(tmp_path / "chat") as r:
        labels = np.empty((1, 49), np.int64)
        r.windows([at - 200], 50, labels=labels, label_mask="loss_mask")      # the mask's blocks before: fine
        with pytest.raises(IntegrityError) as info:
            r.windows([at - 10], 50, labels=labels, label_mask="loss_mask")
        assert info.value.path == str(mask_shard) and info.value.field == "xxh3"
        assert "block 0" in str(info.value)
        r.windows([at - 10], 50)                           # the tokens alone still read
        with pytest.raises(IntegrityError) as info:
            r.ranges([at - 10], [at + 40], labels=np.empty(50, np.int64), label_mask="loss_mask")
        assert info.value.path == str(mask_shard)
    with TokenStreamReader(tmp_path / "chat", verify=False) as r:
        with pytest.raises(CorruptError, match="vocabulary size 2") as info:
            r.windows([at - 10], 50, labels=labels, label_mask="loss_mask")
        assert info.value.path == str(mask_shard) and info.value.field == "token"
        with pytest.raises(CorruptError, match="vocabulary size 2"):
            r.ranges([at - 10], [at + 40], labels=np.empty(50, np.int64), label_mask="loss_mask", label_shift=0)
