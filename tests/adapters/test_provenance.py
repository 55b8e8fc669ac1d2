"""Provenance: a run card and the trace reproduce exactly what the loaders delivered.

Every dataset here encodes each token's own place: a token's value is its global position
plus one (0 is padding; a second dataset adds 10**6), so the batches a real run delivered
say, token by token, which document and offset they came from, with no help from the code
under test. The forward trace must rebuild every delivered row from its documents and
offsets; the inverse trace must find exactly the (step, rank, row) where a brute-force scan
of the delivered batches finds each document."""

from __future__ import annotations

import json
import os
import tempfile
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerobatch.adapters._loader import BaseLoader
from zerobatch.adapters.trace import Trace
from zerobatch.adapters.sources import (Curriculum, FlatDocuments, LLMBatchSource, Mixture, PackedDocuments,
                                        TokenDocuments, TokenWindows)
from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.samplers import WeightSchedule
from zerobatch.writers.llmbatch import write_batch_file
from zerobatch.writers.tokstream import TokenStreamWriter

SECOND = 10**6          # the second dataset's tokens: its positions + SECOND + 1
LB_SEQ, LB_ROWS = 6, 2  # the LLMBATCH file: rows of 6 tokens, batches of 2 rows


@lru_cache(maxsize=None)
def datasets() -> dict[str, object]:
    """Two TOKSTREAM datasets (documents of 1..40 tokens, metadata ``{"id": "a17"}``), and
    an LLMBATCH file, each token its own position + 1."""
    root = tempfile.mkdtemp(prefix="zb-provenance-")
    out: dict[str, object] = {}
    for name, n_docs, base, seed in (("a", 70, 0, 1), ("b", 40, SECOND, 2)):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(1, 41, n_docs)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        folder = os.path.join(root, name)
        with TokenStreamWriter(folder, vocab_size=1 << 21, metadata=True, shard_tokens=500) as w:
            for k in range(n_docs):
                w.add_document(np.arange(starts[k], starts[k + 1]) + base + 1, {"id": f"{name}{k}"})
        out[name] = folder
        out[name + "_starts"] = starts
    # chat: conversations of 1..9 messages of 0..20 tokens, every other message trained (the loss
    # mask of convert --chat), some far longer than a row: packed rows cut them at turn ends
    rng = np.random.default_rng(3)
    folder = os.path.join(root, "chat")
    docs, masks, at = [], [], 0
    while len(docs) < 60:
        turns = rng.integers(0, 21, rng.integers(1, 10))
        m = np.concatenate([np.full(n, j % 2, np.uint16) for j, n in enumerate(turns.tolist())] or [[]])
        if m.size:
            docs.append(np.arange(at, at + m.size) + 1)
            masks.append(m)
            at += m.size
    with TokenStreamWriter(folder, vocab_size=1 << 21, shard_tokens=700) as w:
        for doc in docs:
            w.add_document(doc)
    with TokenStreamWriter(os.path.join(folder, "loss_mask"), vocab_size=2, shard_tokens=700) as w:
        for m in masks:
            w.add_document(m)
    out["chat"] = folder
    out["chat_starts"] = np.concatenate([[0], np.cumsum([d.size for d in docs])])
    rows = 40 * LB_ROWS
    tokens = (np.arange(rows * LB_SEQ, dtype=np.uint32) + 1).reshape(rows, LB_SEQ)
    out["llmbatch"] = os.path.join(root, "c.batch")
    write_batch_file(out["llmbatch"], tokens, LB_ROWS, LB_SEQ, 0, shuffle=False)
    return out


def make_source(kind: str, p: dict) -> object:
    d = datasets()
    if kind == "windows":
        return TokenWindows(d["a"], p["seq_len"], stride=p["stride"], next_token=p["next_token"])
    if kind == "documents":
        return TokenDocuments(d["a"], p["width"], next_token=False)
    if kind == "flat":
        return FlatDocuments(d["a"], p["budget"], next_token=False, buffer=16, layout="next-token")
    if kind == "packed":
        return PackedDocuments(d["a"], p["seq_len"], next_token=False, buffer=p["buffer"], algorithm=p["algorithm"],
                               layout="next-token")
    if kind == "llmbatch":
        return LLMBatchSource(d["llmbatch"], block_size=3)
    if kind == "chat":       # packed chat rows, long conversations cut where a trained message ends
        return PackedDocuments(d["chat"], p["seq_len"], loss_mask=True, layout="hf", buffer=p["buffer"],
                               cu_seqlens=p["cu_seqlens"])
    if kind == "mixture":
        sched = WeightSchedule([(0, {"a": 1.0, "b": 1.0}), (3, {"a": 1.0, "b": 3.0})],
                               interpolation=p["interpolation"])
        return Mixture([("a", TokenWindows(d["a"], 5), 0.5), ("b", TokenWindows(d["b"], 5), 0.5)], seed=p["seed"],
                       weight_schedule=sched)
    if kind == "curriculum":
        return Curriculum([(0, TokenWindows(d["a"], 4), 12), (3, TokenWindows(d["a"], 7), 24)], seed=p["seed"])
    raise AssertionError(kind)


