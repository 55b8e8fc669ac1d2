"""FileMapping: read-only mappings that hold no file descriptor."""

from __future__ import annotations

import os

import numpy as np
import pytest

from zerobatch.core import FileMapping
from zerobatch.formats.errors import ConfigError, ReadError


def test_mapping_outlives_its_descriptor_and_views_keep_it_alive(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 64)
    fd = os.open(path, os.O_RDONLY)
    m = FileMapping(fd, 16384, str(path))
    os.close(fd)
    a = np.frombuffer(m, dtype=np.uint8)
    assert len(m) == 16384 and m.address != 0 and a[:4].tolist() == [0, 1, 2, 3]
    with pytest.raises(BufferError):
        m.close()
    with pytest.raises(ValueError):
        a[0] = 1                                   # read-only
    del a
    m.close()
    assert m.closed
    with pytest.raises(BufferError):
        memoryview(m)
    m.advise("random")
    with pytest.raises(ConfigError):
        m.advise("fast")


def test_empty_and_failed_mappings(tmp_path):
    empty = FileMapping(0, 0)
    assert len(empty) == 0 and bytes(memoryview(empty)) == b""
    with pytest.raises(ReadError) as info:
        FileMapping(987654, 4096, "nowhere")
    assert info.value.errno is not None and info.value.path == "nowhere"
    with pytest.raises(ConfigError):
        FileMapping(0, -1)
