"""Fixtures shared by the whole zerobatch test suite."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from zbtest import ForkServer, records


def pytest_collection_modifyitems(config, items):
    """Under ``ZEROBATCH_PUREPYTHON=1`` (the pure-Python twins) the tests marked ``compiled``
    are skipped: they bound speed or memory, or compare the compiled kernels with the twins."""
    from zerobatch.core import PURE_PYTHON

    if not PURE_PYTHON:
        return
    skip = pytest.mark.skip(reason="needs the compiled kernels (ZEROBATCH_PUREPYTHON=1)")
    for item in items:
        if item.get_closest_marker("compiled"):
            item.add_marker(skip)


@pytest.fixture
def tokens_small() -> np.ndarray:
    return records(1000, 64, seed=1)


@pytest.fixture
def batch_file(tmp_path: Path, tokens_small: np.ndarray) -> Path:
    """A zerobatch-written file: 1000 records of 64 tokens, batches of 8 (125 batches)."""
    from zerobatch.writers.llmbatch import write_batch_file

    path = tmp_path / "small.batch"
    write_batch_file(path, tokens_small, 8, 64, seed=7)
    return path


@pytest.fixture
def fork_server(tmp_path: Path):
    """``fork_server(imports)``: a :class:`zbtest.ForkServer` that imported ``imports`` once,
    stopped when the test ends (kill -9 harnesses: one interpreter start, not one per point)."""
    servers: list[ForkServer] = []

    def start(imports: str) -> ForkServer:
        servers.append(ForkServer(imports, tmp_path))
        return servers[-1]
    yield start
    for server in servers:
        server.__exit__()


@pytest.fixture(scope="session")
def s3_endpoint() -> str:
    """``http://127.0.0.1:PORT`` of a real S3 API server (moto's, one per test process; see
    ``tests/s3kit.py``); the test is skipped, with the reason, where it cannot start."""
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    from s3kit import moto_server

    try:
        return moto_server()
    except Exception as exc:  # noqa: BLE001 - the reason is the skip message
        pytest.skip(f"moto's S3 server cannot start here: {exc}")
