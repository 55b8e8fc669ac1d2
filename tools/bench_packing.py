"""Packing: padding and split documents of zerobatch's planner (best-fit decreasing at several
look-ahead sizes, first-fit, concat) against OLMo-core's ``InstancePacker`` (best-fit
decreasing over all documents, as ``NumpyPackedFSLDataset``) and Grain's
``BestFitPackIterDataset`` / ``FirstFitPackIterDataset``, on the same document lengths; then
real tokens per second through the loader of packed rows against whole documents padded to
the row width (``TokenDocuments``), on the same dataset.

Also whole documents flat (no padding, ``cu_seqlens``) against slicing each document out of an
``np.memmap`` (``--only-flat`` runs that alone).

Document lengths: lognormal with a median of 600 tokens (sigma 1.1), at most 32,768. Documents
longer than a row are cut into row-sized fragments plus a rest for every packer alike (zerobatch
does so itself; OLMo-core's ``long_doc_strategy="fragment"`` and Grain's truncation would
otherwise differ), so every packer packs the same pieces.

    python tools/bench_packing.py --peers-python .venv-peers/bin/python    # grain, ai2-olmo-core

The peers run in their own interpreter (``--peer LENGTHS.npy``): they need torch (OLMo-core)
and JAX-free Grain, which the project's environment does not carry.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np


def lengths_of(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.exp(rng.normal(np.log(600), 1.1, n)).astype(np.int64).clip(1, 32_768)


def fragments(lengths: np.ndarray, cap: int) -> np.ndarray:
    """Every document cut into pieces of at most ``cap`` tokens (full ones first)."""
    full = lengths // cap
    rest = lengths - full * cap
    out = np.repeat(np.full(lengths.size, cap), full)
    return np.concatenate([out, rest[rest > 0]])


def peer(path: str, caps: list[int], grain_bins: list[int]) -> dict:
    lengths = np.load(path)
    result = {}
    for cap in caps:
        pieces = fragments(lengths, cap)
        split = int(np.count_nonzero(lengths > cap))
        try:
            from olmo_core.data.utils import InstancePacker
            t = time.perf_counter()
            ends = np.cumsum(pieces)
            idx = np.stack([ends - pieces, ends], axis=1).astype(np.uint64)
            instances, _, total = InstancePacker(cap).pack_documents(idx)
            rows = len(instances)
            result[f"OLMo-core InstancePacker (best-fit decreasing, all documents), {cap}"] = {
                "rows": rows, "padding": 1 - total / (rows * cap), "split": split, "seconds": time.perf_counter() - t}
        except ImportError as exc:
            result[f"OLMo-core, {cap}"] = {"error": str(exc)}
        try:
            import grain
            for name in ("BestFitPackIterDataset", "FirstFitPackIterDataset"):
                cls = getattr(grain.experimental, name)
                for bins in grain_bins:
                    t = time.perf_counter()
                    ds = grain.MapDataset.source([{"tokens": np.ones(int(k), np.int32)} for k in pieces]
                                                 ).to_iter_dataset()
                    packed = cls(ds, length_struct={"tokens": cap}, num_packing_bins=bins, shuffle_bins=False)
                    rows = real = 0
                    for ex in packed:
                        rows += 1
                        real += int(np.count_nonzero(ex["tokens_segment_ids"]))
                    result[f"Grain {name}, {bins} bins, {cap}"] = {
                        "rows": rows, "padding": 1 - real / (rows * cap), "split": split,
                        "seconds": time.perf_counter() - t}
        except ImportError as exc:
            result[f"Grain, {cap}"] = {"error": str(exc)}
    return result


def ours(lengths: np.ndarray, caps: list[int], buffers: list[int]) -> dict:
    from zerobatch.core import pack_plan
    result = {}
    for cap in caps:
        split = int(np.count_nonzero(lengths > cap))
        runs = [("best-fit", b) for b in buffers] + [("first-fit", buffers[len(buffers) // 2]), ("concat", 1)]
        for algorithm, buffer in runs:
            t = time.perf_counter()
            row_ptr, doc, _, _ = pack_plan(lengths, cap, buffer, algorithm)
            dt = time.perf_counter() - t
            rows = row_ptr.size - 1
            cut = int(np.count_nonzero(np.bincount(doc, minlength=lengths.size) > 1))
            label = f"zerobatch {algorithm}" + (f", buffer {buffer}" if algorithm != "concat" else "") + f", {cap}"
            result[label] = {"rows": rows, "padding": 1 - int(lengths.sum()) / (rows * cap),
                             "split": cut if algorithm == "concat" else split, "seconds": dt}
    return result


def loader_rate(seq_len: int, docs: int, batch: int, seconds: float) -> dict:
    """Real tokens/s of packed rows and of documents padded to the row width."""
    import torch  # noqa: F401 - the torch loader
    from zerobatch.adapters.torch import Loader, PackedDocuments, TokenDocuments
    from zerobatch.writers.tokstream import TokenStreamWriter
    lengths = lengths_of(docs, seed=1)
    tmp = tempfile.mkdtemp(prefix="zb-packing-")
    folder = os.path.join(tmp, "d")
    rng = np.random.default_rng(2)
    with TokenStreamWriter(folder, vocab_size=50_000, shard_tokens=1 << 24) as w:
        tokens = rng.integers(1, 50_000, int(lengths.sum()), dtype=np.int64)
        w.add_documents(tokens, lengths)
    out = {}
    t = time.perf_counter()
    packed = PackedDocuments(folder, seq_len, buffer=4096)
    out["plan seconds"] = time.perf_counter() - t
    longest = int(lengths.max())
    for name, src in (("packed rows (best-fit, buffer 4096)", packed),
                      (f"documents padded to {seq_len + 1}, longer ones cut (TokenDocuments)",
                       TokenDocuments(folder, seq_len + 1)),
                      (f"whole documents padded to the longest, {longest} (TokenDocuments)",
                       TokenDocuments(folder, longest))):
        real = steps = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for b in Loader(src, batch_size=batch, seed=steps, prefetch=8):
                real += int(b["attention_mask"].sum())
                steps += 1
                if time.perf_counter() - t0 >= seconds:
                    break
        dt = time.perf_counter() - t0
        width = src.seq_len if hasattr(src, "seq_len") else src.width - 1
        out[name] = {"steps": steps, "real tokens/s": real / dt, "real fraction": real / (steps * batch * width)}
    return out


def flat_rate(docs: int, batch_docs: int, budget: int, seconds: float) -> dict:
    """Real tokens/s of whole documents flat: zerobatch's FlatDocuments (a document count per
    step, and a token budget) against slicing each document out of an ``np.memmap`` of the
    same tokens and concatenating them (what a map-style ``Dataset.__getitem__`` returning
    ``mm[start:end]`` and a flattening collate do), in one process."""
    import torch
    from zerobatch.adapters.torch import FlatDocuments, Loader
    from zerobatch.writers.tokstream import TokenStreamWriter
    lengths = lengths_of(docs, seed=3)
    tmp = tempfile.mkdtemp(prefix="zb-flat-")
    rng = np.random.default_rng(4)
    tokens = rng.integers(1, 50_000, int(lengths.sum()), dtype=np.int64).astype(np.uint16)
    folder = os.path.join(tmp, "d")
    with TokenStreamWriter(folder, vocab_size=50_000, shard_tokens=1 << 24) as w:
        w.add_documents(tokens, lengths)
    flat_path = os.path.join(tmp, "tokens.bin")
    tokens.tofile(flat_path)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    out = {}
    mm = np.memmap(flat_path, dtype=np.uint16, mode="r")
    real = steps = 0
    order = np.random.default_rng(5).permutation(docs)
    t0 = time.perf_counter()
    at = 0
    while time.perf_counter() - t0 < seconds:
        idx = order[at:at + batch_docs]
        at = (at + batch_docs) % (docs - batch_docs)
        pieces = [torch.from_numpy(mm[starts[i]:ends[i]].astype(np.int64)) for i in idx.tolist()]
        x = torch.cat(pieces)[None, :]
        cu = torch.zeros(len(pieces) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor([p.numel() for p in pieces]), 0)
        real += x.numel()
        steps += 1
    out["np.memmap, a slice per document + torch.cat"] = {"steps": steps, "real tokens/s": real /
                                                          (time.perf_counter() - t0)}

    class Docs(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return docs

        def __getitem__(self, i: int) -> Any:
            return torch.from_numpy(mm[starts[i]:ends[i]].astype(np.int64))

    def flatten(batch: list) -> dict:
        cu = torch.zeros(len(batch) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor([p.numel() for p in batch]), 0)
        return {"input_ids": torch.cat(batch)[None, :], "cu_seqlens": cu}
    real = steps = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for b in torch.utils.data.DataLoader(Docs(), batch_size=batch_docs, shuffle=True, collate_fn=flatten):
            real += b["input_ids"].numel()
            steps += 1
            if time.perf_counter() - t0 >= seconds:
                break
    out["np.memmap Dataset + torch DataLoader (flattening collate)"] = {
        "steps": steps, "real tokens/s": real / (time.perf_counter() - t0)}

    def pad(batch: list) -> dict:
        x = torch.nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=0)
        mask = torch.arange(x.shape[1])[None, :] < torch.tensor([p.numel() for p in batch])[:, None]
        return {"input_ids": x, "attention_mask": mask}
    real = steps = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for b in torch.utils.data.DataLoader(Docs(), batch_size=batch_docs, shuffle=True, collate_fn=pad):
            real += int(b["attention_mask"].sum())
            steps += 1
            if time.perf_counter() - t0 >= seconds:
                break
    out["np.memmap Dataset + torch DataLoader (pad_sequence collate)"] = {
        "steps": steps, "real tokens/s": real / (time.perf_counter() - t0)}
    for name, src, bs in ((f"FlatDocuments, {batch_docs} documents per step", FlatDocuments(folder), batch_docs),
                          (f"FlatDocuments, token budget {budget}", FlatDocuments(folder, budget), 1)):
        real = steps = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for b in Loader(src, batch_size=bs, seed=steps):
                real += b["input_ids"].numel()
                steps += 1
                if time.perf_counter() - t0 >= seconds:
                    break
        out[name] = {"steps": steps, "real tokens/s": real / (time.perf_counter() - t0)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--seq-lens", default="2048,8192")
    ap.add_argument("--buffers", default="256,1024,4096,16384")
    ap.add_argument("--grain-bins", default="64,512")
    ap.add_argument("--peers-python", help="an interpreter with grain and ai2-olmo-core")
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--loader-docs", type=int, default=50_000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--flat-docs", type=int, default=32, help="documents per step of the flat comparison")
    ap.add_argument("--budget", type=int, default=32_768, help="tokens per step of the token-budget run")
    ap.add_argument("--only-flat", action="store_true", help="the flat-documents comparison alone")
    ap.add_argument("--json")
    a = ap.parse_args()
    caps = [int(x) for x in a.seq_lens.split(",")]
    bins = [int(x) for x in a.grain_bins.split(",")]
    if a.peer:
        print(json.dumps(peer(a.peer, caps, bins)))
        return 0
    flat = flat_rate(a.loader_docs, a.flat_docs, a.budget, a.seconds)
    print(f"whole documents flat ({a.loader_docs:,} documents, one process, {a.seconds:.0f} s each):")
    base = flat["np.memmap, a slice per document + torch.cat"]["real tokens/s"]
    for name, v in flat.items():
        print(f"  {name:<52} {v['real tokens/s'] / 1e6:8.2f} M tokens/s  {v['real tokens/s'] / base:5.2f}x "
              f"({v['steps']} steps)")
    if a.only_flat:
        return 0
    lengths = lengths_of(a.docs)
    print(f"{lengths.size:,} documents, {int(lengths.sum()):,} tokens, median {int(np.median(lengths))}, "
          f"mean {lengths.mean():.0f}, longest {int(lengths.max())}")
    results = ours(lengths, caps, [int(x) for x in a.buffers.split(",")])
    if a.peers_python:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "lengths.npy")
            np.save(path, lengths)
            r = subprocess.run([a.peers_python, __file__, "--peer", path, "--seq-lens", a.seq_lens,
                                "--grain-bins", a.grain_bins], capture_output=True, text=True)
            if r.returncode:
                print(r.stderr, file=sys.stderr)
            else:
                results.update(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"{'packer':<78} {'rows':>9} {'padding':>9} {'split docs':>10} {'time':>8}")
    for name, v in results.items():
        if "error" in v:
            print(f"{name:<78} {v['error']}")
            continue
        print(f"{name:<78} {v['rows']:>9,} {100 * v['padding']:>8.3f}% {v['split']:>10,} {v['seconds']:>7.2f}s")
    rate = loader_rate(caps[0], a.loader_docs, a.batch, a.seconds)
    print(f"loader, seq_len {caps[0]}, batch {a.batch} ({a.loader_docs:,} documents; plan {rate['plan seconds']:.2f} s):")
    for name, v in rate.items():
        if isinstance(v, dict):
            print(f"  {name:<45} {v['real tokens/s'] / 1e6:8.2f} M real tokens/s  ({100 * v['real fraction']:.1f} % "
                  f"of the batch real, {v['steps']} steps)")
    keys = [k for k in rate if isinstance(rate[k], dict)]
    for k in keys[1:]:
        print(f"packed / {k}: {rate[keys[0]]['real tokens/s'] / rate[k]['real tokens/s']:.2f}x real tokens/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"packing": results, "loader": rate, "flat": flat}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
