"""The C declarations in _layout.pxd and _status.pxd agree with their Python sources of truth."""

from __future__ import annotations

import re
from importlib import resources

from zerobatch.core.status import STATUS_CODES, STATUS_EXCEPTIONS
from zerobatch.formats import llmbatch as L


def _pxd(name: str) -> str:
    return resources.files("zerobatch.core").joinpath(name).read_text()


def _enum_values(text: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s+(\w+)\s*=\s*(\d+)", text, re.M)}


def test_layout_pxd_matches_formats():
    c = _enum_values(_pxd("_layout.pxd"))
    assert c["LLMBATCH_HEADER_SIZE"] == L.HEADER_SIZE
    assert c["LLMBATCH_ALIGNMENT"] == L.BATCH_ALIGNMENT
    assert c["LLMBATCH_VERSION"] == L.VERSION
    assert c["LLMBATCH_DTYPE_UINT32"] == L.DTYPE_UINT32
    assert c["LLMBATCH_TOKEN_ITEMSIZE"] == L.TOKEN_ITEMSIZE
    assert c["LLMBATCH_CHECKSUM_SIZE"] == L.CHECKSUM_SIZE
    assert c["LLMBATCH_EXT_VERSION"] == L.EXT_VERSION
    assert c["LLMBATCH_EXT_FLAG_BATCH_CHECKSUMS"] == L.EXT_FLAG_BATCH_CHECKSUMS
    assert c["LLMBATCH_EXT_FLAG_MAX_TOKEN"] == L.EXT_FLAG_MAX_TOKEN
    assert c["LLMBATCH_EXT_FLAGS_KNOWN"] == L.EXT_FLAGS_KNOWN
    assert c["LLMBATCH_HASH_ALGO_XXH3_64"] == L.HASH_ALGO_XXH3_64
    assert c["LLMBATCH_MAX_BATCH_SIZE"] == L.MAX_BATCH_SIZE
    assert c["LLMBATCH_MAX_SEQ_LEN"] == L.MAX_SEQ_LEN
    assert c["LLMBATCH_EXT_RESERVED_START"] == L.EXT_RESERVED_START
    for field, offset in L.FIELD_OFFSETS.items():
        assert c[f"LLMBATCH_OFF_{field.upper()}"] == offset, field
    text = _pxd("_layout.pxd")
    assert "{'L','L','M','B','A','T','C','H'}" in text and L.MAGIC == b"LLMBATCH"
    assert "{'Z','B','A','T','C','H','X','1'}" in text and L.EXT_MAGIC == b"ZBATCHX1"
    assert "((uint64_t)1 << 34)" in text and L.MAX_BATCH_BYTES == 1 << 34


def test_seed_struct_offsets():
    import struct

    sizes = {"magic": 8, "version": 4, "batch_size": 4, "seq_len": 4, "num_batches": 8, "dtype": 4,
             "seed": 4, "total_records": 4}
    offset = 0
    for name, size in sizes.items():
        assert L.FIELD_OFFSETS[name] == offset
        offset += size
    assert struct.calcsize(L.HEADER_STRUCT) == offset == 40


def test_status_pxd_matches_python():
    # the numbers live in _status.h (declared for Cython by _status.pxd); codes of 100 and
    # above are signals to the caller, never exceptions
    c = {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define (ZB_\w+) (\d+)", _pxd("_status.h"), re.M)}
    assert c == STATUS_CODES
    assert set(STATUS_EXCEPTIONS) == {v for v in STATUS_CODES.values() if 0 < v < 100}
