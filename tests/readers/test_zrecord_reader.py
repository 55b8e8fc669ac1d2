"""ZRECORD reader: gather order, zero-copy views, batch release, the NumPy-style projection,
threads, the compiled kernel against its pure-Python twin, and consistency while a writer
commits."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from zerobatch.core import _reference
from zerobatch.core.status import STATUS
from zerobatch.formats import zrecord as Z
from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.readers.zrecord import ZRecordStore
from zerobatch.writers.zrecord import ZRecordWriter

FIELDS = [Z.FieldSpec("img", "u8", (8, 8)), Z.FieldSpec("label", "i64", (1,)),
          Z.FieldSpec("text", "bytes"), Z.FieldSpec("feat", "f32", None, "flate"),
          Z.FieldSpec("mask", "bool", (4,), "flate")]


def make(folder, n=300, seed=0):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        recs.append({"img": rng.integers(0, 256, (8, 8), dtype=np.uint8), "label": [i],
                     "text": rng.bytes(int(rng.integers(0, 200))) if i % 7 else None,
                     "feat": rng.standard_normal(int(rng.integers(0, 50))).astype(np.float32),
                     "mask": rng.integers(0, 2, 4).astype(bool)})
    with ZRecordWriter(folder, FIELDS, chunk_size=64) as w:
        w.extend(recs)
    return recs


def same(got, want):
    if want is None:
        return got is None
    return np.array_equal(np.asarray(got).reshape(-1), np.frombuffer(want, np.uint8) if isinstance(want, bytes)
                          else np.asarray(want).reshape(-1))


def test_gather_returns_records_in_request_order(tmp_path):
    recs = make(tmp_path / "s")
    idx = np.array([5, 5, 299, 0, -1, -300, 17, 64, 63])
    with ZRecordStore(tmp_path / "s") as s, s.gather(idx) as b:
        assert b["img"].shape == (9, 8, 8) and b["label"][:, 0].tolist() == [5, 5, 299, 0, 299, 0, 17, 64, 63]
        for j, i in enumerate(idx.tolist()):
            r = recs[i]
            for name in ("img", "text", "feat", "mask"):
                assert same(b[name][j], r[name]), (name, i)
        assert b.present("text").tolist() == [recs[i]["text"] is not None for i in idx.tolist()]
        with pytest.raises(IndexError):
            s.gather([300])
        with pytest.raises(IndexError):
            s.gather([-301])
        with pytest.raises(ConfigError):
            s.gather([1.5])
        with pytest.raises(KeyError):
            s.gather([1], ["nope"])
        assert len(s.gather([], ["img"])["img"]) == 0


def test_raw_records_are_zero_copy_views_of_the_mapping(tmp_path):
    make(tmp_path / "s")
    with ZRecordStore(tmp_path / "s") as s:
        b = s.gather([3, 10, 200], ["text", "img"], zero_copy=True)
        # the writer's threads fill chunks in any order: find the chunk record 3 landed in
        chunks = [np.frombuffer(m, np.uint8) for m in s._gen.chunk_maps if m is not None]
        v = b["text"][0]
        chunk = next(c for c in chunks if c.ctypes.data <= v.ctypes.data < c.ctypes.data + c.nbytes)
        assert not v.flags.writeable
        assert np.shares_memory(v, chunk)
        assert b["img"][0].shape == (8, 8) and any(np.shares_memory(b["img"][0], c) for c in chunks)
        assert v.ctypes.data % 16 == 0
        # the stacked form is one array filled in place
        stacked = s.gather([3, 10, 200], ["img"])["img"]
        assert stacked.flags.c_contiguous and not any(np.shares_memory(stacked, c) for c in chunks)
        np.testing.assert_array_equal(stacked[1], b["img"][1])


def test_released_batches_refuse_use_but_views_stay_valid(tmp_path):
    recs = make(tmp_path / "s")
    with ZRecordStore(tmp_path / "s") as s:
        b = s.gather([1, 2])
        view = b["text"][0]
        feat = b["feat"][1]
        b.release()
        b.release()
        with pytest.raises(StateError):
            b["text"]
        with pytest.raises(StateError):
            b.present("img")
    assert same(view, recs[1]["text"]) and same(feat, recs[2]["feat"])  # store closed, still valid


def test_projection_len_and_iteration(tmp_path):
    recs = make(tmp_path / "s", n=600)
    with ZRecordStore(tmp_path / "s") as s:
        assert len(s) == 600 and s.keys() == [f.name for f in FIELDS]
        view = s["label"]
        assert len(view) == 600 and view.shape == (600, 1) and view.dtype == np.int64
        assert view[[3, 1]][:, 0].tolist() == [3, 1]
        assert view[10:15][:, 0].tolist() == list(range(10, 15))
        assert view[-1].tolist() == [599]
        assert s["text"].shape is None
        assert sum(1 for _ in s["feat"]) == 600
        for i, r in enumerate(s):
            assert r["label"].tolist() == [i] and same(r["feat"], recs[i]["feat"])
        with pytest.raises(KeyError):
            s["nope"]
    with pytest.raises(StateError):
        s.gather([0])


def test_threads_and_pool_splits_read_what_one_thread_reads(tmp_path):
    rng = np.random.default_rng(1)
    fields = [Z.FieldSpec("big", "u8", (4096,), "flate"), Z.FieldSpec("raw", "u8", (4096,))]
    with ZRecordWriter(tmp_path / "s", fields, chunk_size=128) as w:
        w.extend([{"big": np.repeat(rng.integers(0, 256, 64, dtype=np.uint8), 64),
                   "raw": rng.integers(0, 256, 4096, dtype=np.uint8)} for _ in range(1000)])
    idx = rng.integers(0, 1000, 512)
    with ZRecordStore(tmp_path / "s", num_threads=1) as one:
        want = one.gather(idx)
        want = {k: want[k].copy() for k in ("big", "raw")}
    with ZRecordStore(tmp_path / "s", num_threads=3) as s:
        errors = []

        def work() -> None:
            try:
                for _ in range(5):
                    got = s.gather(idx)
                    for k in ("big", "raw"):
                        np.testing.assert_array_equal(got[k], want[k])
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        ts = [threading.Thread(target=work) for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors


@pytest.mark.compiled
def test_compiled_kernel_matches_its_pure_python_twin(tmp_path):
    from zerobatch.core import _zrecord as compiled

    make(tmp_path / "s")
    with ZRecordStore(tmp_path / "s") as s:
        rng = np.random.default_rng(3)
        idx = rng.integers(-300, 300, 60)
        gen = s._gen
        got = {}
        for impl in (compiled, _reference):
            entries = np.empty((idx.size, 3), Z.ENTRY_DTYPE)
            status, length, nch, bad = impl.snapshot_entries(gen.commit_map, gen.epoch, gen.table_addr,
                                                             gen.check_addr, gen.table_entries, [0, 2, 3], idx,
                                                             entries, s._key32)
            assert status == 0
            got[impl] = (entries, length, nch)
        (e1, l1, n1), (e2, l2, n2) = got[compiled], got[_reference]
        assert (l1, n1) == (l2, n2) and e1.tobytes() == e2.tobytes()
        s.gather(np.arange(l1))             # every chunk mapped
        for j, k in enumerate([0, 2, 3]):
            spec = FIELDS[k]
            col = e1[:, j].copy()
            args = (col, gen.chunk_base, gen.chunk_size, n1, k, spec.codec, spec.fixed_bytes,
                    spec.fixed_bytes or 1 << 30, spec.np_dtype.itemsize, True)
            kw = dict(key=s._key, first=gen.first_chunk)
            a, b = compiled.check_records(*args, **kw), _reference.check_records(*args, **kw)
            assert a[:3] == b[:3] == (0, 0, 0)
            # the record checksums are bound to the store: another key fails both alike
            a, b = compiled.check_records(*args, key=s._key ^ 1), _reference.check_records(*args, key=s._key ^ 1)
            assert a[0] == b[0] == STATUS.ZB_E_CHECKSUM
            np.testing.assert_array_equal(a[3], b[3])
            np.testing.assert_array_equal(a[4], b[4])


def test_every_batch_comes_from_one_committed_state_while_a_writer_commits(tmp_path):
    """A writer rewrites every record with its generation number and commits, again and
    again, rebalancing now and then; readers on other threads, sharing one store, must never
    see two generations in one batch (nor fail while chunks are mapped or epochs change)."""
    fields = [Z.FieldSpec("g", "i64", (1,)), Z.FieldSpec("v", "i64", None, "flate")]
    n = 200
    w = ZRecordWriter(tmp_path / "s", fields, chunk_size=1000)
    for i in range(n):
        w.append({"g": [0], "v": [0] * (i % 5)})
    w.commit()
    s = ZRecordStore(tmp_path / "s", num_threads=2)
    stop = threading.Event()
    seen = set()
    errors = []

    def read() -> None:
        try:
            while not stop.is_set():
                b = s.gather(np.arange(len(s)))
                gens = set(b["g"][:, 0].tolist())
                gens |= {int(x) for v in b["v"] for x in v.tolist()}
                assert len(gens) == 1, gens
                seen.update(gens)
                b.release()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    ts = [threading.Thread(target=read) for _ in range(3)]
    for t in ts:
        t.start()
    for gen in range(1, 40):
        for i in range(n):
            w.modify(i, {"g": [gen], "v": [gen] * (i % 5)})
        w.commit()
        if gen % 13 == 0:
            w.rebalance(report=None)   # readers reopen at the new epoch mid-stream
    stop.set()
    for t in ts:
        t.join()
    w.close()
    s.close()
    assert not errors, errors
    assert len(seen) > 3


def _child_gather(store, q) -> None:
    q.put(store.gather([3, 1])["label"][:, 0].tolist())


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_store_in_forked_and_spawned_processes(tmp_path, method):
    import multiprocessing as mp
    import pickle

    make(tmp_path / "s", n=10)
    with ZRecordStore(tmp_path / "s") as s:
        s.gather([0, 1])                      # mapped and pooled before the fork
        copy = pickle.loads(pickle.dumps(s))
        assert copy.gather([2])["label"].tolist() == [[2]]
        copy.close()
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=_child_gather, args=(s, q))
        p.start()
        assert q.get(timeout=60) == [3, 1]
        p.join(60)
        assert p.exitcode == 0
