"""Edge cases users met in conversion (``zerobatch.prepare``'s ``convert``, which ``zerobatch
convert`` runs): undecodable text (lone UTF-16 surrogates,
invalid UTF-8) under an explicit policy, empty and null rows counted, destinations checked
before any work and replaced only with ``--overwrite``, staging removed after a fault a rerun
would meet again, and documents started with a BOS token."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from zerobatch.prepare.pipeline import convert  # noqa: E402
from zerobatch.cli.quickstart import bundled_text, train_tokenizer  # noqa: E402
from zerobatch.formats.errors import ConfigError, CorruptError, TruncatedError  # noqa: E402
from zerobatch.readers.llmchnk import LLMChunkReader  # noqa: E402
from zerobatch.readers.tokstream import TokenStreamReader  # noqa: E402


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "t.txt").write_text(bundled_text()[:30_000])
    path = d / "tokenizer.json"
    return str(path), train_tokenizer(str(d / "t.txt"), 300, str(path))


def run(src, dst, to="tokstream", **kw):
    lines: list[str] = []
    kw.setdefault("tokenizer", None)
    convert(str(src), str(dst), to=to, log=lines.append, quiet=True, workers=1, **kw)
    return lines


def docs(path):
    with TokenStreamReader(path) as r:
        return [r.document(i).tolist() for i in range(r.num_documents)]


SURROGATE = '{"text": "broken \\ud83d emoji"}\n'


def test_lone_surrogates_are_replaced_and_counted_or_refused(tok, tmp_path):
    path, t = tok
    src = tmp_path / "a.jsonl"
    src.write_text(SURROGATE + '{"text": "fine"}\n{"text": "pair \\ud83d\\ude00 kept"}\n')
    lines = run(src, tmp_path / "out.ts", tokenizer=path)
    assert any("1 documents had undecodable text" in ln for ln in lines), lines
    eod = t.token_to_id("<|endoftext|>")
    got = docs(tmp_path / "out.ts")
    assert got[0] == t.encode("broken \ufffd emoji", add_special_tokens=False).ids + [eod]
    assert got[2] == t.encode("pair \U0001F600 kept", add_special_tokens=False).ids + [eod]
    with pytest.raises(CorruptError, match="line 1.*surrogate") as e:
        run(src, tmp_path / "strict.ts", tokenizer=path, text_errors="strict")
    assert e.value.path == str(src)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("strict.ts")]


def test_invalid_utf8_follows_the_same_policy(tok, tmp_path):
    path, _ = tok
    src = tmp_path / "b.txt"
    src.write_bytes(b"good line\nbad \xff\xfe line\r\nother\rlast\n")
    lines = run(src, tmp_path / "b.ts", tokenizer=path, split="line")
    assert any("1 documents had undecodable text" in ln for ln in lines)
    assert len(docs(tmp_path / "b.ts")) == 4          # \r ends a line too, as universal newlines do
    with pytest.raises(CorruptError, match="line 2") as e:
        run(src, tmp_path / "c.ts", tokenizer=path, split="line", text_errors="strict")
    assert e.value.field == "line 2"


def test_empty_and_null_rows_are_counted(tok, tmp_path):
    src = tmp_path / "e.jsonl"
    src.write_text('{"text": "a"}\n{"text": ""}\n\n{"text": null}\n{"text": "b"}\n')
    lines = run(src, tmp_path / "e.ts", tokenizer=tok[0])
    assert any("skipped 2 empty or null documents" in ln for ln in lines), lines
    assert len(docs(tmp_path / "e.ts")) == 2


def test_destinations_are_checked_before_any_work(tok, tmp_path):
    path, _ = tok
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {k}"}) + "\n" for k in range(50)))
    run(src, tmp_path / "d.ts", tokenizer=path)
    run(src, tmp_path / "d.chunk", to="llmchnk", tokenizer=path)
    before = docs(tmp_path / "d.ts")
    for dst, to in (("d.ts", "tokstream"), ("d.chunk", "llmchnk")):
        with pytest.raises(ConfigError, match="--overwrite"):
            # a missing tokenizer would fail later: the destination is refused first
            run(src, tmp_path / dst, to=to, tokenizer=str(tmp_path / "missing.json"))
        assert not os.path.exists(tmp_path / f"{dst}.zbconvert")
    with pytest.raises(ConfigError, match="is a folder"):
        run(src, tmp_path / "d.ts", to="llmchnk", tokenizer=path, overwrite=True)
    src.write_text("".join(json.dumps({"text": f"other {k}"}) + "\n" for k in range(7)))
    run(src, tmp_path / "d.ts", tokenizer=path, overwrite=True)
    run(src, tmp_path / "d.chunk", to="llmchnk", tokenizer=path, overwrite=True)
    assert len(docs(tmp_path / "d.ts")) == 7 and docs(tmp_path / "d.ts") != before
    with LLMChunkReader(tmp_path / "d.chunk") as r:
        assert r.num_records == 7
    assert sorted(os.listdir(tmp_path)) == ["d.chunk", "d.jsonl", "d.ts"]


def test_staging_is_removed_after_a_fault_a_rerun_would_meet(tok, tmp_path):
    src = tmp_path / "f.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {k}"}) + "\n" for k in range(300)) + "{broken\n")
    with pytest.raises(CorruptError, match="line 301"):
        run(src, tmp_path / "f.ts", tokenizer=tok[0], docs_per_shard=10)
    assert os.listdir(tmp_path) == ["f.jsonl"]


def test_a_damaged_parquet_file_is_a_typed_error_naming_it(tok, tmp_path):
    """pyarrow's own errors, wherever a Parquet file is opened (counting its rows, reading it,
    planning the tasks' units of it), are one CorruptError naming the file."""
    pytest.importorskip("pyarrow")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1" + bytes(60))
    for kw in ({}, {"task": 0, "tasks": 2}):
        with pytest.raises(CorruptError, match="parquet: ") as e:
            run(bad, tmp_path / "o.ts", tokenizer=tok[0], **kw)
        assert e.value.path == str(bad) and e.value.field == "parquet"
        assert not (tmp_path / "o.ts").exists()


