"""Every format and every writer's open path under structure-aware mutants (issue 17):
files and folders replaced by each non-regular kind, files swapped between two datasets of
the same layout, header and manifest fields at their boundaries. Each mutant must end in a
typed error or read exactly the pristine data; nothing may crash, hang, or read other data.

The counts per format are printed (``pytest -s tests/test_fault_harness.py``) and asserted.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from faultkit import KINDS, Outcomes, mutate, run_case, swapped
from zerobatch.core import xxh3_64
from zerobatch.formats import llmbatch as L
from zerobatch.formats import zrecord as Z
from zerobatch.formats.errors import CorruptError


def files_of(folder: Path) -> list[Path]:
    """Every file and folder of a dataset folder, deepest first (the folder itself last)."""
    out = []
    for root, dirs, files in os.walk(folder):
        out += [Path(root) / f for f in files]
        out += [Path(root) / d for d in dirs]
    return sorted(out, key=lambda p: -len(p.parts))


def run_mutants(out: Outcomes, folder: Path, read, pristine, writers=(), twin: Path | None = None,
                kinds=tuple(KINDS)) -> None:
    """Each file and folder of ``folder`` replaced by each kind (and, with ``twin``, by the
    same file of the twin dataset), through ``read`` and each of ``writers``."""
    targets = files_of(folder) if folder.is_dir() else [folder]
    for target in targets:
        rel = target.relative_to(folder.parent)
        for kind in kinds:
            with mutate(target, kind):
                run_case(out, f"{rel} as {kind}: read", lambda: read(folder), pristine)
                for name, w in writers:
                    run_case(out, f"{rel} as {kind}: {name}", lambda w=w: w(folder), pristine)
        if twin is not None and target.is_file():
            other = twin / target.relative_to(folder)
            if other.exists() and other.read_bytes() != target.read_bytes():
                with swapped(target, other):
                    run_case(out, f"{rel} from another dataset: read", lambda: read(folder), pristine)
                    for name, w in writers:
                        run_case(out, f"{rel} from another dataset: {name}", lambda w=w: w(folder), pristine)


def parent(doc, keys):
    """The object holding ``keys[-1]`` in a parsed JSON document (keys: a path into it)."""
    for key in keys[:-1]:
        doc = doc[key]
    return doc


def verified(report) -> bool:
    """A verify report that found faults counts as a typed outcome: the damage was named."""
    if not report.ok:
        raise CorruptError(f"verify reported: {report!r}"[:300])
    return True


def _in_unprivileged_child(action) -> str:
    """Run ``action`` in a forked child (as ``nobody`` when this process is root) and return
    what it raised: ``"<class name> <errno>"``, or ``"ok"``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            action()
            msg = "ok"
        except BaseException as exc:  # noqa: BLE001
            msg = f"{type(exc).__name__} {getattr(exc, 'errno', None)}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read().decode()
    os.waitpid(pid, 0)
    return got


def report(out: Outcomes, name: str) -> None:
    print(out.line(name))
    assert not out.other, "\n".join(out.other[:20])


# ---------------------------------------------------------------------------------------------
# LLMBATCH


def llmbatch_read(path: Path):
    from zerobatch.readers.llmbatch import BatchFileReader

    with BatchFileReader(path) as r:
        return [r.read_batch(i).tobytes() for i in range(r.num_batches)], verified(r.verify())


