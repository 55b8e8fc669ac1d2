"""The GPU hop, measured on a real GPU: how much of a training step waits for data.

A small GPT-style model trains on a TOKSTREAM dataset (made here, in a temporary folder)
at three batch sizes, fed four ways in one run:

- ``ring``: ``zerobatch Loader(device="cuda")``: reads gather into page-locked buffers
  allocated once, each read copied on a dedicated stream, handed over with an event;
- ``pin``: the old path: a CPU batch from the zerobatch loader, then ``pin_memory()`` and
  ``.to("cuda", non_blocking=True)`` per batch;
- ``dataloader``: ``torch.utils.data.DataLoader(pin_memory=True, num_workers=W)`` over a
  map-style dataset of the same windows (``TokenStreamReader.windows``), then ``.to``: the
  typical baseline (int64 ids, copied on the compute stream);
- ``packed``: the ring over packed rows (``PackedDocuments``: input_ids, labels,
  position_ids, cu_seqlens built on the host and copied; their bytes are reported).

For each: the step time (CUDA events around the step on the compute stream, the loop
synchronizing once a step as one that logs its loss does), the time inside ``next()``
(the data stall: the GPU idles while the host waits there, since the step before was
synchronized), its share of the step time and its p50/p99, the GPU's own stall (CUDA events
from before ``next()`` to the step's first kernel: the host's wait, the stream's wait on the
copy event, a copy on the compute stream), the host-to-device copy time per
copy (CUDA events on the copy stream; the ring only), the share of it hidden behind the
steps (1 - stall / copy time) and the bytes handed to the model per step. Target
(issue 35): a stall under 1 % of the step time where a baseline shows more, none above 1 ms at
p99.

    python tools/gpu_check.py                 # about 2 minutes on one H100/H200
    python tools/gpu_check.py --steps 100 --batch-sizes 8,32 --json out.json

Prints a table and, with ``--json``, writes the figures. Needs a CUDA GPU (``--device cpu``
runs the same code on the CPU, for checking the script itself: its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np


def make_dataset(folder: str, n_tokens: int, vocab: int, seed: int = 0) -> None:
    from zerobatch.writers.tokstream import TokenStreamWriter
    rng = np.random.default_rng(seed)
    with TokenStreamWriter(folder, vocab_size=vocab, shard_tokens=4_000_000) as w:
        done = 0
        while done < n_tokens:
            n = int(rng.integers(64, 3000))
            w.add_document(rng.integers(1, vocab, n, dtype=np.int64))
            done += n


def model_for(vocab: int, seq: int, dim: int, layers: int, device: Any) -> Any:
    import torch
    from torch import nn

    class TinyGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(seq, dim)
            layer = nn.TransformerEncoderLayer(dim, max(1, dim // 64), 4 * dim, dropout=0.0, batch_first=True,
                                               norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(dim, vocab, bias=False)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

        def forward(self, x: Any, pos: Any = None) -> Any:
            t = x.shape[1]
            p = torch.arange(t, device=x.device) if pos is None else pos
            h = self.tok(x) + self.pos(p)
            h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
            return self.head(h)
    return TinyGPT().to(device)


def run(feed: str, data: str, args: argparse.Namespace, batch: int, device: Any) -> dict[str, Any]:
    import torch

    from zerobatch.adapters.torch import Loader, PackedDocuments, TokenWindows
    from zerobatch.readers.tokstream import TokenStreamReader
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = model_for(args.vocab, args.seq_len, args.dim, args.layers, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-100)
    loader: Any = None
    if feed == "ring":
        loader = Loader(TokenWindows(data, args.seq_len), batch_size=batch, seed=1, device=device)
        batches: Any = iter(loader)
    elif feed == "pin":
        loader = Loader(TokenWindows(data, args.seq_len), batch_size=batch, seed=1)
        batches = ((x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True))
                   if cuda else (x, y) for x, y in loader)
    elif feed == "packed":
        loader = Loader(PackedDocuments(data, args.seq_len), batch_size=batch, seed=1, device=device)
        batches = iter(loader)
    else:
        reader = TokenStreamReader(data)
        n = (reader.num_tokens - 1) // args.seq_len
        seq = args.seq_len

        class Windows(torch.utils.data.Dataset):
            def __len__(self) -> int:
                return n

            def __getitem__(self, i: int) -> Any:
                w = torch.from_numpy(reader.windows(np.array([i * seq]), seq + 1)[0].astype(np.int64))
                return w[:-1], w[1:]
        dl = torch.utils.data.DataLoader(Windows(), batch_size=batch, shuffle=True, num_workers=args.workers,
                                         pin_memory=cuda, drop_last=True,
                                         generator=torch.Generator().manual_seed(1))
        batches = ((x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in dl)
    stalls, steps_s, gpu_ms = [], [], []
    nbytes = 0
    total = args.warmup + args.steps
    t_prev = time.perf_counter()
    gpu_stalls: list[float] = []
    pinned = None
    for k in range(total):
        before = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            before.record()               # the step before synchronized: the GPU is idle from here
        t0 = time.perf_counter()
        b = next(batches)
        t1 = time.perf_counter()
        if isinstance(b, dict):
            x, y = b["input_ids"], b["labels"]
            pos = b.get("position_ids")
            pos = None if pos is None else pos[0] if pos.dim() > 1 else pos
        else:
            (x, y), pos = b, None
        if k >= args.warmup:
            nbytes += sum(int(t.numel() * t.element_size()) for t in (b.values() if isinstance(b, dict) else b)
                          if isinstance(t, torch.Tensor))
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        end = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            start.record()
        logits = model(x, pos)
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1).long())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            end.record()
        loss_value = float(loss.detach())            # one synchronization a step, as a loop logging its loss
        t2 = time.perf_counter()
        if k == args.warmup and loader is not None:
            pinned = loader.metrics().get("pinned_buffers")
            loader.reset_metrics()
        if k >= args.warmup:
            stalls.append(t1 - t0)
            steps_s.append(t2 - t_prev)
            if cuda:
                gpu_ms.append(start.elapsed_time(end))
                # the GPU's own stall: from before next() to the step's first kernel (the host's
                # wait, the stream's wait on the copy event, a copy on the compute stream)
                gpu_stalls.append(before.elapsed_time(start) / 1e3)
        t_prev = t2
    assert np.isfinite(loss_value)
    m = loader.metrics() if loader is not None else {}
    stalls_a, steps_a = np.array(stalls), np.array(steps_s)
    out = {"feed": feed, "batch": batch, "steps": args.steps, "step_ms": 1e3 * float(np.median(steps_a)),
           "gpu_step_ms": float(np.median(gpu_ms)) if gpu_ms else None,
           "stall_share": float(stalls_a.sum() / steps_a.sum()),
           "gpu_stall_share": float(sum(gpu_stalls) / steps_a.sum()) if gpu_stalls else None,
           "gpu_stall_p99_ms": 1e3 * float(np.percentile(gpu_stalls, 99)) if gpu_stalls else None,
           "stall_p50_ms": 1e3 * float(np.percentile(stalls_a, 50)),
           "stall_p99_ms": 1e3 * float(np.percentile(stalls_a, 99)),
           "stall_max_ms": 1e3 * float(stalls_a.max()),
           "bytes_per_step": nbytes // args.steps,
           "h2d_ms_per_copy": (1e3 * m["h2d_seconds"] / m["h2d_copies"]) if m.get("h2d_copies") else None,
           "h2d_bytes_per_step": (m["h2d_bytes"] / max(1, m["steps"])) if m.get("h2d_copies") else None,
           # the share of the copy time the GPU did not wait for beyond the host's own wait
           "h2d_overlap": (max(0.0, 1.0 - max(0.0, sum(gpu_stalls) - float(stalls_a.sum())) / m["h2d_seconds"])
                           if m.get("h2d_seconds") and gpu_stalls else None),
           "pinned_buffers": pinned}
    if loader is not None:
        loader.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch-sizes", default="8,32,64")
    ap.add_argument("--feeds", default="ring,pin,dataloader,packed")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--workers", type=int, default=4, help="the DataLoader baseline's worker processes")
    ap.add_argument("--tokens", type=int, default=40_000_000)
    ap.add_argument("--data", default=None, help="a TOKSTREAM folder (default: one made in a temporary folder)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here (torch.cuda.is_available() is False); --device cpu checks the "
                 "script only")
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or os.path.join(tmp, "data")
        if args.data is None:
            t = time.perf_counter()
            make_dataset(data, args.tokens, args.vocab)
            print(f"dataset: {args.tokens:,} tokens in {time.perf_counter() - t:.1f} s", flush=True)
        rows = []
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            for feed in args.feeds.split(","):
                r = run(feed, data, args, batch, device)
                rows.append(r)
                h2d = "" if r["h2d_ms_per_copy"] is None else (f"  h2d {r['h2d_ms_per_copy']:.3f} ms/copy, "
                                                               f"{100 * r['h2d_overlap']:.0f}% hidden")
                gpu = "" if r["gpu_stall_share"] is None else (f"  GPU stall {100 * r['gpu_stall_share']:.2f}% "
                                                                f"(p99 {r['gpu_stall_p99_ms']:.3f} ms)")
                print(f"batch {batch:3d} {feed:10s} step {r['step_ms']:8.2f} ms  stall {100 * r['stall_share']:6.2f}%{gpu}  "
                      f"p50 {r['stall_p50_ms']:.3f} ms  p99 {r['stall_p99_ms']:.3f} ms  max {r['stall_max_ms']:.2f} ms  "
                      f"{r['bytes_per_step'] / 1e6:.2f} MB/step{h2d}", flush=True)
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "rows": rows, "args": vars(args)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