def test_documents_can_start_with_bos(tok, tmp_path):
    path, t = tok
    src = tmp_path / "g.jsonl"
    src.write_text('{"text": "one"}\n{"text": "two words"}\n')
    run(src, tmp_path / "g.ts", tokenizer=path, bos_id=7)
    eod = t.token_to_id("<|endoftext|>")
    assert docs(tmp_path / "g.ts") == [[7, *t.encode(s, add_special_tokens=False).ids, eod]
                                       for s in ("one", "two words")]
    with pytest.raises(ConfigError, match="--add-bos"):
        run(src, tmp_path / "h.ts", tokenizer=path, add_bos=True)   # this tokenizer has no BOS token
    np.save(tmp_path / "t.npy", np.arange(10, dtype=np.uint16))
    with pytest.raises(ConfigError, match="bos"):
        run(tmp_path / "t.npy", tmp_path / "i.ts", bos_id=1, eod_id=9)


def test_a_flat_stream_without_eod_stays_one_stream(tmp_path):
    stream = np.arange(1000, dtype=np.uint16) % 300
    stream.tofile(tmp_path / "train.bin")
    for to, dst in (("tokstream", "t.ts"), ("llmchnk", "t.chunk"), ("zrecord", "t.zr")):
        with pytest.raises(ConfigError, match="no document boundaries.*nanoGPT's prepare.py appends") as e:
            run(tmp_path / "train.bin", tmp_path / dst, to=to)
        assert e.value.field == "eod_id"
    lines = run(tmp_path / "train.bin", tmp_path / "t.batch", to="llmbatch", seq_len=10, batch_size=4,
                shuffle=False)
    assert any("no document boundaries" in ln for ln in lines)
    run(tmp_path / "train.bin", tmp_path / "e.ts", eod_id=299)
    got = docs(tmp_path / "e.ts")
    assert [len(d) for d in got] == [300, 300, 300, 100] and np.concatenate(got).tolist() == stream.tolist()


