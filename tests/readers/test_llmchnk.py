"""LLMCHNK: round trips, gathers against NumPy, the compiled kernel against its twin, the
crafted-file cases of RELIABILITY.md, atomic writes, conversions with LLMBATCH, the loader."""

from __future__ import annotations

import os
import pickle
import struct
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from zbtest import records, run_python

from zerobatch.adapters.convert import llmbatch_to_llmchnk, llmchnk_to_llmbatch
from zerobatch.adapters.torch import LLMChunkSource, Loader
from zerobatch.core import ChunkRecords
from zerobatch.core import _reference as ref
from zerobatch.formats import llmchnk as C
from zerobatch.formats.errors import (ConfigError, CorruptError, FormatError, IntegrityError, LimitExceededError,
                                      NotFoundError, TruncatedError, UnsupportedVersionError, ZerobatchError)
from zerobatch.readers.llmbatch import BatchFileReader
from zerobatch.readers.llmchnk import LLMChunkReader
from zerobatch.writers.llmbatch import write_batch_file
from zerobatch.writers.llmchnk import LLMChunkWriter, write_chunk_file


def random_records(n, max_len=30, vocab=2**32, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(0, max_len)), dtype=np.uint64) for _ in range(n)]


def expected_gather(recs, idx, width, pad):
    out = np.full((len(idx), width), pad, np.int64)
    mask = np.zeros((len(idx), width), bool)
    for r, i in enumerate(idx):
        k = min(len(recs[i]), width)
        out[r, :k] = recs[i][:k]
        mask[r, :k] = True
    return out, mask


@pytest.mark.parametrize("dtype, vocab", [("uint32", 2**32), ("uint16", 2**16)])
@pytest.mark.parametrize("checksums", [True, False])
def test_round_trip(tmp_path, dtype, vocab, checksums):
    recs = random_records(200, vocab=vocab)
    p = tmp_path / "d.chunk"
    assert write_chunk_file(p, recs, seq_len=24, dtype=dtype, checksums=checksums) == 200
    assert [f for f in os.listdir(tmp_path)] == ["d.chunk"]          # no staging file left
    with LLMChunkReader(p) as r:
        assert (r.num_records, r.seq_len, r.dtype) == (200, 24, np.dtype(dtype).newbyteorder("<"))
        assert r.num_tokens == sum(len(x) for x in recs)
        assert all((r.read_record(i) == recs[i]).all() for i in range(200))
        assert (r.lengths() == [len(x) for x in recs]).all()
        assert all((a == b).all() for a, b in zip(r, recs, strict=True))
        v = r.read_record(-1)
        assert not v.flags.writeable and (v == recs[-1]).all()
        assert r.verify().ok
        idx = [5, 199, 0, 5, 77]
        got, mask = r.gather(idx, 16, pad_id=3)
        want, wmask = expected_gather(recs, idx, 16, 3)
        assert (got == want).all() and (mask == wmask).all()
        full = [i for i in range(200) if len(recs[i]) >= 10][:4]
        got, mask = r.gather(full, 10)
        assert mask is None and (got == expected_gather(recs, full, 10, 0)[0]).all()
        if dtype == "uint16":
            got32, _ = r.gather(idx, 16, dtype=np.int32)
            assert (got32 == expected_gather(recs, idx, 16, 0)[0]).all()
        clone = pickle.loads(pickle.dumps(r))
        assert (clone.read_record(9) == recs[9]).all()
    write_chunk_file(tmp_path / "e.chunk", [])
    with LLMChunkReader(tmp_path / "e.chunk") as r:
        assert r.num_records == 0 and r.gather([], 4)[0].shape == (0, 4)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=12), max_size=30),
       st.integers(1, 16), st.integers(0, 2**31 - 1), st.data())
