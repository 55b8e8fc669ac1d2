"""The resume matrix, over next-token windows, packed documents and packed chat data with its
loss mask: the loader and its
DataLoader-worker face, restored from every step, at
the epoch boundary, after a previous resume, on other world sizes, with 0 and 2 worker
processes under fork, forkserver and spawn. Each must deliver every sample exactly once per
epoch, in the order of an uninterrupted run."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from zerobatch.adapters.torch import Loader, PackedDocuments, TokenWindows
import zbtest
from zbtest import token_stream

SEQ = 16

G = 8          # global batch (items per step over all ranks)


@pytest.fixture(scope="module", params=["windows", "packed", "packed-chat"])
def source(request, tmp_path_factory):
    """Next-token windows, whole documents packed into rows by best-fit decreasing (a row's
    first token names it: the dataset's token at position p is p), and the same rows of a
    chat dataset read with its loss mask (labels -100 where the mask is off)."""
    folder, docs = token_stream(tmp_path_factory.mktemp("rm") / "d", n_tokens=2600)
    if request.param == "packed-chat":
        import numpy as np
        from zerobatch.writers.tokstream import TokenStreamWriter
        rng = np.random.default_rng(4)
        with TokenStreamWriter(f"{folder}/loss_mask", vocab_size=2, shard_tokens=900) as w:
            for d in docs:
                w.add_document((rng.random(len(d)) < 0.6).astype(np.uint16))
        return PackedDocuments(folder, SEQ, buffer=16, seed=5, loss_mask=True)
    if request.param == "packed":
        return PackedDocuments(folder, SEQ, buffer=16, seed=5)
    return TokenWindows(folder, SEQ)


def ids(batch) -> list[int]:
    if isinstance(batch, dict):
        return batch["input_ids"][:, 0].tolist()
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    return (x[:, 0] // SEQ).tolist()


def make(source, rank, world, **kw):
    return Loader(source, global_batch_size=G, rank=rank, world_size=world, seed=21, **kw)


def global_steps(per_rank: list[list[list[int]]]) -> list[list[int]]:
    """Merge the ranks' batches step by step into the global batch (as a sorted list)."""
    steps = max(len(r) for r in per_rank)
    return [sorted(i for r in per_rank if s < len(r) for i in r[s]) for s in range(steps)]


def take(loader, k: int | None) -> list[list[int]]:
    return zbtest.take(loader, k, ids)


@pytest.fixture(scope="module")
def reference(source):
    """Two uninterrupted epochs on 2 ranks, as global steps."""
    out = []
    for epoch in (0, 1):
        ranks = []
        for r in range(2):
            ld = make(source, r, 2)
            ld.set_epoch(epoch)
            ranks.append(take(ld, None))
        out.append(global_steps(ranks))
    return out


def resume(source, state, world, epochs=(0, 1)):
    """Continue ``state`` on ``world`` ranks to the end of epoch 1, as global steps per epoch."""
    out = []
    per_epoch: dict[int, list[list[list[int]]]] = {e: [] for e in epochs}
    for r in range(world):
        ld = make(source, r, world)
        ld.load_state_dict(state)
        for e in epochs:
            if e < ld.epoch:
                per_epoch[e].append([])
                continue
            ld.set_epoch(e)
            per_epoch[e].append(take(ld, None))
    for e in epochs:
        out.append(global_steps(per_epoch[e]))
    return out


def test_the_reference_reads_every_sample_once_per_epoch(source, reference):
    n = source.num_items
    for steps in reference:
        flat = [i for s in steps for i in s]
        assert len(flat) == len(set(flat)) == n // G * G
    assert reference[0] != reference[1]


@pytest.mark.parametrize("w_from, w_to", [(2, 2), (2, 1), (1, 4), (4, 2)])
def test_resume_from_every_step(source, reference, w_from, w_to):
    steps = len(reference[0])
    for k in range(steps + 1):
        ranks, state = [], None
        for r in range(w_from):
            ld = make(source, r, w_from)
            ranks.append(take(ld, k))
            state = ld.state_dict()
        assert state["consumed"] == k * G
        head = global_steps(ranks)
        rest0, rest1 = resume(source, state, w_to)
        assert head + rest0 == reference[0], k
        assert rest1 == reference[1], k


def test_resume_at_the_epoch_boundary_and_in_epoch_one(source, reference):
    ld = make(source, 0, 1)
    take(ld, None)
    end = ld.state_dict()
    assert end["consumed"] == len(reference[0]) * G and end["epoch"] == 0
    again = make(source, 0, 1)
    again.load_state_dict(end)
    assert take(again, None) == []              # nothing left of epoch 0
    again.set_epoch(1)
    assert global_steps([take(again, 5)]) == reference[1][:5]
    state = again.state_dict()
    assert state["epoch"] == 1
    _, rest1 = resume(source, state, 2)
    assert reference[1][:5] + rest1 == reference[1]


def test_chained_resumes_in_one_epoch(source, reference):
    got: list[list[int]] = []
    state = None
    worlds = [2, 4, 1, 2, 4]
    for n_steps, world in zip([3, 1, 7, 4, 2], worlds, strict=True):
        ranks = []
        new_state = None
        for r in range(world):
            ld = make(source, r, world)
            if state is not None:
                ld.load_state_dict(state)
            ranks.append(take(ld, n_steps))
            new_state = ld.state_dict()
        got += global_steps(ranks)
        state = new_state
    rest0, _ = resume(source, state, 2)
    assert got + rest0 == reference[0]


def test_resume_with_another_global_batch_continues_at_the_same_position(source, reference):
    ld = make(source, 0, 1)
    head = take(ld, 5)
    state = ld.state_dict()
    other = Loader(source, global_batch_size=12, rank=0, world_size=1, seed=21)
    other.load_state_dict(state)
    rest = [i for b in take(other, None) for i in b]
    flat_ref = [i for s in reference[0] for i in s]
    n = source.num_items
    assert sorted(i for b in head for i in b) + sorted(rest) == \
        sorted(flat_ref[:40]) + sorted(rest)
    assert len(set(i for b in head for i in b) | set(rest)) == 40 + (n - 40) // 12 * 12


# ---------------------------------------------------------------------------------------------
# the DataLoader-worker face


def worker_loader(source, rank, world, workers, context=None):
    ld = make(source, rank, world, num_threads=1)
    if workers == 0:
        return ld
    return ld.dataloader(num_workers=workers, multiprocessing_context=context)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [0, 4, 13, 31])
