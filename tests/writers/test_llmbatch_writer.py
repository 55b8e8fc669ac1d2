"""LLMBATCH writers: byte layout, the seed's semantics, streaming memory, atomicity under faults."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import xxhash
from zbtest import SeedSpecReader, records, run_python

from zerobatch.formats.errors import ConfigError, LimitExceededError
from zerobatch.readers.llmbatch import BatchFileReader
from zerobatch.writers.llmbatch import LLMBatchWriter, write_batch_dataset, write_batch_file


def test_layout_of_a_written_file(tmp_path):
    tokens = records(10, 5, seed=2)
    path = tmp_path / "a.batch"
    assert write_batch_file(path, tokens, 3, 5, seed=11) == 3
    data = path.read_bytes()
    magic, version, bs, sl, nb, dtype, seed, total = struct.unpack_from("<8sIIIQIII", data, 0)
    assert (magic, version, bs, sl, nb, dtype, seed, total) == (b"LLMBATCH", 1, 3, 5, 3, 0, 11, 10)
    assert len(data) == 4096 + 3 * 4096 + 3 * 8
    perm = np.random.default_rng(11).permutation(10)
    for b in range(3):
        slot = data[4096 + b * 4096:4096 + (b + 1) * 4096]
        assert np.frombuffer(slot[:60], "<u4").reshape(3, 5).tolist() == tokens[perm[b * 3:(b + 1) * 3]].tolist()
        assert slot[60:] == bytes(4096 - 60)  # zero padding
        assert struct.unpack_from("<Q", data, 4096 + 3 * 4096 + 8 * b)[0] == xxhash.xxh3_64_intdigest(slot)
    assert data[40:48] == b"ZBATCHX1"
    trailer = data[4096 + 3 * 4096:]
    assert struct.unpack_from("<Q", data, 80)[0] == xxhash.xxh3_64_intdigest(trailer)
    assert struct.unpack_from("<I", data, 60)[0] == int(tokens[perm[:9]].max())


def test_a_seed_spec_reader_reads_zerobatch_files(tmp_path):
    tokens = records(100, 7, seed=3)
    path = tmp_path / "a.batch"
    write_batch_file(path, tokens, 4, 7, seed=5)
    seed_reader = SeedSpecReader(path.read_bytes())
    perm = np.random.default_rng(5).permutation(100)
    assert (seed_reader.num_batches, seed_reader.batch_size, seed_reader.seq_len) == (25, 4, 7)
    for b in range(25):
        assert (seed_reader.read_batch(b) == tokens[perm[b * 4:(b + 1) * 4]]).all()


def test_seed_writer_properties(tmp_path):
    n, sl, bs = 1003, 16, 10
    tokens = records(n, sl, seed=4)
    path = tmp_path / "a.batch"
    nb = write_batch_file(path, tokens, bs, sl, seed=42)
    assert nb == n // bs == 100
    with BatchFileReader(path) as r:
        assert (r.num_batches, r.total_records, r.seed) == (100, n, 42)
        rows = np.concatenate([r.read_batch(i) for i in range(nb)])
    ids = rows[:, 0].astype(np.int64)
    assert len(set(ids.tolist())) == nb * bs  # distinct input rows
    assert (rows == tokens[ids]).all()  # each row is an input row, unchanged
    assert ids.tolist() != sorted(ids.tolist())  # shuffled
    assert ids.tolist() == np.random.default_rng(42).permutation(n)[:nb * bs].tolist()  # documented generator
    dropped = set(range(n)) - set(ids.tolist())
    assert len(dropped) == n % bs  # the remainder is dropped
    again = tmp_path / "b.batch"
    write_batch_file(again, tokens, bs, sl, seed=42)
    assert again.read_bytes() == path.read_bytes()  # deterministic, byte for byte
    other = tmp_path / "c.batch"
    write_batch_file(other, tokens, bs, sl, seed=43)
    assert other.read_bytes() != path.read_bytes()
    plain = tmp_path / "d.batch"
    write_batch_file(plain, tokens, bs, sl, seed=42, shuffle=False)
    with BatchFileReader(plain) as r:
        assert (r.read_batch(3) == tokens[30:40]).all()


@pytest.mark.parametrize("chunked", [False, True])
def test_streaming_writer_equals_in_memory_writer(tmp_path, chunked):
    tokens = records(777, 24, seed=5)
    a, b = tmp_path / "a.batch", tmp_path / "b.batch"
    write_batch_file(a, tokens, 16, 24, seed=9)
    it = (tokens[i:i + 50] for i in range(0, 777, 50)) if chunked else iter(tokens)
    assert write_batch_dataset(b, it, 777, 16, 24, seed=9) == 777 // 16
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.compiled
def test_streaming_writer_memory_does_not_grow_with_seq_len(tmp_path):
    """Peak traced memory of the streaming writer: a few bytes per record, nothing per token."""
    r = run_python(f"""
        import tracemalloc, numpy as np
        from zerobatch.writers.llmbatch import write_batch_dataset
        def run(n, seq_len, name):
            rec = np.arange(seq_len, dtype=np.uint32)
            tracemalloc.start()
            write_batch_dataset({str(tmp_path)!r} + "/" + name, (rec for _ in range(n)), n, 8, seq_len, seed=1)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            return peak
        small = run(4096, 256, "s.batch")      # 4 MiB of tokens
        big = run(4096, 8192, "b.batch")       # 128 MiB of tokens
        many = run(65536, 16, "m.batch")       # 16x the records
        print(small, big, many)
    """, timeout=300)
    assert r.returncode == 0, r.stderr
    small, big, many = map(int, r.stdout.split())
    data_big = 4096 * 8192 * 4
    assert big < data_big / 8, (small, big)  # far below the data it wrote
    # growing seq_len 32x adds at most the hash read-back buffer (8 MiB), not the data
    assert big - small < 10 * 2**20, (small, big)
    # per-record cost: well under 64 bytes a record
    assert (many - small) / (65536 - 4096) < 64, (small, many)


def test_writer_arguments_are_validated(tmp_path):
    p = tmp_path / "x.batch"
    t = records(10, 4)
    with pytest.raises(ConfigError, match="seq_len must be between 1"):
        write_batch_file(p, t, 2, 0, seed=0)
    with pytest.raises(ConfigError, match="shape"):
        write_batch_file(p, t, 2, 5, seed=0)
    for seed in (-1, 2**32, 1.5, True, float("nan")):
        with pytest.raises(ConfigError, match="seed"):
            write_batch_file(p, t, 2, 4, seed=seed)
    with pytest.raises(ConfigError, match="integers"):
        write_batch_file(p, t.astype(np.float32), 2, 4, seed=0)
    neg = t.astype(np.int64)
    neg[3, 1] = -5
    with pytest.raises(ConfigError, match="found -5"):
        write_batch_file(p, neg, 2, 4, seed=0)
    big = t.astype(np.int64)
    big[0, 0] = 2**32
    with pytest.raises(ConfigError, match="found 4294967296"):
        write_batch_file(p, big, 2, 4, seed=0)
    with pytest.raises(LimitExceededError, match="total_records"):
        write_batch_dataset(p, iter([]), 2**32, 2, 4, seed=0)
    with pytest.raises(ConfigError, match="yielded 10 records but total_records=11"):
        write_batch_dataset(p, iter(t), 11, 2, 4, seed=0)
    with pytest.raises(ConfigError, match="more than total_records=9"):
        write_batch_dataset(p, iter(t), 9, 2, 4, seed=0)
    with pytest.raises(ConfigError, match="records of 4 tokens"):
        write_batch_dataset(p, iter([np.zeros(5, np.uint32)]), 1, 1, 4, seed=0)
    assert not p.exists() and os.listdir(tmp_path) == []  # nothing partial left behind
    # int64 tokens within range are accepted and stored exactly
    ok = t.astype(np.int64)
    write_batch_file(p, ok, 2, 4, seed=0)
    with BatchFileReader(p) as r:
        assert r.num_batches == 5


def test_fewer_records_than_a_batch_and_empty_input(tmp_path):
    p = tmp_path / "e.batch"
    assert write_batch_file(p, records(5, 8), 8, 8, seed=0) == 0
    with BatchFileReader(p) as r:
        assert r.num_batches == 0 and len(r) == 0 and r.total_records == 5 and list(r) == []
    assert write_batch_dataset(p, iter([]), 0, 8, 8, seed=0) == 0
    assert os.path.getsize(p) == 4096


def test_llmbatch_writer_appends_formed_batches(tmp_path):
    p = tmp_path / "w.batch"
    batches = records(6 * 4, 10).reshape(6, 4, 10)
    with LLMBatchWriter(p, batch_size=4, seq_len=10, seed=3) as w:
        w.write_batches(batches[:2])
        for b in batches[2:]:
            w.write_batch(b)
        with pytest.raises(ConfigError, match="expected 4 rows"):
            w.write_batch(batches[0][:3])
    with BatchFileReader(p) as r:
        assert r.num_batches == 6 and r.total_records == 24 and r.seed == 3
        assert all((r.read_batch(i) == batches[i]).all() for i in range(6))
        assert r.verify().ok
    with pytest.raises(RuntimeError):
        with LLMBatchWriter(p, batch_size=4, seq_len=10) as w:
            w.write_batch(batches[0])
            raise RuntimeError("abort")
    with BatchFileReader(p) as r:  # the previous file is untouched
        assert r.num_batches == 6


def _count_io_calls(code: str) -> int:
    r = run_python(code + "\nfrom zerobatch.core.io import _FAULTS\nprint('CALLS', _FAULTS.calls)\n",
                   env={"ZEROBATCH_FAULT_KILL_AFTER": str(10**9)})
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split("CALLS")[1])


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["file", "dataset"])
def test_kill_after_every_io_call_leaves_old_or_new_file(tmp_path, writer, fork_server):
    """SIGKILL after each system call of a write: the final name holds the old file or the
    complete new one, never a mix; the next writer cleans up the orphan and succeeds."""
    path = tmp_path / "d.batch"
    old = records(40, 6, seed=1)
    write_batch_file(path, old, 4, 6, seed=1)
    old_bytes = path.read_bytes()
    call = ("write_batch_file(p, t, 4, 6, seed=2)" if writer == "file"
            else "write_batch_dataset(p, iter(t), len(t), 4, 6, seed=2)")
    code = f"""
        import numpy as np
        from zerobatch.writers.llmbatch import write_batch_file, write_batch_dataset
        p = {str(path)!r}
        t = (np.arange(30 * 6, dtype=np.uint32).reshape(30, 6) * 7) % 1000
        {call}
    """
    import textwrap
    code = textwrap.dedent(code)
    total = _count_io_calls(code)
    new_bytes = path.read_bytes()
    assert new_bytes != old_bytes
    path.write_bytes(old_bytes)
    outcomes = {"old": 0, "new": 0}
    server = fork_server("import numpy as np\nfrom zerobatch.writers.llmbatch import write_batch_file, "
                         "write_batch_dataset")
    for k in range(1, total + 1):
        r = server.run(code, env={"ZEROBATCH_FAULT_KILL_AFTER": str(k)})
        assert r.returncode == -9, (k, r.returncode, r.stderr)
        now = path.read_bytes()
        assert now in (old_bytes, new_bytes), k
        outcomes["old" if now == old_bytes else "new"] += 1
        with BatchFileReader(path) as rd:
            assert rd.verify().ok
        path.write_bytes(old_bytes)
    assert outcomes["old"] >= 1 and outcomes["new"] >= 1
    print(f"kill -9 harness ({writer}): {total} kill points, {outcomes['old']} old, {outcomes['new']} new, 0 mixed")
    # a writer killed mid-way leaves an orphan; the next writer removes it
    r = run_python(code, env={"ZEROBATCH_FAULT_KILL_AFTER": "3"})
    assert r.returncode == -9
    assert any(".zbtmp." in f for f in os.listdir(tmp_path))
    write_batch_file(path, old, 4, 6, seed=1)
    assert [f for f in os.listdir(tmp_path) if ".zbtmp." in f] == []
