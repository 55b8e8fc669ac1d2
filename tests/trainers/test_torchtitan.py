"""torchtitan (0.3.0) takes zerobatch data natively and resumes exactly from its own DCP checkpoints.

torchtitan 0.3.0's data path is a ``BaseDataLoader`` (a ``Stateful`` built from
``Trainer.Config.dataloader``) saved by its DCP ``CheckpointManager``; it has no Grain path.
``torchtitan_train.py`` runs two loops over ``ZerobatchDataLoader``:

- ``--loop manager`` (always run): the dataloader built from its config as the Trainer builds
  it, torchtitan's ``CheckpointManager`` with its optimizer and LR-scheduler containers, and
  ``trainerkit.RecordingLM``; 2 processes (gloo) run ``2N`` steps; 2 processes run ``N`` and
  are SIGKILLed right after torchtitan's checkpoint of step ``N``; 1 process resumes from it
  (the same global batch: zerobatch's state is saved once, not per rank). Accumulation 2.
- ``--loop trainer`` (when ``triton`` is importable: torchtitan's model code imports it, CPU or
  not; skipped otherwise): torchtitan's own ``Trainer.train()`` on CPU, 1 process, killed
  after its checkpoint of step ``N`` and resumed by it; what its model received equals the
  uninterrupted order (the 2-process run's, interleaved: the same global batch gives the
  same order).
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from trainerkit import HERE, assert_resumed_exactly, recorded, run
from zbtest import token_stream

from zerobatch.adapters.torchtitan import STATE_KEY, ZerobatchDataLoader
from zerobatch.formats.errors import ConfigError, StateError

SEQ = 16
SCRIPT = str(HERE / "torchtitan_train.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder, docs = token_stream(tmp_path_factory.mktemp("titan") / "data", n_tokens=6000)
    return folder, docs


def build(folder, dp_rank=0, dp_world_size=1, local_batch=4, **config):
    """The dataloader, built as torchtitan's Trainer builds its dataloader."""
    return ZerobatchDataLoader.Config(dataset_path=folder, seed=3, num_threads=1, **config).build(
        dp_world_size=dp_world_size, dp_rank=dp_rank, tokenizer=None, seq_len=SEQ,
        local_batch_size=local_batch, snapshot_every_n_steps=1)


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_batches_are_torchtitans(data):
    folder, docs = data
    starts = set(np.cumsum([0] + [len(d) for d in docs[:-1]]).tolist())
    inputs, labels = take(build(folder), 1)[0]
    assert set(inputs) == {"input", "positions"}
    x, pos = inputs["input"], inputs["positions"]
    assert x.shape == pos.shape == labels.shape == (4, SEQ) and x.dtype == labels.dtype == torch.int64
    assert torch.equal(labels[:, :-1], x[:, 1:])            # token p is p: labels are the next tokens
    for row, prow in zip(x.tolist(), pos.tolist()):
        for k, (t, p) in enumerate(zip(row, prow)):
            assert (p == 0) == (k == 0 or t in starts)          # positions restart at each document
    plain, _ = take(build(folder, positions=False), 1)[0]
    assert set(plain) == {"input"}
    packed = take(build(folder, kind="packed"), 20)
    assert set(packed[0][0]) == {"input", "positions"} and packed[0][0]["input"].shape == (4, SEQ)
    x, y = torch.cat([b[0]["input"] for b in packed]), torch.cat([b[1] for b in packed])
    assert ((y == -100) | (y == x + 1)).all() and (y == -100).any()      # no label across documents
    # two data-parallel ranks split the global batch: rank r holds its rows r, r + 2
    one = take(build(folder), 3)
    two = [take(build(folder, dp_rank=r, dp_world_size=2, local_batch=2), 3) for r in (0, 1)]
    for step in range(3):
        rows = torch.stack([two[0][step][0]["input"], two[1][step][0]["input"]], 1).reshape(4, SEQ)
        assert torch.equal(rows, one[step][0]["input"])


def test_state_is_one_shared_string_that_resumes_anywhere(data):
    folder, _ = data
    want = [b[0]["input"] for b in take(build(folder, infinite=True), 200)]
    per_epoch = len(build(folder).loader)
    assert per_epoch < 200 and not torch.equal(want[0], want[per_epoch])    # a new epoch, a new order
    rank1 = build(folder, dp_rank=1, dp_world_size=2, local_batch=2)
    it = iter(rank1)
    for _ in range(per_epoch - 2):
        next(it)
    state = rank1.state_dict()
    assert set(state) == {STATE_KEY} and isinstance(state[STATE_KEY], str)
    assert json.loads(state[STATE_KEY])["world_size"] == 2
    resumed = build(folder)
    resumed.load_state_dict(state)                          # rank 1 of 2 -> 1 process
    assert all(torch.equal(b[0]["input"], w) for b, w in zip(take(resumed, 6), want[per_epoch - 2:]))
    once = build(folder, infinite=False)
    once.load_state_dict(state)
    assert len(list(once)) == 2                             # the rest of the epoch, then the end
    empty = build(folder)
    empty.load_state_dict({})                               # no dataloader in the checkpoint: a fresh start
    assert torch.equal(take(empty, 1)[0][0]["input"], want[0])


