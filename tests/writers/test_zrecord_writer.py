"""ZRECORD writer: round trips for every dtype and both codecs, absent fields, modify and
delete, commit visibility, rebalance, growth, the one-writer lock and bad arguments."""

from __future__ import annotations

import os

import numpy as np
import pytest

from zerobatch.formats import zrecord as Z
from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.readers.zrecord import ZRecordStore
from zerobatch.writers.zrecord import ZRecordWriter

DTYPES = [d for d in Z.DTYPES if d != "bytes"]


def value(dtype: str, shape, i: int, rng) -> np.ndarray:
    dt = Z.FieldSpec("v", dtype).np_dtype
    n = shape if shape is not None else (int(rng.integers(0, 9)),)
    if dt.kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    if dt.kind == "f":
        return (rng.standard_normal(n) * 100).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)


@pytest.mark.parametrize("compress", ["raw", "flate"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype_fixed_and_variable(tmp_path, dtype, compress):
    rng = np.random.default_rng(DTYPES.index(dtype))
    fields = [Z.FieldSpec("fixed", dtype, (3, 2), compress), Z.FieldSpec("var", dtype, None, compress)]
    want = [(value(dtype, (3, 2), i, rng), value(dtype, None, i, rng)) for i in range(150)]
    with ZRecordWriter(tmp_path / "s", fields, chunk_size=64, chunk_grow_bytes=1 << 16) as w:
        for a, b in want[:50]:
            w.append({"fixed": a, "var": b})
        w.extend([{"fixed": a, "var": b} for a, b in want[50:]])
    with ZRecordStore(tmp_path / "s") as s:
        assert len(s) == 150
        idx = rng.permutation(150)
        with s.gather(idx) as batch:
            assert batch["fixed"].dtype == np.dtype(Z.DTYPES[dtype]) and batch["fixed"].shape == (150, 3, 2)
            for j, i in enumerate(idx):
                np.testing.assert_array_equal(batch["fixed"][j], want[i][0])
                np.testing.assert_array_equal(batch["var"][j], want[i][1])
                assert batch["var"][j].dtype == np.dtype(Z.DTYPES[dtype])


def test_bytes_fields_and_single_field_stores(tmp_path):
    with ZRecordWriter(tmp_path / "s", [Z.FieldSpec("blob", "bytes", compress="flate")]) as w:
        w.append(b"")
        w.append(b"abc" * 1000)
        w.append(bytearray(b"x"))
        w.append(np.frombuffer(b"np", np.uint8))
    with ZRecordStore(tmp_path / "s") as s:
        got = [bytes(v) for v in s["blob"][:]]
        assert got == [b"", b"abc" * 1000, b"x", b"np"]
        assert s["blob"][1].tobytes() == b"abc" * 1000


def test_absent_fields(tmp_path):
    fields = [Z.FieldSpec("x", "f32", (2,)), Z.FieldSpec("y", "i32"), Z.FieldSpec("z", "u8", compress="flate")]
    with ZRecordWriter(tmp_path / "s", fields) as w:
        w.append({"x": [1, 2]})
        w.append({"y": [5], "z": [1, 2, 3]})
        w.append((None, None, None))
    with ZRecordStore(tmp_path / "s") as s, s.gather([0, 1, 2]) as b:
        np.testing.assert_array_equal(b["x"], [[1, 2], [0, 0], [0, 0]])
        assert b.present("x").tolist() == [True, False, False]
        assert b["y"][0] is None and b["y"][1].tolist() == [5] and b["y"][2] is None
        assert b["z"][0] is None and b["z"][1].tolist() == [1, 2, 3]
        assert b.present("z").tolist() == [False, True, False]
    # the offset tables hold zero-length entries for them
    table = np.fromfile(tmp_path / "s" / "y.offset", dtype=Z.ENTRY_DTYPE, count=3)
    assert table["length"].tolist()[0] == 0 and table["length"].tolist()[2] == 0


def test_modify_and_delete(tmp_path):
    fields = [Z.FieldSpec("a", "i64", (1,)), Z.FieldSpec("b", "bytes")]
    with ZRecordWriter(tmp_path / "s", fields) as w:
        for i in range(10):
            w.append({"a": [i], "b": b"r%d" % i})
        w.commit()
        w.modify(3, {"b": b"changed"})          # a keeps its value
        w.modify(4, {"a": [40], "b": None})     # b becomes absent
        w.modify(-1, ([99], b"last"))           # negative index, both fields
        w.delete(0)                             # the last record (index 9) moves into 0
        w.delete(8)                             # now the last one: just shrinks
        assert len(w) == 8
        with pytest.raises(IndexError):
            w.delete(8)
        with pytest.raises(IndexError):
            w.modify(100, {"a": [1]})
    with ZRecordStore(tmp_path / "s") as s:
        a = s["a"][:][:, 0].tolist()
        b = [None if v is None else v.tobytes() for v in s["b"][:]]
    assert a == [99, 1, 2, 3, 40, 5, 6, 7]
    assert b == [b"last", b"r1", b"r2", b"changed", None, b"r5", b"r6", b"r7"]


def test_nothing_is_visible_before_commit_and_abort_drops_it(tmp_path):
    fields = [Z.FieldSpec("a", "i32", (1,))]
    w = ZRecordWriter(tmp_path / "s", fields)
    for i in range(5):
        w.append([i])
    w.commit()
    s = ZRecordStore(tmp_path / "s")
    w.append([5])
    w.modify(0, [100])
    w.delete(1)
    assert len(s) == 5 and s["a"][:][:, 0].tolist() == [0, 1, 2, 3, 4]
    w.commit()
    assert len(s) == 5 and s["a"][:][:, 0].tolist() == [100, 5, 2, 3, 4]
    w.append([6])
    w.modify(2, [200])
    w.abort()
    assert s["a"][:][:, 0].tolist() == [100, 5, 2, 3, 4]
    with ZRecordWriter(tmp_path / "s") as w2:
        assert len(w2) == 5
        w2.append([7])
    assert s["a"][:][:, 0].tolist() == [100, 5, 2, 3, 4, 7]
    s.close()


def test_chunks_fill_then_roll_and_a_reopened_writer_continues_the_unfull_chunk(tmp_path):
    fields = [Z.FieldSpec("a", "u8")]
    with ZRecordWriter(tmp_path / "s", fields, chunk_size=10, chunk_grow_bytes=1 << 16) as w:
        for i in range(25):
            w.append(np.full(i, i, np.uint8))
    meta = Z.parse_meta((tmp_path / "s" / "meta.json").read_bytes())
    assert meta.num_chunks == 3 and len(meta.unfull) == 1 and meta.unfull[0][2] == 5
    size = os.path.getsize(tmp_path / "s" / "chunk" / "2.zr")
    assert size == 1 << 16  # sparse growth step
    with ZRecordWriter(tmp_path / "s", chunk_grow_bytes=1 << 16) as w:
        for i in range(25, 30):
            w.append(np.full(i, i, np.uint8))
    meta = Z.parse_meta((tmp_path / "s" / "meta.json").read_bytes())
    assert meta.num_chunks == 3 and meta.unfull == ()  # chunk 2 filled up to 10 records
    with ZRecordStore(tmp_path / "s") as s:
        for i, v in enumerate(s["a"][:]):
            assert v.tolist() == [i] * i


def test_offset_tables_grow_a_step_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setattr(Z, "OFFSET_GROW_ENTRIES", 64)
    with ZRecordWriter(tmp_path / "s", [Z.FieldSpec("a", "i32", (1,))]) as w:
        sizes = set()
        s = None
        for i in range(300):
            w.append([i])
            sizes.add(os.path.getsize(tmp_path / "s" / "a.offset"))
            if i == 10:
                w.commit()
                s = ZRecordStore(tmp_path / "s")  # maps the table at 64 entries
    assert sizes == {64 * 16 * k for k in range(1, 6)}
    assert s["a"][:][:, 0].tolist() == list(range(300))  # remapped as the table grew
    s.close()


def test_extend_keeps_order_over_threads(tmp_path):
    fields = [Z.FieldSpec("a", "i64", (1,)), Z.FieldSpec("b", "u8", compress="flate")]
    with ZRecordWriter(tmp_path / "s", fields, num_writers=4, chunk_size=100) as w:
        seen = []
        r = w.extend(({"a": [i], "b": np.full(i % 50, i % 256, np.uint8)} for i in range(5000)), batch=64,
                     progress=seen.append)
        assert r == range(5000) and sum(seen) == 5000
    with ZRecordStore(tmp_path / "s") as s:
        assert s["a"][:][:, 0].tolist() == list(range(5000))
        assert all(v.tolist() == [i % 256] * (i % 50) for i, v in enumerate(s["b"][:]))


def test_rebalance_keeps_every_record_and_removes_old_chunks_once_unused(tmp_path, capsys):
    fields = [Z.FieldSpec("a", "i64", (2,)), Z.FieldSpec("b", "bytes", compress="flate")]
    rng = np.random.default_rng(0)
    with ZRecordWriter(tmp_path / "s", fields, chunk_size=50) as w:
        for i in range(400):
            w.append({"a": [i, -i], "b": rng.bytes(int(rng.integers(0, 300)))})
        w.commit()
        for i in range(0, 400, 3):
            w.modify(i, {"b": b"m%d" % i})
        for _ in range(50):
            w.delete(int(rng.integers(0, len(w))))
        w.commit()
        reader = ZRecordStore(tmp_path / "s")
        before = [(r["a"].tolist(), bytes(r["b"])) for r in reader]
        chunks_before = sorted(os.listdir(tmp_path / "s" / "chunk"))
        held = reader.gather(np.arange(10))            # views into the old chunks
        old_view = held["b"][1].copy()
        util = w.rebalance()
        printed = capsys.readouterr().out
        assert "utilization" in printed
        assert util["records"] > 0.85 and util["bytes"] > 0.99
        # the reader holds epoch 0: the old chunks stay until it moves on
        assert set(chunks_before) <= set(os.listdir(tmp_path / "s" / "chunk"))
        after = [(r["a"].tolist(), bytes(r["b"])) for r in reader]   # the reader reopened at epoch 1
        assert after == before
        np.testing.assert_array_equal(held["b"][1], old_view)
        w.commit()                                      # retires the old chunks now
        assert not set(chunks_before) & set(os.listdir(tmp_path / "s" / "chunk"))
        reader.close()
        w.append({"a": [7, 7], "b": b"after"})
    with ZRecordStore(tmp_path / "s") as s:
        assert [(r["a"].tolist(), bytes(r["b"])) for r in s] == before + [([7, 7], b"after")]


def test_one_writer_at_a_time_and_readers_alongside(tmp_path):
    w = ZRecordWriter(tmp_path / "s", [Z.FieldSpec("a", "u8")])
    with pytest.raises(StateError, match="writer.lock"):
        ZRecordWriter(tmp_path / "s")
    with ZRecordStore(tmp_path / "s") as s:
        assert len(s) == 0
    w.close()
    ZRecordWriter(tmp_path / "s").close()


def test_bad_arguments(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        ZRecordWriter(tmp_path / "full", [Z.FieldSpec("a")])
    with pytest.raises(ConfigError):
        Z.FieldSpec("bad name!")
    with pytest.raises(ConfigError):
        Z.FieldSpec("a", "f128")
    with pytest.raises(ConfigError):
        Z.FieldSpec("a", compress="zstd")
    with pytest.raises(ConfigError):
        ZRecordWriter(tmp_path / "t", [Z.FieldSpec("a"), Z.FieldSpec("a")])
    (tmp_path / "empty").mkdir()
    with ZRecordWriter(tmp_path / "empty", [Z.FieldSpec("a", "f32", (2,))]) as w:
        with pytest.raises(ConfigError, match="shape"):
            w.append([1, 2, 3])
        with pytest.raises(ConfigError, match="unknown fields"):
            w.append({"b": [1]})
        with pytest.raises(ConfigError, match="tuple of 2 values"):
            w.append(([1, 2], [3]))
    with ZRecordWriter(tmp_path / "u", [Z.FieldSpec("u", "u8")]) as w:
        with pytest.raises(ConfigError, match="fit"):
            w.append([300])
    w = ZRecordWriter(tmp_path / "u")
    w.close()
    with pytest.raises(StateError):
        w.append([1])


@pytest.mark.parametrize("k", range(1, 40, 3))
def test_an_io_error_during_commit_is_typed_and_loses_nothing_committed(tmp_path, k):
    from zbtest import run_python

    folder = tmp_path / "s"
    with ZRecordWriter(folder, [Z.FieldSpec("a", "i32", (1,)), Z.FieldSpec("b", "bytes", compress="flate")]) as w:
        for i in range(20):
            w.append({"a": [i], "b": b"x" * i})
    code = f"""
import errno
from zerobatch.writers.zrecord import ZRecordWriter
from zerobatch.formats.errors import WriteError
try:
    w = ZRecordWriter({str(folder)!r})
    for i in range(20, 30):
        w.append({{"a": [i], "b": b"y" * i}})
    w.modify(0, {{"a": [1000]}})
    w.delete(5)
    w.commit()
    w.close()
    print("OK")
except WriteError as exc:
    assert exc.errno == errno.EIO, exc
    print("WRITEERROR")
"""
    r = run_python(code, env={"ZEROBATCH_FAULT_ERRNO_AFTER": f"{k}:EIO"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("OK", "WRITEERROR")
    with ZRecordStore(folder) as s:
        a = s["a"][:][:, 0].tolist()
    assert a == list(range(20)) or a == [1000, 1, 2, 3, 4, 29, *range(6, 29)], a
    with ZRecordWriter(folder) as w:   # the next writer works
        w.append({"a": [1], "b": b""})
