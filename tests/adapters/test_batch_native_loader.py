"""BatchNativeLoader: the seed's block shuffle, epochs, ranks, exact resume, threads, the seed API."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from zbtest import run_python

from zerobatch.adapters.torch import BatchNativeLoader
from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.samplers import BlockShuffleOrder, IndexSampler
from zerobatch.writers.llmbatch import write_batch_file

BS, SL = 4, 8


def make_file(path, num_batches: int) -> str:
    """Batch i holds rows whose first token is i * BS + row (input order kept)."""
    n = num_batches * BS
    t = np.random.default_rng(0).integers(0, 50000, size=(n, SL), dtype=np.uint32)
    t[:, 0] = np.arange(n, dtype=np.uint32)
    write_batch_file(path, t, BS, SL, seed=0, shuffle=False)
    return str(path)


def ids(batches) -> list[int]:
    return [int(b[0, 0]) // BS for b in batches]


@pytest.fixture
def path50(tmp_path):
    return make_file(tmp_path / "d.batch", 50)


def test_yields_the_seed_block_shuffle_order(path50):
    loader = BatchNativeLoader(path50, block_size=4, seed=42)
    got = list(loader)
    assert all(b.dtype == torch.int64 and b.shape == (BS, SL) for b in got)
    assert ids(got) == BlockShuffleOrder(50, 4, seed=42).epoch_order(0).tolist()
    assert len(loader) == 50
    # whole blocks, ascending inside: 12 full blocks of 4 and one of 2
    seq = ids(got)
    starts = [i for i in range(50) if i == 0 or seq[i] != seq[i - 1] + 1 or seq[i] % 4 == 0]
    assert len(starts) == 13 and all(seq[s] % 4 == 0 for s in starts)


@pytest.mark.parametrize("world, drop_last", [(1, True), (3, True), (3, False), (4, False)])
def test_the_loader_reads_the_samplers_order(path50, world, drop_last):
    """One implementation: the loader's batches are IndexSampler's block-shuffle indices."""
    for rank in range(world):
        loader = BatchNativeLoader(path50, block_size=4, seed=9, epoch=2, rank=rank, world_size=world,
                                   drop_last=drop_last, num_threads=0)
        sampler = IndexSampler(BlockShuffleOrder(50, 4, seed=9), 1, rank=rank, world_size=world,
                               tail="drop" if drop_last else "pad", epoch=2)
        assert ids(loader) == [int(b[0]) for b in sampler]


def test_epochs_differ_and_are_deterministic(path50):
    a = BatchNativeLoader(path50, block_size=2, seed=1)
    e0 = ids(a)
    a.set_epoch(1)
    e1 = ids(a)
    assert e0 != e1 and sorted(e0) == sorted(e1) == list(range(50))
    b = BatchNativeLoader(path50, block_size=2, seed=1, epoch=1)
    assert ids(b) == e1
    assert ids(BatchNativeLoader(path50, block_size=2, seed=2)) != e0
    assert ids(BatchNativeLoader(path50, block_size=2, shuffle=False)) == list(range(50))
    a.set_epoch(1)  # same epoch again after completing it: a second pass, same order
    assert ids(a) == e1


@pytest.mark.parametrize("threads, prefetch", [(0, 1), (0, 64), (1, 1), (1, 7), (2, 64), (3, 200)])
def test_every_configuration_yields_the_same_batches(path50, threads, prefetch):
    ref = [b.clone() for b in BatchNativeLoader(path50, block_size=4, seed=3, num_threads=0)]
    got = list(BatchNativeLoader(path50, block_size=4, seed=3, num_threads=threads, prefetch=prefetch))
    assert len(got) == len(ref) and all((g == r).all() for g, r in zip(got, ref, strict=True))
    i32 = list(BatchNativeLoader(path50, block_size=4, seed=3, dtype=torch.int32))
    assert all(g.dtype == torch.int32 and (g == r).all() for g, r in zip(i32, ref, strict=True))


def test_batches_held_by_the_loop_are_never_overwritten(path50):
    """Output buffers are reused only once nothing references them."""
    kept = list(BatchNativeLoader(path50, block_size=4, seed=3, prefetch=2))
    again = [b.clone() for b in BatchNativeLoader(path50, block_size=4, seed=3, num_threads=0)]
    assert all((k == a).all() for k, a in zip(kept, again, strict=True))


def run_steps(loader, k):
    it = iter(loader)
    return [int(next(it)[0, 0]) // BS for _ in range(k)]


@pytest.mark.parametrize("threads", [0, 2])
def test_resume_from_every_step(path50, threads):
    """The shared resume check: a state saved after any step continues the same order."""
    full = ids(BatchNativeLoader(path50, block_size=4, seed=5, num_threads=threads))
    for k in range(0, 51):
        a = BatchNativeLoader(path50, block_size=4, seed=5, num_threads=threads)
        head = run_steps(a, k)
        state = a.state_dict()
        assert state["consumed"] == k
        b = BatchNativeLoader(path50, block_size=4, seed=5, num_threads=threads)
        b.load_state_dict(state)
        assert head + ids(b) == full, k


def test_resume_at_epoch_boundary_and_chained(path50):
    a = BatchNativeLoader(path50, block_size=4, seed=5)
    e0 = ids(a)
    state = a.state_dict()  # the whole epoch delivered
    b = BatchNativeLoader(path50, block_size=4, seed=5)
    b.load_state_dict(state)
    assert list(b) == []  # nothing of epoch 0 is repeated
    b.set_epoch(1)
    c = BatchNativeLoader(path50, block_size=4, seed=5, epoch=1)
    e1 = ids(c)
    assert ids(b) == e1 != e0
    # chained resumes, several times in one epoch
    x = BatchNativeLoader(path50, block_size=4, seed=5, epoch=1)
    got = run_steps(x, 7)
    for k in (3, 11, 1, 0, 20):
        y = BatchNativeLoader(path50, block_size=4, seed=5)
        y.load_state_dict(x.state_dict())
        y.set_epoch(1)  # the usual loop calls set_epoch: it keeps the position of the current epoch
        got += run_steps(y, k)
        x = y
    z = BatchNativeLoader(path50, block_size=4, seed=5)
    z.load_state_dict(x.state_dict())
    got += ids(z)
    assert got == e1


def test_state_counts_delivered_not_prefetched(path50):
    a = BatchNativeLoader(path50, block_size=4, seed=5, prefetch=64)
    it = iter(a)
    next(it)
    next(it)
    assert a.state_dict()["consumed"] == 2
    assert a.state_dict()["epoch"] == 0


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_are_disjoint_complete_and_even(path50, world, drop_last):
    order = BlockShuffleOrder(50, 4, seed=9).epoch_order(0).tolist()
    per_rank = [ids(BatchNativeLoader(path50, block_size=4, seed=9, rank=r, world_size=world, drop_last=drop_last))
                for r in range(world)]
    counts = {len(p) for p in per_rank}
    assert len(counts) == 1
    (k,) = counts
    assert k == len(BatchNativeLoader(path50, block_size=4, seed=9, rank=0, world_size=world, drop_last=drop_last))
    for r, got in enumerate(per_rank):
        assert got == [order[(s * world + r) % 50] for s in range(k)]
    flat = [i for p in per_rank for i in p]
    if drop_last:
        assert k == 50 // world and len(set(flat)) == len(flat) == k * world
    else:
        assert k == -(-50 // world) and set(flat) == set(range(50))


@pytest.mark.parametrize("w_from, w_to", [(2, 1), (1, 4), (4, 2), (2, 3)])
def test_resume_on_another_world_size(path50, w_from, w_to):
    order = BlockShuffleOrder(50, 4, seed=9).epoch_order(0).tolist()
    steps = 3
    seen = []
    states = []
    for r in range(w_from):
        ld = BatchNativeLoader(path50, block_size=4, seed=9, rank=r, world_size=w_from)
        seen += run_steps(ld, steps)
        states.append(ld.state_dict())
    assert all(s == states[0] for s in states)  # every rank holds the same global state
    for r in range(w_to):
        ld = BatchNativeLoader(path50, block_size=4, seed=9, rank=r, world_size=w_to)
        ld.load_state_dict(states[0])
        seen += ids(ld)
    consumed = steps * w_from
    tail = (50 - consumed) % w_to
    assert sorted(seen) == sorted(order[:50 - tail])  # nothing skipped, nothing repeated


def test_mismatched_states_are_refused(path50, tmp_path):
    good = BatchNativeLoader(path50, block_size=4, seed=5)
    run_steps(good, 3)
    state = good.state_dict()
    cases = [
        (BatchNativeLoader(path50, block_size=4, seed=6), state, "seed"),
        (BatchNativeLoader(path50, block_size=8, seed=5), state, "block_size"),
        (BatchNativeLoader(path50, block_size=4, seed=5, shuffle=False), state, "shuffle"),
        (BatchNativeLoader(path50, block_size=4, seed=5, drop_last=False), state, "tail"),
        (BatchNativeLoader(make_file(tmp_path / "short.batch", 40), block_size=4, seed=5), state, "num_items"),
        (BatchNativeLoader(path50, block_size=4, seed=5), {**state, "consumed": 51}, "consumed"),
        (BatchNativeLoader(path50, block_size=4, seed=5), {**state, "zerobatch_state": 99}, "zerobatch_state"),
        (BatchNativeLoader(path50, block_size=4, seed=5), {**state, "epoch": -1}, "epoch"),
        (BatchNativeLoader(path50, block_size=4, seed=5), {**state, "world_size": 0}, "world_size"),
        (BatchNativeLoader(path50, block_size=4, seed=5), {k: v for k, v in state.items() if k != "seed"}, "seed"),
        (BatchNativeLoader(path50, block_size=4, seed=5), "garbage", "state"),
    ]
    for loader, st, field in cases:
        with pytest.raises(StateError) as info:
            loader.load_state_dict(st)
        assert info.value.field == field, field
    # a file with identical geometry but other contents: the fingerprint differs
    changed = make_file(tmp_path / "changed.batch", 50)
    t = np.ones((200, SL), np.uint32)
    write_batch_file(changed, t, BS, SL, seed=0)
    with pytest.raises(StateError, match="num_items|fingerprint"):
        BatchNativeLoader(changed, block_size=4, seed=5).load_state_dict(state)


def test_arguments_and_environment(path50, monkeypatch):
    for kw in ({"seed": -1}, {"seed": 1.5}, {"block_size": 0}, {"dtype": torch.float32}, {"prefetch": 0},
               {"rank": 1}, {"rank": 2, "world_size": 2}, {"epoch": -1}):
        with pytest.raises(ConfigError):
            BatchNativeLoader(path50, **kw)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    ld = BatchNativeLoader(path50)
    assert (ld.rank, ld.world_size) == (1, 3) and len(ld) == 16
    monkeypatch.setenv("WORLD_SIZE", "x")
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        BatchNativeLoader(path50)


def test_empty_file(tmp_path):
    p = tmp_path / "e.batch"
    write_batch_file(p, np.zeros((3, SL), np.uint32), BS, SL, seed=0)
    with pytest.raises(ConfigError, match="no step: the llmbatch source has 0 items"):
        BatchNativeLoader(p)   # an epoch without a step would end before it starts, every epoch


def test_abandoned_and_restarted_iterators(path50):
    ld = BatchNativeLoader(path50, block_size=4, seed=5)
    full = ids(BatchNativeLoader(path50, block_size=4, seed=5))
    it = iter(ld)
    first = [int(next(it)[0, 0]) // BS for _ in range(5)]
    it2 = iter(ld)  # a new iterator continues from the position, the old one stops
    rest = ids(it2)
    assert first + rest == full
    assert list(it) == []
    ld.close()


def test_exit_with_a_live_iterator_is_clean(path50):
    r = run_python(f"""
        from zerobatch.adapters.torch import BatchNativeLoader
        it = iter(BatchNativeLoader({path50!r}, block_size=4))
        next(it)
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok" and "terminate" not in r.stderr, r.stderr


