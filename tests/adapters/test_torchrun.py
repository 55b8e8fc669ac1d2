"""A real distributed run: torchrun with gloo trains a tiny causal LM on a zerobatch dataset,
is killed, resumes on 1 process and then on 2; the logged sample ids prove that no sample was
skipped or repeated, that the ranks never overlapped, and that the order is the one an
uninterrupted run reads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from zbtest import REPO, ddp_logged_steps, token_stream, uninterrupted_order

from zerobatch.adapters.torch import Loader, TokenWindows

SEQ, G, STEPS, SEED = 16, 8, 300, 1234


def torchrun(nproc: int, data: str, ckpt: str, logs: str, die_at: int | None,
             env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / "examples" / "ddp_train.py"), data, ckpt, "--steps", str(STEPS), "--seq-len", str(SEQ),
            "--global-batch", str(G), "--vocab", "12000", "--ckpt-every", "50", "--log-every", "25", "--seed",
            str(SEED), "--ids-log", logs, "--resume"]
    if die_at is not None:
        argv += ["--die-at", str(die_at)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHELASTIC_ERROR_FILE": os.path.join(logs, "error.json"),
           **(env_extra or {})}
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)


def remote_copy(folder: str, tmp_path: Path, endpoint: str) -> tuple[str, dict[str, str]]:
    """``folder`` uploaded to moto's S3 server on 127.0.0.1 (``endpoint``): its URL and the
    environment that reaches it (credentials, endpoint, a cache folder)."""
    from s3kit import new_bucket, options, upload
    url = f"s3://{new_bucket(endpoint)}/data"
    upload(Path(folder), url, options(endpoint))
    return url, {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": endpoint, "ZEROBATCH_CACHE_DIR": str(tmp_path / "cache")}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("where", ["local", "s3"])
def test_killed_and_resumed_on_other_world_sizes(tmp_path, where, request):
    data, _ = token_stream(tmp_path / "data", n_tokens=12000)
    env_extra = None
    where_read = data
    if where == "s3":
        # every rank reads the dataset from the S3 server; the reference order below reads
        # the local copy: one build id, one order
        where_read, env_extra = remote_copy(data, tmp_path, request.getfixturevalue("s3_endpoint"))
    ckpt, logs = str(tmp_path / "ckpt"), str(tmp_path / "logs")
    runs = [(2, 130), (1, 210), (2, None)]
    for nproc, die_at in runs:
        r = torchrun(nproc, where_read, ckpt, logs, die_at, env_extra)
        if die_at is None:
            assert r.returncode == 0, r.stderr[-3000:]
        else:
            assert r.returncode != 0 and f"step {die_at // 25 * 25} " in r.stdout, (r.stdout, r.stderr[-3000:])
    out = r.stdout
    assert "resumed at step 200 on 2 process(es)" in out and "step 300" in out, out

    # the logs of each run, cut at the checkpoint the next run resumed from
    starts, steps = ddp_logged_steps(logs, STEPS)
    assert starts == [0, 100, 200]
    assert sorted(steps) == list(range(1, STEPS + 1))

    # ranks never overlapped, every step is a whole global batch
    for s, parts in steps.items():
        flat = [i for p in parts for i in p]
        assert len(flat) == len(set(flat)) == G, s

    # the order of an uninterrupted run, and nothing skipped or repeated within an epoch
    per_epoch = len(Loader(TokenWindows(data, SEQ), global_batch_size=G, seed=SEED, rank=0, world_size=1))
    got = [sorted(i for p in steps[s] for i in p) for s in range(1, STEPS + 1)]
    assert got == uninterrupted_order(data, SEQ, G, SEED, STEPS)
    first_epoch = [i for s in got[:per_epoch] for i in s]
    assert len(first_epoch) == len(set(first_epoch)) == per_epoch * G


def example(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``python examples/ddp_train.py ARGS`` on one process, its default folders in ``tmp_path``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, str(REPO / "examples" / "ddp_train.py"), *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


@pytest.mark.timeout(300)
def test_example_run_as_the_docs_say_prints_checkpoints_and_resumes(tmp_path):
    import re

    import torch

    run = tmp_path / "zerobatch-ddp-example"
    r = example(tmp_path, "--steps", "20")
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [(int(m[1]), float(m[2]), m[3]) for m in
             re.finditer(r"^step (\d+) epoch 0 loss (\d+\.\d+) \(([\d,]+) tokens/s\)$", r.stdout, re.M)]
    assert [s for s, _, _ in steps] == list(range(2, 21, 2)), r.stdout
    assert all(int(rate.replace(",", "")) > 0 for _, _, rate in steps)
    assert f"checkpoint {run / 'ckpt.pt'}: step 20, loader at epoch 0 after 160 of" in r.stdout
    assert "--steps 40 --resume" in r.stdout
    ckpt = torch.load(run / "ckpt.pt", weights_only=False)
    assert ckpt["step"] == 20 and set(ckpt) == {"model", "optim", "loader", "step", "run_card"}
    assert ckpt["loader"]["consumed"] == 160 and ckpt["loader"]["source"]["seq_len"] == 32

    # --resume continues at the checkpoint, with a checkpoint every --ckpt-every steps
    r = example(tmp_path, "--steps", "30", "--resume", "--ckpt-every", "5", "--log-every", "5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed at step 20 on 1 process(es), epoch 0" in r.stdout
    assert re.findall(r"^step (\d+) ", r.stdout, re.M) == ["25", "30"]
    assert re.findall(r"checkpoint .*: step (\d+),", r.stdout) == ["25", "30"]
    ckpt = torch.load(run / "ckpt.pt", weights_only=False)
    # the loader stands where an uninterrupted 30-step run stands
    ref = Loader(TokenWindows(str(run / "demo-data"), 32), global_batch_size=8, seed=1234, rank=0,
                 world_size=1)
    it = iter(ref)
    for _ in range(30):
        next(it)
    assert ckpt["step"] == 30 and ckpt["loader"] == ref.state_dict()
    ref.close()

    # a resumed run at its end has nothing to do; without --resume a run starts over
    r = example(tmp_path, "--steps", "30", "--resume")
    assert r.returncode == 0 and "nothing to do: the checkpoint is at step 30" in r.stdout, r.stdout
    r = example(tmp_path, "--steps", "2")
    assert r.returncode == 0 and "starting at step 0" in r.stdout and "pass --resume" in r.stdout, r.stdout
    assert torch.load(run / "ckpt.pt", weights_only=False)["step"] == 2
