"""Each distribution builds to its own wheel and installs alone from a folder of wheels."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
GOLDEN = REPO / "tests" / "fixtures" / "v1" / "llmbatch" / "zerobatch_3x5_seed9.batch"

# one worker builds the wheels once and runs every test here: the suite runs with pytest-xdist's
# --dist loadfile (a file's tests on one worker). Not loadgroup: under pytest 9.2 xdist 3.8's
# xdist_group marks are ignored, and two workers built the wheels at once.
# The first test's deadline covers the module's wheel build (9 wheels, the compiled core among
# them: 184 s on an idle 2-core machine, past 300 s when the other worker's tests load it).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # built in this environment (its Cython and setuptools): installing `.` builds each package
    # in isolation already, as users do; nine isolated builds here cost a CI worker minutes
    r = subprocess.run([sys.executable, str(REPO / "tools" / "build_wheels.py"), "--no-build-isolation",
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    names = sorted(p.name for p in out.glob("*.whl"))
    assert len(names) == 9, names
    return out


def fresh_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return path / "bin" / "python"


def pip_install(python: Path, wheels: Path, *names: str) -> None:
    # zerobatch comes only from the wheel folder (no index holds it); numpy may come from the index.
    r = subprocess.run([str(python), "-m", "pip", "install", "--find-links", str(wheels), *names],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr


def installed(python: Path) -> set[str]:
    r = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True)
    return {line.split("==")[0].lower() for line in r.stdout.split()}


def test_readers_alone_without_torch(wheels, tmp_path):
    py = fresh_venv(tmp_path / "venv")
    pip_install(py, wheels, "zerobatch-readers")
    names = installed(py)
    assert {"zerobatch-readers", "zerobatch-core", "zerobatch-formats", "numpy"} <= names
    assert not {"torch", "zerobatch-adapters", "zerobatch-writers", "zerobatch-samplers", "zerobatch-prepare",
                "zerobatch-cli"} & names
    code = f"""
import sys, importlib.util
from zerobatch.readers.llmbatch import BatchFileReader
r = BatchFileReader({str(GOLDEN)!r})
assert r.num_batches == 6 and r.read_batch(2).shape == (3, 5) and r.verify().ok
assert r.read_batch_numpy(1).dtype.name == "int64"
assert "torch" not in sys.modules and importlib.util.find_spec("torch") is None
try:
    r.read_batch_torch(0)
except Exception as e:
    print(type(e).__name__, e)
"""
    res = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ConfigError read_batch_torch needs PyTorch")


def test_adapters_install_without_torch(wheels, tmp_path):
    """JAX users install the adapters without torch: the sources, the loader core and loaderx
    work; zerobatch.adapters.torch names the extra to install."""
    py = fresh_venv(tmp_path / "venv")
    pip_install(py, wheels, "zerobatch-adapters")
    names = installed(py)
    assert "zerobatch-adapters" in names and "torch" not in names
    code = f"""
import sys
from zerobatch.adapters._loader import BaseLoader
from zerobatch.adapters.sources import LLMBatchSource
import zerobatch.adapters.loaderx
ld = BaseLoader(LLMBatchSource({str(GOLDEN)!r}), shuffle=False, num_threads=1)
batches = list(ld)
assert len(batches) == 6 and batches[0].shape == (3, 5) and batches[0].dtype.name == "int64"
assert "torch" not in sys.modules
try:
    import zerobatch.adapters.torch
except ImportError as e:
    print("ImportError", e)
"""
    res = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ImportError zerobatch.adapters.torch needs PyTorch: pip install "
                                 "'zerobatch-adapters[torch]'"), res.stdout


@pytest.mark.parametrize("dist, module", [("zerobatch-formats", "zerobatch.formats"),
                                          ("zerobatch-writers", "zerobatch.writers"),
                                          ("zerobatch-samplers", "zerobatch.samplers")])
def test_each_numpy_only_distribution_installs_alone(wheels, tmp_path, dist, module):
    py = fresh_venv(tmp_path / "venv")
    pip_install(py, wheels, dist)
    assert "torch" not in installed(py)
    res = subprocess.run([str(py), "-c", f"import {module}, sys; print({module}.__version__, 'torch' in sys.modules)"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.split() == ["0.1.0", "False"], res.stderr


def test_preparation_installs_without_torch_or_the_command_line(wheels, tmp_path):
    """Preparation is a library: zerobatch-prepare installs without torch, the adapters or the
    CLI, and converts."""
    py = fresh_venv(tmp_path / "venv")
    pip_install(py, wheels, "zerobatch-prepare")
    names = installed(py)
    assert "zerobatch-prepare" in names
    assert not {"torch", "zerobatch-adapters", "zerobatch-samplers", "zerobatch-cli"} & names
    code = """
import sys
import numpy as np
from zerobatch.prepare import convert
np.save("t.npy", np.arange(100, dtype=np.uint16).reshape(10, 10))
print(convert("t.npy", "t.ts", to="tokstream", quiet=True, log=lambda *_: None))
assert "torch" not in sys.modules and "zerobatch.cli" not in sys.modules and "zerobatch.adapters" not in sys.modules
"""
    res = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("10 documents in 1 shards, 100 tokens"), res.stdout


def test_namespace_is_shared_not_shadowed(wheels):
    import zipfile

    for whl in wheels.glob("*.whl"):
        names = zipfile.ZipFile(whl).namelist()
        assert "zerobatch/__init__.py" not in names, whl.name
        assert not [n for n in names if n.endswith((".pyx", ".c"))], whl.name
        assert not [n for n in names if "_prefetch" in n or "/build/" in n], whl.name
