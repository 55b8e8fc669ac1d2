"""ZRECORD under faults: crafted stores (entries past chunk ends, missing chunks, overflowing
and misaligned offsets, decompression bombs, truncated and bit-flipped chunks, a lying
meta.json and commit file), and kill -9 at every I/O call of append, modify, delete and
rebalance."""

from __future__ import annotations

import os
import shutil
import struct
import textwrap
import zlib

import numpy as np
import pytest

from zbtest import run_python
from zerobatch.core import xxh3_64
from zerobatch.formats import zrecord as Z
from zerobatch.formats.errors import (
    CorruptError,
    IntegrityError,
    LimitExceededError,
    NotFoundError,
    TruncatedError,
    ZerobatchError,
)
from zerobatch.readers.zrecord import ZRecordStore
from zerobatch.writers.zrecord import ZRecordWriter

FIELDS = [Z.FieldSpec("a", "i32", (2,)), Z.FieldSpec("b", "bytes", compress="flate"), Z.FieldSpec("c", "u8")]


def build(folder, n=40):
    with ZRecordWriter(folder, FIELDS, chunk_size=16, chunk_grow_bytes=1 << 16) as w:
        for i in range(n):
            w.append({"a": [i, -i], "b": b"b%d" % i * (i % 4), "c": np.full(i % 9, i, np.uint8)})


def read_all(folder) -> tuple:
    with ZRecordStore(folder) as s:
        n = len(s)
        b = s.gather(np.arange(n))
        return (n, b["a"].tobytes(), tuple(None if v is None else v.tobytes() for v in b["b"]),
                tuple(None if v is None else v.tobytes() for v in b["c"]))


def store_key(folder) -> int:
    return Z.parse_meta((folder / "meta.json").read_bytes()).key


def set_entry(folder, field, index, chunk=None, offset=None, length=None, check=True):
    """Rewrite an entry as a crafted store would: with a valid check unless ``check=False``."""
    path = folder / f"{field}.offset"
    t = np.fromfile(path, Z.ENTRY_DTYPE)
    if chunk is not None:
        t[index]["chunk"] = chunk
    if offset is not None:
        t[index]["offset"] = offset
    if length is not None:
        t[index]["length"] = length
    t.tofile(path)
    if check:
        k = [f.name for f in FIELDS].index(field) if field in [f.name for f in FIELDS] else 0
        checks = np.fromfile(folder / f"{field}.check", "<u4")
        checks[index] = Z.entry_checks(t[index:index + 1], index, k, store_key(folder))[0]
        checks.tofile(folder / f"{field}.check")


def entry(folder, field, index):
    e = np.fromfile(folder / f"{field}.offset", Z.ENTRY_DTYPE, count=index + 1)[index]
    return int(e["chunk"]), int(e["offset"]), int(e["length"])


@pytest.mark.parametrize("change, error, match", [
    (dict(offset=(1 << 16) - 16), CorruptError, "past the end of chunk"),
    (dict(chunk=7), CorruptError, "chunk"),
    (dict(offset=(1 << 64) - 16, length=64), CorruptError, "overflow"),
    (dict(offset=8), CorruptError, "disagrees|magic"),
    (dict(length=8), CorruptError, "disagrees"),
    (dict(length=(1 << 32) - 1), CorruptError, "past the end|disagrees"),
    (dict(offset=0), IntegrityError, "checksum|disagrees"),
])
def test_crafted_entries_are_refused(tmp_path, change, error, match):
    build(tmp_path / "s")
    set_entry(tmp_path / "s", "b", 20, **change)
    with ZRecordStore(tmp_path / "s") as s:
        s.gather([0, 1, 19])  # untouched records still read
        with pytest.raises(error, match=match) as info:
            s.gather([0, 20])
        assert "record 20" in str(info.value) or "chunk" in str(info.value)


def test_an_entry_changed_without_its_check_is_refused(tmp_path):
    build(tmp_path / "s")
    set_entry(tmp_path / "s", "a", 5, length=48, check=False)
    with ZRecordStore(tmp_path / "s") as s:
        with pytest.raises(IntegrityError, match="a.offset: the entry of record 5 fails its check"):
            s.gather([5])
    with pytest.raises(IntegrityError, match="record 5"):
        ZRecordWriter(tmp_path / "s").rebalance(report=None)


