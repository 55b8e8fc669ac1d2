"""A torch training loop fed by Grain pipelines over zerobatch data, checkpointed with Grain's own
iterator checkpoint (``grain.checkpoint.CheckpointHandler``: the iterator's ``get_state`` in
``process_<i>-of-<n>.json``) and ``torch.save`` for the model and the optimizer.

Each ``--pipeline`` trains its own :class:`trainerkit.RecordingLM` (forward calls logged to
``$ZB_RECORD-<pipeline>.rank0``); several pipelines train in lockstep in one process, so one
SIGKILL after the checkpoints of step ``--save-at`` interrupts all of them at once:

- ``map``: ``MapDataset.source(DataSource(TokenWindows)).shuffle(seed).repeat().batch(B)``;
- ``mp``: the same with ``mp_prefetch`` (two Grain worker processes);
- ``zerobatch``: ``LoaderDataset(TokenWindows, batch_size=B)``, zerobatch's own order.

With ``--resume`` each pipeline restores its iterator first (the handler calls
``set_state`` then ``start_prefetch``), then its model and optimizer, and trains on to
``--steps``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import grain
import numpy as np
from absl import flags
from etils import epath

from zerobatch.adapters.grain import DataSource, LoaderDataset, die_with_parent
from zerobatch.adapters.sources import TokenWindows

# torch is imported by main() alone: Grain starts its worker processes with spawn, which
# imports this module again in each of them, where only the pipeline is needed


def pipeline(kind: str, data: str, seq_len: int, batch: int, seed: int) -> Any:
    if kind == "zerobatch":
        return LoaderDataset(TokenWindows(data, seq_len=seq_len), batch_size=batch, seed=seed, num_epochs=None,
                             rank=0, world_size=1)
    ds = grain.MapDataset.source(DataSource(TokenWindows(data, seq_len=seq_len))).shuffle(seed=seed).repeat()
    ds = ds.batch(batch).to_iter_dataset()
    if kind == "mp":
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2, per_worker_buffer_size=2),
                            worker_init_fn=die_with_parent)
    return ds


class Run:
    """One pipeline's loop: its iterator, model, optimizer and checkpoint folder."""

    def __init__(self, kind: str, args: argparse.Namespace) -> None:
        import torch
        from trainerkit import RecordingLM
        self.kind = kind
        self.folder = Path(args.ckpt) / kind
        self.accum = args.accum
        self.handler = grain.checkpoint.CheckpointHandler()
        self.iterator = iter(pipeline(kind, args.data, args.seq_len, args.batch, args.seed))
        torch.manual_seed(0)
        os.environ["ZB_RECORD"] = f"{args.record}-{kind}"
        self.model = RecordingLM(shift=False)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.step = 0

    def restore(self) -> None:
        import torch
        step = int((self.folder / "latest").read_text())
        at = self.folder / f"step-{step}"
        # the data first: the handler's restore calls set_state and then start_prefetch, so
        # the first batch is read while the model loads
        self.iterator = self.handler.restore(epath.Path(at / "data"), item=self.iterator)
        saved = torch.load(at / "model.pt")
        self.model.load_state_dict(saved["model"])
        self.optim.load_state_dict(saved["optim"])
        self.step = saved["step"]

    def train_step(self) -> None:
        import torch
        self.optim.zero_grad()
        for _ in range(self.accum):
            x, y = next(self.iterator)
            out = self.model(input_ids=torch.from_numpy(np.asarray(x)).long(),
                             labels=torch.from_numpy(np.asarray(y)).long())
            (out["loss"] / self.accum).backward()
        self.optim.step()
        self.step += 1

    def save(self) -> None:
        import torch
        at = self.folder / f"step-{self.step}"
        (at / "data").mkdir(parents=True)
        self.handler.save(epath.Path(at / "data"), item=self.iterator)
        torch.save({"model": self.model.state_dict(), "optim": self.optim.state_dict(), "step": self.step},
                   at / "model.pt")
        tmp = self.folder / "latest.tmp"
        tmp.write_text(str(self.step))
        os.replace(tmp, self.folder / "latest")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("ckpt")
    p.add_argument("--pipelines", default="map,mp,zerobatch")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--kill", action="store_true", help="SIGKILL right after the checkpoints of --save-at")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    flags.FLAGS.mark_as_parsed()        # Grain's worker processes read absl flags (no absl.app here)
    from trainerkit import die
    args.record = os.environ["ZB_RECORD"]
    runs = [Run(kind, args) for kind in args.pipelines.split(",")]
    if args.resume:
        for run in runs:
            run.restore()
    while any(run.step < args.steps for run in runs):
        for run in runs:
            if run.step < args.steps:
                run.train_step()
                if run.step == args.save_at:
                    run.save()
        if args.kill and all(run.step == args.save_at for run in runs):
            die()
    for run in runs:
        run.iterator.close()


if __name__ == "__main__":
    main()
