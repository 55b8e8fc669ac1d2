#!/usr/bin/env python3
"""Distributed preparation speed: zerobatch's convert tasks, its datatrove step and datatrove's
own DocumentTokenizer, tokenizing the same JSONL text with the same tokenizer.

    python tools/bench_prep.py [--mb 200] [--json PATH]

Input: the bundled public-domain text (zerobatch.cli.quickstart.bundled_text) repeated into
8 JSONL files of ``--mb`` MB in all, one document per paragraph; a byte-level BPE tokenizer of
8,192 tokens trained on the text once. Every run is a fresh process tree, timed from its start
to a finished dataset (the commit included), with ``TOKENIZERS_PARALLELISM=false`` and
``RAYON_NUM_THREADS=1`` so that a process is one core (2 processes on this 2-core machine):

- ``zerobatch convert`` in one process (``--workers 1``);
- ``zerobatch convert --task I --tasks 2`` in two processes at once, then ``zerobatch commit``;
- the datatrove step (``TokenStreamStep``) and datatrove's ``DocumentTokenizer`` (no document
  shuffle: the same work) under ``LocalPipelineExecutor`` with 1 task, and with 2 tasks on 2
  workers, both reading with datatrove's ``JsonlReader``.

Reported: tokens/s, the speed-up from 1 to 2 processes, and the peak resident memory of the
largest process of each run (each process's memory is bounded by a batch of documents, not by
the input: the same figure at ``--mb 50`` and ``--mb 200``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

ENV = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}


def make_input(root: str, mb: int) -> tuple[str, str, int]:
    from zerobatch.cli.quickstart import bundled_text, train_tokenizer
    text = bundled_text()
    tok = os.path.join(root, "tokenizer.json")
    with open(os.path.join(root, "t.txt"), "w") as f:
        f.write(text)
    train_tokenizer(os.path.join(root, "t.txt"), 8192, tok)
    paras = [p.strip() for p in text.split("\n\n") if p.strip()]
    lines = [json.dumps({"text": p}) + "\n" for p in paras]
    one = "".join(lines).encode()
    src = os.path.join(root, "jsonl")
    os.makedirs(src)
    per = mb * 1_000_000 // 8
    total = 0
    for k in range(8):
        with open(os.path.join(src, f"part-{k}.jsonl"), "wb") as f:
            n = 0
            while n < per:
                f.write(one)
                n += len(one)
            total += n
    return src, tok, total


RUNNERS = {
    "convert-1": "zerobatch convert, 1 process",
    "convert-tasks-2": "zerobatch convert --task I --tasks 2, 2 processes (+ commit)",
    "zb-datatrove-1": "zerobatch datatrove step, 1 task",
    "zb-datatrove-2": "zerobatch datatrove step, 2 tasks on 2 workers (+ commit)",
    "datatrove-1": "datatrove DocumentTokenizer, 1 task",
    "datatrove-2": "datatrove DocumentTokenizer, 2 tasks on 2 workers",
}


def run_one(name: str, src: str, tok: str, out: str) -> None:
    """One measurement, in this (fresh) process."""
    if name == "convert-1":
        from zerobatch.prepare.pipeline import convert
        convert(src, out, to="tokstream", tokenizer=tok, workers=1, quiet=True, log=lambda *_: None)
    elif name == "convert-tasks-2":
        procs = [subprocess.Popen([sys.executable, "-m", "zerobatch.cli", "convert", src, out, "--to", "tokstream",
                                   "--tokenizer", tok, "--task", str(i), "--tasks", "2", "--workers", "1", "-q"],
                                  stdout=subprocess.DEVNULL) for i in range(2)]
        if any(p.wait() for p in procs):
            raise SystemExit("a task failed")
        from zerobatch.prepare.tasks import commit
        commit(out, log=lambda *_: None)
    else:
        from datatrove.executor import LocalPipelineExecutor
        from datatrove.pipeline.readers import JsonlReader
        tasks = int(name[-1])
        if name.startswith("zb-"):
            from zerobatch.prepare.integrations.datatrove import TokenStreamStep
            step: Any = TokenStreamStep(out, tok)
        else:
            from datatrove.pipeline.tokens import DocumentTokenizer
            step = DocumentTokenizer(out, tok, eos_token="<|endoftext|>", shuffle_documents=False)
        LocalPipelineExecutor([JsonlReader(src), step], tasks=tasks, workers=tasks,
                              logging_dir=out + ".logs").run()
        if name.startswith("zb-"):
            from zerobatch.prepare.tasks import commit
            commit(out, log=lambda *_: None)


def _tree_rss(root: int) -> int:
    """The largest resident set among ``root`` and its descendants (from /proc)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier += kids
    peak = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/statm") as f:
                peak = max(peak, int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, IndexError):
            pass
    return peak


