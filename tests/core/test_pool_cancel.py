"""A Python call cancelled without waiting while a worker runs it stays alive until the worker
is done with its task: the pool's own reference goes when the callable returns, before the
worker writes the task's status and state, so an owner that drops the call at once (a loader
closed mid-read) must not free the task under the worker (found as a segfault when
loaderx.DataLoader became a face over the loader)."""

from __future__ import annotations

import gc
import sys
import threading
import time

import pytest

from zbtest import run_python

_pool = pytest.importorskip("zerobatch.core._pool")
if not hasattr(_pool, "abandoned_calls"):
    pytest.skip("the compiled pool (the pure-Python twin frees nothing by hand)", allow_module_level=True)


def test_a_call_cancelled_without_waiting_is_kept_until_its_worker_is_done():
    pool = _pool.TaskPool(1, name="zb-abandon")
    started, release = threading.Event(), threading.Event()

    def fn():
        started.set()
        release.wait(5)
    c = pool.call(fn, caller_runs=False)
    assert started.wait(5)
    before = sys.getrefcount(c)
    assert c.cancel(False) is False                       # running: not dropped
    assert sys.getrefcount(c) == before + 1 and _pool.abandoned_calls() == 1
    del c
    gc.collect()
    release.set()
    deadline = time.monotonic() + 5
    while _pool.abandoned_calls() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _pool.abandoned_calls() == 0                   # pruned once the worker was done
    pool.stop()


def test_loaders_closed_mid_read_many_times_do_not_crash(tmp_path):
    """The reproduction: loaderx DataLoaders closed while their reads run (cancel without
    waiting), again and again, in a child process (a crash fails the test, not the run)."""
    code = f"""
import os, numpy as np
from zerobatch.adapters.loaderx import DataLoader, NPDataset
path = os.path.join({str(tmp_path)!r}, "y.npy")
np.save(path, np.arange(3000, dtype=np.int64).reshape(1000, 3))
for trial in range(150):
    loader = DataLoader(NPDataset(path), batch_size=50, num_workers=3, prefetch_size=6, seed=trial)
    it = iter(loader)
    for _ in range(3):
        next(it)
    loader.close()
    del it, loader
print("ok")
"""
    done = run_python(code, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
