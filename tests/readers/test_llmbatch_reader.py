"""BatchFileReader: round trips, zero copies, every crafted bad file, faults, processes, threads."""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from zbtest import records, run_python, seed_layout_bytes

from zerobatch.formats.errors import (
    ConfigError,
    CorruptError,
    FormatError,
    IntegrityError,
    LimitExceededError,
    NotFoundError,
    TruncatedError,
    UnsupportedVersionError,
    ZerobatchError,
)
from zerobatch.batch_loader import BatchFileReader  # the reader with the seed's read_batch_torch
from zerobatch.writers.llmbatch import write_batch_file

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "v1" / "llmbatch"


def golden_tokens(n, sl):
    i = np.arange(n, dtype=np.uint64)[:, None]
    j = np.arange(sl, dtype=np.uint64)[None, :]
    return ((i * 1000 + j * 7 + 3) % 50257).astype(np.uint32)


# ------------------------------------------------------------------------------------------
# golden files


def test_golden_zerobatch_file():
    p = FIXTURES / "zerobatch_3x5_seed9.batch"
    t = golden_tokens(20, 5)
    perm = np.random.default_rng(9).permutation(20)
    with BatchFileReader(p) as r:
        h = r.header
        assert (h.batch_size, h.seq_len, h.num_batches, h.seed, h.total_records) == (3, 5, 6, 9, 20)
        assert h.has_checksums and h.max_token == int(t[perm[:18]].max())
        for b in range(6):
            assert (r.read_batch(b) == t[perm[3 * b:3 * b + 3]]).all()
        assert r.verify().ok


def test_golden_files_are_still_written_byte_for_byte(tmp_path):
    p = tmp_path / "again.batch"
    write_batch_file(p, golden_tokens(20, 5), 3, 5, seed=9)
    assert p.read_bytes() == (FIXTURES / "zerobatch_3x5_seed9.batch").read_bytes()
    t = golden_tokens(16, 512)
    t[5, 100] = 4000000000
    write_batch_file(p, t, 4, 512, seed=1)
    assert p.read_bytes() == (FIXTURES / "zerobatch_4x512_seed1_bigtoken.batch").read_bytes()
    write_batch_file(p, golden_tokens(31, 512), 32, 512, seed=0)
    assert p.read_bytes() == (FIXTURES / "empty_32x512.batch").read_bytes()
    assert hashlib.sha256((FIXTURES / "seed_layout_2x4.batch").read_bytes()).hexdigest() == \
        "0eadb03ca5d7bd7502f9979c7a53a662cc4b9b9c7208aa4ebd6f562f83e254ca"


def test_golden_seed_layout_file():
    with BatchFileReader(FIXTURES / "seed_layout_2x4.batch") as r:
        h = r.header
        assert not h.has_extension and h.max_token is None and r.fingerprint.startswith("legacy:")
        assert (h.num_batches, h.seed, h.total_records) == (3, 5, 7)
        t = golden_tokens(7, 4)
        for b in range(3):
            assert (r.read_batch(b) == t[2 * b:2 * b + 2]).all()
            assert (r.read_batch_torch(b, dtype=torch.int32) == torch.from_numpy(t[2 * b:2 * b + 2].astype(np.int32))).all()
        report = r.verify()
        assert report.ok and not report.has_checksums


def test_golden_big_token_file_refuses_int32():
    with BatchFileReader(FIXTURES / "zerobatch_4x512_seed1_bigtoken.batch") as r:
        assert r.max_token == 4000000000
        big = int(np.random.default_rng(1).permutation(16).tolist().index(5)) // 4  # batch of record 5
        with pytest.raises(ConfigError, match="does not fit in int32"):
            r.read_batch_torch(big, dtype=torch.int32)
        with pytest.raises(ConfigError):
            r.read_batch_numpy(big, dtype=np.int32)
        for i in set(range(4)) - {big}:  # the header's max is not below 2**31: each batch is checked
            assert r.read_batch_torch(i, dtype=torch.int32).dtype == torch.int32
        assert int(r.read_batch_torch(big).max()) == 4000000000


def test_golden_empty_file():
    with BatchFileReader(FIXTURES / "empty_32x512.batch") as r:
        assert r.num_batches == 0 and len(r) == 0 and list(r) == [] and r.verify().ok
        with pytest.raises(IndexError):
            r.read_batch(0)