def test_llmbatch(tmp_path):
    from zerobatch.writers.llmbatch import write_batch_file

    path = tmp_path / "a.batch"
    tokens = np.random.default_rng(1).integers(0, 60000, (24, 8), dtype=np.uint32)
    write_batch_file(path, tokens, 4, 8, seed=2)
    pristine = llmbatch_read(path)
    out = Outcomes()

    def rewrite(p):
        write_batch_file(p, tokens, 4, 8, seed=2)
        return llmbatch_read(p)

    run_mutants(out, path, llmbatch_read, pristine, writers=[("write_batch_file", rewrite)])
    # every header field at its boundaries, the header re-hashed: only the value lies
    good = path.read_bytes()
    fields = {"batch_size": "<I", "seq_len": "<I", "num_batches": "<Q", "dtype": "<I", "seed": "<I",
              "total_records": "<I", "ext_version": "<I", "ext_flags": "<I", "hash_algo": "<I", "max_token": "<I",
              "trailer_offset": "<Q", "trailer_size": "<Q", "trailer_hash": "<Q", "version": "<I"}
    for name, fmt in fields.items():
        top = (1 << (8 * struct.calcsize(fmt))) - 1
        old = struct.unpack_from(fmt, good, L.FIELD_OFFSETS[name])[0]
        for value in sorted({0, 1, 2, top - 1, top, old - 1, old + 1, old * 2, old // 2} - {old}):
            if not 0 <= value <= top:
                continue
            raw = bytearray(good)
            struct.pack_into(fmt, raw, L.FIELD_OFFSETS[name], value)
            struct.pack_into("<Q", raw, L.HEADER_HASH_OFFSET, xxh3_64(bytes(raw[:L.HEADER_HASH_OFFSET])))
            path.write_bytes(raw)
            run_case(out, f"header {name} = {value}", lambda: llmbatch_read(path), pristine)
    path.write_bytes(good)
    report(out, "LLMBATCH")


# ---------------------------------------------------------------------------------------------
# LLMCHNK


def llmchnk_read(path: Path):
    from zerobatch.readers.llmchnk import LLMChunkReader

    with LLMChunkReader(path) as r:
        return [r.read_record(i).tobytes() for i in range(r.num_records)], verified(r.verify())


def test_llmchnk(tmp_path):
    from zerobatch.writers.llmchnk import write_chunk_file

    rng = np.random.default_rng(2)
    records = [rng.integers(0, 3000, int(rng.integers(1, 40))) for _ in range(30)]
    path = tmp_path / "a.chunk"
    write_chunk_file(path, records, dtype="uint16")
    pristine = llmchnk_read(path)
    out = Outcomes()

    def rewrite(p):
        write_chunk_file(p, records, dtype="uint16")
        return llmchnk_read(p)

    run_mutants(out, path, llmchnk_read, pristine, writers=[("write_chunk_file", rewrite)])
    # every header field at its boundaries (the header has no hash of its own: the structural
    # checks and the record checksums must catch each value)
    good = path.read_bytes()
    for name, off, fmt in (("version", 8, "<I"), ("flags", 12, "<I"), ("num_records", 16, "<Q"),
                           ("seq_len", 24, "<I"), ("dtype", 28, "<I")):
        top = (1 << (8 * struct.calcsize(fmt))) - 1
        old = struct.unpack_from(fmt, good, off)[0]
        for value in sorted({0, 1, 2, 3, top - 1, top, old - 1, old + 1, old * 2, old // 2} - {old}):
            if not 0 <= value <= top:
                continue
            raw = bytearray(good)
            struct.pack_into(fmt, raw, off, value)
            path.write_bytes(raw)
            run_case(out, f"header {name} = {value}", lambda: llmchnk_read(path), pristine)
    path.write_bytes(good)
    report(out, "LLMCHNK")


# ---------------------------------------------------------------------------------------------
# ZRECORD


FIELDS = [Z.FieldSpec("a", "i32", (2,)), Z.FieldSpec("b", "bytes", compress="flate")]


def zrecord_build(folder: Path, offset: int = 0) -> None:
    from zerobatch.writers.zrecord import ZRecordWriter

    with ZRecordWriter(folder, FIELDS, chunk_size=8, chunk_grow_bytes=1 << 16) as w:
        for i in range(30):
            w.append({"a": [i, -i], "b": b"x%d" % (i + offset) * (i % 3 + 1)})


def zrecord_read(folder: Path):
    from zerobatch.readers.zrecord import ZRecordStore

    with ZRecordStore(folder) as s:
        b = s.gather(np.arange(len(s)))
        got = b["a"].tobytes(), [v.tobytes() for v in b["b"]]
        s.verify_all()
        return got


def zrecord_writer(folder: Path):
    from zerobatch.writers.zrecord import ZRecordWriter

    ZRecordWriter(folder).abort()
    return zrecord_read(folder)


def test_zrecord(tmp_path):
    folder, twin = tmp_path / "s", tmp_path / "t"
    zrecord_build(folder)
    zrecord_build(twin)          # the same layout and records: only the identity differs
    pristine = zrecord_read(folder)
    out = Outcomes()
    run_mutants(out, folder, zrecord_read, pristine, writers=[("ZRecordWriter", zrecord_writer)], twin=twin)
    # meta.json: every integer at its boundaries, re-checksummed
    good = (folder / "meta.json").read_text()
    paths = [("length",), ("generation",), ("epoch",), ("chunks", "num"), ("chunks", "size"), ("chunks", "first"),
             ("chunks", "written_bytes")]
    for keys in paths:
        doc = json.loads(good)
        at = parent(doc, keys)
        old = at[keys[-1]]
        for value in sorted({0, 1, old - 1, old + 1, 2**32 - 1, 2**32, 2**48, 2**62, 2**63, -1} - {old}):
            at[keys[-1]] = value
            doc["checksum"] = Z.meta_checksum(doc)
            (folder / "meta.json").write_text(json.dumps(doc))
            for name, action in (("read", zrecord_read), ("ZRecordWriter", zrecord_writer)):
                run_case(out, f"meta.json {'.'.join(keys)} = {value}: {name}", lambda a=action: a(folder), pristine)
    (folder / "meta.json").write_text(good)
    assert zrecord_read(folder) == pristine
    report(out, "ZRECORD")


# ---------------------------------------------------------------------------------------------
# TOKSTREAM


def tokstream_build(folder: Path, seed: int = 0) -> None:
    from zerobatch.writers.tokstream import TokenStreamWriter

    rng = np.random.default_rng(seed)
    with TokenStreamWriter(folder, vocab_size=1000, metadata=True, shard_tokens=300) as w:
        for k in range(20):
            w.add_document(rng.integers(0, 1000, int(rng.integers(1, 40))), {"doc": k})


def tokstream_read(folder: Path):
    from zerobatch.readers.tokstream import TokenStreamReader

    with TokenStreamReader(folder) as r:
        n = r.num_tokens
        tokens = r.windows([0], n)[0].tobytes()
        flat, offsets = r.documents(np.arange(r.num_documents))
        meta = r.windows_metadata([0], n)
        return tokens, flat.tobytes(), offsets.tobytes(), meta.ids.tobytes(), repr(list(meta.objects)), verified(r.verify())


def tokstream_assemble(folder: Path):
    """assemble() on the mutant, then read; the manifest is put back after (assemble trusts
    shard.json, so a swapped one makes a manifest of the other build: the read must say so)."""
    from zerobatch.writers.tokstream import assemble

    path = folder / "manifest.json"
    regular = path.is_file() and not path.is_symlink()     # else the mutant itself: mutate() restores it
    manifest = path.read_bytes() if regular else None
    try:
        assemble(folder)
        return tokstream_read(folder)
    finally:
        if manifest is not None:
            path.write_bytes(manifest)


def test_tokstream(tmp_path):
    folder, twin = tmp_path / "d", tmp_path / "e"
    tokstream_build(folder)
    tokstream_build(twin, seed=0)          # the same documents: the build ids still differ per file
    pristine = tokstream_read(folder)
    out = Outcomes()
    run_mutants(out, folder, tokstream_read, pristine, writers=[("assemble", tokstream_assemble)], twin=twin)
    # manifest.json: every count and size at its boundaries, the build id recomputed (so
    # only the value lies; the shard files and their trailers must give it away)
    from zerobatch.formats import tokstream as T

    good = (folder / "manifest.json").read_text()
    places = [("vocab_size",), ("num_tokens",), ("num_documents",)]
    for k in range(2):
        places += [("shards", k, "num_tokens"), ("shards", k, "num_documents"), ("shards", k, "num_metadata")]
        places += [("shards", k, "files", f, "size") for f in ("tokens.bin", "documents.index", "metadata.index",
                                                                 "metadata.bin", "checksums.bin")]
    for keys in places:
        doc = json.loads(good)
        at = parent(doc, keys)
        old = at[keys[-1]]
        for value in sorted({0, 1, old - 1, old + 1, 2 * old, 2**32 - 1, 2**32, 2**53, 2**63} - {old}):
            at[keys[-1]] = value
            try:
                m = T.parse_manifest(json.dumps(doc).encode(), path=None)
                ids, record = T.build_id_material(m.options(), m.shards)
                doc["build_id"] = f"{xxh3_64(ids):016x}{xxh3_64(record):016x}"
            except Exception:  # noqa: BLE001 - a value the parser refuses: the reader must too
                pass
            (folder / "manifest.json").write_text(json.dumps(doc))
            run_case(out, f"manifest {'.'.join(map(str, keys))} = {value}", lambda: tokstream_read(folder),
                     pristine)
    (folder / "manifest.json").write_text(good)
    assert tokstream_read(folder) == pristine
    report(out, "TOKSTREAM")


# ---------------------------------------------------------------------------------------------
# feature matrices


def features_read(folder: Path):
    from zerobatch.readers.features import FeatureMatrix

    m = FeatureMatrix(folder, 4, horizon=1)
    x, y = m.windows(np.arange(len(m)))
    m.verify()
    return x.tobytes(), y.tobytes()


def test_features(tmp_path):
    from zerobatch.writers.features import write_feature_matrix

    rng = np.random.default_rng(4)
    sources = {"a": rng.normal(size=(50, 3)), "b": rng.normal(size=(30, 3))}
    folder, twin = tmp_path / "f", tmp_path / "g"
    write_feature_matrix(folder, sources)
    write_feature_matrix(twin, {k: v + 1 for k, v in sources.items()})
    pristine = features_read(folder)
    out = Outcomes()
    run_mutants(out, folder, features_read, pristine, twin=twin)
    # metadata.json: every count at its boundaries and every key range moved, re-digested
    from zerobatch.formats import features as F

    meta_path = folder / F.METADATA
    good = meta_path.read_text()
    places = [("num_rows",), ("num_features",), ("block_bytes",)]
    places += [("keys", k, i) for k in range(2) for i in ("start", "stop")]
    for keys in places:
        doc = json.loads(good)
        at = parent(doc, keys)
        old = at[keys[-1]]
        if not isinstance(old, int):
            continue
        for value in sorted({0, 1, old - 1, old + 1, 2 * old, 4096, 2**31, 2**32, 2**62, 2**63, -1} - {old}):
            at[keys[-1]] = value
            doc["metadata_xxh3"] = f"{xxh3_64(F.canonical(doc)):016x}"
            meta_path.write_text(json.dumps(doc))
            run_case(out, f"metadata {'.'.join(map(str, keys))} = {value}", lambda: features_read(folder), pristine)
    meta_path.write_text(good)
    assert features_read(folder) == pristine
    report(out, "features")


@pytest.mark.parametrize("writer", ["llmbatch", "llmchnk", "zrecord", "tokstream", "shard", "features"])
def test_writers_into_a_target_of_every_kind(tmp_path, writer):
    """Every writer's target path replaced by each kind: a typed error or a dataset that
    reads back, never a hang or an untyped error; and a read-only parent folder is a
    WriteError (EACCES) for every writer."""
    from zerobatch.writers.features import write_feature_matrix
    from zerobatch.writers.llmbatch import write_batch_file
    from zerobatch.writers.llmchnk import write_chunk_file
    from zerobatch.writers.tokstream import ShardWriter, TokenStreamWriter
    from zerobatch.writers.zrecord import ZRecordWriter

    tokens = np.arange(64, dtype=np.uint32).reshape(8, 8)

    def shard(p):
        with ShardWriter(p.parent, p.name, vocab_size=100) as w:
            w.add_document([1, 2, 3])
        return "ok"

    def stream(p):
        with TokenStreamWriter(p, vocab_size=100) as w:
            w.add_document([1, 2, 3])
        return "ok"

    write = {
        "llmbatch": lambda p: (write_batch_file(p, tokens, 2, 8, seed=0), "ok")[1],
        "llmchnk": lambda p: (write_chunk_file(p, tokens), "ok")[1],
        "zrecord": lambda p: (ZRecordWriter(p, FIELDS).close(), "ok")[1],
        "tokstream": stream,
        "shard": shard,
        "features": lambda p: (write_feature_matrix(p, {"a": np.ones((9, 2))}), "ok")[1],
    }[writer]
    out = Outcomes()
    target = tmp_path / "out" / "target"
    target.parent.mkdir()
    for kind in KINDS:
        KINDS[kind](str(target))
        run_case(out, f"{writer} into {kind}", lambda: write(target), "ok")
        if target.is_dir() and not target.is_symlink():
            import shutil
            shutil.rmtree(target)
        elif os.path.lexists(target):
            os.unlink(target)
    # a read-only parent folder: WriteError(EACCES) from every writer (root ignores
    # permissions, so the attempt runs in a child that drops to an unprivileged user)
    import shutil
    import tempfile

    base = tempfile.mkdtemp(prefix="zb-readonly-")     # outside tmp_path, which only root may enter
    try:
        os.chmod(base, 0o755)
        ro = Path(base) / "ro"
        ro.mkdir(mode=0o555)
        os.chmod(ro, 0o555)
        assert _in_unprivileged_child(lambda: write(ro / "target")) == "WriteError 13"
    finally:
        shutil.rmtree(base)
    report(out, f"{writer} writer")
