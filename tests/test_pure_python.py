"""The pure-Python twins (``ZEROBATCH_PUREPYTHON=1``) serve every format: a slice of the suite
(every format's reader and writer round trips and fault checks, the formats' parsers, the
loader) runs again under the twins, in a child pytest on one core."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
#: Each format's reader tests, the format modules' tests and the loader's: about a minute
#: under the twins. The fuzzing and kill loops (``slow``) and the compiled-only tests are left out.
SLICE = [
    "formats",
    "readers/test_llmbatch_reader.py",
    "readers/test_llmchnk.py",
    "readers/test_tokstream_reader.py",
    "readers/test_zrecord_reader.py",
    "readers/test_features.py",
    "writers/test_zrecord_writer.py",
    "adapters/test_loader.py",
]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_format_under_the_pure_python_twins(tmp_path):
    env = {**os.environ, "ZEROBATCH_PUREPYTHON": "1"}
    cmd = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-q", "-m",
           "not slow", "--basetemp", str(tmp_path / "t"), *(str(TESTS / s) for s in SLICE)]
    r = subprocess.run(cmd, env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=880)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "no tests ran" not in r.stdout
