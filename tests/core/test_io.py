"""Atomic writes, orphan cleanup, safe opens, and injected I/O faults."""

from __future__ import annotations

import errno
import os
import socket
import stat

import pytest
from zbtest import run_python

from zerobatch.core.io import AtomicFile, cleanup_orphans, open_regular_file, pread_exact, temp_prefix
from zerobatch.formats.errors import FormatError, NotFoundError, ReadError, TruncatedError, WriteError


def test_commit_replaces_atomically(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"old")
    with AtomicFile(p) as f:
        f.write(b"hello ")
        f.write(memoryview(b"world"))
        assert p.read_bytes() == b"old"  # nothing visible before the commit
        assert os.path.exists(f.tmp_path) and os.path.basename(f.tmp_path).startswith(".f.bin.zbtmp.")
    assert p.read_bytes() == b"hello world"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_exception_aborts_and_keeps_previous(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with AtomicFile(p) as f:
            f.write(b"new data")
            raise RuntimeError("boom")
    assert p.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]


def test_pwrite_truncate_and_read_back(tmp_path):
    p = tmp_path / "f.bin"
    with AtomicFile(p) as f:
        f.truncate(10)
        f.pwrite(b"xy", 4)
        buf = bytearray(3)
        f.pread_into(buf, 3)
        assert bytes(buf) == b"\0xy"
    assert p.read_bytes() == b"\0\0\0\0xy\0\0\0\0"


def test_orphans_of_dead_writers_are_removed(tmp_path):
    p = tmp_path / "f.bin"
    dead = tmp_path / f".f.bin.zbtmp.{2**22 + 12345}.abcd"  # no such pid
    alive = tmp_path / f".f.bin.zbtmp.{os.getpid()}.abcd"
    other = tmp_path / ".g.bin.zbtmp.999999.abcd"
    for q in (dead, alive, other):
        q.write_bytes(b"x")
    assert cleanup_orphans(p) == [str(dead)]
    assert alive.exists() and other.exists()
    assert temp_prefix(str(p)).endswith(".f.bin.zbtmp.")


def test_missing_folder_and_directory_target(tmp_path):
    with pytest.raises(WriteError, match="folder does not exist") as info:
        AtomicFile(tmp_path / "nope" / "f.bin")
    assert info.value.errno == errno.ENOENT
    with pytest.raises(Exception, match="is a directory"):
        AtomicFile(tmp_path)


@pytest.mark.parametrize("name, errno_name", [("fsync", "EIO"), ("rename", "EROFS"), ("pwrite", "ENOSPC"),
                                              ("pwrite", "EDQUOT")])
def test_injected_errors_raise_write_error_and_leave_nothing(tmp_path, name, errno_name):
    """Each failing call: WriteError with that call's errno; previous file intact; no temp file."""
    target = tmp_path / "f.bin"
    target.write_bytes(b"previous")
    # Find k: the index of the first call named `name` (open=1, pwrite=2,3, fsync=4, close=5, rename=6, open dir=7, fsync dir=8).
    order = ["open", "pwrite", "pwrite", "fsync", "close", "rename", "open", "fsync"]
    k = order.index(name) + 1
    r = run_python(f"""
        import errno
        from zerobatch.core.io import AtomicFile
        from zerobatch.formats.errors import WriteError
        try:
            with AtomicFile({str(target)!r}) as f:
                f.write(b"a" * 10)
                f.write(b"b" * 10)
        except WriteError as e:
            print("WriteError", errno.errorcode[e.errno], e.operation)
    """, env={"ZEROBATCH_FAULT_ERRNO_AFTER": f"{k}:{errno_name}"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["WriteError", errno_name]
    assert target.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_failed_fsync_is_reported_not_retried(tmp_path):
    target = tmp_path / "f.bin"
    r = run_python(f"""
        from zerobatch.core.io import AtomicFile, _FAULTS
        from zerobatch.formats.errors import WriteError
        f = AtomicFile({str(target)!r})
        f.write(b"x")
        try:
            f.commit()
        except WriteError as e:
            print("failed", e.operation, _FAULTS.calls)
        f.commit()  # a second commit must not retry the fsync and report success
        print("calls", _FAULTS.calls)
    """, env={"ZEROBATCH_FAULT_ERRNO_AFTER": "3:EIO"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0] == "failed fsync 3"
    assert lines[1] == "calls 3"
    assert not target.exists()


def test_short_write_then_efbig(tmp_path):
    """Under RLIMIT_FSIZE the kernel accepts a short write, then EFBIG: a WriteError, no file."""
    target = tmp_path / "f.bin"
    r = run_python(f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        import errno
        from zerobatch.core.io import AtomicFile
        from zerobatch.formats.errors import WriteError
        try:
            with AtomicFile({str(target)!r}) as f:
                f.write(b"z" * 5000)
        except WriteError as e:
            print(errno.errorcode[e.errno])
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "EFBIG"
    assert os.listdir(tmp_path) == []


def test_open_regular_file_refuses_everything_else(tmp_path):
    with pytest.raises(NotFoundError):
        open_regular_file(tmp_path / "missing")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(NotFoundError):
        open_regular_file(tmp_path / "dangling")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(ReadError) as info:
        open_regular_file(tmp_path / "loop")
    assert info.value.errno == errno.ELOOP
    with pytest.raises(FormatError, match="a directory"):
        open_regular_file(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(FormatError, match="a FIFO"):  # and never blocks waiting for a writer
        open_regular_file(fifo)
    sock_path = tmp_path / "sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock_path))
    try:
        with pytest.raises(FormatError, match="socket"):
            open_regular_file(sock_path)
    finally:
        s.close()
    ok = tmp_path / "ok"
    ok.write_bytes(b"abc")
    fd, st = open_regular_file(ok)
    try:
        assert stat.S_ISREG(st.st_mode) and pread_exact(fd, 3, 0) == b"abc"
        with pytest.raises(TruncatedError, match="ended after 3"):
            pread_exact(fd, 4, 0, path=ok)
    finally:
        os.close(fd)