def delivered_rows(kind: str, batch: object) -> list[np.ndarray]:
    """The global positions of each delivered row's tokens (-1: padding; the second dataset's
    as SECOND + position); for next-token windows the row includes its last target."""
    if isinstance(batch, tuple):
        x, y = (np.asarray(v) for v in batch)
        rows = np.concatenate([x, y[:, -1:]], axis=1)
    elif isinstance(batch, dict):
        rows = np.asarray(batch["input_ids"]).copy()
        if "attention_mask" in batch:
            rows[~np.asarray(batch["attention_mask"], bool)] = 0
    else:
        rows = np.asarray(batch)
    return [r.astype(np.int64) - 1 for r in rows]


def traced_rows(kind: str, rows: list[dict], lengths: list[int]) -> list[np.ndarray]:
    """The rows the trace describes, rebuilt from its documents and offsets alone."""
    if kind == "flat":           # one flat row: the items back to back
        parts = []
        for row in rows:
            for piece in row["documents"]:
                parts.append(np.arange(*piece["tokens"]))
        return [np.concatenate(parts) if parts else np.zeros(0, np.int64)]
    out = []
    for row, n in zip(rows, lengths, strict=True):
        r = np.full(max(n, 1) if n else 0, -1, np.int64)
        base = SECOND if row["source"] == "b" else 0
        for piece in row["documents"]:
            a, b = piece["tokens"]
            at = piece["row_offset"]
            r[at:at + b - a] = np.arange(a, b)[:max(0, n - at)] + base
        out.append(r[:n])
    return out


