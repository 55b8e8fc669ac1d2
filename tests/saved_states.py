"""Resume states saved by an earlier release, and what must follow them.

``tests/fixtures/v1/states/`` holds small datasets of every format and ``cases.json``: for
each case, the loader (or sampler) that was run, the state it saved after some steps, and a
digest of every batch that followed when that state was loaded into a new loader. The
datasets and states were written once, by the commit named in ``cases.json`` (the last one
before the loader was rebuilt on the samplers' schedules); every later release must load
those states and deliver exactly the same batches.

    python tests/saved_states.py --write      # only ever to add cases; never rewrites one

The test is ``tests/adapters/test_saved_states.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent / "fixtures" / "v1" / "states"
DATA = HERE / "data"
CASES = HERE / "cases.json"


# ---------------------------------------------------------------------------------------------
# the datasets (written once, then read from the fixtures folder)

def _token_docs(seed: int, n_docs: int, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=int(rng.integers(3, 40)), dtype=np.int64) for _ in range(n_docs)]


def write_datasets(root: Path) -> None:
    from zerobatch.writers.features import write_feature_matrix
    from zerobatch.writers.llmbatch import write_batch_file
    from zerobatch.writers.llmchnk import write_chunk_file
    from zerobatch.writers.tokstream import TokenStreamWriter
    from zerobatch.writers.zrecord import ZRecordWriter
    from zerobatch.formats.zrecord import FieldSpec

    root.mkdir(parents=True)
    for name, seed, shard_tokens in (("web", 1, 700), ("code", 2, 400)):
        with TokenStreamWriter(root / name, vocab_size=1000, metadata=True, shard_tokens=shard_tokens) as w:
            for k, doc in enumerate(_token_docs(seed, 120, 1000)):
                w.add_document(doc, {"doc": k, "src": name})
    rng = np.random.default_rng(3)
    recs = rng.integers(0, 5000, size=(90, 8), dtype=np.uint32)
    recs[:, 0] = np.arange(90, dtype=np.uint32)
    write_batch_file(root / "train.batch", recs, 2, 8, seed=11)
    write_chunk_file(root / "docs.chunk", _token_docs(4, 70, 3000), dtype="uint16")
    with ZRecordWriter(root / "store", [FieldSpec("tokens", "u16", None, "flate"), FieldSpec("label", "i64", ())]) as w:
        for k, doc in enumerate(_token_docs(5, 60, 3000)):
            w.append({"tokens": doc.astype(np.uint16), "label": k % 7})
    _trim_store(root / "store")
    np.save(root / "labels.npy", (np.arange(60) % 7).astype(np.int64))
    feats = np.random.default_rng(6).standard_normal((200, 3)).astype(np.float32)
    write_feature_matrix(root / "features", [("a", feats[:90]), ("b", feats[90:])])
    (root / "npy").mkdir()
    for k in range(3):
        np.save(root / "npy" / f"part{k}.npy", np.random.default_rng(7 + k).integers(0, 900, 150 + 20 * k,
                                                                                      dtype=np.uint16))


def write_more_datasets(root: Path) -> None:
    """Datasets added after the first cases (each written once, when missing): a chat
    dataset with a loss mask (every other message trained), for the packed cases."""
    from zerobatch.writers.tokstream import TokenStreamWriter

    if not (root / "chat").exists():
        rng = np.random.default_rng(12)
        docs, masks = [], []
        for _ in range(80):
            turns = rng.integers(1, 12, rng.integers(1, 7))
            masks.append(np.concatenate([np.full(n, j % 2, np.uint16) for j, n in enumerate(turns.tolist())]))
            docs.append(rng.integers(1, 1000, masks[-1].size))
        with TokenStreamWriter(root / "chat", vocab_size=1000, shard_tokens=300) as w:
            for d in docs:
                w.add_document(d)
        with TokenStreamWriter(root / "chat" / "loss_mask", vocab_size=2, shard_tokens=300) as w:
            for m in masks:
                w.add_document(m)


def _trim_store(store: Path) -> None:
    """Cut a new store's sparse preallocation (1 Mi table entries, a 1 GiB chunk) to what
    its records use, so that a checkout holds kilobytes: a reader needs no more."""
    entry = np.dtype([("chunk", "<u4"), ("offset", "<u8"), ("length", "<u4")])
    end = 0
    for table in sorted(store.glob("*.offset")):
        entries = np.fromfile(table, dtype=entry)
        n = int(np.flatnonzero(entries["length"]).max()) + 1 if entries["length"].any() else 0
        os.truncate(table, n * entry.itemsize)
        os.truncate(table.with_suffix(".check"), n * 4)
        if n:
            end = max(end, int((entries["offset"][:n] + entries["length"][:n]).max()))
    for chunk in (store / "chunk").glob("*.zr"):
        os.truncate(chunk, -(-end // 16) * 16)


# ---------------------------------------------------------------------------------------------
# the cases: a builder (make / resume configurations) and the steps taken before saving

CASE_SPECS: list[dict[str, Any]] = [
    {"name": "llmbatch-block-shuffle-world2", "kind": "loader", "source": ["llmbatch", {"block_size": 4}],
     "make": {"seed": 3, "rank": 1, "world_size": 2}, "epoch": 1, "steps": 3,
     "resume": [{"rank": 1, "world_size": 2}, {"rank": 0, "world_size": 1, "batch_size": 4}]},
    {"name": "llmbatch-native-pad", "kind": "native", "make": {"seed": 9, "block_size": 8, "drop_last": False,
                                                             "rank": 2, "world_size": 4},
     "epoch": 0, "steps": 5, "resume": [{"rank": 2, "world_size": 4}]},
    {"name": "tokstream-windows", "kind": "loader", "source": ["windows", {"data": "web", "seq_len": 8}],
     "make": {"batch_size": 4, "seed": 5, "drop_last": False}, "epoch": 0, "steps": 2,
     "resume": [{"batch_size": 4}, {"batch_size": 2, "rank": 1, "world_size": 2}]},
    {"name": "tokstream-windows-boundaries", "kind": "loader",
     "source": ["windows", {"data": "web", "seq_len": 12, "boundaries": True, "metadata": True}],
     "make": {"batch_size": 3, "shuffle": False, "rank": 0, "world_size": 2}, "epoch": 2, "steps": 4,
     "resume": [{"batch_size": 3, "rank": 0, "world_size": 2}]},
    {"name": "tokstream-documents-pad", "kind": "loader", "source": ["documents", {"data": "code", "width": 12}],
     "make": {"batch_size": 3, "seed": 4, "tail": "pad", "rank": 2, "world_size": 3}, "epoch": 0, "steps": 6,
     "resume": [{"batch_size": 3, "rank": 2, "world_size": 3}, {"batch_size": 9}]},
    {"name": "llmchnk-mask", "kind": "loader", "source": ["llmchnk", {"seq_len": 10, "mask": True}],
     "make": {"batch_size": 4, "seed": 8}, "epoch": 0, "steps": 7, "resume": [{"batch_size": 4}]},
    {"name": "zrecord-fields", "kind": "loader",
     "source": ["zrecord", {"fields": ["tokens", "label"], "pad_to": 16, "token_fields": ["tokens"]}],
     "make": {"batch_size": 5, "seed": 2}, "epoch": 1, "steps": 4, "resume": [{"batch_size": 5}]},
    {"name": "features-horizon", "kind": "loader", "source": ["features", {"window": 4, "horizon": 1}],
     "make": {"batch_size": 6, "seed": 1}, "epoch": 0, "steps": 9, "resume": [{"batch_size": 6}]},
    {"name": "npy-windows", "kind": "loader", "source": ["npy", {"seq_len": 6}],
     "make": {"batch_size": 2, "seed": 6}, "epoch": 3, "steps": 11, "resume": [{"batch_size": 2}]},
    {"name": "tokstream-random-order", "kind": "loader", "source": ["windows", {"data": "code", "seq_len": 5}],
     "order": ["random", 13], "make": {"batch_size": 4}, "epoch": 0, "steps": 8, "next": 6,
     "resume": [{"batch_size": 4}]},
    {"name": "mixture", "kind": "loader", "source": ["mixture", {"seq_len": 8, "weights": [0.7, 0.3]}],
     "make": {"batch_size": 4, "seed": 21}, "epoch": 0, "steps": 5, "next": 12,
     "resume": [{"batch_size": 4}, {"batch_size": 2, "rank": 1, "world_size": 2}]},
    {"name": "mixture-dataloader-workers", "kind": "dataloader", "source": ["mixture", {"seq_len": 8,
                                                                                      "weights": [0.5, 0.5]}],
     "make": {"batch_size": 3, "seed": 22}, "epoch": 0, "steps": 4, "next": 9, "resume": [{"batch_size": 3}]},
    {"name": "windows-dataloader-workers", "kind": "dataloader", "source": ["windows", {"data": "web", "seq_len": 8}],
     "make": {"batch_size": 4, "seed": 23}, "epoch": 1, "steps": 5, "resume": [{"batch_size": 4}]},
    {"name": "index-sampler-global-random", "kind": "sampler", "order": ["global-random", 100, 1],
     "make": {"batch_size": 8, "rank": 1, "world_size": 2, "tail": "pad"}, "epoch": 2, "steps": 3,
     "resume": [{"batch_size": 8, "rank": 1, "world_size": 2, "tail": "pad"}]},
    {"name": "index-sampler-block-shuffle", "kind": "sampler", "order": ["block-shuffle", 77, 5, 6],
     "make": {"batch_size": 4, "tail": "keep"}, "epoch": 1, "steps": 7,
     "resume": [{"batch_size": 4, "tail": "keep"}]},
    {"name": "mixture-schedule", "kind": "schedule", "make": {"seed": 31}, "steps": 6, "next": 8,
     "resume": [{}]},
    {"name": "loaderx", "kind": "loaderx", "make": {"batch_size": 4, "mode": "global_random", "seed": 3},
     "epoch": 0, "steps": 6, "resume": [{}]},
    {"name": "npy-folder-dataset-loader", "kind": "dataset_loader", "make": {"batch": 2, "seq_len": 8,
                                                                            "process_rank": 1, "num_processes": 2},
     "steps": 9, "next": 12, "resume": [{}]},
    # added before the one storage door and declared read interfaces (issue 31): packed,
    # flat and chat sources, a curriculum, a batch-size ramp, and remote sources of the
    # three remote designs (TOKSTREAM, LLMBATCH, ZRECORD on a real S3 API server)
    {"name": "packed-best-fit", "kind": "loader", "source": ["packed", {"data": "web", "seq_len": 16}],
     "make": {"batch_size": 3, "seed": 41}, "epoch": 1, "steps": 4, "next": 10,
     "resume": [{"batch_size": 3}, {"batch_size": 1, "rank": 2, "world_size": 3}]},
    {"name": "packed-chat-mask-turns", "kind": "loader",
     "source": ["packed", {"data": "chat", "seq_len": 12, "loss_mask": True, "split_at_turns": True}],
     "make": {"batch_size": 2, "seed": 42}, "epoch": 0, "steps": 5, "next": 10,
     "resume": [{"batch_size": 2}, {"batch_size": 1, "rank": 1, "world_size": 2}]},
    {"name": "flat-documents-budget", "kind": "loader",
     "source": ["flat", {"data": "code", "token_budget": 48, "layout": "hf"}],
     "make": {"batch_size": 1, "seed": 43}, "epoch": 0, "steps": 6, "next": 8,
     "resume": [{"batch_size": 1}]},
    {"name": "flat-documents-chat", "kind": "loader",
     "source": ["flat", {"data": "chat", "token_budget": None, "loss_mask": True}],
     "make": {"batch_size": 3, "seed": 44}, "epoch": 0, "steps": 3, "next": 8, "resume": [{"batch_size": 3}]},
    {"name": "curriculum-ramp", "kind": "loader", "source": ["curriculum", {}],
     "make": {"seed": 45}, "epoch": 0, "steps": 5, "next": 9,
     "resume": [{}, {"rank": 1, "world_size": 2}]},
    {"name": "mixture-batch-schedule", "kind": "loader", "source": ["mixture-ramp", {"seq_len": 10}],
     "make": {"seed": 46}, "epoch": 0, "steps": 4, "next": 8, "resume": [{}, {"rank": 0, "world_size": 2}]},
    {"name": "remote-windows", "kind": "loader", "source": ["windows", {"data": "web", "seq_len": 8, "remote": True}],
     "make": {"batch_size": 4, "seed": 47}, "epoch": 0, "steps": 3, "next": 6,
     "resume": [{"batch_size": 4}, {"batch_size": 2, "rank": 1, "world_size": 2}]},
    {"name": "remote-packed", "kind": "loader",
     "source": ["packed", {"data": "chat", "seq_len": 12, "loss_mask": True, "remote": True}],
     "make": {"batch_size": 2, "seed": 48}, "epoch": 1, "steps": 3, "next": 6, "resume": [{"batch_size": 2}]},
    {"name": "remote-llmbatch", "kind": "loader", "source": ["llmbatch", {"block_size": 4, "remote": True}],
     "make": {"seed": 49}, "epoch": 0, "steps": 4, "resume": [{}]},
    {"name": "remote-zrecord", "kind": "loader",
     "source": ["zrecord", {"fields": ["tokens", "label"], "pad_to": 16, "token_fields": ["tokens"], "remote": True}],
     "make": {"batch_size": 5, "seed": 50}, "epoch": 0, "steps": 3, "next": 5, "resume": [{"batch_size": 5}]},
]


_REMOTE: dict[str, Any] = {}


def _remote(root: Path, name: str) -> tuple[str, dict[str, Any]]:
    """The URL of ``root / name`` uploaded to this process's real S3 API server (moto, on
    127.0.0.1; once per process), and the keyword arguments a reader opens it with."""
    import tempfile

    from s3kit import moto_server, new_bucket, options, upload

    if name not in _REMOTE:
        endpoint = moto_server()
        url = f"s3://{new_bucket(endpoint)}/{name}"
        if (root / name).is_dir():
            upload(root / name, url, options(endpoint))
        else:
            from zerobatch.core.remote import ObjectStore
            url = f"s3://{url[5:].split('/')[0]}/{name}"
            ObjectStore(url.rsplit("/", 1)[0], options(endpoint)).put(name, str(root / name))
        _REMOTE[name] = url, options(endpoint)
    url, opts = _REMOTE[name]
    return url, {"storage_options": opts, "cache_dir": tempfile.mkdtemp(prefix="zb-states-")}


def _reader(root: Path, name: str, remote: bool) -> Any:
    """``root / name`` as a path, or (``remote``) as a reader of its copy on the S3 server."""
    if not remote:
        return str(root / name)
    from zerobatch.readers import detect

    url, kw = _remote(root, name)
    fmt = detect.detect(str(root / name)).name
    if fmt == "llmbatch":
        from zerobatch.readers.llmbatch import BatchFileReader
        return BatchFileReader(url, **kw)
    if fmt == "zrecord":
        from zerobatch.readers.zrecord import ZRecordStore
        return ZRecordStore(url, **kw)
    from zerobatch.readers.tokstream import TokenStreamReader
    return TokenStreamReader(url, **kw)


def _source(spec: list[Any], root: Path) -> Any:
    from zerobatch.adapters import sources as S

    kind, kw = spec
    kw = dict(kw)
    remote = kw.pop("remote", False)
    if kind == "llmbatch":
        return S.LLMBatchSource(_reader(root, "train.batch", remote), **kw)
    if kind == "windows":
        return S.TokenWindows(_reader(root, kw.pop("data"), remote), **kw)
    if kind == "packed":
        return S.PackedDocuments(_reader(root, kw.pop("data"), remote), **kw)
    if kind == "flat":
        return S.FlatDocuments(_reader(root, kw.pop("data"), remote), **kw)
    if kind == "curriculum":
        return S.Curriculum([("short", 0, S.TokenWindows(str(root / "web"), 8), 4),
                             ("long", 3, S.TokenWindows(str(root / "code"), 16), 2)],
                            seed=71, batch_schedule=[(6, 4)])
    if kind == "mixture-ramp":
        seq = kw["seq_len"]
        return S.Mixture([("web", S.TokenWindows(str(root / "web"), seq), 0.6),
                          ("chat", S.TokenWindows(str(root / "chat"), seq), 0.4)],
                         seed=72, batch_schedule=[(0, 2), (3, 4), (6, 6)])
    if kind == "documents":
        return S.TokenDocuments(str(root / kw.pop("data")), **kw)
    if kind == "llmchnk":
        return S.LLMChunkSource(str(root / "docs.chunk"), **kw)
    if kind == "zrecord":
        return S.RecordFields(_reader(root, "store", remote), **kw)
    if kind == "features":
        return S.FeatureWindows(str(root / "features"), **kw)
    if kind == "npy":
        return S.NpyTokenWindows(str(root / "npy"), **kw)
    if kind == "mixture":
        wa, wb = kw["weights"]
        return S.Mixture([("web", S.TokenWindows(str(root / "web"), kw["seq_len"]), wa),
                          ("code", S.TokenWindows(str(root / "code"), kw["seq_len"]), wb)], seed=kw.get("seed", 0))
    raise ValueError(kind)


def _order(spec: list[Any] | None, num_items: int | None = None) -> Any:
    from zerobatch import samplers

    if spec is None:
        return None
    kind, *args = spec
    if kind == "random":
        return samplers.RandomOrder(num_items, seed=args[0])
    if kind == "global-random":
        return samplers.GlobalRandomOrder(args[0], seed=args[1])
    if kind == "block-shuffle":
        return samplers.BlockShuffleOrder(args[0], args[1], seed=args[2])
    raise ValueError(kind)


def build(case: dict[str, Any], config: dict[str, Any], root: Path = DATA) -> Any:
    """The object a case runs, with ``config`` (``make`` or one ``resume`` entry) applied."""
    kind = case["kind"]
    if kind in ("loader", "dataloader"):
        from zerobatch.adapters.torch import Loader

        source = _source(case["source"], root)
        kw = {**{k: v for k, v in case["make"].items() if k not in ("rank", "world_size", "batch_size")}, **config}
        kw.setdefault("rank", 0)
        kw.setdefault("world_size", 1)
        kw.setdefault("num_threads", 1)
        order = _order(case.get("order"), source.num_items)
        if order is not None:
            kw["order"] = order
        loader = Loader(source, **kw)
        return loader.dataloader(num_workers=2) if kind == "dataloader" and config is case["make"] else loader
    if kind == "native":
        from zerobatch.adapters.torch import BatchNativeLoader

        kw = {**case["make"], **config, "num_threads": 1}
        return BatchNativeLoader(str(root / "train.batch"), **kw)
    if kind == "sampler":
        from zerobatch.samplers import IndexSampler

        return IndexSampler(_order(case["order"]), **config)
    if kind == "schedule":              # a mixture order (MixtureSchedule when the case was written)
        from zerobatch.samplers import MixtureOrder

        return MixtureOrder([("a", 37, 0.5), ("b", 11, 0.3), ("c", 5, 0.2)], seed=case["make"]["seed"])
    if kind == "loaderx":
        from zerobatch.adapters.loaderx import ARDataset, DataLoader, NPDataset

        return DataLoader(ARDataset(str(root / "store"), "label"), NPDataset(str(root / "labels.npy")),
                          num_workers=1, **case["make"])
    if kind == "dataset_loader":
        from zerobatch.adapters.torch import DatasetLoader

        return DatasetLoader(dataset_dir=str(root / "npy"), device="cpu", **case["make"])
    raise ValueError(kind)


def digest(value: Any) -> str:
    """A digest of one delivered batch: every array's dtype, shape and bytes, in a fixed
    walk of tuples, lists and dicts (sorted keys); plain ints by value; other objects by repr."""
    h = hashlib.sha256()

    def walk(v: Any) -> None:
        if hasattr(v, "numpy") and hasattr(v, "dtype"):          # a torch tensor
            v = v.numpy()
        if isinstance(v, np.ndarray):
            h.update(f"a{v.dtype.str}{v.shape}".encode())
            h.update(np.ascontiguousarray(v).tobytes())
        elif isinstance(v, dict):
            for k in sorted(v):
                h.update(f"k{k}".encode())
                walk(v[k])
        elif isinstance(v, (tuple, list)):
            h.update(f"s{len(v)}".encode())
            for x in v:
                walk(x)
        elif isinstance(v, (int, np.integer)):
            h.update(f"i{int(v)}".encode())
        elif v is None:
            h.update(b"n")
        else:                                       # metadata objects: decoded on access
            h.update(f"o{[x for x in v]!r}".encode() if hasattr(v, "__len__") else repr(v).encode())

    walk(value)
    return h.hexdigest()[:24]


def _batches(obj: Any, case: dict[str, Any], count: int | None) -> list[str]:
    kind = case["kind"]
    out: list[str] = []
    if kind == "schedule":
        for _ in range(count or 0):
            src, items = obj.take(6)
            out.append(digest((src.astype(np.int64), items)))
        return out
    if kind == "dataset_loader":
        for _ in range(count or 0):
            out.append(digest(obj.get_batch()))
        return out
    it = iter(obj)
    while count is None or len(out) < count:
        try:
            out.append(digest(next(it)))
        except StopIteration:
            break
    return out


def _start(obj: Any, case: dict[str, Any]) -> None:
    if case["kind"] in ("loader", "native", "sampler", "loaderx", "dataloader") and case.get("epoch"):
        obj.set_epoch(case["epoch"])


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Run ``case`` from the start, save its state after ``steps`` batches, and record what
    each resume configuration delivers from that state."""
    obj = build(case, case["make"])
    _start(obj, case)
    if case["kind"] == "schedule":
        for _ in range(case["steps"]):
            obj.take(6)
    elif case["kind"] == "dataset_loader":
        for _ in range(case["steps"]):
            obj.get_batch()
    else:
        it = iter(obj)
        for _ in range(case["steps"]):
            next(it)
    state = json.loads(json.dumps(obj.state_dict()))
    if hasattr(obj, "close"):
        obj.close()
    resumed = []
    for config in case["resume"]:
        r = build(case, config)
        r.load_state_dict(json.loads(json.dumps(state)))
        resumed.append({"config": config, "next": _batches(r, case, case.get("next"))})
        if hasattr(r, "close"):
            r.close()
    return {**case, "state": state, "resumed": resumed}


def write() -> None:
    if not DATA.exists():
        write_datasets(DATA)
    write_more_datasets(DATA)
    have = json.loads(CASES.read_text()) if CASES.exists() else {"cases": []}
    known = {c["name"] for c in have["cases"]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    for case in CASE_SPECS:
        if case["name"] not in known:
            result = run_case(case)
            result["written_by"] = commit
            have["cases"].append(result)
            print(f"{case['name']}: {[len(r['next']) for r in result['resumed']]} batches after the state")
    have["note"] = ("states saved by the named commit and the batches that followed them; "
                    "written by tests/saved_states.py --write, only ever added to")
    CASES.write_text(json.dumps(have, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(__doc__)
    os.environ.setdefault("ZEROBATCH_TEST_FIXTURES", "1")
    write()
