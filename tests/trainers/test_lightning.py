"""PyTorch Lightning: ``Trainer.fit`` with :class:`ZerobatchDataModule`, and a Fabric loop with the
zerobatch Loader, are killed with SIGKILL right after Lightning's own checkpoint and resume from
it: the model receives, call for call, what an uninterrupted run received. Covered: gradient
accumulation 2 with the checkpoint mid-epoch and the run crossing into the next epoch; two DDP
processes (gloo) resumed on one; an endless mixture, which Lightning's fetcher reads one batch
ahead of the model; a checkpoint at the very end of an epoch."""

from __future__ import annotations

import socket
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
from trainerkit import HERE, assert_resumed_exactly, recorded, run  # noqa: E402
from zbtest import take, token_stream  # noqa: E402

from zerobatch.adapters.torch import Loader  # noqa: E402
from zerobatch.formats.errors import ConfigError, StateError  # noqa: E402

SCRIPT = str(HERE / "lightning_train.py")
#: 400 tokens: 24 windows of 16 (+1) tokens, 6 global batches of 4 per epoch
N_TOKENS = 400
BATCH = 4


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


class Runs:
    """Every subprocess run of this file, started together when the first test asks: each
    scenario runs its killed run then its resumed run, beside its uninterrupted run; the
    scenarios do not wait for one another."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.data, _ = token_stream(tmp / "data", n_tokens=N_TOKENS)
        self.data2, _ = token_stream(tmp / "data2", n_tokens=N_TOKENS, offset=8000)
        self.side = ThreadPoolExecutor(max_workers=2)          # the uninterrupted runs
        self.scenarios = ThreadPoolExecutor(max_workers=3)
        self.futures: dict[str, Future[Any]] = {
            "acc": self.scenarios.submit(self.trainer_accumulation),
            "ddp": self.scenarios.submit(self.ddp_mixture),
            "fabric": self.scenarios.submit(self.fabric)}

    def result(self, name: str) -> Any:
        """What scenario ``name`` returns (its record paths), once its runs are done."""
        return self.futures[name].result()

    def close(self) -> None:
        self.scenarios.shutdown(wait=True)
        self.side.shutdown(wait=True)

    def script(self, name: str, *args: Any, **kw: Any) -> Any:
        """``lightning_train.py`` with ``args``, forward calls recorded under ``tmp/<name>``."""
        argv = [SCRIPT, "--data", self.data, "--data2", self.data2, *map(str, args)]
        return run(argv, record=self.tmp / name, **kw)

    def trainer_accumulation(self) -> tuple[Path, Path, Path]:
        """One process, token windows, accumulation 2: 4 optimizer steps (8 batches: the 6 of
        epoch 0, 2 of epoch 1), killed after the checkpoint of step 2 (batch 4 of 6)."""
        t = self.tmp
        common = ["--steps", 4, "--save-every", 2, "--accum", 2]
        full = self.side.submit(self.script, "acc-full", "--ckpt", t / "acc-a", *common)
        self.script("acc-kill", "--ckpt", t / "acc-b", *common, "--kill-at", 2, expect_killed=True)
        self.script("acc-res", "--ckpt", t / "acc-c", *common, "--resume", t / "acc-b" / "step=2.ckpt")
        full.result()
        return t / "acc-full", t / "acc-kill", t / "acc-res"

    def ddp_mixture(self) -> tuple[Path, Path, Path]:
        """An endless mixture on 2 DDP processes (global batch 4): 6 steps; killed after the
        checkpoint of step 3; resumed on 1 process."""
        t = self.tmp
        common = ["--source", "mixture", "--steps", 6, "--save-every", 3]
        two = [*common, "--devices", 2]
        full = self.side.submit(self.script, "ddp-full", "--ckpt", t / "ddp-a", *two,
                                env={"MASTER_PORT": _port()})
        self.script("ddp-kill", "--ckpt", t / "ddp-b", *two, "--kill-at", 3, env={"MASTER_PORT": _port()},
                    expect_killed=True)
        self.script("ddp-res", "--ckpt", t / "ddp-c", *common, "--resume", t / "ddp-b" / "step=3.ckpt")
        full.result()
        return t / "ddp-full", t / "ddp-kill", t / "ddp-res"

    def fabric(self) -> tuple[Path, Path]:
        """A Fabric loop over token windows: 8 steps (6 of epoch 0, 2 of epoch 1), killed after
        ``fabric.save`` of step 4."""
        t = self.tmp
        common = ["--loop", "fabric", "--steps", 8, "--save-every", 4]
        self.script("fab-kill", "--ckpt", t / "fab", *common, "--kill-at", 4, expect_killed=True)
        self.script("fab-res", "--ckpt", t / "fab-c", *common, "--resume", t / "fab" / "step=4.ckpt")
        return t / "fab-kill", t / "fab-res"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    r = Runs(tmp_path_factory.mktemp("lightning"))
    yield r
    r.close()


def direct(loader: Loader, steps: int, epochs: int = 1) -> list[list[list[int]]]:
    """The ``x`` of ``steps`` batches of ``loader`` iterated by hand, ``set_epoch`` per epoch."""
    out: list[list[list[int]]] = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out += take(loader, steps - len(out), lambda b: b[0].tolist())
    return out


def windows_loader(data: str, **kw: Any) -> Loader:
    from lightning_train import source
    return Loader(source("windows", data), global_batch_size=BATCH, seed=1, num_threads=1, **kw)


@pytest.mark.timeout(600)
def test_trainer_fit_resumes_exactly_with_accumulation_across_an_epoch(runs):
    full, kill, res = (recorded(p) for p in runs.result("acc"))
    # the uninterrupted run: epoch 0 (6 batches), then epoch 1 in its own order
    assert full == direct(windows_loader(runs.data), 8, epochs=2)
    assert_resumed_exactly(full, kill, res, 4)
    ckpt = torch.load(runs.tmp / "acc-b" / "step=2.ckpt", weights_only=False)
    assert ckpt["ZerobatchDataModule"]["loader"]["consumed"] == 4 * BATCH     # 4 batches received
    # the fit loop's copy (it saves every train loader with a state_dict) is the same
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [ckpt["ZerobatchDataModule"]]
    # zerobatch trace reads the run card from Lightning's own checkpoint file: the 4 batches
    # the model received, row for row
    from zerobatch.adapters.trace import Trace
    trace = Trace(runs.tmp / "acc-b" / "step=2.ckpt")
    assert trace.position == 4
    for step in range(4):
        rows = trace.step(step, metadata=False)["ranks"][0]["rows"]
        assert [list(range(r["item"] * 16, r["item"] * 16 + 16)) for r in rows] == full[step]


@pytest.mark.timeout(600)
def test_ddp_run_of_an_endless_mixture_resumes_on_one_process(runs):
    from lightning_train import source
    paths = runs.result("ddp")
    full = [recorded(paths[0], r) for r in range(2)]
    kill = [recorded(paths[1], r) for r in range(2)]
    res = recorded(paths[2])
    assert [len(c) for c in full] == [6, 6] and [len(c) for c in kill] == [3, 3]
    for r in range(2):
        assert kill[r] == full[r][:3], f"rank {r} diverged before its checkpoint"
    # the global batches of one process (same global batch): each holds the rows the two
    # processes received at that step...
    one = Loader(source("mixture", runs.data, runs.data2), global_batch_size=BATCH, seed=1, num_threads=1,
                 rank=0, world_size=1)
    ref = take(one, 6, lambda b: b[0].tolist())
    for k in range(6):
        assert sorted(ref[k]) == sorted(full[0][k] + full[1][k]), f"step {k}"
    # ...and the run resumed on one process receives them, in the one-process order
    assert res == ref[3:]


@pytest.mark.timeout(600)
def test_fabric_save_and_load_resume_the_loader_exactly(runs):
    kill, res = (recorded(p) for p in runs.result("fabric"))
    assert_resumed_exactly(direct(windows_loader(runs.data), 8, epochs=2), kill, res, 4)


# -- in this process: the datamodule's contract ---------------------------------------------------

def seen_module(seen: list[list[int]], iter_step: bool = False) -> Any:
    """A LightningModule that keeps the first token of every row it trains on (or, with
    ``iter_step``, whose ``training_step`` takes ``dataloader_iter``)."""
    import lightning as L

    class Seen(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(batch[0][:, 0].tolist())
            return (self.w * batch[0].float().mean()).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class SeenIter(Seen):
        def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
            return self.w.sum()

    return SeenIter() if iter_step else Seen()


def trainer(root: Path, **kw: Any) -> Any:
    """A one-process CPU trainer writing nothing but the checkpoints of the callbacks given."""
    import lightning as L
    return L.Trainer(accelerator="cpu", devices=1, default_root_dir=root, logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing="callbacks" in kw, **kw)


def test_refuses_what_it_cannot_resume(tmp_path):
    from lightning_train import source

    from zerobatch.adapters.lightning import ZerobatchDataModule
    data, _ = token_stream(tmp_path / "data", n_tokens=N_TOKENS)
    src = source("windows", data)
    for key in ("rank", "world_size"):
        with pytest.raises(ConfigError, match=f"{key} comes from the trainer"):
            ZerobatchDataModule(src, batch_size=4, **{key: 0})
    with pytest.raises(ConfigError, match="a ready Loader takes no loader arguments"):
        ZerobatchDataModule(windows_loader(data), seed=3)
    dm = ZerobatchDataModule(src, global_batch_size=4)
    for bad in (None, {}, {"loader": 3}):
        with pytest.raises(StateError, match="a state is"):
            dm.load_state_dict(bad)
    with pytest.raises(ConfigError, match=r"training_step\(dataloader_iter\)"):
        trainer(tmp_path, max_steps=1).fit(seen_module([], iter_step=True),
                                           datamodule=ZerobatchDataModule(src, global_batch_size=4))
    elsewhere = ZerobatchDataModule(windows_loader(data, rank=1, world_size=2))
    with pytest.raises(ConfigError, match="built for rank 1 of 2 but the trainer runs rank 0 of 1"):
        trainer(tmp_path, max_steps=1).fit(seen_module([]), datamodule=elsewhere)
    # another dataset's state: refused by the loader
    other, _ = token_stream(tmp_path / "other", n_tokens=2 * N_TOKENS)
    dm_other = ZerobatchDataModule(windows_loader(other))
    with pytest.raises(StateError):
        dm_other.load_state_dict({"loader": windows_loader(data).state_dict()})


def test_resume_from_the_checkpoint_at_the_end_of_an_epoch(tmp_path):
    """Step 6 is the last batch of epoch 0: the resumed run starts epoch 1 (Lightning's
    ``sampler.set_epoch``), in epoch 1's order."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_train import source

    from zerobatch.adapters.lightning import ZerobatchDataModule
    data, _ = token_stream(tmp_path / "data", n_tokens=N_TOKENS)
    src = source("windows", data)

    def fit(seen: list[list[int]], ckpt: Path, resume: Path | None = None) -> None:
        cb = ModelCheckpoint(dirpath=ckpt, filename="{step}", every_n_train_steps=6, save_top_k=-1)
        dm = ZerobatchDataModule(src, global_batch_size=BATCH, seed=1)
        trainer(tmp_path, max_steps=9, callbacks=[cb]).fit(seen_module(seen), datamodule=dm, ckpt_path=resume)

    full: list[list[int]] = []
    fit(full, tmp_path / "a")
    assert full == [[row[0] for row in b] for b in direct(windows_loader(data), 9, epochs=2)]
    after: list[list[int]] = []
    fit(after, tmp_path / "b", tmp_path / "a" / "step=6.ckpt")
    assert after == full[6:]