# ------------------------------------------------------------------------------------------
# reading


def test_read_batch_is_a_read_only_zero_copy_view(batch_file, tokens_small):
    perm = np.random.default_rng(7).permutation(1000)
    with BatchFileReader(batch_file) as r:
        a = r.read_batch(3)
        assert a.dtype == np.uint32 and a.shape == (8, 64) and not a.flags.writeable
        assert (a == tokens_small[perm[24:32]]).all()
        assert np.shares_memory(a, r.read_batch(3))  # both views of the same mapped pages
        with pytest.raises(ValueError):
            a[0, 0] = 1
        assert (r[3] == a).all()


def test_read_batch_torch_int64_int32_and_out(batch_file, tokens_small):
    perm = np.random.default_rng(7).permutation(1000)
    with BatchFileReader(batch_file) as r:
        expect = torch.from_numpy(tokens_small[perm[80:88]].astype(np.int64))
        t64 = r.read_batch_torch(10)
        assert t64.dtype == torch.int64 and (t64 == expect).all()
        assert (r.read_batch_torch(10, dtype=torch.int64) == expect).all()
        t32 = r.read_batch_torch(10, dtype=torch.int32)
        assert t32.dtype == torch.int32 and (t32 == expect).all()
        assert t32.data_ptr() == r.read_batch(10).ctypes.data  # shares the file's pages: no copy
        for dtype in (torch.int64, torch.int32):
            out = torch.empty((8, 64), dtype=dtype)
            assert r.read_batch_torch(10, out=out) is out and (out == expect).all()
        flat = torch.empty(8 * 64, dtype=torch.int64)
        assert (r.read_batch_torch(10, out=flat).view(8, 64) == expect).all()
        with pytest.raises(ConfigError, match="int64 or int32"):
            r.read_batch_torch(0, out=torch.empty((8, 64), dtype=torch.float32))
        with pytest.raises(ConfigError, match="expected 512"):
            r.read_batch_torch(0, out=torch.empty((8, 63), dtype=torch.int64))
        with pytest.raises(ConfigError, match="contiguous"):
            r.read_batch_torch(0, out=torch.empty((64, 8), dtype=torch.int64).t())
        with pytest.raises(ConfigError, match="dtype"):
            r.read_batch_torch(0, dtype=torch.float16)
        assert (r.read_batch_numpy(10) == expect.numpy()).all()
        assert r.read_batch_numpy(10, np.int32).dtype == np.int32
        assert r.read_batch_numpy(10, "uint32").dtype == np.uint32
        got = r.read_batches([10, 0, 10], dtype=np.int64)
        assert got.shape == (3, 8, 64) and (got[0] == expect.numpy()).all() and (got[2] == got[0]).all()


def test_int32_writes_never_reach_the_file(batch_file):
    before = batch_file.read_bytes()
    with BatchFileReader(batch_file) as r:
        t = r.read_batch_torch(2, dtype=torch.int32)
        t.fill_(7)  # copy-on-write pages: this process only
    assert batch_file.read_bytes() == before


@pytest.mark.parametrize("index", [-1, -125, 125, 2**31, 2**64, np.int64(200)])
def test_out_of_range_indices_raise_index_error(batch_file, index):
    with BatchFileReader(batch_file) as r:
        for call in (r.read_batch, r.read_batch_torch, lambda i: r.read_batch_torch(i, dtype=torch.int32),
                     r.read_batch_numpy):
            with pytest.raises(IndexError):
                call(index)
        with pytest.raises(TypeError):
            r.read_batch(1.0)
        assert (r.read_batch(np.int64(4)) == r.read_batch(4)).all()


def test_verify_once_per_batch(batch_file):
    with BatchFileReader(batch_file) as r:
        assert not r.is_verified(5)
        r.read_batch(5)
        assert r.is_verified(5) and not r.is_verified(6)


def test_legacy_file_int32_scan(tmp_path):
    t = records(8, 4)
    t[5, 2] = 2**31 + 1
    p = tmp_path / "legacy.batch"
    p.write_bytes(seed_layout_bytes(t, 2, 4))
    with BatchFileReader(p) as r:
        assert r.max_token is None
        r.read_batch_torch(0, dtype=torch.int32)
        with pytest.raises(ConfigError, match="token id 2147483649"):
            r.read_batch_torch(2, dtype=torch.int32)
        assert int(r.read_batch_torch(2)[1, 2]) == 2**31 + 1


