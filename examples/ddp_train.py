"""Train a tiny causal language model with DistributedDataParallel on a TOKSTREAM dataset,
checkpointing the model, the optimizer and the zerobatch loader, and resuming on any number
of processes.

    python examples/ddp_train.py --steps 20                  # one process, a demo dataset
    python examples/ddp_train.py --steps 40 --resume         # continues at step 20
    torchrun --nproc_per_node=2 examples/ddp_train.py DATA CKPT_DIR --steps 300 --resume

Without ``DATA`` the run makes a small synthetic TOKSTREAM dataset (documents counting up in
steps of 1 to 3, which the model learns quickly) in ``CKPT_DIR/demo-data``; ``CKPT_DIR``
defaults to ``zerobatch-ddp-example`` in the system's temporary folder. Rank 0 prints the step,
the loss and the tokens per second (all ranks) every ``--log-every`` steps.

Every ``--ckpt-every`` steps, and after the last one, rank 0 writes ``CKPT_DIR/ckpt.pt``
atomically (model, optimizer, loader state, step). ``--resume`` continues from it (starting
at step 0 when there is none yet, so a restarting launcher can always pass it), on any number
of processes that splits the global batch: the loader's state counts the batches the loop
received, so no sample is skipped or read twice. Without ``--resume`` a run starts at step 0
and overwrites the checkpoint. Next to it goes the loader's run card
(``CKPT_DIR/zerobatch_run_card.json``): ``zerobatch trace CKPT_DIR --step N`` lists the
documents step N trained on (loader steps count from 0: this loop's step N is the loader's
N - 1), ``--document D`` every step that saw document D. ``--ids-log`` writes, per rank, one
JSON line per step with the ids of the windows it trained on; ``--die-at`` kills rank 0 with SIGKILL after that step
(to test recovery; ``--die-rank R --die-host``: rank R kills its whole process group, the launcher and every process
of its node, as a lost host).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from typing import Any

import numpy as np

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zerobatch.adapters.torch import Loader, TokenWindows


class TinyLM(nn.Module):
    """Embedding, one causal self-attention block with an MLP, and an output head."""

    def __init__(self, vocab: int, dim: int = 32, heads: int = 2, seq_len: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.block = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.0,
                                                batch_first=True, norm_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        h = self.block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def save_atomic(path: str, write: Any) -> None:
    """``write(f)`` into a temporary file next to ``path``, flushed, fsynced and renamed into
    place: a crash never leaves a half-written file under the real name."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def demo_dataset(folder: str, n_tokens: int = 200_000, vocab: int = 256, seed: int = 0) -> None:
    """A synthetic TOKSTREAM dataset at ``folder`` (kept if it is there): documents of 20 to
    200 tokens, each counting up from a random token in a random step of 1 to 3 (mod
    ``vocab``), so the loss falls within a few dozen steps. Written next to ``folder`` and
    renamed into place, so a run killed while writing leaves no half dataset."""
    from zerobatch.writers.tokstream import TokenStreamWriter

    if os.path.exists(os.path.join(folder, "manifest.json")):
        return
    rng = np.random.default_rng(seed)
    tmp = f"{folder}.tmp-{os.getpid()}"
    with TokenStreamWriter(tmp, vocab_size=vocab) as w:
        done = 0
        while done < n_tokens:
            n = int(rng.integers(20, 201))
            start, step = int(rng.integers(vocab)), int(rng.integers(1, 4))
            w.add_document((start + step * np.arange(n)) % vocab)
            done += n
    os.replace(tmp, folder)


