"""The provenance of a real distributed run: examples/ddp_train.py under torchrun (2 processes,
gloo), resumed on 1, logs the windows every rank trained on; ``zerobatch trace`` on the run
card its checkpoint wrote reproduces every logged step, and the inverse of a sample of
documents equals what the log says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from zbtest import REPO, token_stream

SEQ, G, SEED = 16, 8, 7


def torchrun(nproc: int, data: str, ckpt: str, logs: str, steps: int) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / "examples" / "ddp_train.py"), data, ckpt, "--steps", str(steps), "--seq-len", str(SEQ),
            "--global-batch", str(G), "--vocab", "12000", "--ckpt-every", "20", "--seed", str(SEED),
            "--ids-log", logs, "--resume"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHELASTIC_ERROR_FILE": os.path.join(logs, "error.json")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)


def trace_cli(*args: str) -> object:
    r = subprocess.run([sys.executable, "-m", "zerobatch.cli", "trace", *args, "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.timeout(900)
def test_trace_of_a_torchrun_checkpoint_reproduces_the_logged_steps(tmp_path):
    data, docs = token_stream(tmp_path / "data", n_tokens=6000)
    ckpt, logs = str(tmp_path / "ckpt"), str(tmp_path / "logs")
    for nproc, steps in ((2, 40), (1, 70)):          # 2 processes, then resumed on 1 (epochs of 46 steps)
        r = torchrun(nproc, data, ckpt, logs, steps)
        assert r.returncode == 0, r.stderr[-3000:]
    # the log: (loader step, rank) -> the windows of its rows, in row order
    logged: dict[tuple[int, int], list[int]] = {}
    for f in sorted(Path(logs).glob("start*.jsonl")):
        rank = int(f.stem.rsplit("rank", 1)[1])
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            logged[(rec["step"] - 1, rank)] = rec["ids"]       # the loop counts from 1
    assert len(logged) == 40 * 2 + 30 * 1
    card = json.loads((Path(ckpt) / "zerobatch_run_card.json").read_text())
    assert card["world_sizes"] == [[0, 2], [40, 1]]
    assert card["state"]["consumed"] % G == 0

    # forward: every logged step (a few as a user types it, from the checkpoint folder)
    from zerobatch.adapters.trace import Trace
    trace = Trace(ckpt)
    for step in range(70):
        out = trace_cli(ckpt, "--step", str(step), "--no-metadata") if step % 15 == 0 else trace.step(step)
        world = 2 if step < 40 else 1
        assert out["world_size"] == world
        for part in out["ranks"]:
            rows = part["rows"]
            assert [row["item"] for row in rows] == logged[(step, part["rank"])], step
            for row in rows:           # each row's tokens: its window, from the documents it crosses
                pieces = [np.arange(*p["tokens"]) for p in row["documents"]]
                assert np.array_equal(np.concatenate(pieces), row["item"] * SEQ + np.arange(SEQ + 1))

    # inverse: a sample of documents, against the log
    starts = np.cumsum([0] + [d.size for d in docs])
    seen: dict[int, set] = {}
    for (step, rank), ids in logged.items():
        for row, w in enumerate(ids):
            a, b = w * SEQ, w * SEQ + SEQ + 1
            for d in range(int(np.searchsorted(starts, a, side="right")) - 1,
                           int(np.searchsorted(starts, b - 1, side="right"))):
                seen.setdefault(d, set()).add((step, rank, row))
    sample = [int(d) for d in np.random.default_rng(0).choice(len(docs), 25, replace=False)]
    (tmp_path / "docs.txt").write_text("\n".join(map(str, sample)))
    out = trace_cli(ckpt, "--documents", str(tmp_path / "docs.txt"))
    assert [o["document"] for o in out] == sample
    for o in out:
        assert {(s["step"], s["rank"], s["row"]) for s in o["seen"]} == seen.get(o["document"], set()), o["document"]
