"""XXH3-64 kernel against the xxhash package and the pure-NumPy twin."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from zerobatch.core import _reference as R
from zerobatch.core import hash_slots, xxh3_64
from zerobatch.formats.errors import ConfigError

LENGTHS = list(range(0, 260)) + [511, 512, 1023, 1024, 1025, 2047, 4095, 4096, 4097, 65536, 65537, 100003]


@pytest.mark.parametrize("n", LENGTHS)
def test_xxh3_matches_reference_implementations(n):
    data = np.random.default_rng(n).integers(0, 256, size=n, dtype=np.uint8).tobytes()
    expected = xxhash.xxh3_64_intdigest(data)
    assert xxh3_64(data) == expected
    assert R.xxh3_64(data) == expected


def test_xxh3_accepts_any_contiguous_buffer():
    arr = np.arange(1000, dtype=np.uint32)
    expected = xxhash.xxh3_64_intdigest(arr.tobytes())
    ro = arr.copy()
    ro.flags.writeable = False
    for buf in (arr, ro, memoryview(arr), bytearray(arr.tobytes()), arr.reshape(10, 100)):
        assert xxh3_64(buf) == expected
    with pytest.raises(ConfigError):
        xxh3_64(arr[::2])


def test_hash_slots():
    data = np.random.default_rng(0).integers(0, 256, size=10 * 300 + 17, dtype=np.uint8).tobytes()
    got = hash_slots(data, 17, 300, 10)
    assert got.dtype == np.uint64
    assert [int(x) for x in got] == [xxhash.xxh3_64_intdigest(data[17 + 300 * i:17 + 300 * (i + 1)]) for i in range(10)]
    assert (R.hash_slots(data, 17, 300, 10) == got).all()
    assert hash_slots(data, 0, 1, 0).size == 0
    for args in [(17, 300, 11), (-1, 300, 1), (0, 0, 1), (len(data) + 1, 1, 0), (0, 2**62, 8)]:
        with pytest.raises(ConfigError):
            hash_slots(data, *args)
        with pytest.raises(ConfigError):
            R.hash_slots(data, *args)