def save_checkpoint(path: str, model: nn.Module, opt: torch.optim.Optimizer, loader: Loader,
                    step: int) -> None:
    """Rank 0's checkpoint: model, optimizer, the loader's position, the step (atomically),
    and the loader's run card next to it (``zerobatch_run_card.json``: ``zerobatch trace
    CKPT_DIR --step N`` says which documents any step trained on, ``--document D`` when a
    document was seen)."""
    state = loader.state_dict()
    card = loader.describe(state)
    ckpt = {"model": model.state_dict(), "optim": opt.state_dict(), "loader": state, "step": step, "run_card": card}
    save_atomic(path, lambda f: torch.save(ckpt, f))
    save_atomic(os.path.join(os.path.dirname(path), "zerobatch_run_card.json"),
                lambda f: f.write(json.dumps(card).encode()))
    print(f"checkpoint {path}: step {step}, loader at epoch {state['epoch']} after {state['consumed']} of "
          f"{state['num_items']} windows", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", nargs="?", default=None,
                    help="TOKSTREAM dataset folder (default: a synthetic one made in CKPT_DIR/demo-data)")
    ap.add_argument("ckpt_dir", nargs="?",
                    default=os.path.join(tempfile.gettempdir(), "zerobatch-ddp-example"),
                    help="where ckpt.pt goes (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=300, help="train up to this step (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the dataset's)")
    ap.add_argument("--ckpt-every", type=int, default=50,
                    help="write the checkpoint every N steps (and after the last; default: %(default)s)")
    ap.add_argument("--log-every", type=int, default=None,
                    help="print every N steps (default: a tenth of --steps, at most 25)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from CKPT_DIR/ckpt.pt when it is there (else start at step 0)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--ids-log", default=None, help="folder for the per-rank sample-id logs")
    ap.add_argument("--die-at", type=int, default=None, help="SIGKILL rank 0 after this step")
    ap.add_argument("--die-rank", type=int, default=0, help="the rank --die-at kills (default 0)")
    ap.add_argument("--die-host", action="store_true",
                    help="--die-at kills the rank's whole process group (its launcher and node: a lost host)")
    args = ap.parse_args()
    for name in ("steps", "seq_len", "global_batch", "ckpt_every", "log_every"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    log_every = args.log_every or max(1, min(25, args.steps // 10))

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    torch.manual_seed(args.seed)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    data = args.data
    if data is None:
        data = os.path.join(args.ckpt_dir, "demo-data")
        if rank == 0:
            demo_dataset(data)
            print(f"data: a synthetic TOKSTREAM dataset in {data} (give DATA to train on your own)",
                  flush=True)
        if distributed:
            dist.barrier()
    source = TokenWindows(data, args.seq_len)
    vocab = args.vocab or source.reader.manifest.vocab_size
    loader = Loader(source, global_batch_size=args.global_batch, seed=args.seed)   # rank/world from torch.distributed
    model = TinyLM(vocab, seq_len=args.seq_len)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    ckpt_path = os.path.join(args.ckpt_dir, "ckpt.pt")
    step = 0
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, weights_only=False)
        (model.module if distributed else model).load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed at step {step} on {world} process(es), epoch {loader.epoch}", flush=True)
    elif rank == 0:
        again = " (it is overwritten: pass --resume to continue from it)" if os.path.exists(ckpt_path) else ""
        print(f"starting at step 0 on {world} process(es); checkpoint: {ckpt_path}{again}", flush=True)
    if rank == 0 and step >= args.steps:
        print(f"nothing to do: the checkpoint is at step {step}, --steps is {args.steps}", flush=True)
    log = None
    if args.ids_log:
        os.makedirs(args.ids_log, exist_ok=True)
        log = open(os.path.join(args.ids_log, f"start{step:06d}-world{world}-rank{rank}.jsonl"), "w")

    epoch = loader.epoch
    it = iter(loader)
    tokens, t0 = 0, time.perf_counter()
    start = step
    empty_passes = 0   # a resumed epoch may end at once; two empty passes in a row never end
    while step < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            empty_passes += 1
            if empty_passes == 2:
                raise SystemExit(f"rank {rank}: the loader gives this rank no batch in a whole epoch") from None
            epoch += 1
            loader.set_epoch(epoch)
            it = iter(loader)
            continue
        empty_passes = 0
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        tokens += x.numel() * world
        if log is not None:
            log.write(json.dumps({"step": step, "epoch": epoch, "ids": (x[:, 0] // args.seq_len).tolist()}) + "\n")
            log.flush()
        if rank == 0 and (step % log_every == 0 or step == args.steps):
            now = time.perf_counter()
            rate = tokens / (now - t0)
            tokens, t0 = 0, now
            print(f"step {step} epoch {epoch} loss {loss.item():.3f} ({rate:,.0f} tokens/s)", flush=True)
        if step % args.ckpt_every == 0 or step == args.steps:
            if rank == 0:
                save_checkpoint(ckpt_path, model.module if distributed else model, opt, loader, step)
            if distributed:
                dist.barrier()
        if args.die_at is not None and step == args.die_at and rank == args.die_rank:
            if args.die_host:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
    loader.close()
    if rank == 0 and step > start:
        again = "" if args.data is None else f" {args.data} {args.ckpt_dir}"
        launcher = "torchrun --nproc_per_node=N " if distributed else "python "
        print(f"done: {step} steps; continue with: {launcher}{os.path.relpath(__file__)}{again} "
              f"--steps {step + args.steps - start} --resume", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
