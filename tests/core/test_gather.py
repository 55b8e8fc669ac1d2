"""Gather kernels and LLMBatchSlots against the pure-NumPy twin."""

from __future__ import annotations

import numpy as np
import pytest

from zerobatch.core import (LLMBatchSlots, TaskPool, hash_slots, max_u32, pack_llmbatch_header, pad_rows,
                            parse_llmbatch_header, widen_u32)
from zerobatch.core import _reference as R
from zerobatch.formats.errors import ConfigError, IntegrityError


def make_file(tokens: np.ndarray, batch_size: int, seq_len: int, *, checksums=True, max_token="auto"):
    """Build an LLMBATCH file in memory: (bytearray, header)."""
    nb = tokens.shape[0] // batch_size
    raw = batch_size * seq_len * 4
    padded = -(-raw // 4096) * 4096
    body = bytearray(nb * padded)
    for b in range(nb):
        body[b * padded:b * padded + raw] = tokens[b * batch_size:(b + 1) * batch_size].astype("<u4").tobytes()
    trailer = hash_slots(bytes(body), 0, padded, nb) if nb else np.zeros(0, np.uint64)
    from zerobatch.core import xxh3_64

    mt = int(tokens[:nb * batch_size].max()) if max_token == "auto" and nb else (0 if max_token == "auto" else max_token)
    h = pack_llmbatch_header(batch_size=batch_size, seq_len=seq_len, num_batches=nb, seed=0,
                             total_records=tokens.shape[0], checksums=checksums, max_token=mt,
                             trailer_hash=xxh3_64(trailer.astype("<u8").tobytes()) if checksums else 0)
    data = bytearray(h) + body + (trailer.astype("<u8").tobytes() if checksums else b"")
    return data, parse_llmbatch_header(data, len(data))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 15, 16, 17, 1000, 4096, 65537])
@pytest.mark.parametrize("kind", [np.int64, np.int32, np.uint32])
def test_widen_matches_reference(n, kind):
    rng = np.random.default_rng(n)
    hi = 2**31 if kind == np.int32 else 2**32
    src = rng.integers(0, hi, size=n, dtype=np.uint64).astype("<u4")
    a, b = np.empty(n, kind), np.empty(n, kind)
    widen_u32(src, a)
    R.widen_u32(src, b)
    assert (a == b).all() and (a.astype(np.uint64) == src.astype(np.uint64)).all()
    assert max_u32(src) == R.max_u32(src) == (int(src.max()) if n else 0)


def test_widen_unaligned_and_readonly_sources(tmp_path):
    rng = np.random.default_rng(0)
    src = rng.integers(0, 2**32, size=1001, dtype=np.uint64).astype("<u4")
    raw = b"\x00" + src.tobytes()
    unaligned = memoryview(raw)[1:]  # 1 byte off any 4-byte alignment
    out = np.empty(1001, np.int64)
    widen_u32(unaligned, out)
    assert (out == src.astype(np.int64)).all()
    path = tmp_path / "t.bin"
    src.tofile(path)
    mm = np.memmap(path, dtype="<u4", mode="r")
    assert not mm.flags.writeable
    widen_u32(mm, out)
    assert (out == src.astype(np.int64)).all()
    assert max_u32(mm) == int(src.max())


def test_widen_errors():
    src = np.arange(10, dtype=np.uint32)
    for impl in (widen_u32, R.widen_u32):
        with pytest.raises(ConfigError, match="out holds 9 elements, expected 10"):
            impl(src, np.empty(9, np.int64))
        with pytest.raises(ConfigError, match="int64, int32 or uint32"):
            impl(src, np.empty(10, np.float64))
        with pytest.raises(ConfigError, match="does not fit in int32"):
            impl(np.array([1, 2**31], np.uint32), np.empty(2, np.int32))
        with pytest.raises(ConfigError, match="multiple of 4"):
            impl(b"abcdef", np.empty(1, np.int64))
    ro = np.empty(10, np.int64)
    ro.flags.writeable = False
    with pytest.raises((ConfigError, BufferError, ValueError)):
        widen_u32(src, ro)
    with pytest.raises(ConfigError):
        R.widen_u32(src, ro)


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (1, 1), (7, 13), (32, 512)])
def test_pad_rows_matches_reference_and_definition(dtype, shape):
    k, w = shape
    rng = np.random.default_rng(k * 1000 + w)
    lengths = rng.integers(0, w + 1, size=k)
    if k > 2:
        lengths[:2] = [0, w]                                   # an empty row and a full one
    src = rng.integers(0, 50_000, size=shape).astype(dtype)
    expect_tokens = np.where(np.arange(w)[None, :] < lengths[:, None], src, dtype(7))
    expect_labels = np.where(np.arange(w)[None, :] < lengths[:, None], src, dtype(-100))
    for impl in (pad_rows, R.pad_rows):
        tokens = src.copy()
        for mask_dtype in (np.bool_, np.uint8):
            mask = np.full(shape, 99 if mask_dtype == np.uint8 else True, mask_dtype)
            labels = np.full(shape, 123, dtype)
            assert impl(tokens, lengths, 7, mask, labels, -100) is tokens
            assert (tokens == expect_tokens).all()
            assert (mask.astype(np.int64) == (np.arange(w)[None, :] < lengths[:, None])).all()
            assert (labels == expect_labels).all()
        tokens = src.copy()
        impl(tokens, lengths, 7)                               # no mask, no labels
        assert (tokens == expect_tokens).all()


