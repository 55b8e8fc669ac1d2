"""Grain takes zerobatch data natively and resumes exactly from its own checkpoints.

- Grain's own pipelines (shuffle, batch, first-fit packing) over zerobatch data sources give,
  sample for sample, what the same pipelines give over Grain's own ArrayRecord reader of an
  independent copy of the tokens (written from the arrays the test dataset was made of);
- a torch training loop fed by Grain (``grain_train.py``: a ``MapDataset`` pipeline, the same
  with two ``mp_prefetch`` worker processes, and zerobatch's order as a Grain
  ``IterDataset``), accumulation 2, run ``2N`` steps; run ``N`` steps and SIGKILLed right
  after Grain's iterator checkpoint (``grain.checkpoint.CheckpointHandler``) of step ``N``;
  resumed from it: the model receives exactly the uninterrupted run's tokens;
- zerobatch's order as a Grain iterator keeps zerobatch's elastic resume: a state saved by
  rank 0 of 2 continues a 1-process run (same global batch) exactly.
"""

from __future__ import annotations

import pickle
import threading

import grain
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter
from etils import epath
from trainerkit import HERE, assert_resumed_exactly, recorded, run
from zbtest import token_stream

from zerobatch.adapters.grain import DataSource, Documents, LoaderDataset
from zerobatch.adapters.sources import Mixture, RecordFields, TokenDocuments, TokenWindows
from zerobatch.formats.errors import ConfigError, OutOfRangeError, StateError

SEQ = 16


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The dataset, and the tokens it was written from (never read back through zerobatch)."""
    folder, docs = token_stream(tmp_path_factory.mktemp("grain") / "data", n_tokens=6000)
    return folder, [np.asarray(d, dtype=np.int32) for d in docs]


def array_record(path, records) -> grain.sources.ArrayRecordDataSource:
    """An ArrayRecord file of ``records`` (int32 arrays), opened with Grain's own reader."""
    w = ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        w.write(np.ascontiguousarray(r, dtype=np.int32).tobytes())
    w.close()
    return grain.sources.ArrayRecordDataSource(str(path))


def decode(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.int32)


def pair(window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return window[:-1], window[1:]


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return np.array_equal(np.asarray(a), np.asarray(b))


def test_windows_match_grain_reading_an_array_record_copy(data, tmp_path):
    folder, docs = data
    tokens = np.concatenate(docs)
    source = DataSource(TokenWindows(folder, seq_len=SEQ))
    n = len(source)
    assert n == (len(tokens) - 1) // SEQ
    copy = array_record(tmp_path / "windows.array_record", [tokens[k * SEQ:k * SEQ + SEQ + 1] for k in range(n)])

    def pipeline(ds):
        return ds.shuffle(seed=7).batch(4).to_iter_dataset()

    ours = pipeline(grain.MapDataset.source(source))
    theirs = pipeline(grain.MapDataset.source(copy).map(decode).map(pair))
    want = list(theirs)
    got = list(ours)
    assert len(got) == len(want) == n // 4 + (n % 4 > 0)
    assert all(same(g, w) for g, w in zip(got, want))
    assert got[0][0].dtype == np.int32 and got[0][0].shape == (4, SEQ)
    # Grain's own iterator state, restored into a fresh iterator, continues exactly
    it = iter(ours)
    for _ in range(5):
        next(it)
    state = it.get_state()
    fresh = iter(ours)
    fresh.set_state(state)
    assert all(same(g, w) for g, w in zip(fresh, want[5:]))
    # the batched read and the single read agree; int64 on request
    assert same(source._getitems([3, 0, n - 1]), [source[3], source[0], source[n - 1]])
    assert DataSource(TokenWindows(folder, seq_len=SEQ), dtype=np.int64)[2][0].dtype == np.int64


def test_packed_documents_match_grain_reading_an_array_record_copy(data, tmp_path):
    folder, docs = data
    copy = array_record(tmp_path / "docs.array_record", docs)
    source = Documents(folder)
    assert len(source) == len(docs) and all(np.array_equal(source[i], docs[i]) for i in (0, 7, len(docs) - 1))
    assert all(np.array_equal(a, docs[i][:20]) for a, i in zip(Documents(folder, max_length=20)._getitems([4, 9]),
                                                                (4, 9)))

    def pipeline(ds):
        ds = ds.shuffle(seed=2).map(lambda d: {"tokens": d}).to_iter_dataset()
        return grain.experimental.FirstFitPackIterDataset(ds, length_struct={"tokens": 32}, num_packing_bins=4,
                                                          seed=3)

    # packing takes documents cut to the row length: ours cut by the source, theirs by a map
    ours = pipeline(grain.MapDataset.source(Documents(folder, max_length=32)))
    theirs = pipeline(grain.MapDataset.source(copy).map(decode).map(lambda d: d[:32]))
    want = list(theirs)
    assert len(want) > 20 and set(want[0]) >= {"tokens", "tokens_segment_ids", "tokens_positions"}
    it = iter(ours)
    got = [next(it) for _ in range(9)]
    # Grain's checkpoint of the packing iterator (its buffers included), restored elsewhere
    ckpt = epath.Path(tmp_path / "ckpt")
    ckpt.mkdir()
    grain.checkpoint.CheckpointHandler().save(ckpt, item=it)
    fresh = grain.checkpoint.CheckpointHandler().restore(ckpt, item=iter(ours))
    got += list(fresh)
    assert len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))


