"""What ``zerobatch commit`` refuses, and what the tasks say (distributed preparation).

Commit trusts no record: a part or a whole unit taken from another preparation (another
corpus, the same corpus at another path, another tokenizer) is refused by its build id or its
record's plan; a unit record that lost its shards, or a ``part-`` folder no record names and
nothing proves abandoned, is refused and nothing is deleted; damaged plans and records
(truncated, not JSON, nested without end, a field missing or of the wrong type) are typed
errors naming the file and the field, and no manifest is written. The same holds for a chat
preparation's loss mask. Then the messages: fewer units than tasks (which ``--unit-bytes``
gives each task work), ``commit`` while tasks still run, ``inspect`` of an uncommitted
preparation. Every reproduction runs the real ``zerobatch convert --task/--tasks`` and
``zerobatch commit`` commands."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from zerobatch.cli.quickstart import bundled_text, train_tokenizer  # noqa: E402
from zerobatch.prepare.pipeline import convert  # noqa: E402
from zerobatch.prepare.tasks import (_digest, commit, part_build_id, read_plan, task_units, unit_owner,  # noqa: E402
                                     unit_seed)
from zerobatch.formats.errors import CorruptError, IntegrityError  # noqa: E402
from zerobatch.readers.tokstream import TokenStreamReader  # noqa: E402


def zb(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "zerobatch.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


def refused(dst: Path, *words: str) -> str:
    """``zerobatch commit dst`` fails with one error line holding ``words``, changing nothing."""
    before = files_of(dst)
    r = zb("commit", dst, ok=False)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.startswith("zerobatch commit: error: ") and r.stderr.count("\n") == 1, r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)
    assert files_of(dst) == before and not (dst / "manifest.json").exists()
    return r.stderr


def files_of(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def documents(path: Path) -> list[list[int]]:
    with TokenStreamReader(path) as r:
        return [r.document(i).tolist() for i in range(r.num_documents)]


def reseal(path: Path, **changes) -> None:
    """A record or plan changed and sealed again with a valid digest (a consistent edit)."""
    obj = json.loads(path.read_bytes())
    for k, v in changes.items():
        if v is ...:
            del obj[k]
        else:
            obj[k] = v
    obj["digest"] = _digest(obj)
    path.write_text(json.dumps(obj))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    text = bundled_text()[:90_000]
    docs = [p.strip() for p in text.split("\n\n") if p.strip()]
    (d / "t.txt").write_text(text)
    train_tokenizer(str(d / "t.txt"), 512, str(d / "tok.json"))
    train_tokenizer(str(d / "t.txt"), 300, str(d / "tok2.json"))
    for name, part in (("x", docs[: len(docs) // 2]), ("y", docs[len(docs) // 2:])):
        (d / name).mkdir()
        (d / name / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    shutil.copytree(d / "x", d / "x-copy")          # the same corpus at another path: another plan
    return d


TASK_ARGS = ("--to", "tokstream", "--tasks", "2", "--unit-bytes", "4096", "--shard-tokens", "1500", "-q",
             "--workers", "1")


def prepare(src: Path, dst: Path, tok: Path, tasks=(0, 1)) -> None:
    for i in tasks:
        r = zb("convert", src, dst, "--tokenizer", tok, "--task", i, *TASK_ARGS)
        assert f"task {i} of 2" in r.stdout


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    """Preparation ``a`` (corpus x) and three others with the same file and unit names: another
    corpus (y), the same corpus at another path, the same corpus with another tokenizer."""
    out = tmp_path_factory.mktemp("prepared")
    tok, tok2 = corpus / "tok.json", corpus / "tok2.json"
    for name, src, t in (("a", "x", tok), ("other-corpus", "y", tok), ("same-corpus-elsewhere", "x-copy", tok),
                         ("other-tokenizer", "x", tok2)):
        prepare(corpus / src, out / name, t)
        assert (out / name / "part-000001-00000").is_dir() and (out / name / "part-000001-00001").is_dir()
    ref = out / "a-committed"
    shutil.copytree(out / "a", ref)
    zb("commit", ref)
    return out


def fresh(prepared: Path, tmp_path: Path, as_: str = "a") -> Path:
    """A copy of preparation ``a`` to tamper with."""
    dst = tmp_path / as_
    shutil.copytree(prepared / "a", dst)
    return dst


@pytest.mark.parametrize("other", ["other-corpus", "same-corpus-elsewhere", "other-tokenizer"])
def test_a_part_or_a_unit_of_another_preparation_is_refused(prepared, tmp_path, other):
    """The reproduction: a part (or a whole unit: its parts and its record) replaced by the
    same part of another preparation was committed silently; now commit refuses it by name
    (build_id; the record's plan) and writes nothing. The untouched preparation commits, and
    ``zerobatch verify`` passes."""
    dst = fresh(prepared, tmp_path)
    part = "part-000001-00000"
    shutil.rmtree(dst / part)
    shutil.copytree(prepared / other / part, dst / part)
    err = refused(dst, f"{part}/shard.json", "build_id: part part-000001-00000 has build id",
                  "the part belongs to another preparation")
    want = part_build_id(read_plan(str(dst)), 1, part)
    assert want in err
    # the whole unit: its parts and its record
    dst = fresh(prepared, tmp_path, "unit")
    for p in list(dst.glob("part-000001-*")):
        shutil.rmtree(p)
    for p in (prepared / other).glob("part-000001-*"):
        shutil.copytree(p, dst / p.name)
    shutil.copy(prepared / other / "_parts" / "unit-000001.json", dst / "_parts" / "unit-000001.json")
    refused(dst, "_parts/unit-000001.json", "plan: unit 1's record names plan", "belongs to another preparation")
    # the same unit's record alone, with this preparation's plan named (a consistent edit):
    # the parts are still held to this plan's build ids
    reseal(dst / "_parts" / "unit-000001.json", plan=_digest(read_plan(str(dst))))
    refused(dst, "part-000001-00000/shard.json", "build_id")


def test_the_untouched_preparation_commits_and_verifies(prepared, tmp_path):
    dst = fresh(prepared, tmp_path)
    r = zb("commit", dst)
    assert "committed" in r.stdout and not (dst / "_parts").exists()
    assert files_of(dst) == files_of(prepared / "a-committed")
    assert zb("verify", dst).returncode == 0


def test_a_record_that_lost_its_shards_deletes_nothing(prepared, tmp_path):
    """The reproduction: a unit record whose ``shards`` list was emptied made commit delete
    the unit's parts as leftovers and commit without them. Now: an edit without its digest is
    an IntegrityError; a consistent edit (digest recomputed) still has counts its shards do
    not hold; either way every part stays."""
    dst = fresh(prepared, tmp_path)
    rec = dst / "_parts" / "unit-000001.json"
    obj = json.loads(rec.read_bytes())
    assert obj["shards"] and obj["documents"] > 0
    obj["shards"] = []
    rec.write_text(json.dumps(obj))
    refused(dst, "unit-000001.json", "digest: unit-000001.json does not match its digest")
    reseal(rec, shards=[], build_ids=[])
    refused(dst, "unit-000001.json", "shards: 0 shards for")
    assert (dst / "part-000001-00000" / "shard.json").exists()
    # counts that the parts do not add up to
    dst = fresh(prepared, tmp_path, "counts")
    reseal(dst / "_parts" / "unit-000001.json", tokens=obj["tokens"] + 1)
    refused(dst, "unit-000001.json", "documents: unit 1's record counts")


def test_a_folder_no_record_names_is_deleted_only_when_proven_abandoned(prepared, tmp_path):
    """A ``part-`` folder that no record names: another preparation's part under a free name,
    a part of a unit the plan does not have, a part without shard.json, are refused by name
    (never deleted); a part whose shard.json carries the build id this plan gives its name (a
    killed attempt of this preparation) is deleted, and the dataset is the untouched one."""
    from zerobatch.writers.tokstream import ShardWriter
    a = prepared / "a"
    for name, make in (("part-000001-00009", lambda p: shutil.copytree(prepared / "other-corpus" / "part-000001-00000",
                                                                        p)),
                       ("part-000999-00000", lambda p: shutil.copytree(a / "part-000001-00000", p)),
                       ("part-000001-00008", lambda p: p.mkdir()),
                       ("part-notes", lambda p: p.mkdir())):
        dst = tmp_path / name
        shutil.copytree(a, dst)
        make(dst / name)
        refused(dst, f"{name}: shards: {name} is not named by any unit record", "remove it if it is not needed")
        assert (dst / name).exists()
    # a part with a shard.json whose build id is this plan's own for that name
    dst = tmp_path / "abandoned"
    shutil.copytree(a, dst)
    plan = read_plan(str(dst))
    w = ShardWriter(dst, "part-000001-00009", vocab_size=plan["vocab_size"], eod_token=plan["eod"],
                    build_seed=unit_seed(plan, 1))
    w.add_document([1, 2, 3])
    w.close()
    zb("commit", dst)
    assert not (dst / "part-000001-00009").exists()
    assert files_of(dst) == files_of(prepared / "a-committed")


def _bad_json(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


RECORD_DAMAGE = {
    "truncated": lambda raw: raw[: len(raw) // 2],
    "empty": lambda raw: b"",
    "not JSON": lambda raw: b"unit 1 done",
    "a list": lambda raw: b"[]",
    "deeply nested": lambda raw: _bad_json(200_000),
    "nested in a field": lambda raw: raw.replace(b'"tokens"', b'"x": ' + _bad_json(100_000) + b', "tokens"', 1),
    "a duplicate key": lambda raw: raw.replace(b'"tokens"', b'"tokens": 1, "tokens"', 1),
    "NaN": lambda raw: raw.replace(b'"tokens": ', b'"tokens": NaN, "t": ', 1),
    "no digest": lambda raw: json.dumps({k: v for k, v in json.loads(raw).items() if k != "digest"}).encode(),
    "a value changed": lambda raw: raw.replace(b'"tokens": ', b'"tokens": 1', 1),
}
RESEALED = [("unit", "1"), ("unit", True), ("unit", 2), ("unit", ...), ("plan", 7), ("plan", "00" * 16),
            ("plan", ...), ("shards", "part-000001-00000"), ("shards", [3]), ("shards", ["../../etc"]),
            ("shards", ...), ("build_ids", ["zz"]), ("build_ids", None), ("build_ids", ...), ("documents", -1),
            ("documents", 1.5), ("documents", True), ("documents", None), ("documents", ...), ("tokens", "9"),
            ("tokens", 2 ** 64), ("tokens", ...)]


@pytest.mark.parametrize("how", sorted(RECORD_DAMAGE))
def test_a_damaged_unit_record_is_a_typed_error(prepared, tmp_path, how):
    dst = fresh(prepared, tmp_path)
    rec = dst / "_parts" / "unit-000001.json"
    rec.write_bytes(RECORD_DAMAGE[how](rec.read_bytes()))
    before = files_of(dst)
    with pytest.raises(CorruptError) as e:
        commit(str(dst), log=lambda *_: None)
    assert e.value.path.endswith("unit-000001.json") and e.value.field
    assert files_of(dst) == before


@pytest.mark.parametrize("field,value", RESEALED, ids=[f"{f}={v!r}" for f, v in RESEALED])
def test_a_record_field_of_the_wrong_type_or_missing_is_named(prepared, tmp_path, field, value):
    dst = fresh(prepared, tmp_path)
    reseal(dst / "_parts" / "unit-000001.json", **{field: value})
    before = files_of(dst)
    with pytest.raises(CorruptError) as e:
        commit(str(dst), log=lambda *_: None)
    assert e.value.path.endswith("unit-000001.json") and not isinstance(e.value, IntegrityError)
    assert e.value.field in (field, "shards", "documents"), e.value     # counts that disagree name documents
    assert files_of(dst) == before


PLAN_DAMAGE = {
    "truncated": (lambda raw: raw[:-10], "plan.json"),
    "a list": (lambda raw: b"[1, 2]", "plan.json"),
    "deeply nested": (lambda raw: _bad_json(200_000), "plan.json"),
    "no digest": (lambda raw: json.dumps({k: v for k, v in json.loads(raw).items() if k != "digest"}).encode(),
                  "digest"),
    "a value changed": (lambda raw: raw.replace(b'"shard_tokens": 1500', b'"shard_tokens": 1501'), "digest"),
}
PLAN_RESEALED = [("tasks", "2"), ("tasks", 0), ("tasks", True), ("tasks", ...), ("units", {}), ("units", [[1, None]]),
                 ("units", [["a.jsonl", [5, 2]]]), ("units", [["a.jsonl", [0, 1.5]]]), ("units", ...), ("version", 2),
                 ("version", ...), ("build_ids", "random")]


@pytest.mark.parametrize("how", sorted(PLAN_DAMAGE))
def test_a_damaged_plan_is_a_typed_error(prepared, tmp_path, how):
    dst = fresh(prepared, tmp_path)
    plan = dst / "_parts" / "plan.json"
    damage, field = PLAN_DAMAGE[how]
    plan.write_bytes(damage(plan.read_bytes()))
    before = files_of(dst)
    with pytest.raises(CorruptError) as e:
        commit(str(dst), log=lambda *_: None)
    assert e.value.path.endswith("plan.json") and e.value.field == field
    assert files_of(dst) == before


@pytest.mark.parametrize("field,value", PLAN_RESEALED, ids=[f"{f}={v!r}" for f, v in PLAN_RESEALED])
def test_a_plan_field_of_the_wrong_type_or_missing_is_named(prepared, tmp_path, field, value):
    dst = fresh(prepared, tmp_path)
    reseal(dst / "_parts" / "plan.json", **{field: value})
    before = files_of(dst)
    with pytest.raises(CorruptError) as e:
        commit(str(dst), log=lambda *_: None)
    assert e.value.path.endswith("plan.json") and e.value.field == field, e.value
    assert files_of(dst) == before


def test_damage_through_the_command_line_is_one_line_and_a_task_rewrites_a_damaged_record(corpus, prepared,
                                                                                         tmp_path):
    """The commands: a deeply nested record and a plan missing its units are one error line
    (exit 1, no traceback); a task run again over a damaged record of its own writes that
    unit again and says so, and the commit then gives the untouched dataset."""
    dst = fresh(prepared, tmp_path)
    rec = dst / "_parts" / "unit-000001.json"
    good = rec.read_bytes()
    rec.write_bytes(_bad_json(300_000))
    refused(dst, "unit-000001.json", "invalid JSON")
    rec.write_bytes(good[:40])
    refused(dst, "unit-000001.json", "invalid JSON")
    plan = dst / "_parts" / "plan.json"
    good_plan = plan.read_bytes()
    reseal(plan, units=...)
    refused(dst, "plan.json", "units: missing")
    plan.write_bytes(good_plan)
    owner = unit_owner(len(read_plan(str(dst))["units"]), 1, 2)
    r = zb("convert", corpus / "x", dst, "--tokenizer", corpus / "tok.json", "--task", owner, *TASK_ARGS)
    assert "written again because their records were damaged: 1 (unit-000001.json: invalid JSON" in r.stdout
    zb("commit", dst)
    assert files_of(dst) == files_of(prepared / "a-committed")


# -- chat ------------------------------------------------------------------------------------

CHATML = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{%- if message['role'] == 'assistant' %}{% generation %}{{ (message['content'] or '') + '<|im_end|>\\n' }}"
          "{% endgeneration %}{%- else %}{{ (message['content'] or '') + '<|im_end|>\\n' }}{%- endif %}"
          "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def chat_prepared(corpus, tmp_path_factory):
    pytest.importorskip("jinja2")
    from tokenizers import Tokenizer
    d = tmp_path_factory.mktemp("chat")
    folder = d / "chatml"
    folder.mkdir()
    specials = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|im_start|>"}
    shutil.copy(corpus / "tok.json", folder / "tokenizer.json")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(list(specials.values()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML,
                                                              "tokenizer_class": "PreTrainedTokenizerFast",
                                                              **specials}))
    for name, word in (("a", "answer"), ("b", "reply")):
        src = d / f"src-{name}"
        src.mkdir()
        (src / "c.jsonl").write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": f"question {i} " * (i % 5 + 1)},
            {"role": "assistant", "content": f"{word} {i} " * (i % 4 + 1)}]}) + "\n" for i in range(160)))
        for i in (0, 1):
            zb("convert", src, d / name, "--to", "tokstream", "--tokenizer", folder, "--chat", "--task", i,
               "--tasks", "2", "--unit-bytes", "2048", "--shard-tokens", "900", "-q", "--workers", "1")
    assert (d / "a" / "loss_mask" / "part-000001-00000").is_dir()
    return d


def test_a_chat_preparation_binds_its_loss_mask(chat_prepared, tmp_path):
    """``convert --chat`` with tasks: a mask part or a whole mask unit of another preparation
    is refused before either manifest is written; a mask plan that is not the tokens' is
    refused; the untouched preparation commits and verifies."""
    a, b = chat_prepared / "a", chat_prepared / "b"
    part = "part-000001-00000"
    dst = tmp_path / "part"
    shutil.copytree(a, dst)
    shutil.rmtree(dst / "loss_mask" / part)
    shutil.copytree(b / "loss_mask" / part, dst / "loss_mask" / part)
    refused(dst, f"loss_mask/{part}/shard.json", "build_id")
    assert not (dst / "loss_mask" / "manifest.json").exists()
    dst = tmp_path / "unit"
    shutil.copytree(a, dst)
    for p in list((dst / "loss_mask").glob("part-000001-*")):
        shutil.rmtree(p)
    for p in (b / "loss_mask").glob("part-000001-*"):
        shutil.copytree(p, dst / "loss_mask" / p.name)
    shutil.copy(b / "loss_mask" / "_parts" / "unit-000001.json", dst / "loss_mask" / "_parts" / "unit-000001.json")
    refused(dst, "loss_mask/_parts/unit-000001.json", "another preparation")
    # the whole mask preparation of another corpus (its plan with it)
    dst = tmp_path / "mask"
    shutil.copytree(a, dst)
    shutil.rmtree(dst / "loss_mask")
    shutil.copytree(b / "loss_mask", dst / "loss_mask")
    refused(dst, "loss_mask/_parts/plan.json", "the loss mask's plan is not that of the tokens' preparation")
    # no mask at all
    dst = tmp_path / "nomask"
    shutil.copytree(a, dst)
    shutil.rmtree(dst / "loss_mask")
    refused(dst, "loss_mask/_parts/plan.json", "the chat preparation's loss mask has no plan")
    dst = tmp_path / "ok"
    shutil.copytree(a, dst)
    r = zb("commit", dst)
    assert "loss_mask" in r.stdout and not (dst / "_parts").exists() and not (dst / "loss_mask" / "_parts").exists()
    assert zb("verify", dst).returncode == 0


# -- messages ----------------------------------------------------------------------------------


def test_the_task_and_commit_commands(corpus, tmp_path):
    """``convert --task I --tasks N`` says which task ran, ``commit`` says it committed, and the
    dataset holds the documents of a one-process conversion; ``commit`` of a folder without a
    plan fails naming ``plan.json``."""
    src, tok = corpus / "x", corpus / "tok.json"
    dst = tmp_path / "cli"
    for i in range(2):
        r = zb("convert", src, dst, "--to", "tokstream", "--tokenizer", tok, "--task", i, "--tasks", "2",
               "--unit-bytes", "4096", "-q", "--workers", "1")
        assert f"task {i} of 2" in r.stdout, r.stdout
    assert "committed" in zb("commit", dst).stdout
    one = tmp_path / "one"
    convert(str(src), str(one), to="tokstream", tokenizer=str(tok), workers=1, quiet=True, log=lambda *_: None)
    assert documents(dst) == documents(one)
    r = zb("commit", tmp_path / "none", ok=False)
    assert r.returncode == 1 and "plan.json" in r.stderr


def test_a_small_input_says_which_unit_bytes_gives_every_task_work(corpus, tmp_path):
    """The reproduction: a small input gave its one unit to the last task, tasks 0 and 1
    printed ``units [0, 0) of 1`` and nothing suggested --unit-bytes. Now the tasks without a
    unit say so plainly with the --unit-bytes that gives each task work, and that value does;
    a gzip file (which cannot be cut) says to run fewer tasks."""
    src = corpus / "x" / "a.jsonl"
    dst = tmp_path / "small"
    out = [zb("convert", src, dst, "--to", "tokstream", "--tokenizer", corpus / "tok.json", "--task", i, "--tasks",
              "3", "-q", "--workers", "1").stdout for i in range(3)]
    assert out[0].startswith("task 0 of 3: units [0, 1) of 1: 1 written, 0 finished before (the inputs make 1 unit "
                             "for 3 tasks: --unit-bytes ")
    for i in (1, 2):
        assert out[i].startswith(f"task {i} of 3: nothing to do (the inputs make 1 unit for 3 tasks: --unit-bytes "), \
            out[i]
    assert f"zerobatch commit {dst}" in out[0]
    unit_bytes = int(re.search(r"--unit-bytes (\d+) gives (\d+) units", out[1]).group(1))
    assert unit_bytes < src.stat().st_size
    spread = tmp_path / "spread"
    for i in range(3):
        r = zb("convert", src, spread, "--to", "tokstream", "--tokenizer", corpus / "tok.json", "--task", i,
               "--tasks", "3", "--unit-bytes", unit_bytes, "-q", "--workers", "1")
        assert "nothing to do" not in r.stdout and " 0 written" not in r.stdout, r.stdout
    zb("commit", spread)
    zb("commit", dst)
    assert documents(spread) == documents(dst)
    # a gzip file is one unit whatever --unit-bytes says
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    r = zb("convert", gz, tmp_path / "gz", "--to", "tokstream", "--tokenizer", corpus / "tok.json", "--task", "1",
           "--tasks", "2", "-q", "--workers", "1")
    assert r.stdout.startswith("task 1 of 2: nothing to do (the inputs make 1 unit for 2 tasks and cannot be cut "
                               "finer (each Parquet row group, gzip file and whole file is one unit): run at most 1 "
                               "tasks)"), r.stdout


def test_commit_while_tasks_run_and_inspect_of_an_uncommitted_preparation(corpus, tmp_path):
    """commit before every task finished names the units not finished and their task, which
    may still be running (rerun only if it failed); ``zerobatch inspect`` of the destination
    says it is an uncommitted preparation with N of M units finished and how to commit it."""
    dst = tmp_path / "p"
    prepare(corpus / "x", dst, corpus / "tok.json", tasks=(1,))
    n = len(read_plan(str(dst))["units"])
    mine = task_units(n, 0, 2)
    err = refused(dst, f"{len(mine)} of {n} units are not finished yet (units {', '.join(map(str, mine))}, of task 0 "
                  f"of 2); that task may still be running: wait for it, and run it again only if it failed; nothing "
                  f"was changed")
    assert "again:" not in err
    r = zb("inspect", dst)
    assert "uncommitted preparation" in r.stdout and f"{n - len(mine)} of {n} finished" in r.stdout
    assert "wait for task 0 of 2" in r.stdout and f"zerobatch commit {dst}" in r.stdout
    st = json.loads(zb("inspect", dst, "--json").stdout)
    assert (st["units"], st["finished_units"], st["unfinished_units"], st["unfinished_tasks"]) == \
        (n, n - len(mine), list(mine), [0])
    prepare(corpus / "x", dst, corpus / "tok.json", tasks=(0,))
    r = zb("inspect", dst)
    assert f"{n} of {n} finished" in r.stdout and f"every unit is finished: run zerobatch commit {dst}" in r.stdout
    zb("commit", dst)
    r = zb("inspect", dst)
    assert "uncommitted" not in r.stdout and "TOKSTREAM" in r.stdout.upper()
