"""Distributed preparation (``convert --task I --tasks N`` and ``commit``): N = 1, 3 and 8
tasks over the same inputs (several JSONL files, one of them cut into byte-range units, and
Parquet files split by row group) give the same dataset shard for shard, holding the documents
of a one-process convert in the same order; a task killed at every point of its writing and
run again leaves a correct dataset; commit with a missing part fails, names the tasks and
changes nothing; commit is idempotent; tasks with other options are refused; units are dealt
evenly to the first tasks, and a part's build id is the one its writer derives. (The
commands' own messages, and what commit refuses: tests/cli/test_task_checks.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from zerobatch.prepare.pipeline import convert  # noqa: E402
from zerobatch.cli.quickstart import bundled_text, train_tokenizer  # noqa: E402
from zerobatch.prepare.tasks import commit, part_build_id, task_units, unit_owner, unit_seed  # noqa: E402
from zerobatch.formats.errors import ConfigError  # noqa: E402
from zerobatch.readers.tokstream import TokenStreamReader  # noqa: E402


def quiet(*_: str) -> None:
    pass


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    text = bundled_text()[:120_000]
    docs = [p.strip() for p in text.split("\n\n") if p.strip()]
    tok = str(d / "tokenizer.json")
    (d / "t.txt").write_text(text)
    train_tokenizer(str(d / "t.txt"), 512, tok)
    jl = d / "jsonl"
    jl.mkdir()
    cut = [0, 40, 45, len(docs) - 200, len(docs)]
    for k, (a, b) in enumerate(zip(cut[:-1], cut[1:], strict=True)):
        (jl / f"part-{k}.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n"
                                                    for i, t in enumerate(docs[a:b], a)))
    pqd = d / "parquet"
    pqd.mkdir()
    pq.write_table(pa.table({"text": docs[:300]}), pqd / "a.parquet", row_group_size=37)
    pq.write_table(pa.table({"text": docs[300:420]}), pqd / "b.parquet", row_group_size=1000)
    return {"tok": tok, "jsonl": jl, "parquet": pqd, "docs": docs}


def tokens_and_docs(path: Path) -> list[list[int]]:
    with TokenStreamReader(path) as r:
        return [r.document(i).tolist() for i in range(r.num_documents)]


def layout(path: Path) -> tuple:
    """The dataset's shards (name, tokens, documents), its documents, and its files' names."""
    with TokenStreamReader(path) as r:
        shards = [(e.name, e.num_tokens, e.num_documents) for e in r.manifest.shards]
    return shards, tokens_and_docs(path), sorted(files_of(path))


def files_of(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def prepare(src, dst: Path, tok: str, tasks: int, order=None, **kw) -> None:
    src = [str(p) for p in src] if isinstance(src, list) else str(src)
    for i in (order if order is not None else range(tasks)):
        convert(src, str(dst), to="tokstream", tokenizer=tok, task=i, tasks=tasks, workers=1, quiet=True,
                log=quiet, unit_bytes=4096, shard_tokens=3000, **kw)
    commit(str(dst), log=quiet)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "mixed"])
def test_any_number_of_tasks_gives_the_same_dataset_as_one_process(inputs, tmp_path, kind):
    """N = 1, 3, 8 tasks (run in any order) give the same dataset byte for byte, manifest and
    build ids included, holding a one-process convert's documents in its order; ``mixed``:
    the JSONL files (one of them cut into byte ranges) and the Parquet files (split by row
    group) given together, as two sources."""
    src = [inputs["jsonl"], inputs["parquet"]] if kind == "mixed" else inputs[kind]
    tok = inputs["tok"]
    one = tmp_path / "one"
    convert([str(p) for p in src] if kind == "mixed" else str(src), str(one), to="tokstream", tokenizer=tok,
            workers=1, quiet=True, log=quiet)
    want = tokens_and_docs(one)
    if kind == "mixed":
        assert len(want) == len(inputs["docs"]) + 420
    made = {}
    for n, order in ((1, None), (3, [2, 0, 1]), (8, [7, 3, 5, 0, 1, 6, 2, 4])):
        dst = tmp_path / f"n{n}"
        prepare(src, dst, tok, n, order)
        assert tokens_and_docs(dst) == want, n
        made[n] = files_of(dst)
        assert not (dst / "_parts").exists()
    assert made[1] == made[3] == made[8]          # byte for byte
    with TokenStreamReader(tmp_path / "n3") as r:
        assert len(r.manifest.shards) > 3


def test_commit_refuses_a_missing_part_and_is_idempotent(inputs, tmp_path):
    src, tok = inputs["jsonl"], inputs["tok"]
    dst = tmp_path / "d"
    for i in (0, 2):
        convert(str(src), str(dst), to="tokstream", tokenizer=tok, task=i, tasks=3, workers=1, quiet=True, log=quiet,
                unit_bytes=4096)
    before = files_of(dst)
    with pytest.raises(ConfigError, match=r"units are not finished yet \(units [\d, ]+, of task 1 of 3\); that task "
                       r"may still be running: wait for it, and run it again only if it failed"):
        commit(str(dst), log=quiet)
    assert files_of(dst) == before and not (dst / "manifest.json").exists()
    convert(str(src), str(dst), to="tokstream", tokenizer=tok, task=1, tasks=3, workers=1, quiet=True, log=quiet,
            unit_bytes=4096)
    m1 = commit(str(dst), log=quiet)
    lines: list[str] = []
    m2 = commit(str(dst), log=lines.append)
    assert m1.build_id == m2.build_id and "committed already" in lines[0]
    # a task of another plan (other options) is refused by name; so is a task after the commit
    other = tmp_path / "o"
    convert(str(src), str(other), to="tokstream", tokenizer=tok, task=0, tasks=3, workers=1, quiet=True, log=quiet,
            unit_bytes=4096)
    with pytest.raises(ConfigError, match="--shard-tokens: this task has 1000, the other tasks of this preparation "
                       "have 268435456; every task") as e:
        convert(str(src), str(other), to="tokstream", tokenizer=tok, task=1, tasks=3, workers=1, quiet=True,
                log=quiet, unit_bytes=4096, shard_tokens=1000)
    assert e.value.field == "shard_tokens"
    with pytest.raises(ConfigError, match="plan.json: --tasks: this task has 4, the other tasks of this preparation "
                       "have 3; every task of a preparation must get the same inputs and options"):
        convert(str(src), str(other), to="tokstream", tokenizer=tok, task=1, tasks=4, workers=1, quiet=True,
                log=quiet, unit_bytes=4096)
    with pytest.raises(ConfigError, match="committed already"):
        convert(str(src), str(dst), to="tokstream", tokenizer=tok, task=0, tasks=3, workers=1, quiet=True,
                log=quiet, unit_bytes=4096)
    with pytest.raises(ConfigError, match="--task must be in"):
        convert(str(src), str(tmp_path / "x"), to="tokstream", tokenizer=tok, task=3, tasks=3, log=quiet)


def test_a_task_killed_anywhere_and_run_again_leaves_a_correct_dataset(inputs, tmp_path):
    """SIGKILL at every few I/O calls of a task (zerobatch.core.io's fault switch), then the
    same task again, then the other tasks and the commit: the dataset equals an unkilled one."""
    src, tok = inputs["jsonl"], inputs["tok"]
    ref = tmp_path / "ref"
    prepare(src, ref, tok, 2)
    want = layout(ref)
    code = (f"from zerobatch.prepare.pipeline import convert\n"
            f"convert({str(src)!r}, DST, to='tokstream', tokenizer={tok!r}, task=0, tasks=2, workers=1, quiet=True, "
            f"log=lambda *_: None, unit_bytes=4096, shard_tokens=3000)\n")
    env = {**os.environ, "ZEROBATCH_FAULT_KILL_AFTER": str(10 ** 9)}
    probe = subprocess.run([sys.executable, "-c", "DST = " + repr(str(tmp_path / "probe")) + "\n" + code +
                            "from zerobatch.core.io import _FAULTS\nprint('CALLS', _FAULTS.calls)"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    calls = int(probe.stdout.split("CALLS")[-1])
    assert calls > 10
    for at in sorted({1, 2, calls // 3, calls // 2, calls - 2, calls - 1} - {0}):
        dst = tmp_path / f"k{at}"
        r = subprocess.run([sys.executable, "-c", f"DST = {str(dst)!r}\n" + code],
                           env={**os.environ, "ZEROBATCH_FAULT_KILL_AFTER": str(at)}, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode != 0, at                                   # killed
        prepare(src, dst, tok, 2)
        assert layout(dst) == want and files_of(dst) == files_of(ref), at


def doc_meta(path: Path) -> list:
    with TokenStreamReader(path) as r:
        out = []
        for i in range(r.num_documents):
            start, _ = r.document_span(i)
            out.append(r.window_metadata(start, 1).objects[0])
        return out


def test_document_fields_are_carried_into_the_metadata(inputs, tmp_path):
    """--metadata-fields keeps JSONL fields (Parquet columns) per document, with one process
    and with tasks alike, next to --row-ids."""
    src, tok = inputs["jsonl"], inputs["tok"]
    one = tmp_path / "one"
    convert(str(src), str(one), to="tokstream", tokenizer=tok, workers=1, quiet=True, log=quiet,
            metadata_fields=("id", "missing"), row_ids=True)
    got = doc_meta(one)
    assert got[:3] == [{"id": 0, "missing": None, "row": 0}, {"id": 1, "missing": None, "row": 1},
                       {"id": 2, "missing": None, "row": 2}]
    assert [m["id"] for m in got] == list(range(len(got)))
    dst = tmp_path / "tasks"
    prepare(src, dst, tok, 3, metadata_fields=("id",))
    assert doc_meta(dst) == [{"id": m["id"]} for m in got]
    assert tokens_and_docs(dst) == tokens_and_docs(one)
    pqd = tmp_path / "pq"
    pqd.mkdir()
    pq.write_table(pa.table({"text": ["alpha beta", "gamma", "delta"], "url": ["u0", "u1", "u2"]}), pqd / "x.parquet")
    convert(str(pqd), str(tmp_path / "p"), to="tokstream", tokenizer=tok, workers=1, quiet=True, log=quiet,
            metadata_fields=("url",))
    assert doc_meta(tmp_path / "p") == [{"url": "u0"}, {"url": "u1"}, {"url": "u2"}]
    with pytest.raises(ConfigError, match="no column 'nope'"):
        convert(str(pqd), str(tmp_path / "q"), to="tokstream", tokenizer=tok, workers=1, quiet=True, log=quiet,
                metadata_fields=("nope",))
    with pytest.raises(ConfigError, match="--metadata-fields"):
        convert(str(src), str(tmp_path / "c.chunk"), to="llmchnk", tokenizer=tok, workers=1, quiet=True, log=quiet,
                metadata_fields=("id",))


def test_several_sources_and_a_folder_of_jsonl_and_parquet_read_as_one(inputs, tmp_path):
    """A folder holding JSONL and Parquet files reads every file in name order (not the files
    of one kind alone); several sources read in the order given; a file given twice, and a
    token file among text sources, are refused."""
    tok = inputs["tok"]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "b.jsonl").write_bytes((inputs["jsonl"] / "part-0.jsonl").read_bytes())
    (mixed / "a.parquet").write_bytes((inputs["parquet"] / "b.parquet").read_bytes())
    convert(str(mixed), str(tmp_path / "f"), to="tokstream", tokenizer=tok, workers=1, quiet=True, log=quiet)
    convert([str(mixed / "a.parquet"), str(mixed / "b.jsonl")], str(tmp_path / "l"), to="tokstream", tokenizer=tok,
            workers=1, quiet=True, log=quiet)
    convert(str(mixed / "a.parquet"), str(tmp_path / "p"), to="tokstream", tokenizer=tok, workers=1, quiet=True,
            log=quiet)
    convert(str(mixed / "b.jsonl"), str(tmp_path / "j"), to="tokstream", tokenizer=tok, workers=1, quiet=True,
            log=quiet)
    both = tokens_and_docs(tmp_path / "f")
    assert both == tokens_and_docs(tmp_path / "l") == tokens_and_docs(tmp_path / "p") + tokens_and_docs(tmp_path / "j")
    assert len(both) == 120 + 40
    with pytest.raises(ConfigError, match="given twice"):
        convert([str(mixed), str(mixed / "b.jsonl")], str(tmp_path / "x"), to="tokstream", tokenizer=tok, log=quiet)
    import numpy as np
    np.save(tmp_path / "t.npy", np.arange(10, dtype=np.uint16))
    with pytest.raises(ConfigError, match="combine only as text"):
        convert([str(mixed), str(tmp_path / "t.npy")], str(tmp_path / "x"), to="tokstream", tokenizer=tok, log=quiet)
    r = subprocess.run([sys.executable, "-m", "zerobatch.cli", "convert", str(mixed / "a.parquet"),
                        str(mixed / "b.jsonl"), str(tmp_path / "cli"), "--to", "tokstream", "--tokenizer", tok, "-q",
                        "--workers", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert tokens_and_docs(tmp_path / "cli") == both


def test_tasks_prepare_into_object_storage_and_commit_puts_the_manifest_last(inputs, tmp_path, s3_endpoint,
                                                                             monkeypatch):
    """Tasks write into s3:// on a real S3 API server (moto, 127.0.0.1): each uploads its
    units' shards, then their records; no manifest.json exists until commit, which refuses
    while a task is missing, then puts the manifest and removes _parts. What a killed attempt
    left under a unit's names is cleared by its rerun. The dataset equals the one prepared in a
    local folder byte for byte (manifest and build ids included) and a one-process convert."""
    from s3kit import new_bucket
    from zerobatch.core.remote import ObjectStore
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": s3_endpoint, "AWS_ALLOW_HTTP": "true",
                 "ZEROBATCH_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    src = [str(inputs["jsonl"]), str(inputs["parquet"])]
    tok = inputs["tok"]
    url = f"s3://{new_bucket(s3_endpoint)}/prepared"
    store = ObjectStore(url)
    store.put("part-000001-00000/tokens.bin", b"left by a killed attempt")
    args = ["--to", "tokstream", "--tokenizer", tok, "--tasks", "3", "--unit-bytes", "4096", "--shard-tokens",
            "3000", "-q", "--workers", "1"]
    for i in (2, 0):
        r = subprocess.run([sys.executable, "-m", "zerobatch.cli", "convert", *src, url, "--task", str(i), *args],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    keys = {k for k, _ in store.list("")}
    assert "manifest.json" not in keys and "_parts/plan.json" in keys
    r = subprocess.run([sys.executable, "-m", "zerobatch.cli", "commit", url], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "of task 1 of 3); that task may still be running" in r.stderr, r.stderr
    assert {k for k, _ in store.list("")} == keys                              # nothing changed
    r = subprocess.run([sys.executable, "-m", "zerobatch.cli", "convert", *src, url, "--task", "1", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # a part folder no record names is refused by name at a URL too (the store lists by path
    # segment: the check lists every key and filters names itself), and left in place
    store.put("part-000999-00000/shard.json", b"{}")
    r = subprocess.run([sys.executable, "-m", "zerobatch.cli", "commit", url], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "part-000999-00000 is not named by any unit record" in r.stderr, r.stderr
    assert store.head("part-000999-00000/shard.json") is not None and store.head("manifest.json") is None
    store.delete("part-000999-00000/shard.json")
    m = commit(url, log=quiet)
    keys = {k for k, _ in store.list("")}
    assert not any(k.startswith("_parts/") for k in keys) and "manifest.json" in keys
    assert {k.partition("/")[0] for k in keys} == {e.name for e in m.shards} | {"manifest.json"}
    local = tmp_path / "local"
    prepare([Path(p) for p in src], local, tok, 3)
    assert store.get("manifest.json", limit=1 << 20) == (local / "manifest.json").read_bytes()
    for e in m.shards:
        for fname in (*e.files, "shard.json"):
            assert store.get(f"{e.name}/{fname}", limit=1 << 30) == (local / e.name / fname).read_bytes()
    assert tokens_and_docs(url) == tokens_and_docs(local)
    lines: list[str] = []
    assert commit(url, log=lines.append).build_id == m.build_id and "committed already" in lines[0]


def test_task_units_cover_every_unit_once_and_the_first_tasks_take_them():
    for n in (0, 1, 2, 3, 7, 64, 100):
        for tasks in (1, 2, 3, 8, 100, 101):
            got = [u for t in range(tasks) for u in task_units(n, t, tasks)]
            assert got == list(range(n)), (n, tasks)
            sizes = [len(task_units(n, t, tasks)) for t in range(tasks)]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            for u in range(n):
                assert u in task_units(n, unit_owner(n, u, tasks), tasks)


def test_part_build_id_is_the_one_the_writer_derives(tmp_path):
    from zerobatch.writers.tokstream import ShardWriter
    plan = {"version": 1, "tasks": 3, "units": [["f", None]], "x": [1, "é"]}
    w = ShardWriter(tmp_path, "part-000000-00003", vocab_size=100, build_seed=unit_seed(plan, 0))
    w.add_document([1, 2])
    assert w.close().build_id == part_build_id(plan, 0, "part-000000-00003")
    assert part_build_id(plan, 0, "part-000000-00003") != part_build_id(plan, 1, "part-000000-00003")
    assert part_build_id({**plan, "tasks": 8}, 0, "part-000000-00003") == part_build_id(plan, 0, "part-000000-00003")
