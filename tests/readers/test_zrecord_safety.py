"""ZRECORD data safety (issue 17): a damaged or crafted ``meta.json`` never makes a writer
delete what the committed state references; files of another store (a chunk, the chunk
folder, a table, the commit file, a journal) are refused, by the reader, ``verify_all()``,
the loader's state and its workers; a store replaced under a loader reaches the training
loop as a typed error."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from zerobatch.formats import zrecord as Z
from zerobatch.formats.errors import CorruptError, IntegrityError, StateError, UnsupportedVersionError, ZerobatchError
from zerobatch.readers.zrecord import ZRecordStore
from zerobatch.writers.zrecord import ZRecordWriter

FIELDS = [Z.FieldSpec("a", "i32", (2,)), Z.FieldSpec("b", "bytes", compress="flate")]
V1_STORE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "v1", "states", "data", "store")


def build(folder, n=40, offset=0):
    with ZRecordWriter(folder, FIELDS, chunk_size=8, chunk_grow_bytes=1 << 16) as w:
        for i in range(n):
            w.append({"a": [i + offset, -i], "b": b"b%d" % i * (i % 4 + 1)})


def snapshot(folder) -> dict[str, tuple[int, int, int]]:
    """Every file of the store: its inode, size and modification time (a file deleted,
    replaced or written to changes them)."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            st = os.stat(os.path.join(root, f))
            out[os.path.relpath(os.path.join(root, f), folder)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def read_all(folder) -> tuple:
    with ZRecordStore(folder) as s:
        b = s.gather(np.arange(len(s)))
        return b["a"].tobytes(), tuple(v.tobytes() for v in b["b"])


def rebalanced_with_retired(folder):
    """A store whose meta.json lists retired chunks (a reader of the old epoch kept them)."""
    build(folder)
    reader = ZRecordStore(folder)
    with ZRecordWriter(folder) as w:
        for i in range(39, 0, -3):
            w.delete(i)
        w.commit()
        w.rebalance(report=None)
    meta = Z.parse_meta((folder / "meta.json").read_bytes())
    assert meta.retired and meta.first_chunk > 0
    return reader, meta


def rewrite_meta(folder, change) -> None:
    """A crafted meta.json: changed, then re-checksummed (the strongest lie a file can tell)."""
    doc = json.loads((folder / "meta.json").read_text())
    change(doc)
    doc["checksum"] = Z.meta_checksum(doc)
    (folder / "meta.json").write_text(json.dumps(doc))


def test_every_bit_flip_of_meta_json_leaves_every_file_in_place(tmp_path):
    """The issue's reproducer class: a flipped bit of meta.json (retired ids, epochs, counts,
    anything) must never make the next writer delete a file. Every bit of the bytes that
    describe chunks and epochs, and every bit of 120 other bytes drawn at random."""
    folder = tmp_path / "s"
    reader, meta = rebalanced_with_retired(folder)
    reader.close()   # the old epoch is free now: a writer may delete exactly the retired chunks
    good = (folder / "meta.json").read_bytes()
    before = snapshot(folder)
    data = read_all(folder)
    outcomes = {"typed": 0, "opened": 0}
    text = good.decode()
    hot = set(range(text.index('"chunks"'), text.index('"fields"')))
    hot |= set(range(text.index('"retired"'), len(good)))
    rng = np.random.default_rng(17)
    positions = sorted(hot | set(rng.choice(len(good), 120, replace=False).tolist()))
    for pos in positions:
        for bit in range(8):
            raw = bytearray(good)
            raw[pos] ^= 1 << bit
            (folder / "meta.json").write_bytes(raw)
            try:
                ZRecordWriter(folder).abort()
                outcomes["opened"] += 1
            except ZerobatchError:
                outcomes["typed"] += 1
            after = snapshot(folder)
            after.pop("meta.json")
            assert after == {k: v for k, v in before.items() if k != "meta.json"}, (pos, bit)
    (folder / "meta.json").write_bytes(good)
    assert outcomes == {"typed": len(positions) * 8, "opened": 0}
    assert read_all(folder) == data
    # the intact file: the writer removes the retired chunks (and only those)
    ZRecordWriter(folder).close()
    assert read_all(folder) == data
    for c in meta.retired[0][1]:
        assert not (folder / Z.chunk_name(c)).exists()


@pytest.mark.parametrize("change, match", [
    (lambda d: d["retired"][0].update(chunks=[d["chunks"]["first"]]), "retired chunk"),     # a live chunk
    (lambda d: d["retired"][0].update(epoch=d["epoch"]), "retired.epoch"),                  # the current epoch
    (lambda d: d["retired"][0].update(chunks=[0, 0]), "listed twice"),
])
def test_a_crafted_meta_json_cannot_name_a_live_file_for_deletion(tmp_path, change, match):
    folder = tmp_path / "s"
    reader, _ = rebalanced_with_retired(folder)
    reader.close()
    rewrite_meta(folder, change)
    before = snapshot(folder)
    with pytest.raises(CorruptError, match=match):
        ZRecordWriter(folder)
    assert snapshot(folder) == before
    with pytest.raises(CorruptError, match=match):
        ZRecordStore(folder)


def test_a_writer_never_deletes_a_chunk_a_committed_entry_points_into(tmp_path):
    """Crafted entries (valid checks) pointing into a retired chunk: the writer deletes nothing."""
    folder = tmp_path / "s"
    reader, meta = rebalanced_with_retired(folder)
    reader.close()
    retired = meta.retired[0][1][0]
    t = np.fromfile(folder / "a.offset", Z.ENTRY_DTYPE)
    t[5]["chunk"] = retired
    t.tofile(folder / "a.offset")
    checks = np.fromfile(folder / "a.check", "<u4")
    checks[5] = Z.entry_checks(t[5:6], 5, 0, meta.key)[0]
    checks.tofile(folder / "a.check")
    before = snapshot(folder)
    with pytest.raises(CorruptError, match="lists as retired; nothing was deleted"):
        ZRecordWriter(folder)
    assert snapshot(folder) == before
    # and a reader refuses the entry: the chunk is below the first live one
    with ZRecordStore(folder) as s, pytest.raises(CorruptError, match="disagrees"):
        s.gather([5], ["a"])


@pytest.mark.parametrize("what", ["chunk", "chunk folder", "table", "commit", "journal"])
def test_files_of_another_store_with_the_same_layout_are_refused(tmp_path, what):
    a, b = tmp_path / "a", tmp_path / "b"
    build(a)
    build(b)                       # the same records, the same layout: only the identity differs
    if what == "chunk":
        shutil.copy(b / "chunk" / "1.zr", a / "chunk" / "1.zr")
    elif what == "chunk folder":
        shutil.rmtree(a / "chunk")
        shutil.copytree(b / "chunk", a / "chunk")
    elif what == "table":
        shutil.copy(b / "b.offset", a / "b.offset")
        shutil.copy(b / "b.check", a / "b.check")
    elif what == "commit":
        shutil.copy(b / "commit.zr", a / "commit.zr")
    else:
        # a journal of the other store's next commit, left as if its writer died
        with ZRecordWriter(b) as w:
            w.append({"a": [1, 1], "b": b"x"})
            w.commit()
            import zerobatch.core.zrstore as zrstore
            j = zrstore.Journal(Z.JOURNAL_KIND_COMMIT, Z.Commit(0, 41, 6, 99, 0),
                                Z.parse_meta((b / "meta.json").read_bytes()), np.zeros(0, Z.JOURNAL_UPDATE_DTYPE), ())
            (a / "journal.zr").write_bytes(zrstore.pack_journal(j))
    with pytest.raises(CorruptError):
        with ZRecordStore(a) as s:
            s.verify_all()
    if what != "chunk folder" and what != "chunk":
        with pytest.raises(CorruptError):
            ZRecordWriter(a)


def test_a_version_1_store_is_read_and_never_written(tmp_path):
    """zerobatch 0.1 stores (no identity, no meta.json checksum) stay readable; a writer,
    which would act on an unchecked meta.json, refuses them."""
    with ZRecordStore(V1_STORE) as s:
        assert s.meta.version == 1 and s.fingerprint == ""
        assert s.verify_all() == 60
    shutil.copytree(V1_STORE, tmp_path / "v1")
    with pytest.raises(UnsupportedVersionError, match="version 1"):
        ZRecordWriter(tmp_path / "v1")


def test_a_pickled_reader_opens_lazily_and_refuses_a_replaced_store(tmp_path):
    import pickle

    folder = tmp_path / "s"
    build(folder)
    s = ZRecordStore(folder)
    raw = pickle.dumps(s)
    s.close()
    shutil.rmtree(folder)
    clone = pickle.loads(raw)                 # nothing opened yet: unpickling cannot fail
    with pytest.raises(ZerobatchError):
        clone.gather([0])
    build(folder, offset=1000)                # another store at the same path
    clone = pickle.loads(raw)
    with pytest.raises(CorruptError, match="store_id"):
        len(clone)
    shutil.rmtree(folder)
    build(tmp_path / "t")
    os.rename(tmp_path / "t", folder)
    with pytest.raises(CorruptError, match="store_id"):
        pickle.loads(raw).gather([0])


def test_a_loader_state_belongs_to_its_store(tmp_path):
    torch = pytest.importorskip("torch")  # noqa: F841
    from zerobatch.adapters.torch import Loader, RecordFields

    build(tmp_path / "a")
    build(tmp_path / "b")
    la = Loader(RecordFields(tmp_path / "a", ["a"]), global_batch_size=4, seed=1)
    it = iter(la)
    next(it)
    state = la.state_dict()
    lb = Loader(RecordFields(tmp_path / "b", ["a"]), global_batch_size=4, seed=1)
    with pytest.raises(StateError, match="fingerprint"):
        lb.load_state_dict(state)
    la2 = Loader(RecordFields(tmp_path / "a", ["a"]), global_batch_size=4, seed=1)
    la2.load_state_dict(state)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_store_replaced_under_dataloader_workers_is_a_typed_error(tmp_path, context):
    pytest.importorskip("torch")
    from zerobatch.adapters.torch import Loader, RecordFields

    folder = tmp_path / "s"
    build(folder, n=64)
    loader = Loader(RecordFields(folder, ["a"]), global_batch_size=8, seed=1, num_threads=1)
    expected = [b.numpy().tobytes() for b in loader]
    shutil.rmtree(folder)
    build(folder, n=64, offset=7)              # same layout, other records, another identity
    dl = loader.dataloader(num_workers=2, multiprocessing_context=context)
    try:
        got = [b.numpy().tobytes() for b in dl]
    except ZerobatchError as exc:
        assert isinstance(exc, (CorruptError, IntegrityError)), exc
    else:
        # a forked worker may serve the store it inherited, whole: never the other one
        assert got == expected


def test_a_loader_over_a_store_that_lost_records_mid_epoch_raises_a_typed_error(tmp_path):
    pytest.importorskip("torch")
    import dataclasses

    from zerobatch.adapters.torch import Loader, RecordFields
    from zerobatch.core import xxh3_64
    from zerobatch.formats.errors import OutOfRangeError

    folder = tmp_path / "s"
    build(folder, n=400)
    it = iter(Loader(RecordFields(folder, ["a"]), batch_size=16, seed=1, num_threads=1))
    next(it)
    # the store now holds 250 records (a crafted commit and meta.json, both checksummed)
    meta = Z.parse_meta((folder / "meta.json").read_bytes())
    c = Z.unpack_commit((folder / "commit.zr").read_bytes(), xxh3_64, key=meta.key)
    with open(folder / "commit.zr", "r+b") as f:
        f.write(Z.pack_commit(dataclasses.replace(c, length=250), xxh3_64, meta.key))
    rewrite_meta(folder, lambda d: d.update(length=250))
    with pytest.raises(OutOfRangeError, match="fewer than the 400"):
        list(it)


@pytest.mark.parametrize("size", [0, 1, 8, 16, 23, 24, 63])
def test_a_short_commit_file_is_a_typed_error_for_readers_and_writers(tmp_path, size):
    folder = tmp_path / "s"
    build(folder)
    raw = (folder / "commit.zr").read_bytes()
    (folder / "commit.zr").write_bytes(raw[:size])
    from zerobatch.formats.errors import FormatError
    with pytest.raises(FormatError, match="commit.zr"):
        ZRecordStore(folder)
    with pytest.raises(FormatError, match="commit.zr"):
        ZRecordWriter(folder)


def test_a_sparse_giant_journal_is_refused_without_allocating_it(tmp_path):
    import zerobatch.core.zrstore as zrstore

    folder = tmp_path / "s"
    build(folder)
    meta = Z.parse_meta((folder / "meta.json").read_bytes())
    j = zrstore.Journal(Z.JOURNAL_KIND_COMMIT, Z.Commit(0, 40, 5, 1, 0), meta, np.zeros(0, Z.JOURNAL_UPDATE_DTYPE), ())
    raw = bytearray(zrstore.pack_journal(j))
    # the header claims 2**31 updates (64 GiB), and the file is that large, all holes
    struct_ = Z.JOURNAL_HEADER
    fields = list(struct_.unpack_from(raw))
    fields[7] = (64 << 30) // Z.JOURNAL_UPDATE_DTYPE.itemsize
    raw[:struct_.size] = struct_.pack(*fields)
    with open(folder / "journal.zr", "wb") as f:
        f.write(raw)
        f.truncate(struct_.size + fields[8] + fields[7] * Z.JOURNAL_UPDATE_DTYPE.itemsize)
    for opener in (ZRecordStore, ZRecordWriter):
        with pytest.raises(CorruptError, match="sparse"):
            opener(folder)


def _flate_record(folder, index, logical, stream):
    """Rewrite record ``index`` of field b as a flate container (valid checksum and entry)."""
    from zerobatch.core import xxh3_64

    key = Z.parse_meta((folder / "meta.json").read_bytes()).key
    tail = Z.RECORD_HEADER.pack(0, logical, 1, Z.RECORD_MAGIC, 1)[8:]
    container = (xxh3_64(tail + stream) ^ key).to_bytes(8, "little") + tail + stream
    t = np.fromfile(folder / "b.offset", Z.ENTRY_DTYPE)
    at = 1 << 15                               # free space inside chunk 0's sparse growth step
    with open(folder / "chunk" / "0.zr", "r+b") as f:
        f.seek(at + 4096 * index)
        f.write(container)
    t[index]["chunk"], t[index]["offset"], t[index]["length"] = 0, at + 4096 * index, len(container)
    t.tofile(folder / "b.offset")
    checks = np.fromfile(folder / "b.check", "<u4")
    checks[index] = Z.entry_checks(t[index:index + 1], index, 1, key)[0]
    checks.tofile(folder / "b.check")


def test_flate_records_that_lie_about_their_length(tmp_path):
    import zlib

    folder = tmp_path / "s"
    build(folder)
    # logical length 0 with a non-empty stream: it must be an empty stream ending exactly
    _flate_record(folder, 2, 0, zlib.compress(b"hidden payload", wbits=-15))
    # 6 records each declaring 2**30 bytes from 40-byte streams (more than deflate's 1032:1)
    for i in range(8, 14):
        _flate_record(folder, i, 1 << 30, zlib.compress(b"x" * 100, wbits=-15))
    with ZRecordStore(folder) as s:
        with pytest.raises(CorruptError, match="disagrees"):
            s.gather([2], ["b"])
        with pytest.raises(CorruptError, match="disagrees"):
            s.gather(np.arange(8, 14), ["b"])
        assert s.gather([3], ["b"])["b"][0] is not None
    # an empty stream of logical length 0 is a valid empty record
    _flate_record(folder, 2, 0, zlib.compress(b"", wbits=-15))
    with ZRecordStore(folder) as s:
        assert s.gather([2], ["b"])["b"][0].size == 0
