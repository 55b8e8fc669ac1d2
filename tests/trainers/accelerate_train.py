"""A custom training loop under accelerate on a zerobatch dataset, for the kill-and-resume tests:
the loader is registered for checkpointing, save_state/load_state carry its position."""

from __future__ import annotations

import argparse
import os

import torch
import trainerkit
from accelerate import Accelerator

from zerobatch.adapters.torch import Loader, TokenWindows

p = argparse.ArgumentParser()
p.add_argument("data")
p.add_argument("out")
p.add_argument("--steps", type=int, required=True)
p.add_argument("--global-batch", type=int, default=4)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--save-every", type=int, default=2)
p.add_argument("--die-at", type=int)
p.add_argument("--resume", action="store_true")
a = p.parse_args()

accelerator = Accelerator(cpu=True, gradient_accumulation_steps=a.accum)
torch.manual_seed(0)
model = trainerkit.RecordingLM(shift=False)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
loader = Loader(TokenWindows(a.data, seq_len=16), global_batch_size=a.global_batch // a.accum, seed=7)
accelerator.register_for_checkpointing(loader)

step = 0
if a.resume:
    last = max(os.listdir(a.out), key=int)
    accelerator.load_state(os.path.join(a.out, last))
    step = int(last)

while step < a.steps:
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = model(x, labels=y)["loss"]
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            if step % a.save_every == 0:
                accelerator.save_state(os.path.join(a.out, str(step)))
                accelerator.wait_for_everyone()
                if step == a.die_at:
                    trainerkit.die()
            if step == a.steps:
                break
    else:
        loader.set_epoch(loader.epoch + 1)