def test_state_counts_only_the_batches_the_model_received(tmp_path):
    """Lightning reads an endless loader one batch ahead of the model: the datamodule's state
    stands after the batches the model received, during and after ``fit``."""
    from lightning_train import source

    from zerobatch.adapters.lightning import ZerobatchDataModule
    data, _ = token_stream(tmp_path / "data", n_tokens=N_TOKENS)
    data2, _ = token_stream(tmp_path / "data2", n_tokens=N_TOKENS, offset=8000)
    mixture = source("mixture", data, data2)
    seen: list[list[int]] = []
    dm = ZerobatchDataModule(mixture, global_batch_size=BATCH, seed=1)
    trainer(tmp_path, max_steps=3).fit(seen_module(seen), datamodule=dm)
    one = Loader(mixture, global_batch_size=BATCH, seed=1, rank=0, world_size=1)
    assert seen == take(one, 3, lambda b: b[0][:, 0].tolist())
    state = dm.state_dict()
    assert state["loader"] == one.state_dict() and set(state) == {"loader", "run_card"}
    assert state["run_card"]["state"] == state["loader"]
    # another fit of the same datamodule goes on with the batch read ahead and never trained on
    more: list[list[int]] = []
    trainer(tmp_path, max_steps=2).fit(seen_module(more), datamodule=dm)
    assert more == take(one, 2, lambda b: b[0][:, 0].tolist())