def test_a_chunk_id_that_does_not_exist(tmp_path):
    build(tmp_path / "s")
    os.unlink(tmp_path / "s" / "chunk" / "1.zr")
    with ZRecordStore(tmp_path / "s") as s:
        s.gather([0])
        with pytest.raises(CorruptError, match="does not exist"):
            s.gather([17])


def _write_record(folder, field_no, chunk, offset, logical, payload, codec):
    tail = Z.RECORD_HEADER.pack(0, logical, codec, Z.RECORD_MAGIC, field_no)[8:]
    digest = xxh3_64(tail + payload) ^ store_key(folder)
    with open(folder / "chunk" / f"{chunk}.zr", "r+b") as f:
        f.seek(offset)
        f.write(digest.to_bytes(8, "little") + tail + payload)
    return Z.RECORD_HEADER_SIZE + len(payload)


def test_decompression_bombs_and_broken_streams(tmp_path):
    build(tmp_path / "s")
    folder = tmp_path / "s"
    at = 1 << 15  # free space inside chunk 0's sparse growth step
    bomb = zlib.compress(bytes(64 << 20), 9, wbits=-15)
    n = _write_record(folder, 1, 0, at, 64 << 20, bomb, 1)
    set_entry(folder, "b", 3, chunk=0, offset=at, length=n)
    with ZRecordStore(folder, max_record_bytes=1 << 20) as s:
        with pytest.raises(LimitExceededError, match="max_record_bytes"):
            s.gather([3], ["b"])
    # a stream that inflates to more than it declares, a truncated one, junk after the end
    for payload, logical in [(zlib.compress(b"x" * 100, wbits=-15), 50),
                             (zlib.compress(b"x" * 100, wbits=-15)[:-3], 100),
                             (zlib.compress(b"x" * 100, wbits=-15) + b"junk", 100),
                             (b"\xff" * 20, 100)]:
        n = _write_record(folder, 1, 0, at, logical, payload, 1)
        set_entry(folder, "b", 3, chunk=0, offset=at, length=n)
        with ZRecordStore(folder) as s, pytest.raises(CorruptError, match="inflated size|disagrees"):
            s.gather([3], ["b"])
    # a fixed-shape flate field whose record declares another size
    with ZRecordWriter(tmp_path / "f", [Z.FieldSpec("x", "f32", (4,), "flate")]) as w:
        w.append(np.ones(4, np.float32))
    n = _write_record(tmp_path / "f", 0, 0, 4096, 32, zlib.compress(bytes(32), wbits=-15), 1)
    set_entry(tmp_path / "f", "x", 0, chunk=0, offset=4096, length=n)
    with ZRecordStore(tmp_path / "f") as s, pytest.raises(CorruptError, match="disagrees"):
        s.gather([0])


def flip_each(folder, places, pristine, must_fail=lambda path, byte: True) -> dict[str, int]:
    """Flip every bit of each ``(path, size)`` in turn and read everything: each case must
    end in a typed error or the pristine output, and in an error where ``must_fail``."""
    counts = {"cases": 0, "typed": 0, "identical": 0}
    for path, size in places:
        good = path.read_bytes()
        # one byte rewritten in place per case and put back after (rewriting the whole file
        # with truncation costs several times the read on this filesystem)
        fd = os.open(path, os.O_RDWR)
        try:
            for byte in range(size):
                for bit in range(8):
                    os.pwrite(fd, bytes([good[byte] ^ (1 << bit)]), byte)
                    counts["cases"] += 1
                    try:
                        got = read_all(folder)
                    except ZerobatchError:
                        counts["typed"] += 1
                    else:
                        assert got == pristine, f"silently wrong after flipping bit {bit} of byte {byte} of {path.name}"
                        assert not must_fail(path, byte), f"bit {bit} of byte {byte} of {path.name} went unnoticed"
                        counts["identical"] += 1
                    os.pwrite(fd, good[byte:byte + 1], byte)
        finally:
            os.close(fd)
        assert path.read_bytes() == good
    assert read_all(folder) == pristine
    return counts