def test_gather_equals_numpy_and_the_twin(tmp_path_factory, recs, width, pad, data):
    p = tmp_path_factory.mktemp("h") / "h.chunk"
    recs = [np.array(x, np.uint64) for x in recs]
    write_chunk_file(p, recs)
    with LLMChunkReader(p) as r:
        if not recs:
            return
        idx = data.draw(st.lists(st.integers(0, len(recs) - 1), max_size=20))
        got, mask = r.gather(idx, width, pad_id=pad)
        want, wmask = expected_gather(recs, idx, width, pad)
        assert (got == want).all()
        if mask is None:
            assert wmask.all()                           # no row was padded
        else:
            assert (mask == wmask).all()
        twin = ref.ChunkRecords(r._mm, len(recs), 4, True, np.zeros(len(recs), np.uint8), str(p))
        out = np.empty((len(idx), width), np.int64)
        m = np.empty((len(idx), width), bool)
        lens = twin.gather(idx, out, m, pad)
        assert (out == want).all() and (m == wmask).all()
        assert (lens == [len(recs[i]) for i in idx]).all()


def test_kernel_and_twin_refuse_alike(tmp_path):
    recs = [np.array([1, 2, 2**31 + 5], np.uint64), np.array([4], np.uint64)]
    p = tmp_path / "k.chunk"
    write_chunk_file(p, recs)
    r = LLMChunkReader(p)
    for impl in (ChunkRecords(r._mm, 2, 4, True, np.zeros(2, np.uint8), "k"),
                 ref.ChunkRecords(r._mm, 2, 4, True, np.zeros(2, np.uint8), "k")):
        with pytest.raises(IndexError):
            impl.gather([0, 2], np.empty((2, 3), np.int64))
        with pytest.raises(ConfigError, match="int32"):
            impl.gather([0], np.empty((1, 3), np.int32))
        assert (impl.gather([1], np.empty((1, 3), np.int32)) == [1]).all()
        for bad_out in (np.empty((2, 3), np.float64), np.empty((3, 3), np.int64), np.empty((2, 3), np.int64)[:, ::2]):
            with pytest.raises(ConfigError):
                impl.gather([0, 1], bad_out)
        with pytest.raises(ConfigError):
            impl.gather([0, 1], np.empty((2, 3), np.int64), np.empty((2, 4), bool))
    with pytest.raises(ConfigError, match="seq_len"):
        LLMChunkReader(write_chunk_file(tmp_path / "n.chunk", recs) and tmp_path / "n.chunk").gather([0])


# ---------------------------------------------------------------------------------------------
# crafted files


@pytest.fixture
def small(tmp_path):
    p = tmp_path / "s.chunk"
    write_chunk_file(p, random_records(6, max_len=8, seed=2), seq_len=8)
    return p, p.read_bytes()


def reopen(tmp_path, data):
    p = tmp_path / "crafted.chunk"
    p.write_bytes(data)
    with LLMChunkReader(p) as r:
        r.gather(np.arange(r.num_records), 8)
        r.verify()


def test_structure_faults_are_typed(tmp_path, small):
    _, good = small
    n = 6
    cases = {
        b"": TruncatedError, good[:1]: TruncatedError, good[:31]: TruncatedError, good[:32]: TruncatedError,
        b"NOTCHNK\0" + good[8:]: CorruptError,
        good[:8] + struct.pack("<I", 2) + good[12:]: UnsupportedVersionError,
        good[:12] + struct.pack("<I", 2) + good[16:]: UnsupportedVersionError,
        good[:28] + struct.pack("<I", 7) + good[32:]: CorruptError,
        good[:-8] + b"XXXXXXXX": CorruptError,
        good[:-16] + bytes(8) + good[-8:]: IntegrityError,
        good + b"\0": FormatError,
    }
    for count in (0, 1, 5, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1):
        if count != n:
            cases[good[:16] + struct.pack("<Q", count) + good[24:]] = FormatError
    for data, err in cases.items():
        with pytest.raises(err):
            reopen(tmp_path, data)
    # offset tables that lie: re-sign the digest so only the table check can refuse them
    table = np.frombuffer(good, "<u8", n + 1, 32).copy()
    for t in {"first": np.r_[table[0] + 4, table[1:]], "last": np.r_[table[:-1], table[-1] + 4],
                    "backwards": np.r_[table[:2], table[1] - 4, table[3:]],
                    "odd": np.r_[table[:2], table[2] + 1, table[3:]]}.values():
        data = bytearray(good)
        data[32:32 + 8 * (n + 1)] = t.astype("<u8").tobytes()
        data = _resign(bytes(data), n)
        with pytest.raises(CorruptError, match="offsets"):
            reopen(tmp_path, data)
    for kind in ("dir", "fifo", "missing"):
        target = tmp_path / kind
        if kind == "dir":
            target.mkdir()
        elif kind == "fifo":
            os.mkfifo(target)
        with pytest.raises(NotFoundError if kind == "missing" else FormatError):
            LLMChunkReader(target)
    p = tmp_path / "n.npy"
    np.save(p, np.arange(100))
    with pytest.raises(CorruptError, match="magic"):
        LLMChunkReader(p)


