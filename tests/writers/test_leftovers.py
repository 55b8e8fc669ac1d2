"""Writers that were killed (issue 17): the rerun succeeds into the same place, and whatever
the dead writer left (temporaries, unfinished shards, a conversion's folder) is found and
removed by the next one, including when the dead writer is a zombie not yet reaped or its
pid was reused."""

from __future__ import annotations

import os
import time

import numpy as np

from zerobatch.core.io import _pid_alive, sweep_orphans
from zerobatch.readers.tokstream import TokenStreamReader
from zerobatch.writers.tokstream import TokenStreamWriter

DOCS = [np.arange(1, 40, dtype=np.int64) + k for k in range(12)]


def zombie(action) -> int:
    """Fork a child that runs ``action()`` then exits; never reap it (a zombie until the test
    ends). Returns its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            action()
        finally:
            os._exit(0)
    for _ in range(500):
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                return pid
        time.sleep(0.01)
    raise AssertionError("the child did not exit")


def test_a_zombie_or_a_reused_pid_is_not_a_live_writer(tmp_path):
    pid = zombie(lambda: None)
    try:
        assert not _pid_alive(pid)
        assert _pid_alive(os.getpid())
        # this process started before now: alive; a temporary made before it started: reused pid
        now = time.time()
        assert _pid_alive(os.getpid(), since=now)
        assert not _pid_alive(os.getpid(), since=0.0)
    finally:
        os.waitpid(pid, 0)


def test_a_killed_token_stream_writer_can_be_rerun_into_the_same_folder(tmp_path):
    folder = tmp_path / "d"

    def killed_run():
        w = TokenStreamWriter(folder, vocab_size=100, shard_tokens=100)
        for d in DOCS:                       # several shards finish, the last one does not
            w.add_document(d)
        os._exit(9)                          # killed: no close(), no manifest

    pid = os.fork()
    if pid == 0:
        killed_run()
    os.waitpid(pid, 0)
    assert (folder / "shard-00000" / "shard.json").exists() and not (folder / "manifest.json").exists()
    with TokenStreamWriter(folder, vocab_size=100, shard_tokens=1000) as w:
        for d in DOCS[:5]:
            w.add_document(d)
    with TokenStreamReader(folder) as r:
        assert r.num_documents == 5 and r.verify().ok
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "shard-00000"]


def test_a_killed_feature_matrix_build_leaves_nothing_the_next_run_keeps(tmp_path):
    from zerobatch.writers.features import write_feature_matrix

    folder = tmp_path / "f"
    rows = np.random.default_rng(1).normal(size=(2000, 4))

    def chunks():
        yield rows[:1000]
        yield rows[1000:]

    calls = {"n": 0}

    def dying_source():
        calls["n"] += 1
        if calls["n"] == 2:                   # the second pass: the data file is being written
            yield rows[:1000]
            os._exit(9)
        yield from chunks()

    pid = os.fork()
    if pid == 0:
        write_feature_matrix(folder, {"a": dying_source}, chunk_rows=1000)
        os._exit(0)
    os.waitpid(pid, 0)
    leftovers = [p.name for p in folder.iterdir() if ".zbtmp." in p.name]
    assert leftovers, "the killed build left no temporary: the test would prove nothing"
    write_feature_matrix(folder, {"a": rows})
    assert not [p.name for p in folder.iterdir() if ".zbtmp." in p.name]


def test_a_killed_conversions_folder_is_removed_by_the_next_conversion(tmp_path):
    from zerobatch.prepare.pipeline import convert

    src = tmp_path / "docs.npy"
    np.save(src, np.arange(1, 4000, dtype=np.uint16))
    dst = tmp_path / "out"

    def leave_tmp():
        os.mkdir(f"{dst}.zbtmp.{os.getpid()}")
        (tmp_path / f"out.zbtmp.{os.getpid()}" / "tokens.bin").write_bytes(b"x" * 1000)

    pid = zombie(leave_tmp)                 # a writer that died, not yet reaped
    try:
        assert os.path.isdir(f"{dst}.zbtmp.{pid}")
        convert(str(src), str(dst), to="tokstream", log=lambda line: None, vocab_size=5000, eod_id=0)
        assert not os.path.exists(f"{dst}.zbtmp.{pid}")
        with TokenStreamReader(dst) as r:
            assert r.num_tokens == 3999
    finally:
        os.waitpid(pid, 0)


def test_sweep_leaves_a_live_writers_temporaries_alone(tmp_path):
    mine = tmp_path / f".x.bin.zbtmp.{os.getpid()}.abcd"
    mine.write_bytes(b"1")
    dead = zombie(lambda: None)
    theirs = tmp_path / f".y.bin.zbtmp.{dead}.abcd"
    theirs.write_bytes(b"1")
    try:
        assert sweep_orphans(tmp_path) == [str(theirs)]
        assert mine.exists()
    finally:
        os.waitpid(dead, 0)


def test_kill_after_every_io_call_of_a_feature_matrix_build(tmp_path, fork_server):
    """SIGKILL after each system call of a rebuild: the folder reads as the old build or the
    complete new one, never a mix; the next build removes everything the killed one left."""
    import textwrap

    from zbtest import run_python
    from zerobatch.readers.features import FeatureMatrix
    from zerobatch.writers.features import write_feature_matrix

    folder = tmp_path / "f"
    write_feature_matrix(folder, {"a": np.ones((40, 3)), "b": np.zeros((10, 3))}, normalize=False)

    def content():
        m = FeatureMatrix(folder, 1)
        m.verify()
        return m.windows(np.arange(len(m)))[0].tobytes()

    old = content()
    code = textwrap.dedent(f"""
        import numpy as np
        from zerobatch.writers.features import write_feature_matrix
        rng = np.random.default_rng(3)
        write_feature_matrix({str(folder)!r}, {{"a": rng.normal(size=(300, 3)), "c": rng.normal(size=(70, 3))}},
                             chunk_rows=64, block_bytes=4096)
    """)
    r = run_python(code + "\nfrom zerobatch.core.io import _FAULTS\nprint('CALLS', _FAULTS.calls)\n",
                   env={"ZEROBATCH_FAULT_KILL_AFTER": str(10**9)})
    assert r.returncode == 0, r.stderr
    total = int(r.stdout.split("CALLS")[1])
    new = content()
    assert new != old
    outcomes = {"old": 0, "new": 0}
    server = fork_server("import numpy as np\nfrom zerobatch.writers.features import write_feature_matrix")
    for k in range(1, total + 1):
        write_feature_matrix(folder, {"a": np.ones((40, 3)), "b": np.zeros((10, 3))}, normalize=False)
        assert content() == old
        r = server.run(code, env={"ZEROBATCH_FAULT_KILL_AFTER": str(k)})
        assert r.returncode == -9, (k, r.returncode, r.stderr)
        now = content()
        assert now in (old, new), k
        outcomes["old" if now == old else "new"] += 1
    assert outcomes["old"] >= 1 and outcomes["new"] >= 1
    print(f"kill -9 harness (write_feature_matrix): {total} kill points, {outcomes}")
    write_feature_matrix(folder, {"a": np.ones((40, 3))})
    assert not [p.name for p in folder.iterdir() if ".zbtmp." in p.name]
    assert len([p for p in folder.iterdir() if p.name.endswith(".bin")]) == 1
