"""Fixtures shared by the whole zerobatch test suite."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from zbtest import ForkServer, records


#: The files that take longest on one worker (seconds on 2 idle cores, ``--durations``),
#: collected first: the suite runs a file per worker at a time (``--dist loadfile``), and a
#: long file dealt out last kept one worker busy for minutes after the other ran out of work.
LONGEST_FIRST = (
    "packaging/test_wheels.py",         # 330: nine wheels built, then installed in fresh venvs
    "test_pure_python.py",              # 162: a slice of the suite under the twins
    "trainers/test_hf.py",              # 110: Trainer, SFTTrainer, accelerate runs killed and resumed
    "adapters/test_torchrun.py",        # 92
    "trainers/test_lightning.py",       # 90
    "adapters/test_fleet.py",           # 80: hosts in network namespaces, torchrun across them
    "readers/test_zrecord_faults.py",   # 90
    "readers/test_zrecord_remote.py",   # 90
    "test_repository.py",               # 55: mypy
    "trainers/test_olmo.py",            # 38
)


def _longest_first(items: list[pytest.Item]) -> None:
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    here = Path(__file__).parent

    def key(item: pytest.Item) -> int:
        try:
            return rank.get(Path(item.path).relative_to(here).as_posix(), len(rank))
        except ValueError:
            return len(rank)
    items.sort(key=key)          # stable: every file's tests keep their order


def pytest_collection_modifyitems(config, items):
    """The longest files first (:data:`LONGEST_FIRST`). Under ``ZEROBATCH_PUREPYTHON=1`` (the
    pure-Python twins) the tests marked ``compiled`` are skipped: they bound speed or memory,
    or compare the compiled kernels with the twins."""
    from zerobatch.core import PURE_PYTHON

    _longest_first(items)
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


@pytest.fixture(scope="session")
def seaweed_endpoint() -> str:
    """``http://127.0.0.1:PORT`` of SeaweedFS's S3 gateway (a real object store, one per test
    process; see ``tests/s3kit.py``); skipped, with the reason, where it cannot start."""
    pytest.importorskip("obstore")
    from s3kit import seaweed_server

    try:
        return seaweed_server()
    except Exception as exc:  # noqa: BLE001 - the reason is the skip message
        pytest.skip(f"SeaweedFS cannot start here: {exc}")
