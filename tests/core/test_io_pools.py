"""core.pool's I/O pools: run_io runs every call, in item order, and raises the first error
only once every call has finished (an upload never runs on after its caller returned)."""

from __future__ import annotations

import threading
import time

import pytest

from zerobatch.core.pool import io_executor, run_io


def test_run_io_returns_in_order_and_uses_threads():
    names = set()

    def fn(x):
        names.add(threading.current_thread().name)
        time.sleep(0.01)
        return x * 2
    assert run_io(fn, range(8), 4, "zb-test-io") == [0, 2, 4, 6, 8, 10, 12, 14]
    assert names and all(n.startswith("zb-test-io") for n in names)
    assert run_io(fn, [5], 4, "zb-test-io") == [10]            # one item: inline
    assert run_io(fn, [], 4, "zb-test-io") == []


def test_run_io_raises_the_first_error_after_every_call_finished():
    done = []

    def fn(x):
        if x == 1:
            raise ValueError("first")
        time.sleep(0.05)
        done.append(x)
    with pytest.raises(ValueError, match="first"):
        run_io(fn, range(4), 4, "zb-test-io")
    assert sorted(done) == [0, 2, 3]


def test_io_executor_names_its_threads():
    with io_executor(2, "zb-named") as pool:
        assert pool.submit(lambda: threading.current_thread().name).result().startswith("zb-named")
