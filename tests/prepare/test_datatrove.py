"""The datatrove integration: zerobatch's TokenStreamWriter step under datatrove's own
LocalPipelineExecutor (3 tasks on 2 workers), reading JSONL with datatrove's JsonlReader;
then commit. The dataset holds the documents the CLI's convert makes (in rank order: each
datatrove task reads its own files), with their ids as metadata; a rerun skips the completed
tasks, and commit refuses while a task is missing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("datatrove")

from datatrove.executor import LocalPipelineExecutor  # noqa: E402
from datatrove.pipeline.readers import JsonlReader  # noqa: E402

from zerobatch.prepare.pipeline import convert  # noqa: E402
from zerobatch.prepare.integrations.datatrove import TokenStreamCommit  # noqa: E402
from zerobatch.prepare.integrations.datatrove import TokenStreamStep as TokenStreamWriter  # noqa: E402
from zerobatch.cli.quickstart import bundled_text, train_tokenizer  # noqa: E402
from zerobatch.prepare.tasks import commit  # noqa: E402
from zerobatch.formats.errors import ConfigError  # noqa: E402
from zerobatch.readers.tokstream import TokenStreamReader  # noqa: E402


def documents(path) -> list[list[int]]:
    with TokenStreamReader(path) as r:
        return [r.document(i).tolist() for i in range(r.num_documents)]


def metadata(path) -> list:
    with TokenStreamReader(path) as r:
        return [r.window_metadata(r.document_span(i)[0], 1).objects[0] for i in range(r.num_documents)]


def corpus(tmp_path):
    """A tokenizer and five JSONL files of the bundled text (with an id per record)."""
    text = bundled_text()[:80_000]
    docs = [p.strip() for p in text.split("\n\n") if p.strip()]
    (tmp_path / "t.txt").write_text(text)
    tok = str(tmp_path / "tokenizer.json")
    train_tokenizer(str(tmp_path / "t.txt"), 512, tok)
    src = tmp_path / "jsonl"
    src.mkdir()
    for k in range(5):
        part = docs[k::5]
        (src / f"f{k}.jsonl").write_text("".join(json.dumps({"text": t, "id": f"{k}-{i}"}) + "\n"
                                                 for i, t in enumerate(part)))
    return tok, src, docs


def test_datatrove_tasks_write_the_documents_of_the_cli(tmp_path):
    tok, src, docs = corpus(tmp_path)
    cli = tmp_path / "cli"
    convert(str(src), str(cli), to="tokstream", tokenizer=tok, workers=1, quiet=True, log=lambda *_: None)
    want = documents(cli)

    def pipeline(out):
        return [JsonlReader(str(src)), TokenStreamWriter(out, tok, batch_size=64, shard_tokens=5000,
                                                         metadata_fields=("id",))]
    one = tmp_path / "dt1"
    LocalPipelineExecutor(pipeline(one), tasks=1, workers=1, logging_dir=str(tmp_path / "logs1")).run()
    commit(str(one), log=lambda *_: None)
    assert documents(one) == want                       # one task: the CLI's order
    three = tmp_path / "dt3"
    ex = LocalPipelineExecutor(pipeline(three), tasks=3, workers=2, logging_dir=str(tmp_path / "logs3"),
                               local_tasks=2)           # tasks 0 and 1 only: task 2 missing
    ex.run()
    with pytest.raises(ConfigError, match=r"1 of 3 units are not finished yet \(unit 2, of task 2 of 3\)"):
        commit(str(three), log=lambda *_: None)
    LocalPipelineExecutor(pipeline(three), tasks=3, workers=2, logging_dir=str(tmp_path / "logs3"),
                          local_tasks=1, local_rank_offset=2).run()
    commit(str(three), log=lambda *_: None)
    got = documents(three)
    assert sorted(got) == sorted(want) and len(got) == len(want)
    ids = [m["id"] for m in metadata(three)]
    assert sorted(ids) == sorted(f"{k}-{i}" for k in range(5) for i in range(len(docs[k::5])))
    assert ids[0].startswith("0-")                     # rank 0 read f0 (and f3) first


def test_datatrove_tasks_write_into_object_storage(tmp_path, s3_endpoint, monkeypatch):
    """The same step with an s3:// output (a real S3 API server, moto): two tasks upload their
    parts, then a dependent stage of TokenStreamCommit puts the manifest; the documents are
    the CLI's."""
    from s3kit import new_bucket
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": s3_endpoint, "AWS_ALLOW_HTTP": "true",
                 "ZEROBATCH_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    tok, src, _ = corpus(tmp_path)
    cli = tmp_path / "cli"
    convert(str(src), str(cli), to="tokstream", tokenizer=tok, workers=1, quiet=True, log=lambda *_: None)
    url = f"s3://{new_bucket(s3_endpoint)}/dt"
    tokenize = LocalPipelineExecutor([JsonlReader(str(src)), TokenStreamWriter(url, tok, batch_size=64,
                                                                               shard_tokens=5000)],
                                     tasks=2, workers=1, logging_dir=str(tmp_path / "logs"))
    # the commit as a dependent datatrove stage (what a dependent Slurm job runs)
    LocalPipelineExecutor([TokenStreamCommit(url)], tasks=1, logging_dir=str(tmp_path / "logs-commit"),
                          depends=tokenize).run()
    got, want = documents(url), documents(cli)
    assert sorted(got) == sorted(want) and len(got) == len(want)


def test_a_tokenizer_that_does_not_say_its_vocabulary_size_is_refused(tmp_path):
    """A tokenizer function (ids from Python) has no vocabulary size, which the plan and the
    shards need: a typed error, as the Ray step gives, not a TypeError."""
    step = TokenStreamWriter(str(tmp_path / "ds"), lambda texts: [[1] for _ in texts], eod_id=0)
    with pytest.raises(ConfigError, match="vocabulary size"):
        list(step.run(iter([]), rank=0, world_size=1))


def test_the_import_paths_of_earlier_releases_still_work():
    """``zerobatch.cli.integrations.datatrove.TokenStreamWriter`` (the documented name before
    the step moved to zerobatch.prepare) is the step under its new name."""
    from zerobatch.cli.integrations import datatrove as old
    from zerobatch.prepare.integrations import datatrove as new
    assert old.TokenStreamWriter is new.TokenStreamStep and old.TokenStreamCommit is new.TokenStreamCommit
    from zerobatch.cli.convert import convert as old_convert
    from zerobatch.cli.tasks import commit as old_commit
    from zerobatch.prepare import commit as new_commit, convert as new_convert
    assert old_convert is new_convert and old_commit is new_commit