def test_pad_rows_errors():
    t = np.zeros((2, 4), np.int64)
    for impl in (pad_rows, R.pad_rows):
        with pytest.raises(ConfigError, match=r"lengths\[1\] = 5 is outside \[0, 4\]") as e:
            impl(t, [1, 5])
        assert e.value.field == "lengths"
        with pytest.raises(ConfigError, match=r"lengths\[0\] = -1"):
            impl(t, [-1, 0])
        with pytest.raises(ConfigError, match="lengths holds 3 values for 2 rows"):
            impl(t, [1, 1, 1])
        with pytest.raises(ConfigError, match="tokens must be"):
            impl(t.astype(np.float64), [1, 1])
        with pytest.raises(ConfigError, match="tokens must be"):
            impl(np.zeros((4, 4), np.int64)[:, :2], [1, 1])     # not C-contiguous
        with pytest.raises(ConfigError, match="mask must be"):
            impl(t, [1, 1], 0, np.zeros((2, 3), bool))
        with pytest.raises(ConfigError, match="labels must be"):
            impl(t, [1, 1], 0, None, np.zeros((2, 4), np.int32))
        with pytest.raises(ConfigError, match="labels shares memory with tokens"):
            impl(t, [1, 1], 0, None, t)
        with pytest.raises(ConfigError, match="does not fit in int32"):
            impl(np.zeros((2, 4), np.int32), [1, 1], 2**31)
        ro = np.zeros((2, 4), np.int64)
        ro.flags.writeable = False
        with pytest.raises(ConfigError, match="tokens must be"):
            impl(ro, [1, 1])
    assert (t == 0).all()                                      # nothing written on a refused call


@pytest.fixture(params=["compiled", "reference"])
def slots_impl(request):
    return LLMBatchSlots if request.param == "compiled" else R.LLMBatchSlots


def test_slots_read_and_gather(slots_impl):
    rng = np.random.default_rng(3)
    bs, sl = 3, 5  # padded slots
    tokens = rng.integers(0, 2**31, size=(3 * 11 + 2, sl), dtype=np.uint32)
    data, hdr = make_file(tokens, bs, sl)
    s = slots_impl(data, hdr, path="mem.batch")
    assert s.num_batches == 11 and s.tokens_per_batch == 15 and not s.int32_safe
    for i in range(11):
        expect = tokens[i * bs:(i + 1) * bs]
        assert (s.view_uint32(i) == expect).all()
        assert not s.view_uint32(i).flags.writeable
        assert (s.view_int32(i) == expect.astype(np.int32)).all()
        assert (s.new_int64(i) == expect.astype(np.int64)).all()
        out = np.empty((bs, sl), np.int32)
        assert (s.read_into(i, out) == expect).all()
        assert s.is_verified(i)
    idx = np.array([10, 0, 0, 5], dtype=np.int64)
    out = np.empty((4, bs, sl), np.int64)
    s.gather(idx, out)
    for k, i in enumerate(idx):
        assert (out[k] == tokens[i * bs:(i + 1) * bs]).all()
    assert s.verify_range(0, 11) == [] and s.padding_is_zero(0, 11)
    assert s.max_token(0, 11) == int(tokens[:33].max())
    for bad in (-1, 11, 2**64):
        with pytest.raises(IndexError):
            s.view_uint32(bad)
    with pytest.raises(IndexError):
        s.gather([0, 11], np.empty((2, bs, sl), np.int64))
    with pytest.raises(TypeError):
        s.check(1.0)
    with pytest.raises(ConfigError):
        s.verify_range(5, 12)


def test_slots_detect_flipped_batch(slots_impl):
    tokens = np.arange(4 * 8 * 16, dtype=np.uint32).reshape(-1, 16)
    data, hdr = make_file(tokens, 8, 16)
    data[4096 + 2 * 4096 + 100] ^= 0x10  # batch 2
    s = slots_impl(data, hdr, path="mem.batch")
    s.view_uint32(1)
    with pytest.raises(IntegrityError, match="batch 2 does not match its checksum") as info:
        s.view_uint32(2)
    assert info.value.field == "batch_checksum"
    with pytest.raises(IntegrityError):
        s.gather([0, 2], np.empty((2, 8, 16), np.int64))
    with pytest.raises(IntegrityError):
        s.read_into(2, np.empty((8, 16), np.int64))
    assert s.verify_range(0, 4) == [2]
    unverified = slots_impl(data, hdr, verify=False)
    assert unverified.view_uint32(2).shape == (8, 16)
    # padding flips are caught by the slot checksum and by padding_is_zero
    data2, hdr2 = make_file(tokens, 8, 16)
    data2[4096 + 4096 - 1] = 1
    s2 = slots_impl(data2, hdr2)
    assert not s2.padding_is_zero(0, 4)
    assert s2.verify_range(0, 4) == [0]


