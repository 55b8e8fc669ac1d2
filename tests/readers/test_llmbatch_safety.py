"""LLMBATCH data safety (issue 17): a header edited and re-hashed (another geometry, a lower
``max_token``) is refused at open, because the build id binds the geometry and ``max_token``
to the batch checksums; and an ``int32`` narrowing never trusts ``max_token``."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from zerobatch.core import xxh3_64
from zerobatch.formats import llmbatch as L
from zerobatch.formats.errors import ConfigError, IntegrityError
from zerobatch.readers.llmbatch import BatchFileReader
from zerobatch.writers.llmbatch import write_batch_file


def make(path, big=False):
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 50000, size=(24, 8), dtype=np.uint32)
    if big:
        tokens[9, 3] = 3_000_000_000
    write_batch_file(path, tokens, 4, 8, seed=3)
    return path


def edit(path, changes: dict[str, int], *, rebuild_id: bool = False) -> None:
    """Change header fields and re-hash the header, as a tool that "fixes" a header would;
    with ``rebuild_id`` also recompute the build id (a file crafted with this very code)."""
    raw = bytearray(path.read_bytes())
    fmt = {"batch_size": "<I", "seq_len": "<I", "num_batches": "<Q", "seed": "<I", "total_records": "<I",
           "max_token": "<I"}
    for name, value in changes.items():
        struct.pack_into(fmt[name], raw, L.FIELD_OFFSETS[name], value)
    if rebuild_id:
        t_off, t_size = struct.unpack_from("<QQ", raw, L.FIELD_OFFSETS["trailer_offset"])
        max_token = struct.unpack_from("<I", raw, L.FIELD_OFFSETS["max_token"])[0]
        raw[88:104] = L.build_id(bytes(raw[:40]), max_token, np.frombuffer(bytes(raw[t_off:t_off + t_size]), "<u8"))
    struct.pack_into("<Q", raw, L.HEADER_HASH_OFFSET, xxh3_64(bytes(raw[:L.HEADER_HASH_OFFSET])))
    path.write_bytes(raw)


@pytest.mark.parametrize("changes", [
    {"seq_len": 2}, {"batch_size": 1}, {"seq_len": 16, "batch_size": 2}, {"max_token": 7}, {"seed": 4},
    {"total_records": 1},
])
def test_an_edited_and_rehashed_header_is_refused_at_open(tmp_path, changes):
    path = make(tmp_path / "a.batch")
    with BatchFileReader(path) as r:
        r.read_batch(0)
    edit(path, changes)
    for verify in (True, False):
        with pytest.raises(IntegrityError, match="build_id"):
            BatchFileReader(path, verify=verify)


def test_an_int32_narrowing_never_trusts_max_token(tmp_path):
    """Even a header crafted whole (build id recomputed) that claims a small max_token cannot
    make an int32 read return a negative id: every batch is scanned once."""
    path = make(tmp_path / "a.batch", big=True)
    edit(path, {"max_token": 60000}, rebuild_id=True)
    for verify in (True, False):
        with BatchFileReader(path, verify=verify) as r:
            assert r.header.max_token == 60000
            assert r.read_batch_numpy(0, dtype=np.int32).min() >= 0
            with pytest.raises(ConfigError, match="does not fit in int32"):
                r.read_batch_numpy(2, dtype=np.int32)
            out = np.empty((1, 4, 8), np.int32)
            with pytest.raises(ConfigError, match="int32"):
                r.read_into([2], out)
