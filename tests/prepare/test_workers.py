"""convert's worker processes fail instead of hanging: a worker that dies mid-task (as under the
OOM killer) fails the run with a ConfigError naming --workers, where multiprocessing.Pool would
wait for the lost task forever; an initializer's error (a tokenizer the worker cannot load) is
raised from the tasks, where Pool would respawn workers without end. Each case runs in a
subprocess with a timeout, so a regression shows as a failure, not a stuck suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from zerobatch.prepare.workers import WorkerPool

SCRIPT = textwrap.dedent("""
    import os, sys
    from zerobatch.prepare.workers import WorkerPool
    from zerobatch.prepare.encoders import _init_chat_worker, _encode_chat_group
    from zerobatch.formats.errors import ConfigError, NotFoundError

    def main(case):
        if case == "died":
            with WorkerPool(2, int, ()) as pool:
                futures = [pool.submit(os._exit, 3), pool.submit(os.getpid)]
                try:
                    [WorkerPool.result(f) for f in futures]
                except ConfigError as exc:
                    print("raised", exc.field, exc)
                    return
        elif case == "init":
            with WorkerPool(2, _init_chat_worker, ("/nonexistent/tokenizer", ("assistant",))) as pool:
                try:
                    WorkerPool.result(pool.submit(_encode_chat_group, [("x line 1", [])]))
                except (NotFoundError, ConfigError) as exc:
                    print("raised", type(exc).__name__, exc.field)
                    return
        print("no error")

    if __name__ == "__main__":
        main(sys.argv[1])
""")


@pytest.mark.parametrize("case, expect", [("died", "raised workers"), ("init", "raised NotFoundError")])
def test_a_dead_worker_or_a_failed_initializer_fails_the_run(tmp_path, case, expect):
    script = tmp_path / "pool_case.py"          # a file: forkserver workers import its __main__
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), case], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(expect), r.stdout + r.stderr


def test_results_and_task_errors_come_back_in_the_caller():
    with WorkerPool(2, int, ()) as pool:
        assert [WorkerPool.result(pool.submit(abs, -k)) for k in range(5)] == [0, 1, 2, 3, 4]
        with pytest.raises(ValueError, match="invalid literal"):
            WorkerPool.result(pool.submit(int, "x"))
