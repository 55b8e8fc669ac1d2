"""TOKSTREAM under faults: single-bit flips anywhere in a shard's files, truncation at every
byte, zero-filled tails, ``kill -9`` at every I/O call of a writer adding a shard, a full
verify, and readers carried into forked and spawned processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import textwrap

import numpy as np
import pytest

from zbtest import run_python
from zerobatch.formats import tokstream as T
from zerobatch.formats.errors import CorruptError, IntegrityError, NotFoundError, TruncatedError, ZerobatchError
from zerobatch.readers.tokstream import TokenStreamReader
from zerobatch.writers.tokstream import ShardWriter, TokenStreamWriter, assemble


def build(folder, n_docs=40, shard_tokens=600, seed=0):
    rng = np.random.default_rng(seed)
    with TokenStreamWriter(folder, vocab_size=50257, metadata=True, shard_tokens=shard_tokens) as w:
        for k in range(n_docs):
            t = rng.integers(0, 50257, int(rng.integers(1, 80)))
            spans = [(0, 1, {"concept": k})] if k % 4 == 0 else []
            w.add_document(t, {"doc": k} if k % 3 else None, spans=spans)


def read_everything(folder) -> tuple:
    """Everything a reader can return, as comparable values."""
    with TokenStreamReader(folder) as r:
        n = r.num_tokens
        tokens = r.windows([0], n)[0]
        flat, offsets = r.documents(np.arange(r.num_documents))
        meta = r.windows_metadata([0], n)
        objects = list(meta.objects)
        starts = np.arange(0, n - 16, 7)
        pos, seg, cu, maxlen = r.boundaries(starts, 16)
        return (tokens.tobytes(), flat.tobytes(), offsets.tobytes(), meta.ids.tobytes(), repr(objects),
                pos.tobytes(), seg.tobytes(), cu.tobytes(), maxlen)


def shard_paths(folder):
    d = sorted(p for p in folder.iterdir() if p.is_dir())[0]
    return [d / f for f in ("tokens.bin", "documents.index", "metadata.index", "metadata.bin", "checksums.bin")]


def flip(path, byte, bit):
    with open(path, "r+b") as f:
        f.seek(byte)
        b = f.read(1)[0]
        f.seek(byte)
        f.write(bytes([b ^ (1 << bit)]))


def flip_harness(name, folder, places, pristine) -> dict[str, int]:
    """Flip each ``(path, byte, bit)`` in turn, read everything, flip it back: every case must
    end in a typed error or the pristine output. Prints the harness's summary line."""
    counts = {"cases": 0, "typed": 0, "identical": 0}
    for path, byte, bit in places:
        flip(path, byte, bit)
        counts["cases"] += 1
        try:
            got = read_everything(folder)
        except ZerobatchError:
            counts["typed"] += 1
        else:
            assert got == pristine, f"silently wrong output after flipping bit {bit} of byte {byte} of {path.name}"
            counts["identical"] += 1
        flip(path, byte, bit)
    print(f"{name}: {counts['cases']} cases, {counts['typed']} typed errors, {counts['identical']} identical, "
          f"0 crashes, 0 silently wrong")
    assert read_everything(folder) == pristine
    return counts


def test_every_single_bit_flip_is_refused_or_harmless(tmp_path):
    folder = tmp_path / "d"
    build(folder)
    pristine = read_everything(folder)
    rng = np.random.default_rng(1)
    places = []
    for path in shard_paths(folder):
        size = path.stat().st_size
        # every byte of the trailer, both ends of the payload, and random places in between
        places += [(path, b, int(rng.integers(8))) for b in range(size - T.TRAILER_SIZE, size)]
        places += [(path, 0, 0), (path, size - T.TRAILER_SIZE - 1, 7)]
        places += [(path, int(b), int(rng.integers(8))) for b in rng.integers(0, size, 48)]
    counts = flip_harness("bit-flip harness", folder, places, pristine)
    # the top-level digests at the end of checksums.bin (version 2) are what remote readers
    # check pages of digests against; local reads check the digest lists against the manifest
    # instead, so a flip there is harmless to them (and reported by verify, below)
    sums = shard_paths(folder)[-1]
    with TokenStreamReader(folder) as r:
        sh = r._shards[0]
        top = range(sh.digest_bytes, sh.digest_bytes + sh.top_bytes)
    in_top = sum(1 for p, b, _ in places if p == sums and b in top)
    assert in_top and counts["typed"] >= counts["cases"] - 5 - in_top
    for p, b, bit in places:
        if p == sums and b in top:
            flip(p, b, bit)
            with TokenStreamReader(folder) as r:
                assert not r.verify().ok
            flip(p, b, bit)
            break


