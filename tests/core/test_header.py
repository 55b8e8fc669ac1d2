"""LLMBATCH header kernels: byte layout, round trips, every validation error, and the twin."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from zerobatch.core import _reference as R
from zerobatch.core import llmbatch_geometry, pack_llmbatch_header, parse_llmbatch_header
from zerobatch.formats.errors import (
    ConfigError,
    CorruptError,
    IntegrityError,
    LimitExceededError,
    TruncatedError,
    UnsupportedVersionError,
)

IMPLS = [pytest.param((parse_llmbatch_header, pack_llmbatch_header, llmbatch_geometry), id="compiled"),
         pytest.param((R.parse_llmbatch_header, R.pack_llmbatch_header, R.llmbatch_geometry), id="reference")]


def file_size(bs, sl, nb, checksums=True):
    raw = bs * sl * 4
    padded = -(-raw // 4096) * 4096
    return 4096 + nb * padded + (8 * nb if checksums else 0)


def rehash(h: bytes) -> bytes:
    b = bytearray(h)
    struct.pack_into("<Q", b, 4088, xxhash.xxh3_64_intdigest(bytes(b[:4088])))
    return bytes(b)


def put(h: bytes, fmt: str, offset: int, value, *, ext=True) -> bytes:
    b = bytearray(h)
    struct.pack_into(fmt, b, offset, value)
    return rehash(bytes(b)) if ext else bytes(b)


@pytest.mark.parametrize("impl", IMPLS)
def test_seed_fields_at_their_offsets(impl):
    _, pack, _ = impl
    h = pack(batch_size=32, seq_len=512, num_batches=3275, seed=42, total_records=104829, extension=False)
    assert len(h) == 4096
    assert h[0:8] == b"LLMBATCH"
    assert struct.unpack_from("<I", h, 8)[0] == 1
    assert struct.unpack_from("<I", h, 12)[0] == 32
    assert struct.unpack_from("<I", h, 16)[0] == 512
    assert struct.unpack_from("<Q", h, 20)[0] == 3275
    assert struct.unpack_from("<I", h, 28)[0] == 0
    assert struct.unpack_from("<I", h, 32)[0] == 42
    assert struct.unpack_from("<I", h, 36)[0] == 104829
    assert h[40:] == bytes(4056)
    assert h == struct.pack("<8sIIIQIII", b"LLMBATCH", 1, 32, 512, 3275, 0, 42, 104829).ljust(4096, b"\0")


@pytest.mark.parametrize("impl", IMPLS)
def test_extension_layout_and_round_trip(impl):
    parse, pack, _ = impl
    bid = bytes(range(16))
    h = pack(batch_size=3, seq_len=5, num_batches=7, seed=9, total_records=23, max_token=1234,
             trailer_hash=0xDEADBEEF, build_id=bid)
    assert h[40:48] == b"ZBATCHX1"
    assert struct.unpack_from("<IIII", h, 48) == (1, 3, 1, 1234)
    trailer_offset = 4096 + 7 * 4096
    assert struct.unpack_from("<QQQ", h, 64) == (trailer_offset, 56, 0xDEADBEEF)
    assert h[88:104] == bid
    assert h[104:4088] == bytes(4088 - 104)
    assert struct.unpack_from("<Q", h, 4088)[0] == xxhash.xxh3_64_intdigest(h[:4088])
    hdr = parse(h, file_size(3, 5, 7))
    assert (hdr.batch_size, hdr.seq_len, hdr.num_batches, hdr.seed, hdr.total_records) == (3, 5, 7, 9, 23)
    assert (hdr.raw_batch_bytes, hdr.padded_batch_bytes, hdr.trailer_offset, hdr.trailer_size) == (60, 4096, trailer_offset, 56)
    assert hdr.has_extension and hdr.has_checksums and hdr.max_token == 1234 and hdr.build_id == bid
    assert hdr.file_size == file_size(3, 5, 7)
    assert hdr.to_dict()["build_id"] == bid.hex()


def test_compiled_and_reference_agree_on_random_headers():
    rng = np.random.default_rng(0)
    for _ in range(300):
        bs, sl, nb = (int(x) for x in rng.integers(1, 3000, size=3))
        kw = dict(batch_size=bs, seq_len=sl, num_batches=nb, seed=int(rng.integers(0, 2**32)),
                  total_records=int(rng.integers(0, 2**32)), max_token=int(rng.integers(0, 2**32)),
                  trailer_hash=int(rng.integers(0, 2**63)), build_id=rng.bytes(16),
                  checksums=bool(rng.integers(0, 2)), extension=bool(rng.integers(0, 2)))
        a, b = pack_llmbatch_header(**kw), R.pack_llmbatch_header(**kw)
        assert a == b
        size = file_size(bs, sl, nb, kw["checksums"] and kw["extension"])
        assert parse_llmbatch_header(a, size) == R.parse_llmbatch_header(a, size)


def test_compiled_and_reference_agree_on_mutated_headers():
    """Random byte mutations: both give the same header or the same error and field."""
    rng = np.random.default_rng(1)
    base = pack_llmbatch_header(batch_size=4, seq_len=16, num_batches=5, seed=1, total_records=20, max_token=7)
    size = file_size(4, 16, 5)
    for _ in range(2000):
        b = bytearray(base)
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(0, 120))] = int(rng.integers(0, 256))
        if rng.integers(0, 2):
            b = bytearray(rehash(bytes(b)))
        outcomes = []
        for parse in (parse_llmbatch_header, R.parse_llmbatch_header):
            try:
                outcomes.append(parse(bytes(b), size))
            except (ConfigError, CorruptError, TruncatedError, UnsupportedVersionError, LimitExceededError) as e:
                outcomes.append((type(e), e.field, str(e)))
        assert outcomes[0] == outcomes[1]


GOOD = dict(batch_size=4, seq_len=16, num_batches=5, seed=1, total_records=20, max_token=7)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mutate, size, exc, field, match", [
    (lambda h: h, 0, TruncatedError, "header", "needs at least 4096 bytes for its header, but the file holds 0"),
    (lambda h: h[:1], 1, TruncatedError, "header", "holds 1"),
    (lambda h: h[:4095], 4095, TruncatedError, "header", "holds 4095"),
    (lambda h: b"LLMBATCX" + h[8:], None, CorruptError, "magic", "not an LLMBATCH file"),
    (lambda h: b"\x93NUMPY\x01\x00" + h[8:], None, CorruptError, "magic", "not an LLMBATCH file"),
    (lambda h: put(h, "<I", 8, 2), None, UnsupportedVersionError, "version", "unsupported LLMBATCH version 2"),
    (lambda h: put(h, "<I", 28, 1), None, UnsupportedVersionError, "dtype", "unsupported token dtype code 1"),
    (lambda h: put(h, "<I", 48, 2), None, UnsupportedVersionError, "ext_version", "extension version 2"),
    (lambda h: put(h, "<I", 52, 7), None, UnsupportedVersionError, "ext_flags", "unknown flag bits 0x4"),
    (lambda h: put(h, "<I", 56, 2), None, UnsupportedVersionError, "hash_algo", "algorithm code 2"),
    (lambda h: put(h, "<B", 200, 1), None, CorruptError, "reserved", "reserved header bytes must be zero"),
    (lambda h: put(h, "<B", 200, 1, ext=False), None, IntegrityError, "header_hash", "header checksum does not match"),
    (lambda h: put(h, "<I", 12, 0), None, CorruptError, "batch_size", "between 1 and 2\\*\\*31-1, got 0"),
    (lambda h: put(h, "<I", 16, 0), None, CorruptError, "seq_len", "between 1 and 2\\*\\*31-1, got 0"),
    (lambda h: put(h, "<I", 12, 2**31), None, LimitExceededError, "batch_size", "got 2147483648"),
    (lambda h: put(h, "<I", 16, 2**32 - 1), None, LimitExceededError, "seq_len", "got 4294967295"),
    (lambda h: put(h, "<I", 12, 65536), None, TruncatedError, "num_batches", "header claims 5 batches"),
    (lambda h: put(put(h, "<I", 12, 65536), "<I", 16, 65537), None, LimitExceededError, "batch_bytes",
     "exceeds the limit of 17179869184 bytes"),
    (lambda h: put(h, "<Q", 20, 6), None, TruncatedError, "num_batches", "header claims 6 batches .* the file holds 5"),
    (lambda h: put(h, "<Q", 20, 2**32), None, TruncatedError, "num_batches", "claims 4294967296 batches"),
    (lambda h: put(h, "<Q", 20, 2**32 + 5), None, TruncatedError, "num_batches", "claims 4294967301"),
    (lambda h: put(h, "<Q", 20, 2**63), None, TruncatedError, "num_batches", "claims 9223372036854775808"),
    (lambda h: put(h, "<Q", 20, 2**64 - 1), None, TruncatedError, "num_batches", "claims 18446744073709551615"),
    (lambda h: put(h, "<Q", 20, 4), None, CorruptError, "trailer_offset", "extension says 24576"),
    (lambda h: put(h, "<Q", 72, 48), None, CorruptError, "trailer_size", "extension says 48 bytes, expected 40"),
    (lambda h: h, 4096 + 5 * 4096 + 40 + 1, CorruptError, "file_size", "1 extra bytes after the last batch"),
    (lambda h: h, 4096 + 5 * 4096 + 39, TruncatedError, "num_batches", "the file holds 4"),
])
def test_every_header_error(impl, mutate, size, exc, field, match):
    parse, pack, _ = impl
    h = mutate(pack(**GOOD))
    if size is None:
        size = file_size(4, 16, 5)
    with pytest.raises(exc, match=match) as info:
        parse(h[:size], size, path="bad.batch")
    assert info.value.field == field
    assert str(info.value).startswith("bad.batch: ")


@pytest.mark.parametrize("impl", IMPLS)
def test_legacy_header_without_extension(impl):
    parse, pack, _ = impl
    h = pack(batch_size=4, seq_len=16, num_batches=5, seed=1, total_records=20, extension=False)
    hdr = parse(h, file_size(4, 16, 5, checksums=False))
    assert not hdr.has_extension and not hdr.has_checksums and hdr.max_token is None and hdr.build_id is None
    with pytest.raises(CorruptError, match="reserved"):
        parse(put(h, "<B", 4000, 1, ext=False), file_size(4, 16, 5, checksums=False))
    with pytest.raises(CorruptError, match="extra bytes"):
        parse(h, file_size(4, 16, 5, checksums=False) + 8)


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_batches_is_a_valid_empty_file(impl):
    parse, pack, _ = impl
    for ext in (False, True):
        hdr = parse(pack(batch_size=32, seq_len=512, num_batches=0, seed=0, total_records=31, extension=ext), 4096)
        assert hdr.num_batches == 0 and hdr.file_size == 4096 and hdr.num_tokens == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_large_geometry_in_sparse_sized_file(impl):
    """Sizes past 2**32 are computed in 64 bits (the file need not exist: only its size)."""
    parse, pack, _ = impl
    bs, sl, nb = 1024, 2**20, 3  # 4 GiB per batch
    hdr = parse(pack(batch_size=bs, seq_len=sl, num_batches=nb, seed=0, total_records=bs * nb), file_size(bs, sl, nb))
    assert hdr.raw_batch_bytes == 2**32 and hdr.trailer_offset == 4096 + 3 * 2**32


@pytest.mark.parametrize("impl", IMPLS)
def test_geometry_and_pack_arguments(impl):
    _, pack, geometry = impl
    assert geometry(32, 512) == (65536, 65536)
    assert geometry(3, 5) == (60, 4096)
    assert geometry(1025, 1) == (4100, 8192)
    with pytest.raises(ConfigError, match="seq_len must be between 1 and 2\\*\\*31-1, got 0"):
        geometry(32, 0)
    with pytest.raises(ConfigError, match="batch_size must be between 1"):
        geometry(0, 5)
    with pytest.raises(LimitExceededError, match="batch_size"):
        geometry(2**31, 1)
    with pytest.raises(LimitExceededError, match="exceeds the limit"):
        geometry(2**16, 2**17)
    for bad in (-1, 1.5, True, float("nan"), "3", None):
        with pytest.raises(ConfigError):
            geometry(bad, 5)
    with pytest.raises(ConfigError, match="seed"):
        pack(batch_size=1, seq_len=1, num_batches=0, seed=2**32, total_records=0)
    with pytest.raises(ConfigError, match="total_records"):
        pack(batch_size=1, seq_len=1, num_batches=0, seed=0, total_records=-1)
    with pytest.raises(ConfigError, match="build_id"):
        pack(batch_size=1, seq_len=1, num_batches=0, seed=0, total_records=0, build_id=b"x")
    with pytest.raises(ConfigError, match="max_token"):
        pack(batch_size=1, seq_len=1, num_batches=0, seed=0, total_records=0, max_token=2**32)
