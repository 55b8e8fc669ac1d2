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


_PATH_CHECK = """
import sys, numpy as np, xxhash
from zerobatch.core import xxh3_kernel
from zerobatch.core import hash_slots, xxh3_64
from zerobatch.readers.llmbatch import BatchFileReader
from zerobatch.writers.llmbatch import write_batch_file
rng = np.random.default_rng(7)
raw = rng.integers(0, 256, size=200_003, dtype=np.uint8).tobytes()
for n in [241, 255, 256, 1023, 1024, 1025, 4097, 65536, 100_003]:
    for at in (0, 1, 3):                                  # unaligned starts too
        assert xxh3_64(raw[at:at + n]) == xxhash.xxh3_64_intdigest(raw[at:at + n]), (n, at)
got = hash_slots(raw, 5, 1000, 100)
assert [int(x) for x in got] == [xxhash.xxh3_64_intdigest(raw[5 + 1000 * i:1005 + 1000 * i]) for i in range(100)]
write_batch_file(sys.argv[1], rng.integers(0, 50_000, (64, 128)).astype(np.uint32), 8, 128, 1)
with BatchFileReader(sys.argv[1]) as r:                  # checksums made and checked by the kernels
    assert r.verify().ok and r.read_batches(list(range(8))).shape == (8, 8, 128)
print(xxh3_kernel())
"""


@pytest.mark.parametrize("cap", ["sse2", "avx2", ""])
def test_every_xxh3_kernel_path_gives_the_same_digest(cap, tmp_path):
    """The x86-64 build picks an AVX-512, AVX2 or SSE2 long-input loop at run time; each must
    compute XXH3-64 (ZEROBATCH_XXH3 caps the choice, in a process of its own)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ZEROBATCH_XXH3=cap)
    r = subprocess.run([sys.executable, "-c", _PATH_CHECK, str(tmp_path / "t.batch")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    kernel = r.stdout.strip()
    assert kernel in ("sse2", "avx2", "avx512", "portable")
    if cap == "sse2":
        assert kernel in ("sse2", "portable")
    elif cap == "avx2":
        assert kernel != "avx512"