def test_a_folder_source_takes_one_split_and_no_dataset_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (np.arange(600, dtype=np.uint16) % 50).tofile(data / "train.bin")
    (np.arange(100, dtype=np.uint16) % 50).tofile(data / "val.bin")
    with pytest.raises(ConfigError, match=r"several splits \(train, validation: train.bin, val.bin\)"):
        run(data, tmp_path / "a.ts", eod_id=49)
    (data / "val.bin").unlink()
    run(data, data / "train.ts", eod_id=49)                # a TOKSTREAM (its tokens.bin) inside the folder
    lines = run(data, tmp_path / "b.ts", eod_id=49)
    assert not any("files, in this order" in ln for ln in lines)
    assert sum(map(len, docs(tmp_path / "b.ts"))) == 600
    with pytest.raises(ConfigError, match="is a TOKSTREAM dataset"):
        run(data / "train.ts", tmp_path / "c.ts", source_kind="nanogpt", eod_id=49)


def test_row_ids_keep_each_document_s_source_row(tok, tmp_path):
    from zerobatch.readers.zrecord import ZRecordStore

    src = tmp_path / "r.jsonl"
    src.write_text('{"text": "a"}\n{"text": ""}\n{"text": null}\n\n{"text": "d"}\n{"text": "e"}\n')
    run(src, tmp_path / "r.ts", tokenizer=tok[0], row_ids=True, docs_per_shard=2)
    with TokenStreamReader(tmp_path / "r.ts") as r:
        def first_object(i):
            start, _ = r.document_span(i)
            return r.window_metadata(start, 1).objects[0]
        assert [first_object(i) for i in range(r.num_documents)] == [{"row": 0}, {"row": 3}, {"row": 4}]
    run(src, tmp_path / "r.zr", to="zrecord", tokenizer=tok[0], row_ids=True)
    store = ZRecordStore(tmp_path / "r.zr")
    assert store["row"][:].tolist() == [0, 3, 4]
    with pytest.raises(ConfigError, match="--row-ids"):
        run(src, tmp_path / "r.chunk", to="llmchnk", tokenizer=tok[0], row_ids=True)


def test_split_by_document_fraction_like_megatron(tok, tmp_path):
    path, _ = tok
    src = tmp_path / "s.jsonl"
    src.write_text("".join(json.dumps({"text": f"document number {k}"}) + "\n" for k in range(1000)))
    run(src, tmp_path / "all.ts", tokenizer=path)
    whole = docs(tmp_path / "all.ts")
    lines = run(src, tmp_path / "c", tokenizer=path, split="969,30,1", row_ids=True)
    parts = [docs(tmp_path / f"c_{n}") for n in ("train", "valid", "test")]
    assert [len(p) for p in parts] == [969, 30, 1] and sum(parts, []) == whole
    assert any("valid: documents [969, 999)" in ln for ln in lines)
    with TokenStreamReader(tmp_path / "c_valid") as r:
        assert r.window_metadata(0, 1).objects[0] == {"row": 969}
    # deterministic, every target: the same cut again, into files
    run(src, tmp_path / "c.chunk", to="llmchnk", tokenizer=path, split="0.9,0.1")
    with LLMChunkReader(tmp_path / "c_valid.chunk") as r:
        assert [r.read_record(i).tolist() for i in range(r.num_records)] == whole[900:]
    with pytest.raises(ConfigError, match="--overwrite"):
        run(src, tmp_path / "c", tokenizer=path, split="98,2")      # c_train exists: refused before any work
    for bad in ("1,2,3,4", "a,b", "0,0", "-1,2"):
        with pytest.raises(ConfigError, match="--split"):
            run(src, tmp_path / "d", tokenizer=path, split=bad)
    assert len(docs(tmp_path / "c_test")) == 1
    # release 0.1's --split file|line|blank still means the plain-text document unit
    (tmp_path / "t.txt").write_text("one\ntwo\nthree\n")
    run(tmp_path / "t.txt", tmp_path / "t.ts", tokenizer=path, split="line")
    assert len(docs(tmp_path / "t.ts")) == 3