def _resign(data: bytes, n: int) -> bytes:
    from zerobatch.core.digest import block_digest
    size = len(data)
    start, sums = 32 + 8 * (n + 1), size - 16 - 8 * n
    d = block_digest([data[:start], data[sums:size - 16]], C.DIGEST_BLOCK)
    return data[:size - 16] + struct.pack("<Q", d) + data[size - 8:]


def test_a_count_far_beyond_the_file_is_refused_before_any_allocation(tmp_path, small):
    _, good = small
    data = good[:16] + struct.pack("<Q", 2**60) + good[24:]
    with pytest.raises(LimitExceededError, match="num_records"):
        reopen(tmp_path, data)


def test_every_single_bit_flip_is_caught_or_harmless(small):
    p, _ = small
    r = run_python(f"""
        import os
        import numpy as np
        from zerobatch.readers.llmchnk import LLMChunkReader
        from zerobatch.formats.errors import ZerobatchError
        src = {str(p)!r}
        good = open(src, "rb").read()
        with LLMChunkReader(src) as rd:
            expect = [rd.read_record(i).copy() for i in range(rd.num_records)]
            g_expect = rd.gather(np.arange(rd.num_records), 8)[0].copy()
        work = src + ".flip"
        open(work, "wb").write(good)
        fd = os.open(work, os.O_RDWR)   # one byte rewritten in place per case, put back after
        typed = same = wrong = 0
        for byte in range(len(good)):
            for bit in range(8):
                os.pwrite(fd, bytes([good[byte] ^ (1 << bit)]), byte)
                try:
                    with LLMChunkReader(work) as rd:
                        got = [rd.read_record(i).copy() for i in range(rd.num_records)]
                        g = rd.gather(np.arange(rd.num_records), 8)[0]
                except ZerobatchError:
                    typed += 1
                    continue
                finally:
                    os.pwrite(fd, good[byte:byte + 1], byte)
                same_records = all(a.shape == b.shape and (a == b).all() for a, b in zip(got, expect))
                if len(got) == len(expect) and same_records and (g == g_expect).all():
                    same += 1
                else:
                    wrong += 1
        print(len(good) * 8, typed, same, wrong)
    """, timeout=600)
    assert r.returncode == 0, r.stderr
    tried, typed, same, wrong = map(int, r.stdout.split())
    print(f"LLMCHNK bit-flip harness: {tried} cases, {typed} typed errors, {same} identical, 0 crashes, "
          f"{wrong} silent wrong")
    assert tried == typed + same and wrong == 0 and typed == tried


def test_truncation_at_every_byte_and_zero_filled_tails(tmp_path, small):
    _, good = small
    for cut in range(len(good)):
        with pytest.raises(FormatError):
            reopen(tmp_path, good[:cut])
    for k in (8, 16, 40):
        with pytest.raises(FormatError):
            reopen(tmp_path, good[:-k] + bytes(k))


# ---------------------------------------------------------------------------------------------
# writing