def test_fork_during_iteration(path50):
    """Pool threads are stopped around fork: the child reads correctly, the parent goes on."""
    full = ids(BatchNativeLoader(path50, block_size=4, seed=5))
    ld = BatchNativeLoader(path50, block_size=4, seed=5, num_threads=2, prefetch=8)
    it = iter(ld)
    head = [int(next(it)[0, 0]) // BS for _ in range(3)]
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            child = ids(BatchNativeLoader(path50, block_size=4, seed=5, num_threads=2))
            os.write(wfd, b"1" if child == full else b"0")
        finally:
            os._exit(0)
    os.close(wfd)
    assert os.read(rfd, 1) == b"1"
    os.waitpid(pid, 0)
    os.close(rfd)
    assert head + ids(it) == full
    assert all(t.is_alive() for t in threading.enumerate() if t.name.startswith("zerobatch-pool"))


def test_seed_examples_run_unchanged(tmp_path):
    """The seed's own code, as its spec prints it (with a small dataset)."""
    r = run_python(f"""
        import os
        os.chdir({str(tmp_path)!r})
        import numpy as np
        from zerobatch.batch_writer import write_batch_file

        tokens = np.random.default_rng(0).integers(0, 50000, size=(2000, 512)).astype(np.uint32)
        num_batches = write_batch_file(
            output_path="dataset.batch",
            tokens_array=tokens,   # np.ndarray, shape (N, seq_len), dtype uint32
            batch_size=32,
            seq_len=512,
            seed=42,
        )
        from zerobatch.batch_writer import write_batch_dataset

        def token_generator():
            for row in tokens:
                yield row
        num_batches = write_batch_dataset(
            output_path="dataset2.batch",
            tokens_iter=token_generator(),  # yields 1D arrays of shape (seq_len,)
            total_records=2000,
            batch_size=32,
            seq_len=512,
            seed=42,
        )
        from zerobatch.batch_loader import BatchFileReader

        reader = BatchFileReader("dataset.batch")
        print(reader.num_batches)  # 62
        print(reader.batch_size)   # 32
        print(reader.seq_len)      # 512
        arr = reader.read_batch(0)     # shape (32, 512), dtype uint32
        tensor = reader.read_batch_torch(0)  # shape (32, 512), dtype int64
        print(arr.shape, arr.dtype, tuple(tensor.shape), tensor.dtype)

        from zerobatch.batch_loader import BatchNativeLoader

        loader = BatchNativeLoader(
            path="dataset.batch",
            block_size=256,    # batches per super-block
            shuffle=True,
            seed=42,
            epoch=0,
        )
        num_epochs = 2
        for epoch in range(num_epochs):
            loader.set_epoch(epoch)  # changes shuffle order
            n = 0
            for batch in loader:
                n += 1
                assert batch.dtype.__str__() == "torch.int64" and tuple(batch.shape) == (32, 512)
            print(epoch, n)
        print(open("dataset.batch", "rb").read() == open("dataset2.batch", "rb").read())
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:7] == ["62", "32", "512", "(32, 512) uint32 (32, 512) torch.int64", "0 62", "1 62",
                                        "True"]
