"""Train a tiny causal language model with DistributedDataParallel on a TOKSTREAM dataset,
checkpointing the model, the optimizer and the zerobatch loader, and resuming on any number
of processes.

    torchrun --nproc_per_node=2 examples/ddp_train.py DATA CKPT_DIR --steps 300

Every ``--ckpt-every`` steps rank 0 writes ``CKPT_DIR/ckpt.pt`` atomically (model, optimizer,
loader state, step). A restarted run (on any number of processes that splits the global
batch) loads it and continues: the loader's state counts the batches the loop received, so
no sample is skipped or read twice. ``--ids-log`` writes, per rank, one JSON line per step with
the ids of the windows it trained on; ``--die-at`` kills rank 0 with SIGKILL after that step
(to test recovery).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

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


def save_atomic(obj: dict, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="TOKSTREAM dataset folder")
    ap.add_argument("ckpt_dir")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the dataset's)")
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--ids-log", default=None, help="folder for the per-rank sample-id logs")
    ap.add_argument("--die-at", type=int, default=None, help="SIGKILL rank 0 after this step")
    args = ap.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    torch.manual_seed(args.seed)

    source = TokenWindows(args.data, args.seq_len)
    vocab = args.vocab or source.reader.manifest.vocab_size
    loader = Loader(source, global_batch_size=args.global_batch, seed=args.seed)   # rank/world from torch.distributed
    model = TinyLM(vocab, seq_len=args.seq_len)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    ckpt_path = os.path.join(args.ckpt_dir, "ckpt.pt")
    step = 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, weights_only=False)
        (model.module if distributed else model).load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed at step {step} on {world} process(es), epoch {loader.epoch}", flush=True)
    log = None
    if args.ids_log:
        os.makedirs(args.ids_log, exist_ok=True)
        log = open(os.path.join(args.ids_log, f"start{step:06d}-world{world}-rank{rank}.jsonl"), "w")

    epoch = loader.epoch
    it = iter(loader)
    tokens, t0 = 0, time.perf_counter()
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
        if rank == 0 and step % 25 == 0:
            rate = tokens / (time.perf_counter() - t0)
            print(f"step {step} epoch {epoch} loss {loss.item():.3f} ({rate:,.0f} tokens/s)", flush=True)
        if step % args.ckpt_every == 0:
            if rank == 0:
                save_atomic({"model": (model.module if distributed else model).state_dict(),
                             "optim": opt.state_dict(), "loader": loader.state_dict(), "step": step}, ckpt_path)
            if distributed:
                dist.barrier()
        if args.die_at is not None and step == args.die_at and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    loader.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