def test_padded_documents_and_records(data, tmp_path):
    folder, docs = data
    padded = DataSource(TokenDocuments(folder, width=24, pad_id=-1))
    for i in (0, 5, len(docs) - 1):
        d = docs[i][:23]                    # a row of 24 tokens: 23 inputs, their 23 labels
        rec = padded[i]
        assert set(rec) == {"input_ids", "labels", "attention_mask"} and rec["input_ids"].shape == (23,)
        assert np.array_equal(rec["input_ids"][:len(d)], d) and (rec["input_ids"][len(d):] == -1).all()
        assert int(rec["attention_mask"].sum()) == len(d)
    assert same(padded._getitems([5, 0]), [padded[5], padded[0]])
    from zerobatch.formats import zrecord as Z
    from zerobatch.writers.zrecord import ZRecordWriter
    recs = [(np.arange(i % 7 + 1, dtype=np.int32) + i, np.array([i, -i])) for i in range(30)]
    with ZRecordWriter(tmp_path / "s", [Z.FieldSpec("ids", "i32", None, "flate"), Z.FieldSpec("label", "i64", (2,))],
                       chunk_size=8) as w:
        w.extend({"ids": a, "label": b} for a, b in recs)
        w.commit()
    store = DataSource(RecordFields(str(tmp_path / "s")))
    assert len(store) == 30
    for i, r in enumerate(store._getitems(range(30))):
        assert np.array_equal(r["ids"], recs[i][0]) and np.array_equal(r["label"], recs[i][1])
    batch = grain.MapDataset.source(DataSource(RecordFields(str(tmp_path / "s"), ["label"]))).batch(3)[1]
    assert batch.tolist() == [[3, -3], [4, -4], [5, -5]]