def test_writer_refuses_bad_records_and_keeps_the_old_file(tmp_path):
    p = tmp_path / "w.chunk"
    write_chunk_file(p, [[1, 2, 3]])
    old = p.read_bytes()
    for bad, dtype in (([[-1]], "uint32"), ([[2**32]], "uint32"), ([[70000]], "uint16"), ([[1.5]], "uint32"),
                       ([[[1, 2]]], "uint32"), ([[True]], "uint32")):
        with pytest.raises(ConfigError):
            write_chunk_file(p, bad, dtype=dtype)
        assert p.read_bytes() == old and sorted(os.listdir(tmp_path)) == ["w.chunk"]
    for kw in ({"dtype": "int8"}, {"seq_len": -1}, {"seq_len": 2**32}):
        with pytest.raises(ConfigError):
            LLMChunkWriter(p, **kw)
    with pytest.raises(RuntimeError):
        with LLMChunkWriter(p) as w:
            w.add([5, 6])
            raise RuntimeError("abort")
    assert p.read_bytes() == old and sorted(os.listdir(tmp_path)) == ["w.chunk"]


@pytest.mark.parametrize("shape, dtype", [((300, 17), "uint32"), ((5, 0), "uint32"), ((40, 9), "uint16")])
def test_a_2d_array_is_written_whole_and_byte_identical(tmp_path, shape, dtype):
    rows = np.random.default_rng(1).integers(0, 60000, shape)
    a, b = tmp_path / "a.chunk", tmp_path / "b.chunk"
    write_chunk_file(a, rows, seq_len=shape[1], dtype=dtype)
    write_chunk_file(b, list(rows), seq_len=shape[1], dtype=dtype)
    assert a.read_bytes() == b.read_bytes()
    with pytest.raises(ConfigError, match="records 0..299"):
        write_chunk_file(tmp_path / "c.chunk", np.full((300, 2), -1))


@pytest.mark.compiled
def test_writer_memory_is_bounded(tmp_path):
    """Peak traced memory of the writer: neither the tokens nor the records' table are held."""
    r = run_python(f"""
        import tracemalloc, numpy as np
        from zerobatch.writers.llmchnk import LLMChunkWriter
        def run(n, length, name):
            rec = np.arange(length, dtype=np.uint32)
            tracemalloc.start()
            with LLMChunkWriter({str(tmp_path)!r} + "/" + name) as w:
                for _ in range(n):
                    w.add(rec)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            return peak
        print(run(2000, 512, "s.chunk"), run(2000, 16384, "b.chunk"), run(100000, 4, "m.chunk"))
    """, timeout=300)
    assert r.returncode == 0, r.stderr
    small, big, many = map(int, r.stdout.split())
    assert big < 2000 * 16384 * 4 / 8, (small, big)          # far below the 128 MiB of tokens
    assert big - small < 12 * 2**20, (small, big)            # the copy buffer, not the data
    assert many < 16 * 2**20, many                            # 100,000 records: the table is not held


@pytest.mark.slow
def test_kill_after_every_io_call_leaves_old_or_new_file(tmp_path, fork_server):
    path = tmp_path / "k.chunk"
    write_chunk_file(path, [[1, 2, 3], [4]])
    old = path.read_bytes()
    code = textwrap.dedent(f"""
        import numpy as np
        from zerobatch.writers.llmchnk import write_chunk_file
        write_chunk_file({str(path)!r}, [np.arange(k) for k in range(12)], seq_len=5)
    """)
    r = run_python(code + "\nfrom zerobatch.core.io import _FAULTS\nprint('CALLS', _FAULTS.calls)\n",
                   env={"ZEROBATCH_FAULT_KILL_AFTER": str(10**9)})
    assert r.returncode == 0, r.stderr
    total = int(r.stdout.split("CALLS")[1])
    new = path.read_bytes()
    outcomes = {"old": 0, "new": 0}
    server = fork_server("import numpy as np\nfrom zerobatch.writers.llmchnk import write_chunk_file")
    for k in range(1, total + 1):
        path.write_bytes(old)
        r = server.run(code, env={"ZEROBATCH_FAULT_KILL_AFTER": str(k)})
        assert r.returncode == -9, (k, r.returncode, r.stderr)
        now = path.read_bytes()
        assert now in (old, new), k
        outcomes["old" if now == old else "new"] += 1
        with LLMChunkReader(path) as rd:
            assert rd.verify().ok
    assert outcomes["old"] >= 1 and outcomes["new"] >= 1
    print(f"LLMCHNK kill -9 harness: {total} kill points, {outcomes['old']} old, {outcomes['new']} new, 0 mixed")
    assert any(".zbtmp." in f for f in os.listdir(tmp_path))   # orphans of the last killed writer
    write_chunk_file(path, [[1]])
    assert [f for f in os.listdir(tmp_path) if ".zbtmp." in f] == []