def doc_of(kind: str, positions: np.ndarray) -> list[tuple[str, int]]:
    """Brute force: the (dataset, document) of each delivered token position."""
    d = datasets()
    out = set()
    for v in positions[positions >= 0].tolist():
        if kind == "llmbatch":
            out.add(("c", v // LB_SEQ))
        elif kind == "chat":
            out.add(("a", int(np.searchsorted(d["chat_starts"], v, side="right")) - 1))
        elif v >= SECOND:
            out.add(("b", int(np.searchsorted(d["b_starts"], v - SECOND, side="right")) - 1))
        else:
            out.add(("a", int(np.searchsorted(d["a_starts"], v, side="right")) - 1))
    return sorted(out)


def run(kind: str, p: dict, world: int, steps: int, *, loaders: list | None = None,
        exclusions: list[dict] = (), epochs_of: object = None) -> tuple[list, dict]:
    """``steps`` global steps on every rank (lockstep, one process): ``{step: {rank: rows}}``."""
    if loaders is None:
        loaders = [BaseLoader(make_source(kind, p), global_batch_size=p.get("g"), rank=r, world_size=world,
                              num_threads=0, seed=p["seed"], tail=p.get("tail", "drop")) for r in range(world)]
        for ld in loaders:
            for e in exclusions:
                ld.exclude(e.get("documents"), steps=e.get("steps"), source=e.get("source"), from_step=e["from_step"])
    got: dict[int, dict[int, list[np.ndarray]]] = {}
    iters = [None] * world
    start = loaders[0].global_step
    while loaders[0].global_step < start + steps:
        for r, ld in enumerate(loaders):
            if iters[r] is None:
                iters[r] = iter(ld)
            try:
                batch = next(iters[r])
            except StopIteration:
                iters[r] = None
                ld.set_epoch(ld.epoch + 1)
                continue
            step = ld.global_step - 1
            got.setdefault(step, {})[r] = delivered_rows(kind, batch)
        if all(it is None for it in iters):
            continue
    return loaders, got


PARAMS = {
    "windows": st.fixed_dictionaries({"seq_len": st.integers(2, 9), "stride": st.integers(1, 12),
                                      "next_token": st.booleans(), "g": st.just(12)}),
    "documents": st.fixed_dictionaries({"width": st.integers(1, 30), "g": st.just(12)}),
    "flat": st.fixed_dictionaries({"budget": st.one_of(st.none(), st.integers(8, 60)), "g": st.just(12)}),
    "packed": st.fixed_dictionaries({"seq_len": st.integers(6, 50), "buffer": st.integers(1, 40),
                                     "algorithm": st.sampled_from(["best-fit", "first-fit", "concat"]),
                                     "g": st.just(12)}),
    "llmbatch": st.fixed_dictionaries({"g": st.just(24)}),
    "chat": st.fixed_dictionaries({"seq_len": st.integers(8, 40), "buffer": st.integers(1, 30),
                                   "cu_seqlens": st.booleans(), "g": st.just(12)}),
    "mixture": st.fixed_dictionaries({"interpolation": st.sampled_from(["constant", "linear"]), "g": st.just(12)}),
    "curriculum": st.fixed_dictionaries({"g": st.none()}),
}


@st.composite
def cases(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(sorted(PARAMS)))
    p = dict(draw(PARAMS[kind]))
    p["seed"] = draw(st.integers(0, 2**32))
    worlds = [1, 2, 3, 4] if kind != "llmbatch" else [1, 2, 3, 4]
    first, second = draw(st.sampled_from(worlds)), draw(st.sampled_from(worlds))
    steps1, steps2 = draw(st.integers(0, 6)), draw(st.integers(1, 10))
    exclusions = []
    if draw(st.booleans()):
        source = "b" if kind == "mixture" and draw(st.booleans()) else ("a" if kind == "mixture" else None)
        n_docs = 40 if source == "b" else {"llmbatch": 80, "chat": 60}.get(kind, 70)
        docs = draw(st.lists(st.integers(0, n_docs - 1), max_size=4))
        frm = draw(st.integers(0, steps1 + steps2))
        skip = draw(st.lists(st.integers(frm, frm + 8), max_size=2))
        if kind == "curriculum":
            source = "phase0"
        exclusions.append({"from_step": frm, "documents": docs, "steps": skip, "source": source})
    return {"kind": kind, "p": p, "worlds": (first, second), "steps": (steps1, steps2), "exclusions": exclusions}


def check_case(case: dict) -> None:
    kind, p = case["kind"], case["p"]
    w1, w2 = case["worlds"]
    s1, s2 = case["steps"]
    loaders, got = run(kind, p, w1, s1, exclusions=case["exclusions"])
    state = loaders[0].state_dict()
    split = loaders[0].global_step
    card = json.loads(json.dumps(loaders[0].describe()))
    # the run resumes on another world size, each rank rebuilt from the run card alone
    resumed = [BaseLoader.from_card(card, rank=r, world_size=w2, num_threads=0) for r in range(w2)]
    assert resumed[0].state_dict()["consumed" if "consumed" in state else "steps"] == \
        state["consumed" if "consumed" in state else "steps"]
    _, more = run(kind, p, w2, s2, loaders=resumed)
    overlap = set(got) & set(more)
    assert not overlap, overlap
    got.update(more)
    final = json.loads(json.dumps(resumed[0].describe()))
    assert final["world_sizes"][0][1] == (w1 if s1 else w2) and final["world_sizes"][-1][1] == w2
    trace = Trace(final)
    for step in range(resumed[0].global_step):
        t = trace.step(step)
        rows_by_rank = {x["rank"]: x["rows"] for x in t["ranks"]}
        delivered = got.get(step, {})
        if t["skipped"]:
            assert not delivered, (step, delivered)
            continue
        assert set(delivered) == set(range(t["world_size"])), (step, set(delivered))
        for r, rows in delivered.items():
            rebuilt = traced_rows(kind, rows_by_rank[r], [x.size for x in rows])
            assert len(rebuilt) == len(rows), (step, r)
            for a, b in zip(rebuilt, rows, strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"step {step} rank {r}")
            for e in case["exclusions"]:
                if step >= e["from_step"]:
                    for row in rows:
                        hit = {d for d in doc_of(kind, row)} & {("b" if e["source"] == "b" else
                                                                  ("c" if kind == "llmbatch" else "a"), d)
                                                                 for d in e["documents"]}
                        assert not hit, (step, r, hit)
    if case["exclusions"]:
        check_exclusions(case, got, split, resumed[0].global_step)
    # the inverse, every document at once, against a brute-force scan of the delivered batches
    brute: dict[tuple[str, int], set] = {}
    for step, ranks in got.items():
        for r, rows in ranks.items():
            for i, row in enumerate(rows):
                for key in doc_of(kind, row):
                    brute.setdefault(key, set()).add((step, r, i if kind != "flat" else None))
    members = {"mixture": [("a", "a"), ("b", "b")], "curriculum": [("a", None)]}.get(
        kind, [("c" if kind == "llmbatch" else "a", None)])
    found: dict[tuple[str, int], set] = {}
    for data, name in members:
        n = 80 if data == "c" else (40 if data == "b" else (60 if kind == "chat" else 70))
        for d, recs in enumerate(trace.documents(range(n), source=name)):
            for rec in recs:
                found.setdefault((data, d), set()).add((rec["step"], rec["rank"], rec["row"] if kind != "flat"
                                                        else None))
    assert found == brute


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_trace_reproduces_every_delivered_step_and_the_inverse_equals_a_scan(case):
    check_case(case)


def check_exclusions(case: dict, got: dict, split: int, end: int) -> None:
    """The same run without exclusions, cut by hand: a step listed is skipped, a row holding
    an excluded document is dropped from its step, and a step where some rank would be left
    with no row is skipped on every rank; every other row is delivered as it was."""
    kind, p = case["kind"], case["p"]
    w1, w2 = case["worlds"]
    first, base = run(kind, p, w1, split)
    resumed = [BaseLoader(make_source(kind, p), global_batch_size=p.get("g"), rank=r, world_size=w2,
                          num_threads=0, seed=p["seed"], tail=p.get("tail", "drop")) for r in range(w2)]
    for ld in resumed:
        ld.load_state_dict(first[0].state_dict())
    _, more = run(kind, p, w2, end - first[0].global_step, loaders=resumed)
    base.update(more)
    data = "b" if any(e["source"] == "b" for e in case["exclusions"]) else ("c" if kind == "llmbatch" else "a")
    for step in range(end):
        active = [e for e in case["exclusions"] if e["from_step"] <= step]
        if any(step in e["steps"] for e in active):
            assert not got.get(step), step
            continue
        gone = {(data, d) for e in active for d in e["documents"]}
        per = LB_ROWS if kind == "llmbatch" else 1        # an LLMBATCH item (batch) goes whole
        want = {}
        for r, rows in base.get(step, {}).items():
            items = [rows[i:i + per] for i in range(0, len(rows), per)]
            want[r] = [row for item in items if not any(set(doc_of(kind, x)) & gone for x in item) for row in item]
        if kind == "flat":       # a flat step is one row: its items are not told apart here
            continue
        if not all(want.values()):
            assert not got.get(step), step
            continue
        assert set(got.get(step, {})) == set(want), step
        for r, rows in want.items():
            assert len(got[step][r]) == len(rows), (step, r)
            for a, b in zip(got[step][r], rows, strict=True):
                np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# the loss-spike walkthrough, metadata ids, and what is refused


def loader(rank: int = 0, world: int = 2, **kw) -> BaseLoader:
    return BaseLoader(TokenWindows(datasets()["a"], 6), global_batch_size=12, rank=rank, world_size=world,
                      num_threads=0, seed=5, **kw)


def take(ld: BaseLoader, n: int) -> list[list[np.ndarray]]:
    out, it = [], iter(ld)
    while len(out) < n:
        try:
            out.append(delivered_rows("windows", next(it)))
        except StopIteration:
            ld.set_epoch(ld.epoch + 1)
            it = iter(ld)
    return out


def test_loss_spike_walkthrough_trace_exclude_resume():
    """Trace a step, exclude its documents from the checkpoint's step on, resume: the run goes
    on as the uninterrupted one, less the rows holding those documents."""
    ld = loader()
    take(ld, 8)
    ckpt = ld.state_dict()
    card = ld.describe()
    later = take(ld, 12)                                    # what the run did after the checkpoint
    trace = Trace(card)
    spike = trace.step(10, rank=0)                          # "the loss spiked at step 10"
    bad = sorted({p["document"] for row in spike["ranks"][0]["rows"] for p in row["documents"]})[:2]
    resumed = loader()
    summary = resumed.exclude(bad, from_step=8)
    assert summary["documents"] == 2 and summary["items"] >= 2
    resumed.load_state_dict(ckpt)
    again = take(resumed, 12)
    gone = {("a", d) for d in bad}
    expected = [[r for r in rows if not set(doc_of("windows", r)) & gone] for rows in later]
    expected = [rows for rows in expected if rows]
    assert len(again) == len(expected)
    for a, b in zip(again, expected, strict=True):
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    # the state now records the exclusions; a loader without them refuses it, by name
    state = resumed.state_dict()
    assert state["exclusions"]
    with pytest.raises(StateError) as info:
        loader().load_state_dict(state)
    assert info.value.field == "exclusions" and "from_step=" in str(info.value)
    # the same exclusions continue exactly
    same = loader()
    same.exclude(bad, from_step=8)
    same.load_state_dict(state)
    cont = take(same, 3)
    assert all(len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
               for a, b in zip(cont, take(resumed, 3), strict=True))


def test_excluding_from_the_resume_step_keeps_the_saved_state_valid():
    ld = loader()
    take(ld, 5)
    state = ld.state_dict()
    other = loader()
    other.exclude([3, 4], from_step=5)
    other.exclude(steps=range(6, 9), from_step=6)
    other.load_state_dict(state)                            # nothing before step 5 changed: accepted
    early = loader()
    early.exclude([3], from_step=4)
    with pytest.raises(StateError, match="exclusions"):     # step 4 was trained with document 3
        early.load_state_dict(state)
    with pytest.raises(ConfigError, match="from_step"):
        ld.exclude([3], from_step=2)                        # already delivered
    with pytest.raises(ConfigError, match="steps"):
        loader().exclude(steps=[2], from_step=3)
    with pytest.raises(ConfigError, match="outside"):
        loader().exclude([10**6], from_step=0)


def test_skipped_steps_deliver_nothing_on_every_rank():
    world = 3
    lds = [loader(r, world) for r in range(world)]
    for ld in lds:
        ld.exclude(steps=[(2, 4), 6], from_step=0)
    base = [take(loader(r, world), 8) for r in range(world)]
    got = [take(ld, 5) for ld in lds]
    for r in range(world):
        want = [base[r][s] for s in (0, 1, 4, 5, 7)]
        assert len(got[r]) == len(want)
        for a, b in zip(got[r], want, strict=True):
            assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert lds[0].global_step == 8            # (the position after the last step delivered)


def test_documents_by_metadata_id():
    ld = loader()
    summary = ld.exclude(["a3", "a40", "nope"], by="id", from_step=0)
    assert summary["missing"] == ["nope"] and summary["documents"] == 2
    by_index = loader()
    by_index.exclude([3, 40], from_step=0)
    take(ld, 1)
    take(by_index, 1)
    assert ld.state_dict()["exclusions"] == by_index.state_dict()["exclusions"]
    trace = Trace(ld.describe())
    units = trace.units()
    from zerobatch.adapters.provenance import find_documents
    assert find_documents(units, "id", ["a7", "a69", "zz"]) == {"a7": [7], "a69": [69], "zz": []}
    row = trace.step(0, 0)["ranks"][0]["rows"][0]
    assert all(p["metadata"] == {"id": f"a{p['document']}"} for p in row["documents"])


def test_run_card_rebuilds_the_torch_loader_and_continues_exactly():
    from zerobatch.adapters.torch import Loader
    src = Mixture([("a", TokenWindows(datasets()["a"], 5), 0.3), ("b", TokenWindows(datasets()["b"], 5), 0.7)],
                  seed=9)
    ld = Loader(src, global_batch_size=8, rank=1, world_size=2, num_threads=0)
    it = iter(ld)
    for _ in range(4):
        next(it)
    card = json.loads(json.dumps(ld.describe()))
    again = Loader.from_card(card, rank=1, world_size=2, num_threads=0)
    for (x1, y1), (x2, y2) in zip([next(it) for _ in range(5)], [b for _, b in zip(range(5), again)], strict=True):
        assert x1.equal(x2) and y1.equal(y2)


def test_a_trace_needs_a_card_and_names_what_is_wrong(tmp_path):
    from zerobatch.adapters.provenance import read_card
    from zerobatch.formats.errors import NotFoundError
    with pytest.raises(NotFoundError):
        read_card(tmp_path / "none.json")
    (tmp_path / "x.json").write_text('{"zerobatch_state": 2}')
    with pytest.raises(ConfigError, match="not a zerobatch run card"):
        read_card(tmp_path / "x.json")
    card = loader().describe()
    with pytest.raises(ConfigError, match="version"):
        read_card({**card, "zerobatch_run_card": 99})
    nested = {"trainer": {"stateful_callbacks": {"ZerobatchCallback": {"card": card}}}}
    assert read_card(json.dumps(nested)) == json.loads(json.dumps(card))
    endless = Mixture([("a", TokenWindows(datasets()["a"], 5), 1.0)])
    trace = Trace(BaseLoader(endless, global_batch_size=4, num_threads=0).describe())
    with pytest.raises(ConfigError, match="until"):
        trace.document(3)
    assert trace.document(3, until=40)
    with pytest.raises(ConfigError, match="outside"):
        Trace(card).document(10**6)
    from zerobatch.adapters.sources import RecordFields
    assert RecordFields.items_at is not TokenWindows.items_at


def test_a_card_from_another_build_of_the_dataset_is_refused(tmp_path):
    folder = tmp_path / "d"
    with TokenStreamWriter(folder, vocab_size=100) as w:
        w.add_document(np.arange(50))
    card = BaseLoader(TokenWindows(str(folder), 4), batch_size=2, num_threads=0).describe()
    import shutil
    shutil.rmtree(folder)
    with TokenStreamWriter(folder, vocab_size=100) as w:
        w.add_document(np.arange(50) + 1)
    with pytest.raises(StateError) as info:
        Trace(card)
    assert info.value.field == "fingerprint"


def test_cli_trace(tmp_path):
    import subprocess
    import sys
    ld = loader()
    take(ld, 3)
    card = tmp_path / "ckpt"
    card.mkdir()
    (card / "zerobatch_run_card.json").write_text(json.dumps(ld.describe()))
    run_cli = [sys.executable, "-m", "zerobatch.cli", "trace", str(card)]
    r = subprocess.run([*run_cli, "--step", "1", "--rank", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("step 1 (epoch 0, step 1 of it): 2 ranks\nrank 1: 6 rows") and '{"id": "a' in r.stdout
    (tmp_path / "ids.txt").write_text("a3\nnope\na9\n")
    r = subprocess.run([*run_cli, "--documents", str(tmp_path / "ids.txt"), "--by", "id", "--until", "20",
                        "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "1 of 3 id values are in no document" in r.stderr
    out = json.loads(r.stdout)
    assert [o["query"] for o in out] == ["a3", "a9"] and all(o["seen"] for o in out)
    trace = Trace(card)
    assert [o["seen"] for o in out] == trace.documents([3, 9], until=20)
    r = subprocess.run([*run_cli, "--document", "zz", "--by", "id"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "no document has id 'zz'" in r.stderr


@pytest.mark.parametrize("kind", ["packed", "flat"])
def test_records_of_an_llmchnk_file_are_traced(tmp_path, kind):
    """Packed rows and flat groups of an LLMCHNK file's records (empty ones included): every
    delivered row rebuilt from the trace, and the inverse equal to a scan."""
    from zerobatch.writers.llmchnk import write_chunk_file
    rng = np.random.default_rng(4)
    lengths = rng.integers(0, 30, 80)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    path = tmp_path / "r.chunks"
    write_chunk_file(path, [np.arange(starts[k], starts[k + 1]) + 1 for k in range(lengths.size)])
    src = (PackedDocuments(str(path), 16, next_token=False, buffer=8, layout="next-token") if kind == "packed" else
           FlatDocuments(str(path), 40, next_token=False, buffer=8, layout="next-token"))
    ld = BaseLoader(src, global_batch_size=4, world_size=2, rank=1, num_threads=0, seed=2)
    got = [delivered_rows(kind, b) for b in ld]
    trace = Trace(ld.describe())
    brute: dict[int, set] = {}
    for step, rows in enumerate(got):
        t = trace.step(step, rank=1)["ranks"][0]["rows"]
        for a, b in zip(traced_rows(kind, t, [r.size for r in rows]), rows, strict=True):
            np.testing.assert_array_equal(a, b)
        for i, row in enumerate(rows):
            for v in row[row >= 0].tolist():
                brute.setdefault(int(np.searchsorted(starts, v, side="right")) - 1, set()).add((step, i))
    found = {d: {(r["step"], r["row"] if kind != "flat" else 0) for r in recs if r["rank"] == 1}
             for d, recs in enumerate(trace.documents(range(lengths.size), until=len(got)))}
    if kind == "flat":
        brute = {d: {(s, 0) for s, _ in v} for d, v in brute.items()}
    assert {d: v for d, v in found.items() if v} == brute