def test_export_to_megatron_and_nanogpt(tok, tmp_path):
    path, _ = tok
    src = tmp_path / "x.jsonl"
    src.write_text("".join(json.dumps({"text": f"export document {k} " * (k % 5 + 1)}) + "\n" for k in range(40)))
    run(src, tmp_path / "x.ts", tokenizer=path)
    want = docs(tmp_path / "x.ts")
    lines = run(tmp_path / "x.ts", tmp_path / "mg", to="megatron")
    assert lines and "40 documents" in lines[-1]
    # the Megatron files read back by our own Megatron source
    run(tmp_path / "mg.bin", tmp_path / "back.ts", source_kind="megatron")
    assert docs(tmp_path / "back.ts") == want
    run(tmp_path / "x.ts", tmp_path / "x.bin", to="nanogpt")
    flat = np.memmap(tmp_path / "x.bin", dtype=np.uint16, mode="r")
    assert flat.tolist() == [t for d in want for t in d]
    with pytest.raises(ConfigError, match="--overwrite"):
        run(tmp_path / "x.ts", tmp_path / "mg.idx", to="megatron")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_megatron_core_reads_the_export_and_writes_what_convert_reads(tok, tmp_path):
    mc = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch

    src = tmp_path / "m.jsonl"
    src.write_text("".join(json.dumps({"text": f"megatron {k} " * (k % 7 + 1)}) + "\n" for k in range(60)))
    run(src, tmp_path / "m.ts", tokenizer=tok[0])
    want = docs(tmp_path / "m.ts")
    run(tmp_path / "m.ts", tmp_path / "exp", to="megatron")
    ds = mc.IndexedDataset(str(tmp_path / "exp"))
    assert len(ds) == 60 and [ds[i].tolist() for i in range(60)] == want
    assert ds.document_indices.tolist() == list(range(61))
    # and the other way: megatron-core's own builder, read by convert --from megatron
    b = mc.IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=np.uint16)
    for d in want:
        b.add_item(torch.tensor(d, dtype=torch.int64))
        b.end_document()
    b.finalize(str(tmp_path / "mc.idx"))
    run(tmp_path / "mc", tmp_path / "mc.ts", source_kind="megatron")
    assert docs(tmp_path / "mc.ts") == want


def test_messages_say_what_is_wrong(tmp_path):
    (tmp_path / "t.npy").write_text("not npy")
    with pytest.raises(CorruptError, match="not a .npy file") as e:
        run(tmp_path / "t.npy", tmp_path / "o.ts")
    assert e.value.field == "magic"
    # a Megatron prefix alone (no --from megatron): found, not "no such file"
    from zerobatch.prepare.exports import write_megatron
    from zerobatch.prepare.pipeline import Target, ConvertOptions

    chunks = lambda: iter([(np.arange(10, dtype=np.uint32), np.array([4, 6]))])  # noqa: E731
    write_megatron(str(tmp_path / "pre"), chunks, Target(10, 10, "uint16", None, ConvertOptions(to="megatron"),
                                                        print))
    run(tmp_path / "pre", tmp_path / "pre.ts")
    assert [len(d) for d in docs(tmp_path / "pre.ts")] == [4, 6]


def test_llm_c_token_files_skip_their_header(tmp_path):
    """llm.c / modded-nanogpt .bin files start with a 256 x int32 header (magic 20240520,
    version 1, token count): the header is not read as tokens."""
    toks = (np.arange(700) % 300).astype(np.uint16)
    head = np.zeros(256, np.int32)
    head[:3] = (20240520, 1, toks.size)
    with open(tmp_path / "fineweb_train_000001.bin", "wb") as f:
        f.write(head.tobytes() + toks.tobytes())
    run(tmp_path / "fineweb_train_000001.bin", tmp_path / "f.ts", eod_id=299)
    assert np.concatenate(docs(tmp_path / "f.ts")).tolist() == toks.tolist()
    with open(tmp_path / "short.bin", "wb") as f:
        f.write(head.tobytes() + toks[:-1].tobytes())
    with pytest.raises(TruncatedError, match="llm.c file of 700"):
        run(tmp_path / "short.bin", tmp_path / "s.ts", eod_id=299)