# ---------------------------------------------------------------------------------------------
# conversions and the loader


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_llmchnk_to_llmbatch_is_the_seed_writer_at_any_batch_size(tmp_path, batch_size):
    rows = records(50, 6, seed=4)
    chunk = tmp_path / "r.chunk"
    write_chunk_file(chunk, rows, seq_len=6)
    out = tmp_path / "b.batch"
    n = llmchnk_to_llmbatch(chunk, out, batch_size, seed=9)
    assert n == 50 // batch_size
    write_batch_file(tmp_path / "direct.batch", rows, batch_size, 6, seed=9)
    assert out.read_bytes() == (tmp_path / "direct.batch").read_bytes()
    back = tmp_path / "back.chunk"
    assert llmbatch_to_llmchnk(out, back) == n * batch_size
    with LLMChunkReader(back) as r, BatchFileReader(out) as b:
        assert r.seq_len == 6
        flat = np.concatenate([b.read_batch(i) for i in range(b.num_batches)])
        assert all((r.read_record(i) == flat[i]).all() for i in range(r.num_records))


def test_conversion_of_variable_lengths_needs_a_pad_id(tmp_path):
    chunk = tmp_path / "v.chunk"
    write_chunk_file(chunk, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=3)
    with pytest.raises(ConfigError, match="record 1"):
        llmchnk_to_llmbatch(chunk, tmp_path / "v.batch", 1)
    assert not (tmp_path / "v.batch").exists()
    llmchnk_to_llmbatch(chunk, tmp_path / "v.batch", 1, pad_id=0, shuffle=False)
    with BatchFileReader(tmp_path / "v.batch") as b:
        assert [b.read_batch(i).tolist() for i in range(3)] == [[[1, 2, 3]], [[4, 5, 0]], [[6, 7, 8]]]


def test_the_loader_reads_every_record_once_per_epoch(tmp_path):
    recs = random_records(90, max_len=12, vocab=1000, seed=5)
    for i, r in enumerate(recs):                      # record i starts with i + 1000
        recs[i] = np.r_[np.uint64(i + 1000), r]
    p = tmp_path / "l.chunk"
    write_chunk_file(p, recs, seq_len=8)
    ld = Loader(LLMChunkSource(str(p), mask=True), batch_size=16, seed=3, drop_last=False)
    seen = []
    for b in ld:
        assert b["input_ids"].dtype == torch.int64 and b["input_ids"].shape[1] == 8
        seen += (b["input_ids"][:, 0] - 1000).tolist()
        lens = [min(len(recs[i]), 8) for i in (b["input_ids"][:, 0] - 1000).tolist()]
        assert b["attention_mask"].sum(1).tolist() == lens
    assert sorted(seen) == list(range(90))
    plain = next(iter(Loader(LLMChunkSource(str(p)), batch_size=4, shuffle=False, dtype=torch.int32)))
    assert plain.dtype == torch.int32 and plain[:, 0].tolist() == [1000, 1001, 1002, 1003]
    with pytest.raises(ZerobatchError):
        LLMChunkSource(str(tmp_path / "missing.chunk"))