def test_every_single_bit_flip_in_the_records_is_refused_or_harmless(tmp_path):
    folder = tmp_path / "s"
    build(folder, n=12)
    pristine = read_all(folder)
    end = max(entry(folder, f.name, i)[1] + entry(folder, f.name, i)[2]
              for f in FIELDS for i in range(12) if entry(folder, f.name, i)[0] == 0)
    inside = np.zeros(end, bool)  # bytes of a record (the rest is alignment padding)
    for f in FIELDS:
        for i in range(12):
            c, off, ln = entry(folder, f.name, i)
            if c == 0 and ln:
                inside[off:off + ln] = True
    counts = flip_each(folder, [(folder / "chunk" / "0.zr", end)], pristine, lambda path, byte: inside[byte])
    print(f"zrecord chunk flips: {counts['cases']} cases, {counts['typed']} typed errors, "
          f"{counts['identical']} identical (padding), 0 crashes, 0 silently wrong")
    assert counts["typed"] == 8 * int(inside.sum())


def test_every_single_bit_flip_in_the_tables_checks_and_commit_file(tmp_path):
    folder = tmp_path / "s"
    build(folder, n=3)
    pristine = read_all(folder)
    places = [(folder / f"{f.name}.offset", 3 * 16) for f in FIELDS]
    places += [(folder / f"{f.name}.check", 3 * 4) for f in FIELDS]
    places += [(folder / "commit.zr", 64)]
    counts = flip_each(folder, places, pristine,
                       lambda path, byte: path.suffix != ".zr" or not 16 <= byte < 24)   # seq may stay even
    print(f"zrecord table, check and commit flips: {counts['cases']} cases, {counts['typed']} typed errors, "
          f"{counts['identical']} identical (seq), 0 silently wrong")


def test_truncated_chunks_tables_and_commit(tmp_path):
    folder = tmp_path / "s"
    build(folder)
    saved = tmp_path / "saved"
    shutil.copytree(folder, saved)
    end = max(sum(entry(folder, f.name, i)[1:]) for f in FIELDS for i in range(16))
    for cut in (0, 1, 100, end - 1):
        os.truncate(folder / "chunk" / "0.zr", cut)
        with ZRecordStore(folder) as s, pytest.raises(CorruptError):
            s.gather(np.arange(16))
        shutil.copy(saved / "chunk" / "0.zr", folder / "chunk" / "0.zr")
    os.truncate(folder / "chunk" / "0.zr", end)  # only the sparse tail: every record intact
    assert read_all(folder) == read_all(saved)
    os.truncate(folder / "a.offset", 16 * 10 + 3)
    with pytest.raises(CorruptError, match="16-byte"):
        ZRecordStore(folder)
    os.truncate(folder / "a.offset", 16 * 10)
    with pytest.raises(TruncatedError, match="a.offset"):
        ZRecordStore(folder)
    shutil.copy(saved / "a.offset", folder / "a.offset")
    os.truncate(folder / "commit.zr", 100)
    with pytest.raises(TruncatedError, match="commit.zr"):
        ZRecordStore(folder)
    shutil.copy(saved / "commit.zr", folder / "commit.zr")
    os.unlink(folder / "b.offset")
    with pytest.raises(NotFoundError, match="b.offset"):
        ZRecordStore(folder)


