"""Fixtures shared by the whole zerobatch test suite."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from zbtest import records


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