@pytest.mark.parametrize("twin", [False, True])
def test_int32_views_checked_on_a_pool(tmp_path, twin, monkeypatch):
    # views are made at once and handed out once a task checked their batches (checksums, and
    # ids below 2**31: each batch once); evenly spaced batches come as one stacked view
    from zerobatch.core import _kernels
    from zerobatch.core.pool import TaskPool
    pool = _kernels.twin("pool").TaskPool(1) if twin else TaskPool(1)
    t = records(40, 16)
    t[22, 3] = 2**31 + 5                                   # one batch holds an id past int32
    p = tmp_path / "v.batch"
    write_batch_file(p, t, 4, 16, seed=0)
    with BatchFileReader(p) as r:
        batches = [r.read_batch(i).copy() for i in range(10)]
    big = next(i for i, b in enumerate(batches) if b.max() >= 2**31)
    bad = next(i for i in range(10) if i != big and i not in (0, 1, 2, 3, 4, 6, 8))
    d = bytearray(p.read_bytes())
    d[4096 + bad * 4096 + 9] ^= 0x10                       # a batch that does not match its checksum
    p.write_bytes(bytes(d))
    fine = [i for i in range(10) if i not in (big, bad)]
    try:
        with BatchFileReader(p) as r:
            if twin:
                twin_slots = _kernels.twin("gather").LLMBatchSlots(r._mm, r.header, verify=True, path=r.path)
                monkeypatch.setattr(r, "_slots", twin_slots)
            f = fine
            for items, stacked in ((f[0:4], f[1] - f[0] == f[2] - f[1] == f[3] - f[2]), ([f[4], f[2], f[0]], False),
                                   ([f[1], f[3]], True), ([f[5]], True), ([f[3], f[1], f[4], f[0]], False)):
                got = r.views_async(pool, items).wait()
                want = [batches[i].astype(np.int32) for i in items]
                if stacked:
                    assert isinstance(got, np.ndarray) and got.shape == (len(items), 4, 16) and got.dtype == np.int32
                else:                                   # one stacked view per evenly spaced run
                    assert isinstance(got, list) and all(g.ndim == 3 for g in got)
                    got = [b for run in got for b in run]
                    assert all(np.shares_memory(b, r.read_batch_numpy(i, dtype=np.int32)) for b, i in zip(got, items,
                                                                                                        strict=True))
                assert all((g == w).all() for g, w in zip(got, want, strict=True))
                assert all(r.is_verified(i) for i in items)
            assert len(r.views_async(pool, []).wait()) == 0
            with pytest.raises(IntegrityError, match=f"batch {bad} does not match its checksum"):
                r.views_async(pool, [f[0], bad]).wait()
            with pytest.raises(ConfigError, match="int32"):
                r.views_async(pool, [f[0], big]).wait()
            with pytest.raises(IndexError):
                r.views_async(pool, [10])
            assert (r.read_batch_numpy(f[0], dtype=np.int32) == batches[f[0]]).all()
    finally:
        pool.stop()


# ------------------------------------------------------------------------------------------
# crafted bad files


def _good_bytes(tmp_path) -> bytes:
    p = tmp_path / "good.batch"
    write_batch_file(p, records(40, 16), 4, 16, seed=0)
    return p.read_bytes()


def _header_put(data: bytes, fmt: str, offset: int, value, *, rehash=True) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    if rehash and b[40:48] == b"ZBATCHX1":
        struct.pack_into("<Q", b, 4088, xxhash.xxh3_64_intdigest(bytes(b[:4088])))
    return bytes(b)