def test_worker_processes_resume(source, reference, workers, k):
    steps = len(reference[0])
    for w_from, w_to in [(2, 1), (1, 4), (4, 2)]:
        ranks, state = [], None
        for r in range(w_from):
            dl = worker_loader(source, r, w_from, workers, "fork")
            ranks.append(take(dl, k))
            state = dl.state_dict()
        head = global_steps(ranks)
        ranks = []
        for r in range(w_to):
            dl = worker_loader(source, r, w_to, workers, "fork")
            dl.load_state_dict(state)
            ranks.append(take(dl, None))
        assert head + global_steps(ranks) == reference[0]
        assert len(head) + len(global_steps(ranks)) == steps


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_worker_processes_under_each_start_method(source, reference, method):
    ctx = multiprocessing.get_context(method)
    dl = worker_loader(source, 0, 1, 2, ctx)
    head = global_steps([take(dl, 6)])
    state = dl.state_dict()
    dl2 = worker_loader(source, 0, 1, 2, ctx)
    dl2.load_state_dict(state)
    rest = global_steps([take(dl2, None)])
    assert head + rest == reference[0]
    dl2.set_epoch(1)
    assert global_steps([take(dl2, 3)]) == reference[1][:3]


def test_worker_loader_epochs_follow_set_epoch(source, reference):
    dl = worker_loader(source, 0, 1, 2, "fork")
    assert global_steps([take(dl, None)]) == reference[0]
    dl.set_epoch(1)
    assert global_steps([take(dl, None)]) == reference[1]
    assert len(dl) == len(reference[0])
    with pytest.raises(Exception, match="persistent_workers"):
        make(source, 0, 1).dataloader(num_workers=2, persistent_workers=True)
    assert torch.utils.data.get_worker_info() is None
