"""``zerobatch convert`` from every source kind into every target, driven through a
subprocess, with the converted tokens compared to the source; an interrupted conversion
resumed; every error path one line and a non-zero exit."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
tokenizers = pytest.importorskip("tokenizers")

from zerobatch.cli.quickstart import bundled_text, train_tokenizer  # noqa: E402
from zerobatch.readers.llmbatch import BatchFileReader  # noqa: E402
from zerobatch.readers.llmchnk import LLMChunkReader  # noqa: E402
from zerobatch.readers.tokstream import TokenStreamReader  # noqa: E402
from zerobatch.readers.zrecord import ZRecordStore  # noqa: E402


def zb(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zerobatch.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def one_line_error(r: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The process failed with ``code`` and said so in one line, without a traceback."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "%|" not in ln]   # progress bars aside
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("corpus")
    text = bundled_text()[:60_000]
    docs = [p for p in text.split("\n\n") if p.strip()]
    txt = d / "plays.txt"
    txt.write_text(text)
    tok_path = d / "tokenizer.json"
    tok = train_tokenizer(str(txt), 512, str(tok_path))
    eod = tok.token_to_id("<|endoftext|>")
    return {"dir": d, "text": text, "docs": docs, "txt": txt, "tok": tok, "tok_path": str(tok_path), "eod": eod}


def expected_docs(c: dict, docs: list[str]) -> list[list[int]]:
    return [c["tok"].encode(t, add_special_tokens=False).ids + [c["eod"]] for t in docs]


def stream_docs(path: Path) -> list[list[int]]:
    with TokenStreamReader(path) as r:
        return [r.document(i).tolist() for i in range(r.num_documents)]


def test_text_sources_tokenize_to_the_same_documents(corpus, tmp_path):
    c = corpus
    docs = c["docs"][:300]
    want = expected_docs(c, docs)
    # JSONL, Parquet (two row groups), a Hugging Face save_to_disk folder (Arrow stream files)
    jl = tmp_path / "docs.jsonl"
    jl.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(docs)))
    pqf = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": docs}), pqf, row_group_size=128)
    hf = tmp_path / "hf"
    hf.mkdir()
    table = pa.table({"body": docs})
    for k, part in enumerate((table.slice(0, 100), table.slice(100))):
        with pa.OSFile(str(hf / f"data-{k:05d}-of-00002.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(part)
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": f"data-{k:05d}-of-00002.arrow"}
                                                               for k in range(2)]}))
    (hf / "dataset_info.json").write_text("{}")
    for src in (jl, pqf, hf):
        out = tmp_path / f"{src.name}.ts"
        r = zb("convert", str(src), str(out), "--to", "tokstream", "--tokenizer", c["tok_path"], "--field", "body",
               "--workers", "2", "--docs-per-shard", "64")
        assert r.returncode == 0, r.stderr
        assert "tok/s" in r.stderr           # the progress bar shows tokens/s
        assert stream_docs(out) == want, src
        assert not Path(str(out) + ".zbconvert").exists()
    # plain text, one document per blank-line block, to LLMCHNK with records cut to 64 tokens
    out = tmp_path / "plays.chunk"
    r = zb("convert", str(c["txt"]), str(out), "--to", "llmchnk", "--tokenizer", c["tok_path"], "--split", "blank",
           "--seq-len", "64", "--workers", "1", "-q")
    assert r.returncode == 0, r.stderr
    want = expected_docs(c, c["docs"])
    cut = [d[s:s + 64] for d in want for s in range(0, len(d), 64)]
    with LLMChunkReader(out) as rd:
        assert rd.num_records == len(cut) and rd.seq_len == 64 and rd.dtype == np.uint16
        assert all(rd.read_record(i).tolist() == cut[i] for i in range(rd.num_records))


def _megatron(prefix: Path, docs: list[np.ndarray], dtype: type = np.uint16) -> None:
    """A Megatron MMapIndexedDataset pair, each document two sequences (as sentence splitting makes)."""
    seqs = [part for d in docs for part in (d[: len(d) // 2], d[len(d) // 2:])]
    lengths = np.array([len(s) for s in seqs], np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize)])
    doc_idx = np.arange(0, len(seqs) + 1, 2, dtype=np.int64)
    prefix.with_suffix(".bin").write_bytes(np.concatenate(seqs).astype(dtype).tobytes())
    code = {np.uint16: 8, np.int32: 4}[dtype]
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(seqs), len(doc_idx)))
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes() + doc_idx.tobytes())


@pytest.fixture
def token_docs() -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [np.append(rng.integers(1, 3000, rng.integers(2, 300)), 0).astype(np.uint16) for _ in range(200)]


def test_token_sources_keep_documents(token_docs, tmp_path):
    want = [d.tolist() for d in token_docs]
    flat = np.concatenate(token_docs)
    _megatron(tmp_path / "mega", token_docs)
    flat.tofile(tmp_path / "train.bin")                       # nanoGPT: flat uint16
    np.save(tmp_path / "stream.npy", flat.astype(np.int32))
    for src, extra in ((tmp_path / "mega.bin", []), (tmp_path / "mega.idx", []),
                       (tmp_path / "train.bin", ["--eod-id", "0"]), (tmp_path / "stream.npy", ["--eod-id", "0"])):
        out = tmp_path / f"{src.name}.ts"
        r = zb("convert", str(src), str(out), "--to", "tokstream", *extra)
        assert r.returncode == 0, r.stderr
        assert stream_docs(out) == want, src
    # 2-D .npy: one document per row; ZRECORD records equal the rows
    rows = np.random.default_rng(1).integers(0, 70000, (50, 33)).astype(np.uint32)
    np.save(tmp_path / "rows.npy", rows)
    r = zb("convert", str(tmp_path / "rows.npy"), str(tmp_path / "rows.zr"), "--to", "zrecord", "--compress", "flate")
    assert r.returncode == 0, r.stderr
    with ZRecordStore(tmp_path / "rows.zr") as st:
        assert len(st) == 50
        with st.gather(np.arange(50)) as b:
            assert all(np.array_equal(b["tokens"][i], rows[i]) for i in range(50))
    # Megatron -> LLMBATCH in order: the records are the stream cut into seq_len pieces
    out = tmp_path / "mega.batch"
    r = zb("convert", str(tmp_path / "mega"), str(out), "--from", "megatron", "--to", "llmbatch", "--seq-len", "100",
           "--batch-size", "8", "--no-shuffle")
    assert r.returncode == 0, r.stderr
    with BatchFileReader(out) as rd:
        got = rd.read_batches(np.arange(rd.num_batches), dtype=np.int64).reshape(-1)
        assert rd.num_batches == flat.size // 800
        assert np.array_equal(got, flat[: got.size])
    # shuffled: records of the same stream, in another order (the dropped tail is a random subset)
    r = zb("convert", str(tmp_path / "mega"), str(tmp_path / "s.batch"), "--from", "megatron", "--to", "llmbatch",
           "--seq-len", "100", "--batch-size", "8", "--seed", "3")
    with BatchFileReader(tmp_path / "s.batch") as rd:
        recs = rd.read_batches(np.arange(rd.num_batches), dtype=np.int64).reshape(-1, 100)
    ordered = got.reshape(-1, 100)
    assert not np.array_equal(recs, ordered)
    every = {tuple(r) for r in flat[: flat.size // 100 * 100].reshape(-1, 100).tolist()}
    assert recs.shape == ordered.shape and all(tuple(r) in every for r in recs.tolist())


def test_interrupted_conversion_resumes(corpus, tmp_path):
    c = corpus
    docs = [f"{t}\n(copy {k})" for k in range(6) for t in c["docs"]]
    jl = tmp_path / "big.jsonl"
    jl.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    ref = tmp_path / "ref.ts"
    r = zb("convert", str(jl), str(ref), "--to", "tokstream", "--tokenizer", c["tok_path"], "--workers", "1",
           "--docs-per-shard", "40", "-q")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out.ts"
    staging = Path(str(out) + ".zbconvert")
    p = subprocess.Popen([sys.executable, "-m", "zerobatch.cli", "convert", str(jl), str(out), "--to", "tokstream",
                          "--tokenizer", c["tok_path"], "--workers", "1", "--docs-per-shard", "40", "-q"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        if staging.is_dir() and len(list(staging.glob("shard-*.npz"))) >= 3:
            break
        time.sleep(0.005)
    assert p.poll() is None, "the conversion finished before it could be interrupted"
    p.send_signal(signal.SIGKILL)
    p.wait()
    staged = len(list(staging.glob("shard-*.npz")))
    assert staged >= 3 and not out.exists()
    r = zb("convert", str(jl), str(out), "--to", "tokstream", "--tokenizer", c["tok_path"], "--workers", "2",
           "--docs-per-shard", "40", "-q")
    assert r.returncode == 0, r.stderr
    total = -(-len(docs) // 40)
    assert f"resumed: {staged} of {total} tokenized groups" in r.stderr or \
        f"resumed: {staged + 1} of {total}" in r.stderr, r.stderr
    assert stream_docs(out) == stream_docs(ref)
    assert not staging.exists()
    # a staging folder of another conversion (here: other options) is not reused
    staging.mkdir()
    (staging / "plan.json").write_text("{}")
    (staging / "shard-000000.npz").write_bytes(b"junk")
    r = zb("convert", str(jl), str(tmp_path / "again.ts"), "--to", "tokstream", "--tokenizer", c["tok_path"], "-q")
    assert r.returncode == 0, r.stderr


def test_a_lone_surrogate_is_reported_in_one_line(corpus, tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "broken \\ud83d emoji"}\n')
    r = zb("convert", str(src), str(tmp_path / "o.ts"), "--to", "tokstream", "--tokenizer", corpus["tok_path"],
           "--text-errors", "strict", "-q", "--workers", "1", timeout=120)
    assert r.returncode == 1 and "internal error" not in r.stderr, r.stderr
    assert "a.jsonl" in r.stderr and "line 2" in r.stderr
    assert not [p for p in os.listdir(tmp_path) if p.startswith("o.ts")]


def test_errors_are_one_line(corpus, tmp_path, token_docs):
    c = corpus
    line = one_line_error(zb("convert", str(tmp_path / "nope.jsonl"), str(tmp_path / "o"), "--to", "llmchnk",
                             "--tokenizer", c["tok_path"]))
    assert "nope.jsonl" in line and "no such file" in line
    line = one_line_error(zb("convert", str(c["txt"]), str(tmp_path / "o"), "--to", "parquetish"), 2)
    assert "--to" in line and "invalid choice" in line
    line = one_line_error(zb("convert", str(c["txt"]), str(tmp_path / "o"), "--to", "llmbatch", "--batch-size", "0"), 2)
    assert "--batch-size" in line
    line = one_line_error(zb("convert", str(c["txt"]), str(tmp_path / "o"), "--to", "llmchnk"))
    assert "--tokenizer" in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    line = one_line_error(zb("convert", str(bad), str(tmp_path / "o"), "--to", "llmchnk", "--tokenizer",
                             c["tok_path"], "--workers", "1"))
    assert "bad.jsonl" in line and "line 2" in line
    line = one_line_error(zb("convert", str(c["txt"]), str(tmp_path / "o"), "--to", "llmchnk", "--tokenizer",
                             str(c["txt"])))
    assert "tokenizer" in line
    # corrupt Megatron indexes: bad magic, counts beyond the file, pointers that skip
    _megatron(tmp_path / "m", token_docs)
    idx = (tmp_path / "m.idx").read_bytes()
    for name, data, what in (("magic", b"XXIDIDX\x00\x00" + idx[9:], "magic"),
                             ("counts", idx[:18] + struct.pack("<Q", 2**60) + idx[26:], "counts"),
                             ("pointers", idx[:34 + 4 * 400] + struct.pack("<q", 7) + idx[34 + 4 * 400 + 8:],
                              "pointers"),
                             ("short", idx[:20], "header")):
        (tmp_path / f"{name}.idx").write_bytes(data)
        (tmp_path / f"{name}.bin").write_bytes((tmp_path / "m.bin").read_bytes())
        line = one_line_error(zb("convert", str(tmp_path / f"{name}.idx"), str(tmp_path / "o"), "--to", "llmchnk"))
        assert f"{name}.idx" in line and what in line, line
    # an id beyond --vocab-size is refused, never cut to fit; nothing is left under the name
    line = one_line_error(zb("convert", str(tmp_path / "m.bin"), str(tmp_path / "small.zr"), "--to", "zrecord",
                             "--vocab-size", "100"))
    assert "outside the vocabulary [0, 100)" in line
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("small.zr")]
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    assert "whole number" in one_line_error(zb("convert", str(odd), str(tmp_path / "o"), "--to", "llmchnk"))
    # a full disk during the write: one line, nothing left under the final name
    out = tmp_path / "full.chunk"
    line = one_line_error(zb("convert", str(tmp_path / "m.bin"), str(out), "--to", "llmchnk",
                             env={"ZEROBATCH_FAULT_ERRNO_AFTER": "4:ENOSPC"}))
    assert "No space left" in line and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".full.chunk")]
    r = zb("--version")
    assert r.returncode == 0 and r.stdout.startswith("zerobatch 0.")
    for cmd in ("convert", "inspect", "verify", "head", "stats", "bench", "quickstart"):
        r = zb(cmd, "--help")
        assert r.returncode == 0 and "usage: zerobatch " + cmd in r.stdout