CASES = [
    ("empty", lambda d: b"", TruncatedError, "header"),
    ("one byte", lambda d: b"L", TruncatedError, "header"),
    ("header one byte short", lambda d: d[:4095], TruncatedError, "header"),
    ("npy file", lambda d: b"\x93NUMPY\x01\x00v\x00{'descr': '<u4'}" + d[26:], CorruptError, "magic"),
    ("zip file", lambda d: b"PK\x03\x04" + d[4:], CorruptError, "magic"),
    ("pickle", lambda d: b"\x80\x04\x95" + d[3:], CorruptError, "magic"),
    ("wrong magic", lambda d: b"LLMBATCZ" + d[8:], CorruptError, "magic"),
    ("version 0", lambda d: _header_put(d, "<I", 8, 0), UnsupportedVersionError, "version"),
    ("version 2", lambda d: _header_put(d, "<I", 8, 2), UnsupportedVersionError, "version"),
    ("dtype 1", lambda d: _header_put(d, "<I", 28, 1), UnsupportedVersionError, "dtype"),
    ("unknown flag", lambda d: _header_put(d, "<I", 52, 0x80000003), UnsupportedVersionError, "ext_flags"),
    ("truncated data", lambda d: d[:-1], TruncatedError, "num_batches"),
    ("last batch cut", lambda d: d[:4096 + 9 * 4096], TruncatedError, "num_batches"),
    ("extra byte", lambda d: d + b"\0", CorruptError, "file_size"),
    ("claims one more batch", lambda d: _header_put(d, "<Q", 20, 11), TruncatedError, "num_batches"),
    ("claims 2**32 batches", lambda d: _header_put(d, "<Q", 20, 2**32), TruncatedError, "num_batches"),
    ("claims 2**32-1 batches", lambda d: _header_put(d, "<Q", 20, 2**32 - 1), TruncatedError, "num_batches"),
    ("claims 2**31-1 batches", lambda d: _header_put(d, "<Q", 20, 2**31 - 1), TruncatedError, "num_batches"),
    ("claims 2**63-1 batches", lambda d: _header_put(d, "<Q", 20, 2**63 - 1), TruncatedError, "num_batches"),
    ("claims 2**63 batches", lambda d: _header_put(d, "<Q", 20, 2**63), TruncatedError, "num_batches"),
    ("claims 2**64-1 batches", lambda d: _header_put(d, "<Q", 20, 2**64 - 1), TruncatedError, "num_batches"),
    ("fewer batches", lambda d: _header_put(d, "<Q", 20, 9), CorruptError, "trailer_offset"),
    ("geometry over 32 bits", lambda d: _header_put(_header_put(d, "<I", 12, 65536), "<I", 16, 16384), TruncatedError,
     "num_batches"),
    ("geometry over the limit", lambda d: _header_put(_header_put(d, "<I", 12, 2**20), "<I", 16, 2**20),
     LimitExceededError, "batch_bytes"),
    ("batch_size 0", lambda d: _header_put(d, "<I", 12, 0), CorruptError, "batch_size"),
    ("seq_len 0", lambda d: _header_put(d, "<I", 16, 0), CorruptError, "seq_len"),
    ("seq_len 2**31", lambda d: _header_put(d, "<I", 16, 2**31), LimitExceededError, "seq_len"),
    ("header bit flip", lambda d: _header_put(d, "<I", 12, 5, rehash=False), IntegrityError, "header_hash"),
    ("trailer flip", lambda d: d[:-3] + bytes([d[-3] ^ 4]) + d[-2:], IntegrityError, "trailer_hash"),
    ("zero-filled tail", lambda d: d[:-100] + bytes(100), IntegrityError, "trailer_hash"),
]


@pytest.mark.parametrize("name, mutate, exc, field", CASES, ids=[c[0] for c in CASES])
def test_crafted_bad_files(tmp_path, name, mutate, exc, field):
    p = tmp_path / "bad.batch"
    p.write_bytes(mutate(_good_bytes(tmp_path)))
    with pytest.raises(exc) as info:
        BatchFileReader(p)
    assert info.value.field == field
    assert str(info.value).startswith(str(p))


def test_flipped_batch_raises_on_read_not_open(tmp_path):
    d = bytearray(_good_bytes(tmp_path))
    d[4096 + 3 * 4096 + 17] ^= 0x80
    p = tmp_path / "flip.batch"
    p.write_bytes(bytes(d))
    with BatchFileReader(p) as r:
        r.read_batch(2)
        for call in (r.read_batch, r.read_batch_torch, lambda i: r.read_batch_torch(i, dtype=torch.int32),
                     lambda i: r.read_batches([i])):
            with pytest.raises(IntegrityError, match="batch 3 does not match its checksum"):
                call(3)
        report = r.verify()
        assert not report.ok and report.bad_batches == (3,)
    with BatchFileReader(p, verify=False) as r:
        r.read_batch(3)  # the caller asked not to verify