def test_verify_reports_every_damaged_chunk(tmp_path):
    folder = tmp_path / "d"
    build(folder)
    with TokenStreamReader(folder) as r:
        report = r.verify()
        assert report.ok and report.shards == len(r.manifest.shards) and report.files == 5 * report.shards
        assert report.bytes_checked == sum(f.size for e in r.manifest.shards for f in e.files.values())
    tokens, _, _, mbin, sums = shard_paths(folder)
    flip(tokens, 3, 1)
    flip(mbin, 5, 2)
    flip(sums, 0, 0)
    seen = []
    with TokenStreamReader(folder) as r:
        report = r.verify(progress=lambda done, total: seen.append((done, total)))
    assert not report.ok
    paths = {p for p, _ in report.problems}
    assert {str(tokens), str(mbin), str(sums)} <= paths
    assert seen[-1][0] == seen[-1][1] and all(a <= b for (a, _), (b, _) in zip(seen, seen[1:], strict=False))


def test_truncation_at_every_byte_and_zero_filled_tails(tmp_path):
    folder = tmp_path / "d"
    build(folder, n_docs=12)
    for path in shard_paths(folder):
        good = path.read_bytes()
        for n in range(len(good)):
            path.write_bytes(good[:n])
            with pytest.raises(TruncatedError) as info:
                TokenStreamReader(folder)
            assert info.value.path == str(path)
        # a killed writer's sparse or zero-filled tail: the trailer's kind or magic is gone (its
        # last 7 bytes are zero already: zeroing them changes nothing)
        for k in (8, 9, T.TRAILER_SIZE, min(len(good), 4096)):
            path.write_bytes(good[:-k] + bytes(k))
            with pytest.raises(CorruptError) as info:
                read_everything(folder)
            assert info.value.path == str(path)
        path.write_bytes(good[:-7] + bytes(7))
        assert path.read_bytes() == good
    read_everything(folder)


def test_checksums_are_checked_once_per_chunk_and_skipped_when_asked(tmp_path):
    folder = tmp_path / "d"
    build(folder)
    tokens = shard_paths(folder)[0]
    flip(tokens, 10, 3)
    with TokenStreamReader(folder, verify=False) as r:
        r.windows([0], r.num_tokens)          # a flip inside the vocabulary goes unseen without checksums
    with TokenStreamReader(folder) as r:
        blocks = [T.num_chunks(e.files["tokens.bin"].size, r.manifest.block) for e in r.manifest.shards]
        assert r._checks.pending == sum(blocks) > len(blocks)
        r.windows([int(r.cum_tokens[1])], 10)  # the second shard's first block: checked, and kept checked
        assert r._checks.pending == sum(blocks) - 1 and r._checks.checked(1, 0) and not r._checks.checked(1, 1)
        with pytest.raises(IntegrityError):
            r.windows([0], 10)
        # a window over several blocks checks them all, once
        r.windows([int(r.cum_tokens[1])], int(r.cum_tokens[2] - r.cum_tokens[1]))
        assert r._checks.pending == sum(blocks) - blocks[1]


