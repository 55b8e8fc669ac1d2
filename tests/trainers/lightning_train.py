"""Lightning training loops over zerobatch data, checkpointed by Lightning's own machinery.

``--loop trainer``: ``Trainer.fit`` fed by :class:`zerobatch.adapters.lightning.ZerobatchDataModule`,
checkpointed by Lightning's ``ModelCheckpoint`` every ``--save-every`` optimizer steps.
``--loop fabric``: a Fabric loop over a :class:`zerobatch.adapters.torch.Loader`, checkpointed
with ``fabric.save(path, {"model", "optimizer", "loader", "step"})`` and restored with
``fabric.load``.

The model is a :class:`trainerkit.RecordingLM` (each forward call's
``input_ids`` logged to ``$ZB_RECORD.rank<r>``). ``--source windows`` reads token windows (an
epoch of known length; Lightning does not read ahead), ``--source mixture`` an endless mixture
of two token streams (no length: Lightning's fetcher reads one batch ahead). ``--devices 2``
runs ``strategy="ddp"`` on CPU (gloo): Lightning starts the second process itself, running
this script again with ``LOCAL_RANK=1``. ``--kill-at N`` SIGKILLs every process right after
``ModelCheckpoint`` wrote the checkpoint of step ``N`` (Fabric: right after
``fabric.save``); ``--resume PATH`` continues with ``trainer.fit(..., ckpt_path=PATH)`` (Fabric:
``fabric.load(PATH, state)``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from trainerkit import RecordingLM, die

from zerobatch.adapters.lightning import ZerobatchDataModule
from zerobatch.adapters.torch import Loader, Mixture, TokenWindows


def source(kind: str, data: str, data2: str | None = None, seq_len: int = 16, seed: int = 1) -> Any:
    """``windows``: token windows of ``data``; ``mixture``: an endless mixture of ``data`` (3/4)
    and ``data2`` (1/4)."""
    if kind == "windows":
        return TokenWindows(data, seq_len=seq_len)
    return Mixture([("a", TokenWindows(data, seq_len=seq_len), 0.75),
                    ("b", TokenWindows(data2, seq_len=seq_len), 0.25)], seed=seed)


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lm = RecordingLM(shift=False)      # (x, y) windows: y is already shifted

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.lm(input_ids=x, labels=y)["loss"]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class KillAfterSave(ModelCheckpoint):
    """Lightning's ModelCheckpoint; after writing the checkpoint of step ``kill_at``, SIGKILL."""

    def __init__(self, kill_at: int | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kill_at = kill_at

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)     # writes (rank 0) and waits for every rank
        if trainer.global_step == self.kill_at:
            if not Path(str(self.dirpath), f"step={self.kill_at}.ckpt").exists():
                raise RuntimeError(f"no checkpoint of step {self.kill_at} in {self.dirpath}")
            die()


def fit(args: argparse.Namespace, src: Any) -> None:
    data = ZerobatchDataModule(src, global_batch_size=args.batch, seed=args.seed, num_threads=1)
    L.seed_everything(0, verbose=False)
    model = LM()
    ckpt = KillAfterSave(args.kill_at, dirpath=args.ckpt, filename="{step}", save_top_k=-1,
                         every_n_train_steps=args.save_every)
    trainer = L.Trainer(max_steps=args.steps, accumulate_grad_batches=args.accum, accelerator="cpu",
                        devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
                        callbacks=[ckpt], logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)


def fabric_loop(args: argparse.Namespace, src: Any) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto")
    fabric.launch()
    Path(args.ckpt).mkdir(parents=True, exist_ok=True)
    # built after launch: rank and world size come from the process group
    loader = Loader(src, global_batch_size=args.batch, seed=args.seed, num_threads=1)
    L.seed_everything(0, verbose=False)
    model = RecordingLM(shift=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)       # calls loader.load_state_dict(saved)
    epoch = loader.epoch
    while state["step"] < args.steps:
        loader.set_epoch(epoch)               # the saved epoch keeps its position
        for x, y in loader:
            loss = model(input_ids=x, labels=y)["loss"]
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            state["step"] += 1
            if state["step"] % args.save_every == 0:
                # fabric.save calls loader.state_dict()
                fabric.save(Path(args.ckpt, f"step={state['step']}.ckpt"), state)
                if state["step"] == args.kill_at:
                    die()
            if state["step"] == args.steps:
                break
        epoch += 1


def main() -> None:
    # RecordingLM logs to $ZB_RECORD.rank$RANK; Lightning's launcher sets LOCAL_RANK in the
    # processes it starts (one node: the global rank), and nothing in the first one
    os.environ["RANK"] = os.environ.get("LOCAL_RANK", "0")
    p = argparse.ArgumentParser()
    p.add_argument("--loop", choices=["trainer", "fabric"], default="trainer")
    p.add_argument("--data", required=True)
    p.add_argument("--data2", help="the mixture's second token stream")
    p.add_argument("--source", choices=["windows", "mixture"], default="windows")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="global batch")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps (max_steps)")
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--resume")
    args = p.parse_args()
    if args.loop == "fabric" and args.accum != 1:
        p.error("--accum: the Fabric loop here takes one batch per optimizer step")

    src = source(args.source, args.data, args.data2, args.seq_len, args.seed)
    (fit if args.loop == "trainer" else fabric_loop)(args, src)


if __name__ == "__main__":
    main()