def test_int32_views_refused_for_large_tokens(slots_impl):
    tokens = np.zeros((4, 8), dtype=np.uint32)
    tokens[3, 7] = 2**31
    data, hdr = make_file(tokens, 2, 8)
    s = slots_impl(data, hdr)
    assert not s.int32_safe
    s.view_int32(0)
    with pytest.raises(ConfigError, match="token id 2147483648"):
        s.view_int32(1)
    with pytest.raises(ConfigError, match="does not fit in int32"):
        s.read_into(1, np.empty((2, 8), np.int32))
    # without max_token in the header, each batch is scanned once
    data, hdr = make_file(tokens, 2, 8, max_token=None)
    s = slots_impl(data, hdr)
    assert not s.int32_safe
    s.view_int32(0)
    with pytest.raises(ConfigError):
        s.view_int32(1)


def test_gather_async_on_pool_matches_sync():
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 2**32, size=(64 * 4, 32), dtype=np.uint64).astype(np.uint32)
    data, hdr = make_file(tokens, 4, 32)
    s = LLMBatchSlots(data, hdr)
    for threads in (1, 2, 3):
        pool = TaskPool(threads, 4)  # capacity smaller than the queue: submit must block, not fail
        tickets = []
        for _ in range(40):
            idx = rng.integers(0, 64, size=int(rng.integers(1, 6)))
            out = np.empty((idx.size, 4, 32), np.int64)
            tickets.append((idx, out, s.gather_async(pool, idx, out)))
        for idx, out, t in tickets:
            assert t.wait() is out
            assert (out == tokens.reshape(64, 4, 32)[idx]).all()
        pool.stop()
        pool.stop()


def test_gather_async_reports_errors_on_wait_and_cancels():
    tokens = np.arange(8 * 8 * 16, dtype=np.uint32).reshape(-1, 16)
    data, hdr = make_file(tokens, 8, 16)
    data[4096 + 3 * 4096] ^= 1
    s = LLMBatchSlots(data, hdr, path="x.batch")
    pool = TaskPool(1)
    with pytest.raises(IndexError):
        s.gather_async(pool, [9], np.empty((1, 8, 16), np.int64))
    t = s.gather_async(pool, [3], np.empty((1, 8, 16), np.int64))
    with pytest.raises(IntegrityError, match="batch 3"):
        t.wait()
    big_tokens = np.ones((4 * 256, 1024), dtype=np.uint32)  # 1 MiB batches: each gather takes ~ms
    big, big_hdr = make_file(big_tokens, 256, 1024)
    s = LLMBatchSlots(big, big_hdr)
    tickets = [s.gather_async(pool, [0, 1, 2], np.empty((3, 256, 1024), np.int64)) for _ in range(50)]
    results = [t.cancel() for t in reversed(tickets)]
    assert any(results)  # the newest cannot all have started on one worker
    dropped = next(t for t, r in zip(reversed(tickets), results) if r)
    with pytest.raises(ConfigError, match="cancelled"):
        dropped.wait()
    kept = [t for t, r in zip(reversed(tickets), results) if not r]
    for t in kept:
        assert t.wait().shape == (3, 256, 1024)
    pool.stop()


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_pad_rows_takes_label_values_in_place_or_from_another_array(dtype):
    rng = np.random.default_rng(3)
    lengths = np.array([0, 5, 9, 3])
    src = rng.integers(0, 50_000, size=(4, 9)).astype(dtype)
    values = np.where(rng.integers(0, 2, (4, 9)) != 0, src, -100).astype(dtype)
    inside = np.arange(9)[None, :] < lengths[:, None]
    want = np.where(inside, values, -100)
    for impl in (pad_rows, R.pad_rows):
        tokens, labels = src.copy(), np.full((4, 9), 11, dtype)
        impl(tokens, lengths, 0, None, labels, -100, label_values=values)
        assert (labels == want).all() and (tokens == np.where(inside, src, 0)).all()
        tokens, labels = src.copy(), values.copy()
        impl(tokens, lengths, 0, None, labels, -100, label_values=labels)         # in place: padding only
        assert (labels == want).all()
        with pytest.raises(ConfigError, match="label_values"):
            impl(src.copy(), lengths, 0, None, None, -100, label_values=values)
        with pytest.raises(ConfigError, match="label_values"):
            impl(src.copy(), lengths, 0, None, labels, -100, label_values=values[:, :5])
        with pytest.raises(ConfigError, match="label_values overlaps"):
            big = np.zeros(40, dtype)
            impl(src.copy(), lengths, 0, None, big[:36].reshape(4, 9), -100, label_values=big[4:].reshape(4, 9))
