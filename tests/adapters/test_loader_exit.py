"""Interpreter exit with a read in flight (issue 17, hangs): the loader's close at
finalization never waits for a worker the interpreter has already stopped. In a file of its
own so that xdist runs it beside the rest of the loader's tests."""

from __future__ import annotations

import pytest

from zbtest import run_python, token_stream


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    return token_stream(tmp_path_factory.mktemp("exit") / "d", n_tokens=3000)


@pytest.mark.slow
@pytest.mark.parametrize("pure", ["", "1"])
def test_exit_with_a_read_in_flight_never_hangs(stream, pure):
    """Interpreter exit while a worker runs a read: the iterator's close at finalization must
    not wait for a worker the interpreter has already stopped (it hung about 1 run in 15
    under the pure-Python pool). Six exits per mode, each with a deadline."""
    folder, _ = stream
    code = f"""
        from zerobatch.adapters.torch import Loader, TokenWindows
        it = iter(Loader(TokenWindows({folder!r}, 16), batch_size=4, num_threads=2))
        next(it)
        print("ok")
    """
    for _ in range(6):
        r = run_python(code, env={"ZEROBATCH_PUREPYTHON": pure}, timeout=30)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
        assert "Fatal" not in r.stderr and "Error" not in r.stderr, r.stderr