def tree_peak(proc: subprocess.Popen) -> int:
    """The largest resident set of any process of ``proc``'s tree (the pool workers of an
    executor included), sampled every 0.2 s until it ends."""
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.2)
    return peak


def count_tokens(name: str, out: str) -> int:
    if name.startswith("datatrove"):
        # uint16 ids (the 8,192-token vocabulary) in the .ds files
        return sum(os.path.getsize(os.path.join(out, f)) // 2 for f in os.listdir(out) if f.endswith(".ds"))
    from zerobatch.readers.tokstream import TokenStreamReader
    with TokenStreamReader(out) as r:
        return r.num_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--runs", default=",".join(RUNNERS))
    ap.add_argument("--json")
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        name, src, tok, out = a.one
        t0 = time.perf_counter()
        run_one(name, src, tok, out)
        dt = time.perf_counter() - t0
        peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                   resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024
        print(json.dumps({"seconds": dt, "peak_rss": peak}))
        return
    root = tempfile.mkdtemp(prefix="zb-bench-prep-")
    try:
        src, tok, nbytes = make_input(root, a.mb)
        print(f"input: {nbytes / 1e6:.0f} MB of JSONL in 8 files; tokenizer: byte-level BPE, 8,192 tokens; "
              f"{os.cpu_count()} cores; each process one core", flush=True)
        results: dict[str, Any] = {"input_bytes": nbytes}
        for name in a.runs.split(","):
            out = os.path.join(root, name)
            log_path = os.path.join(root, f"{name}.log")
            with open(log_path, "w+") as log:      # files, not pipes: the executors log a lot
                proc = subprocess.Popen([sys.executable, __file__, "--one", name, src, tok, out], stdout=log,
                                        stderr=subprocess.STDOUT, text=True, env={**os.environ, **ENV})
                worker_peak = tree_peak(proc)
                proc.wait()
                log.seek(0)
                lines = log.read().strip().splitlines()
            if proc.returncode:
                print(f"  {name}: failed: {lines[-1:]}", flush=True)
                continue
            res = json.loads(lines[-1])
            res["peak_rss"] = max(res["peak_rss"], worker_peak)
            res["tokens"] = count_tokens(name, out)
            res["tokens_per_s"] = res["tokens"] / res["seconds"]
            results[name] = res
            print(f"  {RUNNERS[name]:62s} {res['seconds']:7.1f} s  {res['tokens_per_s'] / 1e6:6.2f} M tokens/s  "
                  f"{res['tokens'] / 1e6:8.1f} M tokens  peak RSS {res['peak_rss'] / 2**20:6.0f} MiB", flush=True)
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out + ".logs", ignore_errors=True)
        for a1, a2, what in (("convert-1", "convert-tasks-2", "zerobatch convert"),
                             ("zb-datatrove-1", "zb-datatrove-2", "zerobatch datatrove step"),
                             ("datatrove-1", "datatrove-2", "datatrove DocumentTokenizer")):
            if a1 in results and a2 in results:
                print(f"{what}: 1 -> 2 processes {results[a2]['tokens_per_s'] / results[a1]['tokens_per_s']:.2f}x")
        if "convert-tasks-2" in results and "datatrove-2" in results:
            print(f"zerobatch convert tasks / datatrove DocumentTokenizer, 2 processes: "
                  f"{results['convert-tasks-2']['tokens_per_s'] / results['datatrove-2']['tokens_per_s']:.2f}x")
        if "zb-datatrove-2" in results and "datatrove-2" in results:
            print(f"zerobatch datatrove step / datatrove DocumentTokenizer, 2 tasks: "
                  f"{results['zb-datatrove-2']['tokens_per_s'] / results['datatrove-2']['tokens_per_s']:.2f}x")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