def test_errors(data, tmp_path):
    folder, _ = data
    with pytest.raises(ConfigError, match="dataset_path: give the TOKSTREAM dataset"):
        build(None)
    with pytest.raises(ConfigError, match="kind must be one of"):
        build(folder, kind="docs")
    loader = build(folder)
    with pytest.raises(StateError, match="not a zerobatch dataloader state"):
        loader.load_state_dict({"dp_rank_0": b"...", "world_size": 1})   # torchtitan's own loaders' state
    with pytest.raises(StateError, match="not JSON"):
        loader.load_state_dict({STATE_KEY: "{"})
    with pytest.raises(StateError):             # another seed's state
        build(folder).load_state_dict({STATE_KEY: json.dumps({**json.loads(loader.state_dict()[STATE_KEY]),
                                                              "seed": 4})})


def interleaved(record) -> list:
    """The 2-process run's forward calls as the 1-process run's: rank r's row j is row r + 2 j."""
    ranks = [recorded(record, 0), recorded(record, 1)]
    assert len(ranks[0]) == len(ranks[1])
    return [[row for pair in zip(a, b) for row in pair] for a, b in zip(*ranks)]


N = 4                                   # the checkpoint's step (2 N steps uninterrupted)
CALLS = 2 * N                           # forward calls up to it (accumulation 2)
MANAGER = ["--steps", str(2 * N), "--global-batch", "8", "--loop", "manager"]


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    """The forward calls of the uninterrupted 2-process run, as 1 process's (the reference of
    every resumed run: the same global batch gives the same order on any world size)."""
    folder, _ = data
    tmp = tmp_path_factory.mktemp("titan-full")
    run([SCRIPT, folder, str(tmp / "ckpt"), *MANAGER, "--local-batch", "2", "--nproc", "2"], record=tmp / "full")
    full = interleaved(tmp / "full")
    assert len(full) == 2 * CALLS and all(np.shape(c) == (4, SEQ) for c in full)
    return full


@pytest.mark.timeout(600)
def test_kill_2_processes_resume_on_1_from_the_checkpoint_manager(data, uninterrupted, tmp_path):
    folder, _ = data
    run([SCRIPT, folder, str(tmp_path / "ckpt"), *MANAGER, "--local-batch", "2", "--nproc", "2", "--save-at",
         str(N), "--kill"], record=tmp_path / "before", expect_killed=True)
    run([SCRIPT, folder, str(tmp_path / "ckpt"), *MANAGER, "--local-batch", "4", "--save-at", str(N)],
        record=tmp_path / "after")
    assert_resumed_exactly(uninterrupted, interleaved(tmp_path / "before"), recorded(tmp_path / "after"), CALLS)
    # the loader's state is in the checkpoint once (DCP keeps one copy of a key every rank saves)
    from torch.distributed.checkpoint import FileSystemReader
    saved = FileSystemReader(str(tmp_path / "ckpt" / "checkpoint" / f"step-{N}")).read_metadata()
    assert [k.fqn for k in saved.storage_data if k.fqn.startswith("dataloader")] == [f"dataloader.{STATE_KEY}"]


@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="torchtitan 0.3.0's Trainer imports triton (its model code does, CPU or not), which is "
                           "not installed: its own train loop cannot run here (the checkpoint-manager loop does)")
def test_kill_and_resume_torchtitans_own_trainer(data, uninterrupted, tmp_path):
    folder, _ = data
    from tokenizers import Tokenizer, models
    (tmp_path / "tok").mkdir()
    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tmp_path / "tok" / "tokenizer.json"))
    trainer = ["--steps", str(2 * N), "--global-batch", "8", "--local-batch", "4", "--loop", "trainer",
               "--tokenizer", str(tmp_path / "tok"), "--save-at", str(N)]
    run([SCRIPT, folder, str(tmp_path / "titan"), *trainer, "--kill"], record=tmp_path / "before",
        expect_killed=True)
    run([SCRIPT, folder, str(tmp_path / "titan"), *trainer], record=tmp_path / "after")
    assert (tmp_path / "titan" / "checkpoint" / f"step-{N}" / ".metadata").exists()
    assert_resumed_exactly(uninterrupted, recorded(tmp_path / "before"), recorded(tmp_path / "after"), CALLS)
