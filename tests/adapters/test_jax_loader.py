"""The JAX adapter's tests (jax_cases.py), in a fresh process: JAX is multithreaded from its
import on, and the rest of the suite forks, which JAX warns may deadlock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(600)
def test_jax_adapter_in_its_own_process():
    pytest.importorskip("jax")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "jax_cases.py")],
                       capture_output=True, text=True, cwd=HERE.parent.parent, timeout=590)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]
