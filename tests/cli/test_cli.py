"""The zerobatch command: inspect, verify, bench."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "v1" / "llmbatch"


def zb(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zerobatch.cli", *args], capture_output=True, text=True, timeout=300)


def test_inspect_prints_header_and_sizes():
    r = zb("inspect", str(FIXTURES / "zerobatch_3x5_seed9.batch"))
    assert r.returncode == 0, r.stderr
    assert "batch_size          3" in r.stdout and "num_batches         6" in r.stdout
    assert "padded_batch_bytes  4096 (4036 padding)" in r.stdout and "XXH3-64 per batch" in r.stdout
    r = zb("inspect", "--json", str(FIXTURES / "seed_layout_2x4.batch"))
    d = json.loads(r.stdout)
    assert d["format"] == "LLMBATCH" and d["num_batches"] == 3 and d["has_extension"] is False


def test_verify_ok_and_faults(tmp_path):
    r = zb("verify", str(FIXTURES / "zerobatch_3x5_seed9.batch"))
    assert r.returncode == 0 and "OK: 6 batches" in r.stdout, r.stderr
    r = zb("verify", str(FIXTURES / "seed_layout_2x4.batch"))
    assert r.returncode == 0 and "no checksums" in r.stdout
    data = bytearray((FIXTURES / "zerobatch_3x5_seed9.batch").read_bytes())
    data[4096 + 2 * 4096 + 7] ^= 1
    bad = tmp_path / "bad.batch"
    bad.write_bytes(bytes(data))
    r = zb("verify", str(bad))
    assert r.returncode == 1 and "FAULT: 1 batches do not match their checksums (first: 2)" in r.stderr
    data[4096 + 2 * 4096 + 7] ^= 1
    data[4096 + 4096 - 1] = 9  # padding: caught by the slot checksum too
    bad.write_bytes(bytes(data))
    r = zb("verify", str(bad))
    assert r.returncode == 1 and "padding" in r.stderr
    bad.write_bytes(bytes(data[:5000]))
    r = zb("verify", str(bad))
    assert r.returncode == 1 and "FAULT:" in r.stderr and "num_batches" in r.stderr
    (tmp_path / "x.npy").write_bytes(b"\x93NUMPY" + bytes(100))
    r = zb("inspect", str(tmp_path / "x.npy"))
    assert r.returncode == 1 and "not a zerobatch file" in r.stderr
    r = zb("verify", str(tmp_path / "missing.batch"))
    assert r.returncode == 1 and "no such file" in r.stderr


def test_bench_runs_the_main_job(tmp_path):
    keep = tmp_path / "sample.batch"
    r = zb("bench", "--records", "4096", "--epochs", "2", "--path", str(keep))
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "epoch 1: 128 batches" in r.stdout and "M tokens/s" in r.stdout
    assert keep.exists() and zb("verify", str(keep)).returncode == 0


def test_usage_errors_exit_2():
    assert zb().returncode == 2
    assert zb("inspect").returncode == 2


def test_every_command_has_a_description_and_an_example():
    from zerobatch.cli.main import COMMAND_HELP, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMAND_HELP)
    for name, p in sub.choices.items():
        text = p.format_help()
        assert "example:\n  zerobatch " + name in text and COMMAND_HELP[name][0][:30] in text.replace("\n", " ")
    to = next(a for a in sub.choices["convert"]._actions if a.dest == "to")
    assert "megatron" in to.help and "tokstream" in to.help
