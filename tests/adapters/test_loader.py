"""zerobatch.adapters.torch.Loader over every source: outputs, options, threads, state."""

from __future__ import annotations

import collections
import os
import threading
import time

import numpy as np
import pytest
import torch
import zbtest
from zbtest import run_python, token_stream

from zerobatch.adapters.torch import (Loader, LLMBatchSource, Mixture, RecordFields, Source, TokenDocuments,
                                      TokenWindows)
from zerobatch.formats import zrecord as Z
from zerobatch.formats.errors import ConfigError, IntegrityError, StateError
from zerobatch.readers.tokstream import TokenStreamReader
from zerobatch.samplers import GlobalRandomOrder, IndexSampler, SequentialOrder
from zerobatch.writers.llmbatch import write_batch_file
from zerobatch.writers.zrecord import ZRecordWriter

SEQ = 16


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    return token_stream(tmp_path_factory.mktemp("ts") / "d")


def win_ids(batch, seq=SEQ):
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    return (x[:, 0] // seq).tolist()


def run(loader, steps=None):
    out = []
    for k, b in enumerate(loader):
        out.append(win_ids(b))
        if steps is not None and k + 1 == steps:
            break
    return out


# ---------------------------------------------------------------------------------------------
# outputs of each source


def test_windows_are_next_token_views_of_one_buffer(stream):
    folder, _ = stream
    src = TokenWindows(folder, SEQ)
    assert src.num_items == (4000 - SEQ - 1) // SEQ + 1
    loader = Loader(src, batch_size=8, seed=3)
    x, y = next(iter(loader))
    assert x.shape == y.shape == (8, SEQ) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    starts = x[:, 0].numpy()
    assert (starts % SEQ == 0).all()
    for row, s in zip(x.numpy(), starts, strict=True):
        assert (row == np.arange(s, s + SEQ)).all()
    x32, _ = next(iter(Loader(src, batch_size=8, seed=3, dtype=torch.int32)))
    assert x32.dtype == torch.int32 and torch.equal(x32.long(), x)


@pytest.mark.parametrize("shuffle", [True, False])
def test_one_epoch_reads_the_samplers_order(stream, shuffle):
    folder, _ = stream
    src = TokenWindows(folder, SEQ)
    n = src.num_items
    for world in (1, 3):
        for rank in range(world):
            ld = Loader(src, batch_size=4, seed=11, shuffle=shuffle, rank=rank, world_size=world, epoch=2)
            order = GlobalRandomOrder(n, seed=11) if shuffle else SequentialOrder(n)
            sampler = IndexSampler(order, 4, rank=rank, world_size=world, tail="drop", epoch=2)
            assert run(ld) == [b.tolist() for b in sampler]
            assert len(ld) == len(sampler) == n // (4 * world)


def test_tails(stream):
    folder, _ = stream
    src = TokenWindows(folder, SEQ)
    n = src.num_items                          # 249 windows
    for world in (1, 2, 4):
        seen = {"drop": [], "keep": [], "pad": []}
        steps = {}
        for tail in seen:
            for r in range(world):
                got = run(Loader(src, batch_size=8, seed=1, tail=tail, rank=r, world_size=world))
                steps.setdefault(tail, set()).add(len(got))
                seen[tail] += [i for b in got for i in b]
        g = 8 * world
        assert sorted(seen["drop"]) == sorted(set(seen["drop"])) and len(seen["drop"]) == n // g * g
        assert sorted(seen["keep"]) == list(range(n))
        assert set(seen["pad"]) == set(range(n)) and len(seen["pad"]) == -(-n // g) * g
        assert len(steps["pad"]) == 1 and len(steps["drop"]) == 1


def test_boundaries_and_metadata(tmp_path):
    folder, _ = token_stream(tmp_path / "m", n_tokens=2000, metadata=True)
    reader = TokenStreamReader(folder)
    src = TokenWindows(reader, SEQ, boundaries=True, metadata=True)
    ld = Loader(src, batch_size=4, seed=5)
    order = GlobalRandomOrder(src.num_items, seed=5)
    for step, batch in enumerate(ld):
        assert set(batch) == {"input_ids", "labels", "position_ids", "segment_ids", "cu_seqlens", "max_seqlen",
                              "metadata_ids", "metadata"}
        items = order.items(0, np.arange(step * 4, step * 4 + 4))
        starts = reader.window_starts(items, SEQ + 1)
        tok, pos, seg, cu, longest = reader.windows_with_boundaries(starts, SEQ + 1)
        assert torch.equal(batch["input_ids"], torch.from_numpy(tok[:, :-1]))
        assert torch.equal(batch["labels"], torch.from_numpy(tok[:, 1:]))
        assert torch.equal(batch["position_ids"], torch.from_numpy(pos))
        assert torch.equal(batch["segment_ids"], torch.from_numpy(seg))
        assert torch.equal(batch["cu_seqlens"], torch.from_numpy(cu)) and batch["max_seqlen"] == longest
        meta = reader.windows_metadata(starts, SEQ)
        assert torch.equal(batch["metadata_ids"], torch.from_numpy(meta.ids))
        assert list(batch["metadata"]) == list(meta.objects)
        if step == 5:
            break


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_documents_padded_with_labels(stream, dtype):
    folder, docs = stream
    src = TokenDocuments(folder, width=40, pad_id=7)
    assert src.num_items == len(docs)
    ld = Loader(src, batch_size=5, shuffle=False, drop_last=False, dtype=dtype)
    got = list(ld)
    assert got[0]["input_ids"].dtype == got[0]["labels"].dtype == dtype
    assert len(got) == -(-len(docs) // 5)
    k = 0
    for b in got:
        for row in range(b["input_ids"].shape[0]):
            d = docs[k][:40]
            n = len(d)
            full = np.full(40, 7)
            full[:n] = d
            assert (b["input_ids"][row].numpy() == full[:-1]).all()
            labels = np.where(np.arange(40) < n, full, -100)[1:]
            assert (b["labels"][row].numpy() == labels).all()
            assert (b["attention_mask"][row].numpy() == (np.arange(39) < n)).all()
            k += 1
    assert k == len(docs)


def test_documents_without_labels_and_bad_pad_ids(stream):
    folder, docs = stream
    b = next(iter(Loader(TokenDocuments(folder, width=16, pad_id=-1, next_token=False), batch_size=len(docs),
                         shuffle=False)))
    assert set(b) == {"input_ids", "attention_mask"}
    for row, doc in enumerate(docs):
        n = min(len(doc), 16)
        assert (b["input_ids"][row, :n].numpy() == doc[:n]).all() and (b["input_ids"][row, n:] == -1).all()
        assert int(b["attention_mask"][row].sum()) == n
    for bad in (2**31, 1.5, True):
        with pytest.raises(ConfigError, match="pad_id must be an integer"):
            TokenDocuments(folder, width=16, pad_id=bad)


def test_record_fields(tmp_path):
    fields = [Z.FieldSpec("ids", "i32", None, "flate"), Z.FieldSpec("label", "i64", (2,))]
    rng = np.random.default_rng(1)
    recs = [(rng.integers(0, 100, int(rng.integers(1, 30))).astype(np.int32), np.array([i, -i])) for i in range(57)]
    with ZRecordWriter(tmp_path / "s", fields, chunk_size=16) as w:
        w.extend({"ids": a, "label": b} for a, b in recs)
        w.commit()
    ld = Loader(RecordFields(str(tmp_path / "s"), pad_to=20, pad_value=-1), batch_size=8, seed=2)
    seen = []
    for b in ld:
        assert set(b) == {"ids", "ids_mask", "label"} and b["ids"].shape == (8, 20) and b["label"].shape == (8, 2)
        for row in range(8):
            i = int(b["label"][row, 0])
            seen.append(i)
            a = recs[i][0][:20]
            assert (b["ids"][row, :len(a)].numpy() == a).all() and (b["ids"][row, len(a):] == -1).all()
            assert int(b["ids_mask"][row].sum()) == len(a)
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 56
    # one unpadded variable field: lists of arrays; one fixed field: the array itself
    lists = next(iter(Loader(RecordFields(str(tmp_path / "s"), ["ids"]), batch_size=3, shuffle=False)))
    assert [t.tolist() for t in lists] == [r[0].tolist() for r in recs[:3]]
    labels = next(iter(Loader(RecordFields(str(tmp_path / "s"), ["label"]), batch_size=3, shuffle=False)))
    assert labels.tolist() == [[0, 0], [1, -1], [2, -2]]
    ids32 = next(iter(Loader(RecordFields(str(tmp_path / "s"), ["ids", "label"], pad_to=8, token_fields=["ids"]),
                             batch_size=3, shuffle=False, dtype=torch.int32)))
    assert ids32["ids"].dtype == torch.int32 and ids32["label"].dtype == torch.int64
    with pytest.raises(ConfigError):
        RecordFields(str(tmp_path / "s"), ["nope"])


def test_llmbatch_file_batches_of_several_file_batches(tmp_path):
    t = np.arange(40 * 4 * 8, dtype=np.uint32).reshape(160, 8)
    write_batch_file(tmp_path / "f.batch", t, 4, 8, seed=0, shuffle=False)
    src = LLMBatchSource(str(tmp_path / "f.batch"), block_size=4)
    assert src.num_items == 40
    one = list(Loader(src, seed=1))
    assert len(one) == 40 and all(b.shape == (4, 8) for b in one)
    three = list(Loader(src, batch_size=12, seed=1))
    assert len(three) == 13 and all(b.shape == (12, 8) for b in three)
    assert torch.cat(three).reshape(-1, 4, 8)[:, 0, 0].tolist() == [int(b[0, 0]) for b in one][:39]
    i32 = list(Loader(src, seed=1, dtype=torch.int32))
    assert all(torch.equal(a.long(), b) for a, b in zip(i32, one, strict=True))
    with pytest.raises(ConfigError, match="multiple"):
        Loader(src, batch_size=6)


# ---------------------------------------------------------------------------------------------
# options, threads and state


def test_arguments(stream, monkeypatch):
    folder, _ = stream
    src = TokenWindows(folder, SEQ)
    for kw in ({"batch_size": 0}, {"seed": -1}, {"dtype": torch.float32}, {"prefetch": 0}, {"tail": "x"},
               {"rank": 1}, {"rank": 2, "world_size": 2}, {"num_threads": -1}, {"epoch": -1},
               {"batch_size": 3, "global_batch_size": 6}, {"global_batch_size": 5, "rank": 0, "world_size": 2}):
        with pytest.raises(ConfigError):
            Loader(src, **({"batch_size": 4} | kw) if "global_batch_size" not in kw else kw)
    with pytest.raises(ConfigError):
        Loader(src)                               # no batch size
    with pytest.raises(ConfigError):
        Loader("no/such/file", batch_size=2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ld = Loader(src, global_batch_size=8)
    assert (ld.rank, ld.world_size, ld.batch_size) == (1, 2, 4)
    with pytest.warns(RuntimeWarning, match="pin_memory"):
        ld = Loader(src, batch_size=4, pin_memory=True, device="cpu")
    assert not ld.pin_memory
    x, _ = next(iter(ld))
    assert x.device.type == "cpu"


@pytest.mark.parametrize("threads, prefetch", [(0, 1), (1, 2), (2, 8), (2, 64)])
def test_every_configuration_yields_the_same_batches(stream, threads, prefetch):
    folder, _ = stream
    src = TokenWindows(folder, SEQ)
    ref = run(Loader(src, batch_size=4, seed=7, num_threads=0))
    assert run(Loader(src, batch_size=4, seed=7, num_threads=threads, prefetch=prefetch)) == ref


def test_state_counts_delivered_not_prefetched(stream):
    folder, _ = stream
    ld = Loader(TokenWindows(folder, SEQ), batch_size=4, seed=7, num_threads=2, prefetch=32)
    it = iter(ld)
    for _ in range(3):
        next(it)
    state = ld.state_dict()
    assert state["consumed"] == 12 and state["global_batch_size"] == 4
    assert state["kind"] == "tokstream-windows/global-random"
    with pytest.raises(StateError):
        ld.load_state_dict({**state, "fingerprint": "other"})
    with pytest.raises(StateError):
        ld.load_state_dict({**state, "consumed": 10**6})


def test_stateful_protocols(stream):
    from torch.distributed.checkpoint.stateful import Stateful
    folder, _ = stream
    ld = Loader(TokenWindows(folder, SEQ), batch_size=4)
    assert isinstance(ld, Stateful) and isinstance(ld, torch.utils.data.IterableDataset)


def test_stateful_dataloader_of_torchdata(stream):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    folder, _ = stream
    make = lambda: Loader(TokenWindows(folder, SEQ), batch_size=4, seed=9)  # noqa: E731
    full = [win_ids(b) for b in sdl.StatefulDataLoader(make(), batch_size=None)]
    dl = sdl.StatefulDataLoader(make(), batch_size=None)
    head = []
    for b in dl:
        head.append(win_ids(b))
        if len(head) == 7:
            break
    state = dl.state_dict()
    dl2 = sdl.StatefulDataLoader(make(), batch_size=None)
    dl2.load_state_dict(state)
    assert head + [win_ids(b) for b in dl2] == full


def test_held_batches_are_never_overwritten(stream):
    folder, _ = stream
    ld = Loader(TokenWindows(folder, SEQ), batch_size=4, seed=1, num_threads=2, prefetch=16)
    held = [(x.clone(), x) for x, _ in ld]
    assert all(torch.equal(a, b) for a, b in held)


def loader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("zerobatch-loader")]


def test_threads_stop_at_the_end_of_iteration_and_on_close(stream):
    folder, _ = stream
    ld = Loader(TokenWindows(folder, SEQ), batch_size=4, seed=2, num_threads=2)
    run(ld)
    assert loader_threads() == []
    it = iter(ld)
    next(it)
    assert loader_threads() == []           # the first batch is read on the calling thread
    next(it)
    assert len(loader_threads()) == 2       # read-ahead from the second on
    ld.close()
    assert loader_threads() == []


class SlowSource(Source):
    """Reads take 30 ms and record whether the source was closed under them."""

    kind = "slow"

    def __init__(self) -> None:
        super().__init__()
        self.num_items = 400
        self.closed = False
        self.read_after_close = False

    def read(self, items, dtype):
        time.sleep(0.03)
        if self.closed:
            self.read_after_close = True
        return {"tokens": items.astype(dtype)}

    def close(self):
        self.closed = True


def test_close_waits_for_reads_in_flight():
    """close() releases the source only after the reads a thread has started (a read under a
    released mapping would crash the process)."""
    for threads in (1, 2):
        src = SlowSource()
        ld = Loader(src, batch_size=4, num_threads=threads, prefetch=8)
        it = iter(ld)
        next(it)
        ld.close()
        time.sleep(0.06)                     # a read still running would finish by now
        assert src.closed and not src.read_after_close
        assert list(it) == []


def test_abandoned_iterators_and_close(stream):
    folder, _ = stream
    src = TokenWindows(folder, SEQ)
    full = run(Loader(src, batch_size=4, seed=2))
    ld = Loader(src, batch_size=4, seed=2, num_threads=2)
    it = iter(ld)
    head = [win_ids(next(it)) for _ in range(5)]
    assert head + run(ld) == full          # a new iterator continues; the old one is stopped
    assert list(it) == []
    ld.close()


def test_fork_during_iteration(stream):
    """Read-ahead threads stop before fork; the child reads correctly, the parent goes on."""
    folder, _ = stream
    src = TokenWindows(folder, SEQ)
    full = run(Loader(src, batch_size=4, seed=5))
    ld = Loader(src, batch_size=4, seed=5, num_threads=2, prefetch=16)
    it = iter(ld)
    head = [win_ids(next(it)) for _ in range(3)]
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            child = run(Loader(TokenWindows(folder, SEQ), batch_size=4, seed=5, num_threads=2))
            rest = [win_ids(b) for b in it]
            os.write(wfd, b"1" if child == full and head + rest == full else b"0")
        finally:
            os._exit(0)
    os.close(wfd)
    assert os.read(rfd, 1) == b"1"
    os.waitpid(pid, 0)
    os.close(rfd)
    assert head + [win_ids(b) for b in it] == full      # threads restarted after the fork
    assert loader_threads() == []


def test_exit_with_a_live_iterator_is_clean(stream):
    folder, _ = stream
    r = run_python(f"""
        from zerobatch.adapters.torch import Loader, TokenWindows
        it = iter(Loader(TokenWindows({folder!r}, 16), batch_size=4, num_threads=2))
        next(it)
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok" and "Fatal" not in r.stderr, r.stderr


def test_read_errors_reach_the_loop(tmp_path):
    folder, _ = token_stream(tmp_path / "bad", n_tokens=3000)
    with open(os.path.join(folder, "shard-00001", "tokens.bin"), "r+b") as f:
        f.seek(100)
        f.write(b"\x01\x00\x00")
    ld = Loader(TokenWindows(folder, SEQ), batch_size=4, num_threads=2, shuffle=False)
    with pytest.raises(IntegrityError, match="tokens.bin"):
        list(ld)
    ld.close()


# ---------------------------------------------------------------------------------------------
# mixtures


def test_mixture_proportions_and_resume_after_reweighting(tmp_path):
    a, _ = token_stream(tmp_path / "a", n_tokens=2000, seed=1)
    b, _ = token_stream(tmp_path / "b", n_tokens=800, seed=2, offset=1 << 19)
    wa, wb = TokenWindows(a, SEQ), TokenWindows(b, SEQ)

    def src_of(batch):
        return [int(v) >= 1 << 19 for v in batch[0][:, 0]]

    mix = Mixture([("a", wa, 0.75), ("b", wb, 0.25)], seed=4)
    ld = Loader(mix, batch_size=8, rank=0, world_size=1)
    with pytest.raises(TypeError):
        len(ld)
    picks = []
    seen_b = []
    for step, batch in enumerate(ld):
        picks += src_of(batch)
        seen_b += [int(v) for v, is_b in zip(batch[0][:, 0], src_of(batch), strict=True) if is_b]
        if step == 19:
            break
    assert sum(picks) == 40                      # exactly a quarter of 160 samples
    state = ld.state_dict()
    assert state["mixture"]["sources"]["b"]["consumed"] == 40
    assert state["mixture"]["sources"]["a"]["consumed"] == 120
    # b has 49 windows: 40 consumed. Reweighted to half and half, b continues its epoch
    mix2 = Mixture([("a", TokenWindows(a, SEQ), 0.5), ("b", TokenWindows(b, SEQ), 0.5)], seed=4)
    ld2 = Loader(mix2, batch_size=8)
    ld2.load_state_dict(state)
    it = iter(ld2)
    more = next(it)
    new_b = [int(v) for v, is_b in zip(more[0][:, 0], src_of(more), strict=True) if is_b]
    assert len(new_b) == 4
    first_epoch_b = set(seen_b + new_b)
    assert len(first_epoch_b) == 44              # nothing of b's current epoch repeated
    # a source added later starts at 0; the others continue
    c, _ = token_stream(tmp_path / "c", n_tokens=500, seed=3, offset=1 << 18)
    mix3 = Mixture([("a", TokenWindows(a, SEQ), 1.0), ("b", TokenWindows(b, SEQ), 1.0),
                    ("c", TokenWindows(c, SEQ), 2.0)], seed=4)
    ld3 = Loader(mix3, batch_size=8)
    ld3.load_state_dict(ld2.state_dict())
    next(iter(ld3))
    counts = ld3.state_dict()["mixture"]["sources"]
    assert counts["c"]["consumed"] == 4 and counts["a"]["consumed"] + counts["b"]["consumed"] == 168 + 4


def first_ids(loader, k):
    """The first token of every window of the loader's first ``k`` steps."""
    out = []
    for i, batch in enumerate(loader):
        out.append(batch[0][:, 0].tolist())
        if i + 1 == k:
            return out
    return out


@pytest.mark.parametrize("w_from, w_to", [(2, 1), (1, 4), (4, 2)])
def test_mixture_ranks_and_resume_on_another_world_size(tmp_path, w_from, w_to):
    a, _ = token_stream(tmp_path / "a", n_tokens=1500, seed=1)
    b, _ = token_stream(tmp_path / "b", n_tokens=700, seed=2, offset=1 << 19)

    def make(rank, world):
        mix = Mixture([("a", TokenWindows(a, SEQ), 2.0), ("b", TokenWindows(b, SEQ), 1.0)], seed=8)
        return Loader(mix, global_batch_size=8, rank=rank, world_size=world)

    steps = first_ids

    ref = [sum((steps(make(r, 1), 10)[s] for r in range(1)), []) for s in range(10)]
    got: list[list[int]] = [[] for _ in range(10)]
    state = None
    for r in range(w_from):
        ld = make(r, w_from)
        for s, ids in enumerate(steps(ld, 4)):
            got[s] += ids
        state = ld.state_dict()
    for r in range(w_to):
        ld = make(r, w_to)
        ld.load_state_dict(state)
        for s, ids in enumerate(steps(ld, 6)):
            got[4 + s] += ids
    assert got == ref


@pytest.mark.parametrize("interpolation", ["constant", "linear"])
def test_a_mixture_weight_schedule_resumes_at_every_change_point_on_another_world_size(tmp_path, interpolation):
    from zerobatch.samplers import WeightSchedule
    a, _ = token_stream(tmp_path / "a", n_tokens=1500, seed=1)
    b, _ = token_stream(tmp_path / "b", n_tokens=700, seed=2, offset=1 << 19)
    sched = WeightSchedule([(3, {"a": 0.1, "b": 0.9}), (6, {"a": 0.9, "b": 0.1})], interpolation=interpolation)

    def make(rank, world):
        mix = Mixture([("a", TokenWindows(a, SEQ), 1.0), ("b", TokenWindows(b, SEQ), 1.0)], seed=8,
                      weight_schedule=sched)
        return Loader(mix, global_batch_size=8, rank=rank, world_size=world)

    steps = first_ids

    ref = steps(make(0, 1), 10)
    from_b = [sum(v >= 1 << 19 for v in step) for step in ref]
    if interpolation == "constant":
        assert sum(from_b[3:6]) in (21, 22) and sum(from_b[6:]) in (3, 4)      # 0.9 of 24, 0.1 of 32
    for k in (2, 3, 4, 6, 7):
        for w_from, w_to in ((2, 1), (1, 4)):
            got: list[list[int]] = [[] for _ in range(10)]
            state = None
            for r in range(w_from):
                ld = make(r, w_from)
                for s, ids in enumerate(steps(ld, k)):
                    got[s] += ids
                state = ld.state_dict()
            for r in range(w_to):
                ld = make(r, w_to)
                ld.load_state_dict(state)
                for s, ids in enumerate(steps(ld, 10 - k)):
                    got[k + s] += ids
            assert got == ref, (k, w_from, w_to)


def test_a_curriculum_changes_seq_len_and_batch_and_resumes_at_every_step(tmp_path):
    """Windows of 8 tokens at a global batch of 8, ramped to 12 at step 2, then windows of 16
    at a global batch of 4 from step 5 (and packed rows the same way): every step has the
    phase's shape, and a run resumed at every step, on another world size, equals an
    uninterrupted one."""
    from zerobatch.adapters.torch import Curriculum, PackedDocuments
    folder, _ = token_stream(tmp_path / "a", n_tokens=3000, seed=1)

    def make(rank, world, packed=False):
        kind = (lambda n: PackedDocuments(folder, n, buffer=32)) if packed else (lambda n: TokenWindows(folder, n))
        cur = Curriculum([("short", 0, kind(8), 8), ("long", 5, kind(16), 4)], seed=3, batch_schedule=[(2, 12)])
        return Loader(cur, rank=rank, world_size=world)

    def ids(batch):
        x = batch["input_ids"] if isinstance(batch, dict) else batch[0]
        return [tuple(x.shape), x[:, 0].tolist()]

    for packed in (False, True):
        ref = zbtest.take(make(0, 1, packed), 9, ids)
        assert [r[0] for r in ref] == [(8, 8)] * 2 + [(12, 8)] * 3 + [(4, 16)] * 4
        for k in range(9):
            for w_from, w_to in ((2, 1), (1, 4), (4, 2)):
                got = [[None, []] for _ in range(9)]
                state = None
                for r in range(w_from):
                    ld = make(r, w_from, packed)
                    for s_, (shape, first) in enumerate(zbtest.take(ld, k, ids)):
                        got[s_][0] = (shape[0] * w_from, shape[1])
                        got[s_][1] += first
                    state = ld.state_dict()
                for r in range(w_to):
                    ld = make(r, w_to, packed)
                    ld.load_state_dict(state)
                    for s_, (shape, first) in enumerate(zbtest.take(ld, 9 - k, ids)):
                        got[k + s_][0] = (shape[0] * w_to, shape[1])
                        got[k + s_][1] += first
                assert [[tuple(g[0]), g[1]] for g in got] == [[r[0], r[1]] for r in ref], (packed, k, w_from, w_to)


def test_mixture_refuses_unlike_sources(stream, tmp_path):
    folder, _ = stream
    with pytest.raises(ConfigError):
        Mixture([(TokenWindows(folder, SEQ, boundaries=True), 1.0)])
    with pytest.raises(ConfigError):
        Mixture([(TokenWindows(folder, SEQ), 1.0), (TokenDocuments(folder, 20), 1.0)])
    with pytest.raises(ConfigError):
        Mixture([])
    ld = Loader(Mixture([(TokenWindows(folder, SEQ), 1.0)]), batch_size=2)
    with pytest.raises(StateError):
        ld.load_state_dict(Loader(TokenWindows(folder, SEQ), batch_size=2).state_dict())


def test_a_mixture_of_items_of_different_shapes_is_refused_when_made(tmp_path):
    a, _ = token_stream(tmp_path / "a", 600)
    b, _ = token_stream(tmp_path / "b", 600)
    with pytest.raises(ConfigError, match=r"'short' \(tokens \[17\]\).*'long' \(tokens \[33\]\)") as e:
        Mixture([("short", TokenWindows(a, 16), 1.0), ("long", TokenWindows(b, 32), 1.0)])
    assert e.value.field == "sources"
    Mixture([("x", TokenWindows(a, 16), 1.0), ("y", TokenWindows(b, 16), 1.0)])


def test_a_loader_without_a_whole_step_is_refused(stream):
    folder, _ = stream
    src = TokenWindows(folder, SEQ)
    with pytest.raises(ConfigError, match="no step.*fewer than one global batch") as e:
        Loader(src, batch_size=src.num_items + 1)
    assert e.value.field == "batch_size"
    with pytest.raises(ConfigError, match="no step"):
        Loader(TokenWindows(folder, 5000), batch_size=1)
    with pytest.raises(ConfigError, match="per rank x 64 ranks"):
        Loader(src, batch_size=4, rank=0, world_size=64)
    # a short step kept: a rank left without items in it is legitimate
    assert len(Loader(src, batch_size=src.num_items + 1, drop_last=False)) == 1


def test_num_workers_says_where_worker_processes_live(stream):
    folder, _ = stream
    with pytest.raises(ConfigError, match=r"loader.dataloader\(num_workers=...\)") as e:
        Loader(TokenWindows(folder, SEQ), batch_size=4, num_workers=2)
    assert e.value.field == "num_workers"


def test_one_set_of_defaults():
    import inspect

    JaxLoader = pytest.importorskip("zerobatch.adapters.jax").Loader
    from zerobatch.adapters.sources._base import DEFAULT_PREFETCH, DEFAULT_SEED
    from zerobatch.adapters.torch import BatchNativeLoader
    from zerobatch.prepare.pipeline import ConvertOptions
    from zerobatch.cli.main import build_parser
    from zerobatch.formats.tokstream import DEFAULT_SHARD_TOKENS
    from zerobatch.writers.tokstream import TokenStreamWriter

    for cls in (Loader, BatchNativeLoader, JaxLoader):
        params = inspect.signature(cls.__init__).parameters
        assert (params["seed"].default, params["prefetch"].default) == (DEFAULT_SEED, DEFAULT_PREFETCH) == (42, 8)
    assert inspect.signature(Mixture.__init__).parameters["seed"].default == DEFAULT_SEED
    assert inspect.signature(TokenStreamWriter.__init__).parameters["shard_tokens"].default == DEFAULT_SHARD_TOKENS
    args = build_parser().parse_args(["convert", "a", "b", "--to", "tokstream"])
    assert args.shard_tokens == ConvertOptions(to="tokstream").shard_tokens == DEFAULT_SHARD_TOKENS == 2**28


class HintedSource(Source):
    """A source at a "URL": records its read-ahead hints and its reads, in order."""

    kind = "hinted"

    def __init__(self, n: int = 3000, remote: bool = True) -> None:
        super().__init__()
        self.num_items = n
        self._remote = remote
        self.events: list[tuple[str, list[int]]] = []
        self.lock = threading.Lock()

    @property
    def access(self):
        from zerobatch.readers.base import FETCHED, MAPPED
        return FETCHED if self._remote else MAPPED

    def prepare(self, items):
        with self.lock:
            self.events.append(("hint", items[:, 0].tolist()))

    def read(self, items, dtype):
        with self.lock:
            self.events.append(("read", items[:, 0].tolist()))
        return {"tokens": items.astype(dtype)}


def test_read_ahead_hints_of_a_remote_source_cover_every_step_once_in_groups_ahead_of_its_read():
    """A source at a URL hears of the first step alone (the first batch waits on nothing
    else), then of ``prefetch`` steps per hint, each step once, in order, every step hinted
    before it is read and never more than 5 x ``prefetch`` steps ahead of the reads; a local
    source hears of each read as it is planned."""
    from zerobatch.readers.base import FETCHED
    AHEAD_GROUPS = FETCHED.hint_groups
    for threads in (0, 2):
        src = HintedSource()
        ld = Loader(src, batch_size=4, num_threads=threads, prefetch=8, seed=1, shuffle=True)
        firsts = [int(b[0]) for b in ld]                       # each step's first item
        hints = [e[1] for e in src.events if e[0] == "hint"]
        assert len(firsts) == 750 and len(hints[0]) == 1
        assert all(len(h) == 8 for h in hints[1:-1])
        hinted = [x for h in hints for x in h]
        assert hinted == firsts                                 # every step once, in order
        seen_hint, seen_read = 0, 0
        for kind, steps in src.events:
            if kind == "hint":
                seen_hint += len(steps)
                assert seen_hint <= seen_read + len(steps) + (AHEAD_GROUPS + 1) * 8 + 8
            else:
                seen_read += len(steps)
                assert seen_read <= seen_hint                   # hinted before read
    local = HintedSource(remote=False)
    list(Loader(local, batch_size=4, num_threads=2, prefetch=8))
    reads = [e[1] for e in local.events if e[0] == "read"]
    assert sorted([e[1] for e in local.events if e[0] == "hint"]) == sorted(reads)   # one hint per read



class FlatHintedSource(HintedSource):
    """A :class:`HintedSource` that records every item of its hints and reads."""

    def prepare(self, items):
        with self.lock:
            self.events.append(("hint", items.reshape(-1).tolist()))
        return items.size * 8

    def read(self, items, dtype):
        with self.lock:
            self.events.append(("read", items.reshape(-1).tolist()))
        return {"tokens": items.astype(dtype)}


def test_a_mixture_at_a_url_hints_each_source_of_its_own_items_before_their_read():
    """A mixture of sources at URLs hears of its steps ahead like any source: each source is
    hinted its own items, every one before it is read."""
    a, b = FlatHintedSource(2000), FlatHintedSource(1000)
    mix = Mixture([("a", a, 0.7), ("b", b, 0.3)], seed=2)
    a.events.clear()
    b.events.clear()                     # (the mixture read item 0 of each to check shapes)
    ld = Loader(mix, batch_size=8, num_threads=2, prefetch=4, seed=1)
    it = iter(ld)
    for _ in range(150):                 # (a mixture is endless)
        next(it)
    ld.close()
    for src in (a, b):
        hinted = [x for kind, items in src.events if kind == "hint" for x in items]
        read = [x for kind, items in src.events if kind == "read" for x in items]
        assert read and not collections.Counter(read) - collections.Counter(hinted)   # each read item hinted
        so_far: collections.Counter[int] = collections.Counter()
        reads_so_far = hints_so_far = 0
        for kind, items in src.events:
            if kind == "hint":
                so_far.update(items)
                hints_so_far += len(items)
            else:
                assert not collections.Counter(items) - so_far  # before its read (reads run in parallel)
                reads_so_far += len(items)
        assert reads_so_far <= hints_so_far


class SizedHintedSource(HintedSource):
    """A :class:`HintedSource` whose hints say their bytes: ``item_bytes`` an item."""

    def __init__(self, item_bytes: int) -> None:
        super().__init__()
        self.item_bytes = item_bytes

    def prepare(self, items):
        super().prepare(items)
        return items.size * self.item_bytes


def _most_ahead(events: list[tuple[str, list[int]]]) -> int:
    """The most steps hinted beyond the steps read, over a run's events."""
    hinted = read = most = 0
    for kind, steps in events:
        if kind == "hint":
            hinted += len(steps)
        else:
            read += len(steps)
        most = max(most, hinted - read)
    return most


def test_read_ahead_hints_go_deep_for_small_steps_and_stop_at_the_byte_bound_for_large_ones():
    """Hints go up to ``hint_groups`` groups ahead while their bytes stay under
    ``Access.hint_bytes`` (a sequential read fills the link), and no further than one group
    past the reads planned once a group's bytes reach it (large steps: the cache is not
    flooded); every step is still hinted once, in order, before its read."""
    from zerobatch.readers.base import FETCHED
    cap, group = FETCHED.hint_bytes, 8
    small = SizedHintedSource(item_bytes=1024)                 # 32 KiB a group of 8 steps
    firsts = [int(b[0]) for b in Loader(small, batch_size=4, num_threads=2, prefetch=group, seed=1)]
    assert [x for e in small.events if e[0] == "hint" for x in e[1]] == firsts
    assert _most_ahead(small.events) >= (FETCHED.hint_groups - 2) * group
    large = SizedHintedSource(item_bytes=cap // 8)             # 4 groups' bytes reach the bound
    firsts = [int(b[0]) for b in Loader(large, batch_size=4, num_threads=2, prefetch=group, seed=1)]
    assert [x for e in large.events if e[0] == "hint" for x in e[1]] == firsts
    # the reads in flight (the loader's depth) plus at most one group beyond them
    assert _most_ahead(large.events) <= 2 * group + group + group
    assert _most_ahead(large.events) < (FETCHED.hint_groups - 2) * group