def test_not_a_file(tmp_path):
    with pytest.raises(NotFoundError):
        BatchFileReader(tmp_path / "missing.batch")
    with pytest.raises(FormatError, match="a directory"):
        BatchFileReader(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(FormatError, match="a FIFO"):
        BatchFileReader(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(ZerobatchError):
        BatchFileReader(tmp_path / "loop")


@pytest.mark.slow
def test_every_single_bit_flip_is_caught_or_harmless(tmp_path):
    """Flip each bit of a small file in turn: a typed error or byte-identical output, never
    a crash or wrong tokens (runs in a child so a crash would be caught and reported)."""
    p = tmp_path / "small.batch"
    write_batch_file(p, records(5, 4, seed=3), 2, 4, seed=1)  # 2 padded batches: 12304 bytes
    r = run_python(f"""
        import os, numpy as np
        from zerobatch.batch_loader import BatchFileReader
        from zerobatch.formats.errors import ZerobatchError
        src = {str(p)!r}
        good = open(src, "rb").read()
        with BatchFileReader(src) as rd:
            expect = [rd.read_batch_torch(i).numpy().copy() for i in range(rd.num_batches)]
        work = src + ".flip"
        open(work, "wb").write(good)
        # each case rewrites the one byte in place (a truncating rewrite of the whole file
        # costs ten times the read on this filesystem), and puts it back after
        fd = os.open(work, os.O_RDWR)
        typed = same = wrong = 0
        for byte in range(len(good)):
            for bit in range(8):
                os.pwrite(fd, bytes([good[byte] ^ (1 << bit)]), byte)
                try:
                    with BatchFileReader(work) as rd:
                        got = [rd.read_batch_torch(i).numpy() for i in range(rd.num_batches)]
                        got32 = [rd.read_batch_torch(i, dtype=__import__("torch").int32).numpy() for i in range(rd.num_batches)]
                        # compared before the byte is put back: the batches may view the mapping
                        ok = len(got) == len(expect) and all((g == e).all() for g, e in zip(got, expect)) \\
                            and all((g == e).all() for g, e in zip(got32, expect))
                except ZerobatchError:
                    typed += 1
                else:
                    same += ok
                    wrong += not ok
                os.pwrite(fd, good[byte:byte + 1], byte)
        print(len(good) * 8, typed, same, wrong)
    """, timeout=600)
    assert r.returncode == 0, r.stderr
    tried, typed, same, wrong = map(int, r.stdout.split())
    print(f"bit-flip harness: {tried} cases, {typed} typed errors, {same} identical, 0 crashes, {wrong} silent wrong")
    assert tried == typed + same and wrong == 0
    assert typed > tried * 0.99  # every byte is covered by a checksum


@pytest.mark.slow
def test_truncation_at_every_byte(tmp_path):
    p = tmp_path / "small.batch"
    write_batch_file(p, records(5, 4, seed=3), 2, 4, seed=1)
    good = p.read_bytes()
    cut = tmp_path / "cut.batch"
    typed = 0
    for n in range(len(good)):
        cut.write_bytes(good[:n])
        with pytest.raises((TruncatedError, CorruptError, IntegrityError)):
            BatchFileReader(cut)
        typed += 1
    for n in (1, 8, 4096, len(good) - 4096):  # zero-filled tails left by a killed writer
        cut.write_bytes(good[:-n] + bytes(n))
        with pytest.raises(ZerobatchError):
            with BatchFileReader(cut) as r:
                for i in range(r.num_batches):
                    r.read_batch(i)
        typed += 1
    print(f"truncation harness: {typed} cases, {typed} typed errors, 0 crashes, 0 silent wrong")


def test_file_over_4_gib_is_read_correctly(tmp_path):
    """A sparse seed-layout file with batches past 4 GiB: offsets stay exact (no checksums, so
    nothing has to read the zeros)."""
    bs, sl, nb = 1024, 2**20, 2  # 4 GiB per batch
    p = tmp_path / "huge.batch"
    raw = bs * sl * 4
    with open(p, "wb") as f:
        f.write(struct.pack("<8sIIIQIII", b"LLMBATCH", 1, bs, sl, nb, 0, 0, bs * nb).ljust(4096, b"\0"))
        f.truncate(4096 + nb * raw)
        f.seek(4096 + raw + 5 * sl * 4 + 123 * 4)  # batch 1, row 5, token 123
        f.write(struct.pack("<I", 777))
    with BatchFileReader(p) as r:
        assert r.header.trailer_offset == 4096 + 2 * raw > 2**33
        b1 = r.read_batch(1)
        assert int(b1[5, 123]) == 777 and int(b1[5, 122]) == 0
        assert int(r.read_batch(0)[5, 123]) == 0


# ------------------------------------------------------------------------------------------
# processes, threads, lifetime


def test_pickle_reopens_and_checks_identity(batch_file, tmp_path):
    r = BatchFileReader(batch_file)
    clone = pickle.loads(pickle.dumps(r))
    assert clone.fingerprint == r.fingerprint and (clone.read_batch(4) == r.read_batch(4)).all()
    blob = pickle.dumps(r)
    assert len(blob) < 500  # a path, not the data
    write_batch_file(batch_file, records(16, 64, seed=9), 8, 64, seed=1)  # the file is replaced
    clone = pickle.loads(blob)              # opens on first use, in the process that uses it
    with pytest.raises(IntegrityError, match="changed since this reader was pickled"):
        clone.read_batch(0)


def test_reader_opened_before_fork(batch_file):
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    r = BatchFileReader(batch_file)
    expect = [r.read_batch_torch(i) for i in range(0, 125, 7)]
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: read through the inherited mapping
        ok = all(bool((r.read_batch_torch(i) == e).all()) for i, e in zip(range(0, 125, 7), expect))
        ok = ok and bool((r.read_batch_torch(3, dtype=torch.int32) == r.read_batch_torch(3)).all())
        os.write(wfd, b"1" if ok else b"0")
        os._exit(0)
    os.close(wfd)
    assert os.read(rfd, 1) == b"1"
    os.waitpid(pid, 0)
    os.close(rfd)


def test_reader_in_spawn_workers(batch_file, tmp_path):
    r = run_python(f"""
        import multiprocessing as mp, pickle
        from zerobatch.readers.llmbatch import BatchFileReader
        def work(reader):
            return [int(reader.read_batch(i).sum()) for i in range(10)]
        if __name__ == "__main__":
            r = BatchFileReader({str(batch_file)!r})
            expect = [int(r.read_batch(i).sum()) for i in range(10)]
            for method in ("spawn", "forkserver", "fork"):
                with mp.get_context(method).Pool(2) as pool:
                    assert pool.map(work, [r, r]) == [expect, expect], method
            print("ok")
    """, timeout=180, script_dir=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_threads_read_identically(batch_file):
    r = BatchFileReader(batch_file)
    expect = [r.read_batch_torch(i).clone() for i in range(125)]
    fresh = BatchFileReader(batch_file)  # nothing verified yet: threads race on verification too
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for i in rng.integers(0, 125, size=400):
            if not (fresh.read_batch_torch(int(i)) == expect[i]).all():
                errors.append(int(i))
            fresh.read_batches([int(i), 0])

    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []


def test_close_and_views_outliving_the_reader(batch_file):
    r = BatchFileReader(batch_file)
    view = r.read_batch(1)
    expect = view.copy()
    r.close()
    r.close()
    assert r.closed and (view == expect).all()  # the mapping lives as long as the view
    with pytest.raises(ConfigError, match="closed"):
        r.read_batch(0)


def test_truncation_under_a_live_mapping_is_sigbus_documented_limit(batch_file):
    """External truncation of a mapped file is the documented limit: the reader dies with
    SIGBUS (zerobatch writers never shrink a published file; they rename a new one)."""
    r = run_python(f"""
        import os
        from zerobatch.batch_loader import BatchFileReader
        r = BatchFileReader({str(batch_file)!r}, verify=False)
        os.truncate({str(batch_file)!r}, 4096)
        r.read_batch_torch(100)
    """)
    assert r.returncode == -7  # SIGBUS


def test_readers_never_import_torch():
    r = run_python("""
        import sys
        import zerobatch.readers, zerobatch.writers, zerobatch.samplers, zerobatch.core, zerobatch.formats
        import zerobatch.readers.llmbatch
        print("torch" in sys.modules)
    """)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