def test_worker_copies_reopen_once_under_concurrent_first_use(data):
    folder, _ = data
    for source in (DataSource(TokenWindows(folder, seq_len=SEQ)), Documents(folder)):
        want = [source[i] for i in range(24)]
        for _ in range(10):                 # (before the readers' first open was awaited, ~half failed)
            copy = pickle.loads(pickle.dumps(source))       # as a spawned Grain worker gets it
            assert repr(copy) == repr(source)
            got: list = [None] * 24
            threads = [threading.Thread(target=lambda k=k: got.__setitem__(k, copy[k])) for k in range(24)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert all(same(g, w) for g, w in zip(got, want))


def test_loader_dataset_keeps_zerobatch_elastic_resume(data, tmp_path):
    folder, _ = data
    src = TokenWindows(folder, seq_len=SEQ)
    one = LoaderDataset(src, batch_size=4, seed=5, rank=0, world_size=1, num_epochs=2)
    want = [x for x, _ in one]
    per_epoch = len(want) // 2
    assert len(want) == 2 * per_epoch and want[0].shape == (4, SEQ) and want[0].dtype == np.int32
    assert not same(want[0], want[per_epoch])                                    # a new shuffle each epoch
    # two ranks of a global batch of 4: rank r's row j is the global row r + 2 j
    ranks = [iter(LoaderDataset(src, batch_size=2, seed=5, rank=r, world_size=2, num_epochs=2)) for r in (0, 1)]
    k = per_epoch - 3                       # the resumed runs cross the epoch boundary
    for step in range(k):
        rows = [next(it)[0] for it in ranks]
        assert same(np.stack([rows[0][0], rows[1][0], rows[0][1], rows[1][1]]), want[step])
    # rank 0's Grain checkpoint continues a 1-process run and rank 1 of 2 exactly
    ckpt = epath.Path(tmp_path / "ckpt")
    ckpt.mkdir()
    handler = grain.checkpoint.CheckpointHandler()
    handler.save(ckpt, item=ranks[0])
    saved = ranks[0].get_state()
    resumed = handler.restore(ckpt, item=iter(one))         # set_state, then start_prefetch
    # the batch read ahead is not counted (the state is this world's: world_size 1)
    # (and the run's world sizes, for zerobatch trace: 2 ranks, then 1 from this step on)
    step = saved["zerobatch"]["consumed"] // saved["zerobatch"]["global_batch_size"]
    assert resumed.get_state()["zerobatch"] == {**saved["zerobatch"], "world_size": 1, "worlds": [[0, 2], [step, 1]]}
    assert all(same(x, w) for (x, _), w in zip(resumed, want[k:], strict=True))
    rank1 = iter(LoaderDataset(src, batch_size=2, seed=5, rank=1, world_size=2, num_epochs=2))
    rank1.set_state(saved["zerobatch"])                     # a bare loader state too
    assert all(same(x, w[1::2]) for (x, _), w in zip(rank1, want[k:], strict=True))
    # start_prefetch, then a state saved before the first batch is taken, then close
    it = iter(one)
    it.start_prefetch()
    started = it.loader.__dict__.get("_started")            # the loader's pass, reading ahead
    it.start_prefetch()
    assert started is not None and it.loader.__dict__.get("_started") is started
    assert it.get_state()["zerobatch"]["consumed"] == 0
    assert same(next(it)[0], want[0]) and it.get_state()["zerobatch"]["consumed"] == 4
    it.close()
    with pytest.raises(ValueError):
        next(it)
    for r in ranks:
        r.close()


def test_errors(data):
    folder, _ = data
    src = TokenWindows(folder, seq_len=SEQ)
    with pytest.raises(ConfigError, match="Mixture or Curriculum has no numbered items"):
        DataSource(Mixture([("a", src, 1.0)]))
    ds = DataSource(src)
    with pytest.raises(OutOfRangeError, match=f"index {len(ds)} is outside"):
        ds[len(ds)]
    with pytest.raises(ConfigError, match="index must be an integer"):
        ds[1.5]
    with pytest.raises(ConfigError, match="dtype must be int64 or int32"):
        DataSource(src, dtype=np.float32)
    with pytest.raises(ConfigError, match="num_epochs must be between 1"):
        LoaderDataset(src, batch_size=4, num_epochs=0)
    it = iter(LoaderDataset(src, batch_size=4, seed=5, rank=0, world_size=1))
    with pytest.raises(StateError, match="is a dict, got int"):
        it.set_state(3)
    other = iter(LoaderDataset(src, batch_size=4, seed=6, rank=0, world_size=1))
    next(other)
    with pytest.raises(StateError):
        it.set_state(other.get_state())


@pytest.mark.timeout(600)
def test_kill_and_resume_from_grains_checkpoint(data, tmp_path):
    folder, _ = data
    script = str(HERE / "grain_train.py")
    n = 4
    common = [folder, "--steps", str(2 * n), "--accum", "2"]
    # the uninterrupted run; mp_prefetch over the map pipeline hands out the map pipeline's
    # batches in the same order, so the map run is its reference too (checked below)
    run([script, *common[:1], str(tmp_path / "full-ckpt"), *common[1:], "--pipelines", "map,zerobatch"],
        record=tmp_path / "full")
    run([script, *common[:1], str(tmp_path / "ckpt"), *common[1:], "--save-at", str(n), "--kill"],
        record=tmp_path / "before", expect_killed=True)
    run([script, *common[:1], str(tmp_path / "ckpt"), *common[1:], "--resume"], record=tmp_path / "after")
    calls = 2 * n                           # forward calls up to the checkpoint (accumulation 2)
    for kind, reference in (("map", "map"), ("mp", "map"), ("zerobatch", "zerobatch")):
        full = recorded(tmp_path / f"full-{reference}")
        before, after = recorded(tmp_path / f"before-{kind}"), recorded(tmp_path / f"after-{kind}")
        assert len(full) == 2 * calls and all(np.shape(c) == (4, SEQ) for c in full)
        assert_resumed_exactly(full, before, after, calls)
    assert recorded(tmp_path / "full-map") != recorded(tmp_path / "full-zerobatch")