@pytest.mark.slow
def test_kill_9_at_every_io_call_while_adding_a_shard(tmp_path, fork_server):
    """A dataset gets a new shard and a new manifest: killed after any I/O call, the folder
    reads as the old dataset or the new one, exactly, and a new writer then succeeds."""
    folder = tmp_path / "d"
    build(folder, n_docs=10)
    old = read_everything(folder)
    code = textwrap.dedent(f"""
        import numpy as np
        from zerobatch.writers.tokstream import ShardWriter, assemble
        folder = {str(folder)!r}
        with ShardWriter(folder, "zz-new", vocab_size=50257, metadata=True) as w:
            for k in range(5):
                w.add_document(np.arange(20) + k, {{"new": k}}, spans=[(2, 4, {{"span": k}})])
        assemble(folder)
    """)
    server = fork_server("import numpy as np\nfrom zerobatch.writers.tokstream import ShardWriter, assemble")
    probe = server.run(code + "\nfrom zerobatch.core.io import _FAULTS\nprint('CALLS', _FAULTS.calls)\n",
                       env={"ZEROBATCH_FAULT_KILL_AFTER": str(10**9)})
    assert probe.returncode == 0, probe.stderr
    total = int(probe.stdout.split("CALLS")[1])
    new = read_everything(folder)
    assert new != old
    saved = tmp_path / "saved"
    shutil.rmtree(folder / "zz-new")
    assemble(folder, sorted(p.name for p in folder.iterdir() if p.is_dir()))
    shutil.copytree(folder, saved)
    outcomes = {"old": 0, "new": 0}
    for k in range(1, total + 1):
        r = server.run(code, env={"ZEROBATCH_FAULT_KILL_AFTER": str(k)})
        assert r.returncode == -9, (k, r.returncode, r.stderr)
        got = read_everything(folder)
        assert got in (old, new), k
        outcomes["old" if got == old else "new"] += 1
        with TokenStreamReader(folder) as rd:
            assert rd.verify().ok
        shutil.rmtree(folder)
        shutil.copytree(saved, folder)
    assert outcomes["old"] >= 1 and outcomes["new"] >= 1
    print(f"kill -9 harness (tokstream shard + manifest): {total} kill points, {outcomes['old']} old, "
          f"{outcomes['new']} new, 0 mixed")
    # killed mid-shard: the shard folder is unfinished; the same writer run again succeeds
    r = run_python(code, env={"ZEROBATCH_FAULT_KILL_AFTER": str(total // 2)})
    assert r.returncode == -9
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert read_everything(folder) == new
    assert not [f for f in os.listdir(folder / "zz-new") if ".zbtmp." in f]


def test_unfinished_dataset_and_shard(tmp_path):
    folder = tmp_path / "d"
    w = ShardWriter(folder, "a", vocab_size=100)
    w.add_document([1, 2, 3])
    with pytest.raises(NotFoundError):
        TokenStreamReader(folder)               # no manifest yet
    w.abort()
    assert not [f for f in os.listdir(folder / "a") if not f.startswith(".")]


def _child_read(reader, starts, q):
    q.put(reader.windows(starts, 9).tolist())


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_reader_in_forked_and_spawned_processes(tmp_path, backend, method):
    folder = tmp_path / "d"
    build(folder)
    with TokenStreamReader(folder, backend=backend, num_threads=2) as r:
        starts = np.arange(0, r.num_tokens - 9, 37)
        want = r.windows(starts, 9).tolist()
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=_child_read, args=(r, starts, q))
        p.start()
        got = q.get(timeout=60)
        p.join(timeout=60)
        assert p.exitcode == 0 and got == want
        assert r.windows(starts, 9).tolist() == want    # the parent is unaffected


def test_a_pickled_reader_refuses_a_different_dataset(tmp_path):
    folder = tmp_path / "d"
    build(folder)
    r = TokenStreamReader(folder)
    blob = pickle.dumps(r)
    r2 = pickle.loads(blob)
    assert (r2.windows([5], 30) == r.windows([5], 30)).all() and r2.backend == r.backend
    r.close()
    r2.close()
    shutil.rmtree(folder)
    build(folder, seed=1)
    clone = pickle.loads(blob)              # opens on first use, in the process that uses it
    with pytest.raises(CorruptError) as info:
        clone.windows([5], 30)
    assert info.value.field == "build_id"


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_threads_sharing_one_reader_read_what_one_thread_reads(tmp_path, backend):
    # chunks are checked on first use and (pread) descriptors are evicted under the threads'
    # feet: every thread still gets exactly the single-threaded result
    import threading

    folder = tmp_path / "d"
    build(folder, n_docs=300, shard_tokens=400)
    with TokenStreamReader(folder) as one:
        batches = [np.random.default_rng(k).integers(0, one.num_tokens - 65, 16) for k in range(40)]
        want = [one.windows(b, 65) for b in batches]
        want_meta = [one.windows_metadata(b, 65).ids for b in batches]
    with TokenStreamReader(folder, backend=backend, max_open_files=4 if backend == "pread" else None) as r:
        errors = []

        def work(k0: int) -> None:
            try:
                for i in range(k0, k0 + 120):
                    j = i % len(batches)
                    assert (r.windows(batches[j], 65) == want[j]).all()
                    assert (r.windows_metadata(batches[j], 65).ids == want_meta[j]).all()
            except BaseException as exc:       # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(k * 7,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]


def test_every_single_bit_flip_in_the_manifest_is_refused_or_harmless(tmp_path):
    # the dataset build id hashes every field reads depend on, and the reader recomputes it
    folder = tmp_path / "d"
    build(folder, n_docs=12)
    pristine = read_everything(folder)
    path = folder / T.MANIFEST_NAME
    good = path.read_bytes()
    counts = flip_harness("manifest bit-flip harness", folder,
                          [(path, byte, byte % 8) for byte in range(len(good))], pristine)
    assert counts["typed"] >= counts["cases"] * 0.9
    # a field only recorded (the end-of-document token) is covered too
    import json
    m = json.loads(good)
    m["eod_token"] = 7
    path.write_text(json.dumps(m))
    with pytest.raises(CorruptError) as info:
        TokenStreamReader(folder)
    assert info.value.field == "build_id"