def test_a_meta_json_that_lies(tmp_path):
    folder = tmp_path / "s"
    build(folder)
    good = (folder / "meta.json").read_text()
    import json

    def lie(change, checksum=True) -> None:
        doc = json.loads(good)
        change(doc)
        if checksum:   # a crafted meta.json, re-checksummed; else one that was damaged
            doc["checksum"] = Z.meta_checksum(doc)
        (folder / "meta.json").write_text(json.dumps(doc))

    lie(lambda d: d.update(length=41), checksum=False)
    with pytest.raises(CorruptError, match="checksum mismatch"):
        ZRecordStore(folder)
    lie(lambda d: d.update(length=41))
    with pytest.raises(CorruptError, match="disagree"):
        ZRecordStore(folder)
    lie(lambda d: d["chunks"].update(num=9))
    with pytest.raises(CorruptError):
        ZRecordStore(folder)
    lie(lambda d: d["fields"][0].update(shape=[3]))
    with ZRecordStore(folder) as s, pytest.raises(CorruptError, match="disagrees"):
        s.gather([0])
    lie(lambda d: d["fields"][2].update(compress="flate"))
    with ZRecordStore(folder) as s, pytest.raises(CorruptError, match="disagrees"):
        s.gather([1], ["c"])
    lie(lambda d: d["fields"].reverse())
    with ZRecordStore(folder) as s, pytest.raises(CorruptError):
        s.gather([1])
    lie(lambda d: d.update(extra=1))
    with pytest.raises(CorruptError, match="unknown keys"):
        ZRecordStore(folder)
    lie(lambda d: d["chunks"].update(unfull=[[99, 0, 0]]))
    with pytest.raises(CorruptError, match="unfull"):
        ZRecordStore(folder)
    (folder / "meta.json").write_text("{")
    with pytest.raises(CorruptError, match="JSON"):
        ZRecordStore(folder)
    (folder / "meta.json").write_text(good)
    raw = bytearray((folder / "commit.zr").read_bytes())
    struct.pack_into("<Q", raw, 24, 10**6)
    (folder / "commit.zr").write_bytes(raw)
    with pytest.raises(CorruptError, match="checksum"):
        ZRecordStore(folder)


OPS = {
    "append": "for i in range(20, 26):\n    w.append({'a': [i, -i], 'b': b'new%d' % i, 'c': [i]})",
    "modify": "for i in (0, 7, 19):\n    w.modify(i, {'b': b'changed', 'c': None})",
    "delete": "w.delete(3)\nw.delete(0)\nw.delete(-1)",
    "rebalance": "w.delete(5)\nw.commit()\nw.rebalance(report=None)",
}


@pytest.mark.slow
@pytest.mark.parametrize("op", list(OPS))
def test_kill_9_at_every_io_call(tmp_path, op, fork_server):
    """Killed after any I/O call of an operation and its commit, the store reads as before or
    after the operation, exactly; a new writer then works and leaves no orphans."""
    folder = tmp_path / "s"
    build(folder, n=20)
    saved = tmp_path / "saved"
    shutil.copytree(folder, saved)
    code = textwrap.dedent(f"""
        from zerobatch.writers.zrecord import ZRecordWriter
        w = ZRecordWriter({str(folder)!r}, chunk_grow_bytes=1 << 16)
    """) + OPS[op] + "\nw.close()\n"
    old = read_all(folder)
    server = fork_server("from zerobatch.writers.zrecord import ZRecordWriter")
    probe = server.run(code + "from zerobatch.core.io import _FAULTS\nprint('CALLS', _FAULTS.calls)\n",
                       env={"ZEROBATCH_FAULT_KILL_AFTER": str(10**9)})
    assert probe.returncode == 0, probe.stderr
    total = int(probe.stdout.split("CALLS")[1])
    new = read_all(folder)
    assert new != old
    outcomes = {"old": 0, "new": 0}
    mid_rebalance = None
    for k in range(1, total + 1):
        shutil.rmtree(folder)
        shutil.copytree(saved, folder)
        r = server.run(code, env={"ZEROBATCH_FAULT_KILL_AFTER": str(k)})
        assert r.returncode == -9, (k, r.returncode, r.stderr)
        got = read_all(folder)   # a reader finishes a journal the dead writer left
        if op == "rebalance" and got != old and got != new:
            # the delete committed before the rebalance: its state is the other legal one
            mid_rebalance = mid_rebalance or got
            assert got == mid_rebalance, k
        else:
            assert got in (old, new), k
        outcomes["old" if got == old else "new"] += 1
        with ZRecordWriter(folder) as w:   # the next writer works and cleans up
            w.append({"a": [1, 1], "b": b"", "c": [1]})
        assert not [f for f in os.listdir(folder) if ".zbtmp." in f]
        with ZRecordStore(folder) as s:
            assert len(s) == got[0] + 1
            s.verify_all()
    assert outcomes["old"] >= 1 and outcomes["new"] >= 1
    print(f"kill -9 harness (zrecord {op}): {total} kill points, {outcomes['old']} old, {outcomes['new']} new, "
          "0 mixed")
