#!/usr/bin/env python3
"""How fast ``zerobatch trace`` answers for a run over a trillion tokens, from cold processes.

    python tools/trace_scale.py [--tokens 1.1e12] [--documents 134217728] [--json PATH]

Builds (in a temporary folder, sparse files: no disk used for the tokens) TOKSTREAM datasets
of ``--tokens`` tokens in ``--documents`` documents (equal lengths; the document indexes are
real files, 8 bytes a document: 1 GiB for the default 2**27 documents of 8,192 tokens), and
run cards as a training job would save them:

- ``windows``: next-token windows of 2048 tokens, global batch 1024 (2 Mi tokens a step) on 64
  ranks, a Feistel shuffle; the card's state at the end of the first epoch;
- ``mixture``: two such datasets (the second half the size) mixed 70/30, with a weight
  schedule that changes at a quarter of the run; the card's state at the step where the run
  has read ``--tokens`` tokens.

Then each query runs in a fresh ``python -m zerobatch.cli trace`` process (imports, opening
the dataset and the answer: what a user waits for), timed with the wall clock (the best of 3
processes):

- ``--step N`` near the end of the run (every rank, every row: the documents, token ranges,
  no token read);
- ``--document D``: every step that saw it, up to the card's state (the inverse);
- ``--documents FILE`` of 100,000 random documents (a contamination list).

What exclusions cost a loop: rank 0 of 64 reading 200 steps with and without ``--many``
documents excluded.

And the packed rows' bound: ``--packed-documents`` documents packed into rows of 2048 (the plan
is made when the source opens, over the whole dataset; the inverse of a document then costs a
binary search of the pieces), timed the same way.

Prints a table; ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from zerobatch.core import xxh3_64
from zerobatch.formats import tokstream as T
from zerobatch.writers.tokstream import assemble


def sparse_shard(folder: str, name: str, num_tokens: int, num_docs: int) -> None:
    """A shard of ``num_tokens`` zero tokens (a sparse file) in ``num_docs`` documents of equal
    length, with the digests a writer would have recorded."""
    d = os.path.join(folder, name)
    os.makedirs(d)
    build_id = os.urandom(16)
    size = 2 * num_tokens
    assert size % T.CHECKSUM_CHUNK == 0 and num_tokens % num_docs == 0
    with open(os.path.join(d, "tokens.bin"), "wb") as f:
        f.truncate(size)
        f.seek(size)
        f.write(T.pack_trailer(build_id, T.FILE_KINDS["tokens.bin"]))
    index = (np.arange(num_docs + 1, dtype="<u8") * (num_tokens // num_docs)).tobytes()
    with open(os.path.join(d, "documents.index"), "wb") as f:
        f.write(index)
        f.write(T.pack_trailer(build_id, T.FILE_KINDS["documents.index"]))
    zero = xxh3_64(bytes(T.CHECKSUM_CHUNK))
    tok_digests = np.full(size // T.CHECKSUM_CHUNK, zero, dtype="<u8")
    idx_digests = np.array([xxh3_64(index[i:i + T.CHECKSUM_CHUNK]) for i in range(0, len(index), T.CHECKSUM_CHUNK)],
                           dtype="<u8")
    sums = np.concatenate([tok_digests, idx_digests]).tobytes()
    assert len(sums) <= T.CHECKSUM_CHUNK
    top = np.array([xxh3_64(sums)], dtype="<u8")
    with open(os.path.join(d, "checksums.bin"), "wb") as f:
        f.write(sums)
        f.write(top.tobytes())
        f.write(T.pack_trailer(build_id, T.FILE_KINDS["checksums.bin"]))

    def hexsum(digests: np.ndarray) -> str:
        return f"{xxh3_64(np.asarray(digests, dtype='<u8').tobytes()):016x}"

    entry = T.ShardEntry(name, build_id.hex(), num_tokens, num_docs, 0, {
        "tokens.bin": T.FileEntry(size, hexsum(tok_digests)),
        "documents.index": T.FileEntry(len(index), hexsum(idx_digests)),
        "checksums.bin": T.FileEntry(len(sums) + top.nbytes, hexsum(top))})
    record = {"format": T.FORMAT_NAME, "version": 2, "token_dtype": "uint16", "vocab_size": 50257,
              "metadata": False, "eod_token": None, "codec": None, "checksum_block": T.CHECKSUM_CHUNK,
              "shard": entry.to_dict()}
    with open(os.path.join(d, "shard.json"), "w") as f:
        json.dump(record, f)


def sparse_dataset(folder: str, tokens: int, documents: int) -> str:
    """``tokens`` (rounded to whole shards of a power of two) in ``documents`` documents (kept
    when ``folder`` holds one already)."""
    if os.path.exists(os.path.join(folder, "manifest.json")):
        return folder
    # shards of at most 2**22 documents (a shard's index holds under 2**23 entries)
    shard = 1 << max(23, int(tokens).bit_length() - 1)
    while shard > 1 << 23 and (tokens // shard < 4 or documents * shard // tokens > 1 << 22):
        shard >>= 1
    shards = max(1, round(tokens / shard))
    per = max(1, documents // shards)
    while shard % per:
        per -= 1
    for k in range(shards):
        sparse_shard(folder, f"s{k:04d}", shard, per)
    assemble(folder)
    return folder


REPEAT = 3


def timed(argv: list[str]) -> tuple[float, str]:
    """The best wall time of :data:`REPEAT` fresh processes (a shared machine's noise only adds)."""
    best, out = float("inf"), ""
    for _ in range(REPEAT):
        t0 = time.perf_counter()
        r = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        wall = time.perf_counter() - t0
        if r.returncode:
            raise SystemExit(f"{' '.join(argv)} failed: {r.stderr}")
        best, out = min(best, wall), r.stdout
    return best, out


def cli(card: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "zerobatch.cli", "trace", card, *args, "--json"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=1.1e12)
    ap.add_argument("--documents", type=int, default=1 << 27)
    ap.add_argument("--packed-documents", type=int, default=1 << 20)
    ap.add_argument("--many", type=int, default=100_000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", default=None, help="build the datasets in this folder and keep them (reused when there)")
    args = ap.parse_args()

    from zerobatch.adapters._loader import BaseLoader
    from zerobatch.adapters.sources import Mixture, PackedDocuments, TokenWindows
    from zerobatch.samplers import WeightSchedule

    root = args.keep or tempfile.mkdtemp(prefix="zb-trace-scale-")
    results: dict[str, object] = {}
    try:
        a = sparse_dataset(os.path.join(root, "a"), int(args.tokens), args.documents)
        b = sparse_dataset(os.path.join(root, "b"), int(args.tokens) // 2, args.documents // 2)
        if args.keep:
            print(f"datasets in {root}: a (windows, mixture 'web'), b (mixture 'code'), p (packed)")
        cards = {}
        ld = BaseLoader(TokenWindows(a, 2048), global_batch_size=1024, rank=0, world_size=64, num_threads=0, seed=7)
        steps = len(ld)
        state = ld.schedule.advanced(steps - 1)
        cards["windows"] = (ld.describe(state), steps - 1, ld.source.reader.num_tokens, ld.source.reader.num_documents)
        ld.close()
        mix_steps = int(args.tokens) // (1024 * 2049)
        mix = Mixture([("web", TokenWindows(a, 2048), 0.7), ("code", TokenWindows(b, 2048), 0.3)], seed=3,
                      weight_schedule=WeightSchedule([(0, {"web": 0.7, "code": 0.3}),
                                                      (mix_steps // 4, {"web": 0.5, "code": 0.5})]))
        ld = BaseLoader(mix, global_batch_size=1024, rank=0, world_size=64, num_threads=0)
        t0 = time.perf_counter()
        state = ld.schedule.advanced(mix_steps)
        results["mixture_state_at_end_s"] = time.perf_counter() - t0
        cards["mixture"] = (ld.describe(state), mix_steps - 1, ld.source.sources[0].reader.num_tokens,
                            ld.source.sources[0].reader.num_documents)
        ld.close()
        rng = np.random.default_rng(0)
        rows = []
        for name, (card, last, num_tokens, num_docs) in cards.items():
            path = os.path.join(root, f"{name}.json")
            with open(path, "w") as f:
                json.dump(card, f)
            extra = ["--source", "web"] if name == "mixture" else []
            wall, out = timed(cli(path, "--step", str(last), "--no-metadata"))
            got = json.loads(out)
            rows.append((name, f"--step {last}", wall, f"{sum(len(r['rows']) for r in got['ranks'])} rows"))
            doc = int(rng.integers(num_docs))
            wall, out = timed(cli(path, "--document", str(doc), *extra))
            got = json.loads(out)
            rows.append((name, f"--document {doc}", wall, f"seen at {len(got[0]['seen'])} rows"))
            many = os.path.join(root, "many.txt")
            with open(many, "w") as f:
                f.write("\n".join(map(str, rng.choice(num_docs, args.many, replace=False).tolist())))
            wall, out = timed(cli(path, "--documents", many, *extra))
            got = json.loads(out)
            rows.append((name, f"--documents ({args.many:,})", wall,
                         f"{sum(len(o['seen']) for o in got):,} rows"))
            results[name] = {"tokens": num_tokens, "documents": num_docs, "steps": last + 1}
        # packed rows: the plan is made over the whole dataset when the source opens
        p = sparse_dataset(os.path.join(root, "p"), args.packed_documents * 4096, args.packed_documents)
        t0 = time.perf_counter()
        src = PackedDocuments(p, 2048, buffer=4096, layout="next-token")
        plan_s = time.perf_counter() - t0
        ld = BaseLoader(src, global_batch_size=64, num_threads=0)
        path = os.path.join(root, "packed.json")
        with open(path, "w") as f:
            json.dump(ld.describe(ld.schedule.advanced(len(ld) - 1)), f)
        wall, out = timed(cli(path, "--step", str(len(ld) - 2), "--no-metadata"))
        rows.append(("packed", f"--step {len(ld) - 2}", wall, f"plan of {src.reader.num_documents:,} documents "
                     f"in {plan_s:.2f} s in-process"))
        wall, out = timed(cli(path, "--document", "12345"))
        rows.append(("packed", "--document 12345", wall, f"seen at {len(json.loads(out)[0]['seen'])} rows"))
        ld.close()
        # what exclusions cost a training loop: rank 0 of 64 reading 200 steps of 16 windows,
        # with and without 100,000 documents excluded (every step's whole global batch is
        # checked against them)
        loop = {}
        for label in ("none", f"{args.many:,} documents"):
            ld = BaseLoader(TokenWindows(a, 2048), global_batch_size=1024, rank=0, world_size=64, num_threads=0,
                            seed=7)
            if label != "none":
                t0 = time.perf_counter()
                info = ld.exclude(rng.choice(ld.source.reader.num_documents, args.many, replace=False), from_step=0)
                loop["exclude_call_s"] = time.perf_counter() - t0
                loop["excluded_windows"] = info["items"]
            it = iter(ld)
            t0 = time.perf_counter()
            delivered = 0
            for _ in range(200):
                x, _y = next(it)
                delivered += x.shape[0]
            loop[label] = {"steps_per_s": 200 / (time.perf_counter() - t0), "rows": delivered}
            ld.close()
        results["exclusions"] = loop
        wall, _ = timed([sys.executable, "-c", "import zerobatch.cli.main, zerobatch.adapters.trace"])
        rows.append(("(imports alone)", "python -c 'import ...'", wall, ""))
        print(f"{'card':<16} {'query':<28} {'wall s':>8}  result")
        for name, q, wall, note in rows:
            print(f"{name:<16} {q:<28} {wall:8.3f}  {note}")
        for name, (card, last, num_tokens, num_docs) in cards.items():
            print(f"{name}: {num_tokens:.3e} tokens, {num_docs:,} documents, {last + 1:,} steps of 1024 x 2048 "
                  f"on 64 ranks")
        print(f"mixture state at the last step (compiled walk of the picks): {results['mixture_state_at_end_s']:.2f} s")
        print(f"exclusions: loader.exclude of {args.many:,} documents ({loop['excluded_windows']:,} windows) took "
              f"{loop['exclude_call_s']:.2f} s; rank 0 of 64, 200 steps: {loop['none']['steps_per_s']:.0f} steps/s "
              f"without, {loop[f'{args.many:,} documents']['steps_per_s']:.0f} steps/s with "
              f"({loop[f'{args.many:,} documents']['rows']} of {loop['none']['rows']} rows delivered)")
        results["rows"] = [{"card": n, "query": q, "wall_s": w, "note": x} for n, q, w, x in rows]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
