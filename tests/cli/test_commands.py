"""``inspect``, ``verify``, ``head``, ``stats`` and ``bench`` on every format, through a
subprocess; ``verify`` names the faulty file and place; ``head`` and ``stats`` decode with a
tokenizer; the quickstart in its shortest configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zerobatch.writers.features import write_feature_matrix
from zerobatch.writers.llmchnk import write_chunk_file
from zerobatch.writers.tokstream import TokenStreamWriter
from zerobatch.writers.zrecord import ZRecordWriter


def zb(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zerobatch.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("formats")
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 900, rng.integers(5, 120)), 0).astype(np.uint32) for _ in range(300)]
    write_chunk_file(d / "docs.chunk", docs, seq_len=64, dtype="uint16")
    w = TokenStreamWriter(d / "docs.ts", vocab_size=1000, eod_token=0, shard_tokens=5000)
    for doc in docs:
        w.add_document(doc)
    w.close()
    with ZRecordWriter(d / "docs.zr", [{"name": "label", "dtype": "i64", "shape": []},
                                       {"name": "tokens", "dtype": "u16", "shape": None}]) as zw:
        for i, doc in enumerate(docs):
            zw.append({"label": np.int64(i), "tokens": doc.astype(np.uint16)})
    write_feature_matrix(d / "feat", {"a": rng.normal(size=(300, 4)), "b": rng.normal(3, 2, size=(200, 4))},
                         columns=None)
    return {"llmchnk": d / "docs.chunk", "tokstream": d / "docs.ts", "zrecord": d / "docs.zr",
            "features": d / "feat", "docs": docs}  # type: ignore[dict-item]


@pytest.mark.parametrize("kind", ["llmchnk", "tokstream", "zrecord", "features"])
def test_every_command_on_every_format(datasets, kind, tmp_path):
    path = str(datasets[kind])
    docs = datasets["docs"]
    r = zb("inspect", path)
    assert r.returncode == 0, r.stderr
    rows = dict(line.split(None, 1) for line in r.stdout.splitlines())
    want = {"llmchnk": {"num_records": "300", "seq_len": "64 (nominal)", "dtype": "uint16"},
            "tokstream": {"documents": "300", "vocab_size": "1000", "eod_token": "0", "dtype": "uint16"},
            "zrecord": {"records": "300", "fields": "label (i64, shape [], raw), tokens (u16, variable, raw)"},
            "features": {"rows": "500", "features": "4", "keys": "2", "dtype": "float32"}}[kind]
    assert {k: rows.get(k) for k in want} == want, r.stdout
    assert "XXH3-64" in rows["checksums"]
    d = json.loads(zb("inspect", "--json", path).stdout)
    assert d["format"] == kind.upper()
    r = zb("verify", path)
    assert r.returncode == 0 and ": OK: " in r.stdout, r.stderr
    r = zb("head", path, "-n", "2")
    assert r.returncode == 0, r.stderr
    if kind == "features":
        assert r.stdout.startswith("row 0: [") and "row 1: [" in r.stdout
    else:
        name = "document" if kind == "tokstream" else "record"
        first = docs[0]
        assert f"--- {name} 0 ({first.size} tokens)\n" + " ".join(map(str, first[:64].tolist())) in r.stdout
    png = tmp_path / "stats.png"
    r = zb("stats", path, "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if kind != "features":
        total = sum(d.size for d in docs)
        assert f"tokens: {total:,}" in r.stdout
        lengths = np.array([d.size for d in docs])
        assert f"mean {lengths.mean():,.1f}  min {lengths.min()}" in r.stdout, r.stdout
        assert f"{int(np.bincount(np.concatenate(docs))[0]):,}" in r.stdout      # id 0 (the eod) is listed
        r = zb("stats", path, "--eod", "0")
        assert f"documents (split at --eod) (tokens each): 300  mean {np.mean([d.size for d in docs]):,.1f}" \
            in r.stdout
    else:
        assert "key lengths (rows each): 2  mean 250.0" in r.stdout
    r = zb("bench", path, "--reads", "50", "--trials", "2", "--batch-size", "4", "--seq-len", "32")
    assert r.returncode == 0, r.stderr
    assert "throughput:" in r.stdout and "p99" in r.stdout and "p50" in r.stdout


def test_stats_eod_counts_an_unterminated_last_document(tmp_path):
    """--eod splits in reading order; tokens after the last end-of-document id are a document too."""
    docs = [np.array([5, 6, 0]), np.array([7, 0]), np.array([8, 9, 10, 11])]   # the last one has no eod
    w = TokenStreamWriter(tmp_path / "t.ts", vocab_size=100, eod_token=0, shard_tokens=4)
    for doc in docs:
        w.add_document(doc)
    w.close()
    r = zb("stats", str(tmp_path / "t.ts"), "--eod", "0")
    assert r.returncode == 0, r.stderr
    assert "documents (split at --eod) (tokens each): 3  mean 3.0  min 2" in r.stdout, r.stdout
    assert "max 4" in r.stdout, r.stdout


def test_verify_names_the_faulty_file_and_place(datasets, tmp_path):
    import shutil

    # LLMCHNK: one record's bytes changed
    data = bytearray(datasets["llmchnk"].read_bytes())
    data[32 + 8 * 301 + 10] ^= 0x40
    bad = tmp_path / "bad.chunk"
    bad.write_bytes(bytes(data))
    r = zb("verify", str(bad))
    assert r.returncode == 1 and "bad.chunk: FAULT: 1 records do not match their checksums (first: 0)" in r.stderr
    # TOKSTREAM: a byte of one shard's tokens
    ts = tmp_path / "ts"
    shutil.copytree(datasets["tokstream"], ts)
    shard = sorted(p for p in ts.iterdir() if p.is_dir())[1]
    tokens = bytearray((shard / "tokens.bin").read_bytes())
    tokens[7] ^= 1
    (shard / "tokens.bin").write_bytes(bytes(tokens))
    r = zb("verify", str(ts))
    assert r.returncode == 1 and f"{shard / 'tokens.bin'}" in r.stderr and "block 0" in r.stderr, r.stderr
    # ZRECORD: a record container's byte
    zr = tmp_path / "zr"
    shutil.copytree(datasets["zrecord"], zr)
    chunk = sorted((zr / "chunk").iterdir())[0]
    raw = bytearray(chunk.read_bytes())
    raw[40] ^= 1
    chunk.write_bytes(bytes(raw))
    r = zb("verify", str(zr))
    assert r.returncode == 1 and "FAULT:" in r.stderr and str(chunk.name) in r.stderr, r.stderr
    # feature matrix: a data byte
    ft = tmp_path / "ft"
    shutil.copytree(datasets["features"], ft)
    data_file = next(p for p in ft.iterdir() if p.suffix == ".bin")
    raw = bytearray(data_file.read_bytes())
    raw[100] ^= 1
    data_file.write_bytes(bytes(raw))
    r = zb("verify", str(ft))
    assert r.returncode == 1 and "FAULT:" in r.stderr and data_file.name in r.stderr, r.stderr
    # not a dataset, a missing path: one line each
    r = zb("verify", str(tmp_path))
    assert r.returncode == 1 and "not a zerobatch dataset folder" in r.stderr and "Traceback" not in r.stderr
    r = zb("inspect", str(tmp_path / "missing"))
    assert r.returncode == 1 and "no such file" in r.stderr and len(r.stderr.splitlines()) == 1


def test_head_decodes_with_a_tokenizer(tmp_path):
    r = zb("convert", "--help")
    assert "--tokenizer" in r.stdout
    from zerobatch.cli.quickstart import bundled_text, train_tokenizer

    txt = tmp_path / "t.txt"
    txt.write_text(bundled_text()[:20000])
    tok = train_tokenizer(str(txt), 400, str(tmp_path / "tok.json"))
    r = zb("convert", str(txt), str(tmp_path / "t.ts"), "--to", "tokstream", "--tokenizer", str(tmp_path / "tok.json"),
           "--split", "blank", "-q", "--workers", "1")
    assert r.returncode == 0, r.stderr
    r = zb("head", str(tmp_path / "t.ts"), "-n", "1", "--tokenizer", str(tmp_path / "tok.json"))
    assert "First Citizen:\nBefore we proceed any further, hear me speak.<|endoftext|>" in r.stdout, r.stdout
    r = zb("stats", str(tmp_path / "t.ts"), "--tokenizer", str(tmp_path / "tok.json"), "--top", "60")
    assert "'<|endoftext|>'" in r.stdout
    assert tok.get_vocab_size() == 400


def test_stats_shows_decoded_text(tmp_path):
    from zerobatch.cli.quickstart import bundled_text, train_tokenizer
    from zerobatch.prepare.pipeline import convert
    from zerobatch.prepare.tokenizer import load_tokenizer

    (tmp_path / "c.txt").write_text(bundled_text()[:20_000])
    train_tokenizer(str(tmp_path / "c.txt"), 300, str(tmp_path / "tok.json"))
    tok = load_tokenizer(str(tmp_path / "tok.json"))
    the = tok.encode_batch([" the"])[0]
    assert len(the) == 1 and tok.label(the[0]) == " the" and tok._piece(the[0]) == "Ġthe"
    src = tmp_path / "s.jsonl"
    src.write_text(json.dumps({"text": "the the the the the the and the"}) + "\n")
    convert(str(src), str(tmp_path / "s.ts"), to="tokstream", tokenizer=str(tmp_path / "tok.json"), workers=1,
            quiet=True, log=lambda s: None)
    r = zb("stats", str(tmp_path / "s.ts"), "--tokenizer", str(tmp_path / "tok.json"), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "' the'" in r.stdout and "Ġ" not in r.stdout, r.stdout


@pytest.mark.slow
def test_quickstart_shortest(tmp_path):
    r = zb("quickstart", "--steps", "12", "--workdir", str(tmp_path), "--seq-len", "32", "--batch-size", "4")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "[4/4] training" in out and "step   12  loss" in out and "M tokens/s" in out
    assert "  loader.metrics(): steps 12 | data " in out
    import re

    first, last = (float(x) for x in re.search(r"\n  loss ([0-9.]+) -> ([0-9.]+) \(uniform", out).groups())
    assert last < first
    assert (tmp_path / "corpus.batch").exists() and (tmp_path / "corpus.tokstream" / "manifest.json").exists()
    assert os.path.getsize(tmp_path / "tokenizer.json") > 1000
