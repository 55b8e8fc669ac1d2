"""What ``zerobatch`` writes to stdout: a reader that goes away (``zerobatch stats X | head -2``)
ends every command quietly; ``stats`` says when every record has the same length, marks the
length percentiles on a log-scaled plot, and gives its figures as JSON (``stats --json``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zerobatch.cli.main import EXIT_PIPE, _token_figure, main
from zerobatch.readers.llmbatch import BatchFileReader
from zerobatch.readers.llmchnk import LLMChunkReader
from zerobatch.readers.tokstream import TokenStreamReader, open_loss_mask
from zerobatch.writers.features import write_feature_matrix
from zerobatch.writers.llmbatch import write_batch_dataset
from zerobatch.writers.llmchnk import write_chunk_file
from zerobatch.writers.tokstream import TokenStreamWriter
from zerobatch.writers.zrecord import ZRecordWriter

PNG = b"\x89PNG\r\n\x1a\n"


def zb(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zerobatch.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("stats")
    rng = np.random.default_rng(7)
    # lengths from 2 to several hundred: a spread that wants a log axis
    docs = [np.append(rng.integers(1, 900, int(rng.lognormal(3.5, 1.0)) + 1), 0).astype(np.uint32)
            for _ in range(400)]
    w = TokenStreamWriter(d / "docs.ts", vocab_size=1000, eod_token=0, shard_tokens=5000)
    for doc in docs:
        w.add_document(doc)
    w.close()
    write_chunk_file(d / "docs.chunk", docs, seq_len=64, dtype="uint16")
    write_batch_dataset(str(d / "fixed.batch"), iter([rng.integers(0, 500, (96, 128), dtype=np.uint32)]),
                        96, 16, 128, seed=3)
    # a chat dataset: tokens and a loss mask of the same documents
    with TokenStreamWriter(d / "chat.ts", vocab_size=100, shard_tokens=500) as cw:
        for n in (30, 50, 70):
            cw.add_document(np.arange(n) % 100)
    with TokenStreamWriter(d / "chat.ts" / "loss_mask", vocab_size=2, shard_tokens=500) as mw:
        for n in (30, 50, 70):
            mw.add_document((np.arange(n) % 3 == 0).astype(np.uint32))
    write_feature_matrix(d / "feat", {"a": rng.normal(size=(30, 3)), "b": rng.normal(size=(20, 3))}, columns=None)
    with ZRecordWriter(d / "blobs.zr", [{"name": "blob", "dtype": "bytes", "shape": None}]) as zw:
        for _ in range(3):
            zw.append({"blob": b"abc"})
    return {"tokstream": d / "docs.ts", "llmchnk": d / "docs.chunk", "llmbatch": d / "fixed.batch",
            "chat": d / "chat.ts", "features": d / "feat", "blobs": d / "blobs.zr",
            "docs": docs}  # type: ignore[dict-item]


# -- a closed stdout ----------------------------------------------------------------------------


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    """``zerobatch head X | head -1``: the first line arrives, then the reader closes the pipe;
    the command ends with 141 (as SIGPIPE would) and nothing on stderr."""
    with TokenStreamWriter(tmp_path / "big.ts", vocab_size=50000, shard_tokens=1 << 20) as w:
        for i in range(2000):           # 2000 lines of 200 six-character ids: 2.4 MB, far past a pipe's buffer
            w.add_document(np.arange(10000 + i, 10200 + i))
    p = subprocess.Popen([sys.executable, "-m", "zerobatch.cli", "head", str(tmp_path / "big.ts"), "-n", "2000",
                          "--full"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    first = p.stdout.readline()
    assert first == b"--- document 0 (200 tokens)\n"
    p.stdout.close()        # the command has megabytes left to write: its next write finds no reader
    err = p.stderr.read()
    assert p.wait(timeout=120) == EXIT_PIPE
    assert err == b"", err.decode()


@pytest.mark.parametrize("args", [["inspect", "{tokstream}"], ["inspect", "--json", "{llmbatch}"],
                                  ["head", "{llmchnk}", "-n", "5"], ["stats", "{tokstream}"],
                                  ["stats", "--json", "{llmbatch}"], ["verify", "{tokstream}"], ["formats"],
                                  ["formats", "--json"], ["convert", "--help"], ["--version"]])
def test_every_command_writing_to_a_closed_pipe_is_quiet(data, args):
    """The pipe's reader is gone before the command starts, so its first write fails: no
    ``error: Broken pipe``, no traceback, no ``Exception ignored`` at exit."""
    argv = [a.format(**{k: v for k, v in data.items() if k != "docs"}) for a in args]
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "zerobatch.cli", *argv], stdout=w, stderr=subprocess.PIPE,
                           timeout=120)
    finally:
        os.close(w)
    assert p.stderr == b"", p.stderr.decode()
    # argparse's own --help and --version writes swallow the error themselves: status 0
    assert p.returncode == (0 if "--help" in argv or "--version" in argv else EXIT_PIPE)


def test_broken_pipe_is_not_reported_as_an_error_in_process(monkeypatch, capsys):
    """main() itself (the ``zerobatch`` console script) returns the status; a stdout without
    a file descriptor is left alone."""
    class Gone:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Gone())
    assert main(["formats"]) == EXIT_PIPE
    monkeypatch.undo()
    assert capsys.readouterr().err == ""


# -- stats text and plot ------------------------------------------------------------------------


def test_records_of_one_length_are_said_not_drawn(data, tmp_path):
    png = tmp_path / "fixed.png"
    r = zb("stats", str(data["llmbatch"]), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert "records: 96, every record holds 128 tokens\n" in r.stdout, r.stdout
    assert "p50" not in r.stdout and "mean" not in r.stdout, r.stdout
    assert png.read_bytes()[:8] == PNG
    counts = np.bincount(np.arange(40))
    fig = _token_figure(counts, np.full(96, 128), "records", "record", "fixed.batch")
    try:
        assert len(fig.axes) == 1 and fig.axes[0].get_title() == "token frequency by rank"
        title = fig.get_suptitle() if hasattr(fig, "get_suptitle") else fig._suptitle.get_text()  # < 3.8
        assert title == "fixed.batch: 96 records, every record holds 128 tokens"
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)


def test_one_token_records_are_singular(tmp_path):
    write_batch_dataset(str(tmp_path / "one.batch"), iter([np.arange(8, dtype=np.uint32).reshape(8, 1)]), 8, 4, 1,
                        seed=0)
    r = zb("stats", str(tmp_path / "one.batch"))
    assert r.returncode == 0, r.stderr
    assert "records: 8, every record holds 1 token\n" in r.stdout, r.stdout


@pytest.mark.parametrize("kind", ["tokstream", "llmchnk"])
def test_varying_lengths_get_percentiles_and_a_log_axis(data, kind, tmp_path):
    docs = data["docs"]
    lengths = np.array([d.size for d in docs])
    png = tmp_path / f"{kind}.png"
    r = zb("stats", str(data[kind]), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    noun = "documents" if kind == "tokstream" else "records"
    assert (f"{noun} (tokens each): {lengths.size:,}  mean {lengths.mean():,.1f}  min {lengths.min():,}  "
            f"p50 {p50:,.0f}  p90 {p90:,.0f}  p99 {p99:,.0f}  max {lengths.max():,}\n") in r.stdout, r.stdout
    assert png.read_bytes()[:8] == PNG and f"wrote {png}" in r.stdout
    fig = _token_figure(np.bincount(np.concatenate(docs)), lengths, noun, noun[:-1], "t")
    try:
        hist = fig.axes[0]
        assert hist.get_xscale() == "log" and hist.get_xlabel() == "tokens (log scale)"
        labels = [t.get_text() for t in hist.get_legend().get_texts()]
        assert labels == [f"p50 {p50:,.0f}", f"p90 {p90:,.0f}", f"p99 {p99:,.0f}", f"max {lengths.max():,}"]
        # log-spaced bins, each holding a whole length: every length counted once
        assert sum(patch.get_height() for patch in hist.patches) == lengths.size
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)


def test_a_narrow_spread_keeps_a_linear_axis_and_empty_documents_show_on_a_log_one():
    import matplotlib.pyplot as plt

    counts = np.ones(10, np.int64)
    fig = _token_figure(counts, np.array([60, 61, 61, 62, 64]), "documents", "document", "t")
    try:
        assert fig.axes[0].get_xscale() == "linear"
        assert sum(patch.get_height() for patch in fig.axes[0].patches) == 5
    finally:
        plt.close(fig)
    fig = _token_figure(counts, np.array([0, 0, 3, 40, 900]), "documents", "document", "t")
    try:
        assert fig.axes[0].get_xscale() == "log"
        assert fig.axes[0].get_title() == "documents: length distribution (2 empty not shown)"
    finally:
        plt.close(fig)


# -- stats --json -------------------------------------------------------------------------------


def _stats_json(path: Path, *extra: str) -> dict:
    r = zb("stats", "--json", str(path), *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _check_lengths(got: dict, lengths: np.ndarray) -> None:
    p = np.percentile(lengths, [50, 90, 99])
    assert got["count"] == lengths.size and got["min"] == int(lengths.min()) and got["max"] == int(lengths.max())
    assert got["mean"] == pytest.approx(lengths.mean())
    assert [got["p50"], got["p90"], got["p99"]] == pytest.approx(p.tolist())
    assert got["all_equal"] is bool(lengths.min() == lengths.max())


def test_stats_json_of_a_tokstream_dataset(data, tmp_path):
    png = tmp_path / "ts.png"
    d = _stats_json(data["tokstream"], "--top", "3", "--plot", str(png))
    with TokenStreamReader(data["tokstream"]) as r:
        starts, stops = r.document_spans(np.arange(r.num_documents))
        lengths = (stops - starts).astype(np.int64)
        ids = np.concatenate([r.document(i) for i in range(r.num_documents)]).astype(np.int64)
        assert d["tokens"] == r.num_tokens == ids.size and d["documents"] == r.num_documents
    assert d["path"] == str(data["tokstream"]) and d["format"] == "TOKSTREAM"
    counts = np.bincount(ids)
    assert d["distinct_ids"] == int(np.count_nonzero(counts)) and d["largest_id"] == counts.size - 1
    assert d["lengths"]["of"] == "documents"
    _check_lengths(d["lengths"], lengths)
    top = np.argsort(-counts, kind="stable")[:3]
    assert d["most_frequent"] == [{"id": int(i), "count": int(counts[i]),
                                   "fraction": pytest.approx(counts[i] / ids.size)} for i in top]
    assert d["trained_tokens"] is None and d["trained_fraction"] is None
    assert d["plot"] == str(png) and png.read_bytes()[:8] == PNG


def test_stats_json_of_an_llmbatch_file(data):
    d = _stats_json(data["llmbatch"])
    with BatchFileReader(str(data["llmbatch"])) as r:
        tokens = r.read_batches(np.arange(r.num_batches), dtype=np.int64).reshape(-1)
        assert d["tokens"] == r.header.num_tokens == tokens.size
        assert d["records"] == r.num_batches * r.batch_size
        seq_len = r.seq_len
    assert d["format"] == "LLMBATCH" and "plot" not in d
    assert d["lengths"] == {"of": "records", "count": d["records"], "mean": seq_len, "min": seq_len,
                            "p50": seq_len, "p90": seq_len, "p99": seq_len, "max": seq_len, "all_equal": True}
    assert d["largest_id"] == int(tokens.max())
    assert sum(e["count"] for e in d["most_frequent"]) <= tokens.size and len(d["most_frequent"]) == 10


def test_stats_json_of_an_llmchnk_file_and_with_eod(data):
    d = _stats_json(data["llmchnk"])
    with LLMChunkReader(str(data["llmchnk"])) as r:
        lengths = r.lengths()
        assert d["tokens"] == r.num_tokens and d["records"] == r.num_records
    assert d["format"] == "LLMCHNK"
    _check_lengths(d["lengths"], lengths)
    e = _stats_json(data["llmchnk"], "--eod", "0")
    assert e["split_at_eod"] == 0 and e["documents"] == len(data["docs"])
    assert e["lengths"]["of"] == "documents (split at --eod)"
    _check_lengths(e["lengths"], np.array([doc.size for doc in data["docs"]]))


def test_stats_json_of_a_chat_dataset_gives_the_trained_fraction(data):
    d = _stats_json(data["chat"])
    with TokenStreamReader(data["chat"]) as r, open_loss_mask(r) as mask:
        trained = int(sum(np.count_nonzero(mask.document(i)) for i in range(mask.num_documents)))
        assert d["tokens"] == mask.num_tokens == 150
    assert d["trained_tokens"] == trained == 10 + 17 + 24
    assert d["trained_fraction"] == pytest.approx(trained / 150)
    text = zb("stats", str(data["chat"])).stdout
    assert f"trained on (loss mask 1): {trained:,} of 150 tokens ({100 * trained / 150:.2f} %)" in text, text


def test_stats_json_of_a_feature_matrix(data):
    d = _stats_json(data["features"], "--top", "2")
    assert d["format"] == "FEATURES" and d["rows"] == 50 and d["features"] == 3 and d["keys"] == 2
    _check_lengths(d["lengths"], np.array([30, 20]))
    assert [v["feature"] for v in d["values"]] == ["f0", "f1"]
    assert all(v["min"] <= v["mean"] <= v["max"] and v["std"] > 0 for v in d["values"])


def test_stats_of_a_field_without_token_ids_names_it(data):
    r = zb("stats", str(data["blobs"]))
    assert r.returncode == 1
    assert "stats: field 'blob' holds bytes values, not token ids; choose an integer field with --field" in r.stderr
