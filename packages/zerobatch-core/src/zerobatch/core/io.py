"""File I/O helpers shared by every zerobatch writer and reader.

:class:`AtomicFile` is the only way zerobatch writes a file: data goes to a temporary file in
the destination folder, which is flushed, ``fsync``-ed and renamed over the final name, and
then the folder is ``fsync``-ed. A crash at any point leaves either the previous file or the
complete new one under the final name, never a mix; a failed call raises
:class:`~zerobatch.formats.errors.WriteError` with the ``errno`` of that call, removes the
temporary file and is never retried (a failed ``fsync`` cannot be retried safely).

Every system call a writer makes goes through :func:`io_call`, one small layer that tests can
tell to ``SIGKILL`` the process, or fail with an ``errno``, after its k-th call
(``ZEROBATCH_FAULT_KILL_AFTER=k``, ``ZEROBATCH_FAULT_ERRNO_AFTER=k:ERRNO``). That is how the
suite proves the crash and disk-full guarantees at every step of every write.

:func:`open_regular_file` opens a file for reading without ever hanging on a FIFO and refuses
anything but a regular file with a typed error.
"""

from __future__ import annotations

import errno as _errno
import os
import secrets
import signal
import shutil
import stat
from collections.abc import Callable
from typing import Any, TypeVar

from zerobatch.formats.errors import (
    ConfigError,
    FormatError,
    NotFoundError,
    ReadError,
    TruncatedError,
    WriteError,
)

__all__ = [
    "AtomicFile",
    "replace_folder",
    "cleanup_orphans",
    "fsync_dir",
    "grow_file",
    "io_call",
    "local_destination",
    "open_regular_file",
    "pread_exact",
    "pwrite_all",
    "pwritev_all",
    "make_folder",
    "read_document",
    "sweep_orphans",
    "temp_prefix",
]

T = TypeVar("T")

_TMP_MARK = ".zbtmp."
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


# --------------------------------------------------------------------------------------------
# Fault injection: one counter over every system call writers make.


class _FaultPlan:
    """Kill the process or fail with an errno at the k-th I/O call (tests only)."""

    def __init__(self) -> None:
        self.calls = 0
        self.kill_after = _env_int("ZEROBATCH_FAULT_KILL_AFTER")
        self.errno_after: int | None = None
        self.errno_value = 0
        spec = os.environ.get("ZEROBATCH_FAULT_ERRNO_AFTER")
        if spec:
            k, _, name = spec.partition(":")
            self.errno_after = int(k)
            self.errno_value = int(name) if name.isdigit() else getattr(_errno, name)
        self.active = self.kill_after is not None or self.errno_after is not None

    def before(self, name: str) -> None:
        self.calls += 1
        if self.errno_after is not None and self.calls == self.errno_after:
            raise OSError(self.errno_value, f"injected {os.strerror(self.errno_value)} at {name}")

    def after(self) -> None:
        if self.kill_after is not None and self.calls >= self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


_FAULTS = _FaultPlan()


def io_call(name: str, func: Callable[..., T], *args: Any) -> T:
    """Run one system call of a writer, through the fault-injection counter when it is active.

    Args:
        name: the call's name, as a fault report gives it (``"pwrite"``, ``"fsync"``...).
        func: the call (``os.pwrite``...); args: its arguments.

    Returns:
        What ``func`` returns. An ``OSError`` from it (or an injected one) propagates.
    """
    if not _FAULTS.active:
        return func(*args)
    _FAULTS.before(name)
    result = func(*args)
    _FAULTS.after()
    return result


#: URL schemes a local write must not take for a relative path (``s3://b/x`` would become the
#: folder ``./s3:/b/x``); the same list as :data:`zerobatch.core.remote.SCHEMES`.
_URL_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss", "adl", "http", "https")


def local_destination(path: str | os.PathLike[str], *, field: str = "path") -> str | os.PathLike[str]:
    """``path`` as a local path to write to: a ``file://`` URL as its path; an object-store
    URL refused (a writer of local files would otherwise write a folder named ``s3:`` in the
    working directory while its user believes the data uploaded).

    Raises:
        ConfigError: an object-store URL, naming the ways to write there.
    """
    if isinstance(path, str) and "://" in path:
        scheme = path.partition("://")[0].lower()
        if scheme == "file":
            from zerobatch.core.remote import local_path
            return str(local_path(path))
        if scheme in _URL_SCHEMES:
            raise ConfigError(f"{field}: a {scheme}:// URL; this writes local files: write locally, then publish with "
                              "zerobatch.writers.remote (publish: the format's own order; or publish_tokstream, "
                              "publish_file, publish_zrecord), or give TokenStreamWriter or `zerobatch convert` the URL",
                              path=f"{scheme}://", field=field)
        # another scheme (r2://, minio://...) is no local path either: a folder named after
        # it would hold whatever the URL holds, credentials included
        raise ConfigError(f"{field}: {scheme}:// is not a URL scheme zerobatch writes to (s3, gs, az, http(s), "
                          "file) nor a local path", path=f"{scheme}://" if scheme.isalnum() else None, field=field)
    return path


def make_folder(path: str | os.PathLike[str], *, field: str = "path") -> str:
    """Create the folder ``path`` (and its parents) unless it exists; returns its absolute path.

    Raises:
        ConfigError: ``path`` (or a parent) exists and is not a folder (a file, a FIFO, a
            socket, a link to one, a symlink loop or a dangling link).
        WriteError: the folder cannot be created (``EACCES`` in a read-only parent ...).
    """
    p = os.path.abspath(os.fspath(local_destination(path, field=field)))
    if os.path.islink(p) and not os.path.isdir(p):
        raise ConfigError("path: a symlink that does not lead to a folder (dangling, or a loop)", path=p,
                          field=field)
    try:
        os.makedirs(p, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise ConfigError("path: exists and is not a folder (or a parent is not one)", path=p, field=field) from exc
    except OSError as exc:
        raise WriteError(f"path: cannot create the folder: {exc.strerror}", errno=exc.errno, path=p, field=field,
                         operation="mkdir") from exc
    return p


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """``fsync`` a folder, so that the names created or renamed in it are durable.

    Raises:
        OSError: from ``open`` or ``fsync`` (through :func:`io_call`).
    """
    fd = io_call("open", os.open, os.fspath(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC)
    try:
        io_call("fsync", os.fsync, fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` at ``offset``, resuming after short writes (each one a call
    through :func:`io_call`).

    Raises:
        OSError: from ``pwrite``; ``ENOSPC`` when a call writes nothing.
    """
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = io_call("pwrite", os.pwrite, fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(_errno.ENOSPC, os.strerror(_errno.ENOSPC))
        done += n


def pwritev_all(fd: int, buffers: list[Any], offset: int) -> None:
    """Write ``buffers`` back to back at ``offset`` with one ``pwritev`` (the common case),
    finishing a short write with :func:`pwrite_all`.

    Raises:
        OSError: from ``pwritev`` / ``pwrite``; ``ENOSPC`` when a call writes nothing.
    """
    if not buffers:
        return
    want = sum(memoryview(b).nbytes for b in buffers)
    done = io_call("pwritev", os.pwritev, fd, buffers, offset)
    if done < want:
        flat = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
        pwrite_all(fd, memoryview(flat)[done:], offset + done)


def grow_file(fd: int, size: int, needed: int, step: int) -> int:
    """Grow a file of ``size`` bytes (sparse, with ``ftruncate``) so that it holds ``needed``,
    in whole ``step``-byte steps; never shrinks it (a reader may have it mapped). Returns the
    new size.

    Raises:
        OSError: from ``ftruncate`` (``ENOSPC``, ``EFBIG``).
    """
    if needed <= size:
        return size
    size += -(-(needed - size) // step) * step
    io_call("ftruncate", os.ftruncate, fd, size)
    return size


# --------------------------------------------------------------------------------------------
# Reading


def open_regular_file(path: str | os.PathLike[str], *, write: bool = False,
                      create: bool = False) -> tuple[int, os.stat_result]:
    """Open ``path`` (read-only, or read-write with ``write``; ``create`` makes it if missing)
    and make sure it is a regular file.

    ``O_NONBLOCK`` keeps ``open()`` from waiting for a writer on a FIFO; the flag is cleared
    once the file is known to be regular.

    Returns:
        ``(fd, stat_result)``; the caller owns the descriptor.

    Raises:
        NotFoundError: the file or a symlink's target does not exist.
        ReadError: the operating system refused (permissions, a symlink loop, a socket...).
        FormatError: the path is a directory, FIFO, device or socket rather than a file.
    """
    p = os.fspath(path)
    flags = (os.O_RDWR if write else os.O_RDONLY) | (os.O_CREAT if create else 0)
    try:
        fd = os.open(p, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o644)
    # (from None: the OSError's text would repeat the raw path, which the typed error names
    # scrubbed of any credential a mistyped URL put there; errno is kept)
    except FileNotFoundError:
        raise NotFoundError("file: no such file (or a dangling symlink)", path=p, field="file") from None
    except OSError as exc:
        if exc.errno in (_errno.ENXIO, _errno.EISDIR):
            kind = "a directory" if exc.errno == _errno.EISDIR else "a socket or device"
            raise FormatError(f"file: not a regular file ({kind})", path=p, field="file") from None
        raise ReadError(f"file: cannot open: {exc.strerror}", errno=exc.errno, path=p, field="file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = (
                "a directory" if stat.S_ISDIR(st.st_mode)
                else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a device"
            )
            raise FormatError(f"file: not a regular file ({kind})", path=p, field="file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_document(path: str | os.PathLike[str], *, limit: int, field: str) -> bytes:
    """The whole of a small document (a manifest, ``meta.json``, ``shard.json``): a regular
    file of at most ``limit`` bytes, never sparse (documents are written whole, so a file
    with holes is damage, refused before its size is allocated).

    Raises:
        NotFoundError / ReadError / FormatError: as :func:`open_regular_file`.
        LimitExceededError: more than ``limit`` bytes.
        CorruptError: a sparse file.
    """
    from zerobatch.formats.errors import CorruptError, LimitExceededError

    p = os.fspath(path)
    fd, st = open_regular_file(p)
    try:
        if st.st_size > limit:
            raise LimitExceededError(f"{field}: {st.st_size} bytes, more than {limit}", path=p, field=field)
        if st.st_size > 65536 and st.st_blocks * 512 + 65536 < st.st_size:
            raise CorruptError(f"{field}: a sparse file of {st.st_size} bytes (documents are written whole)",
                               path=p, field=field)
        return pread_exact(fd, st.st_size, 0, path=p, field=field)
    finally:
        os.close(fd)


def pread_exact(fd: int, size: int, offset: int, *, path: Any = None, field: str = "file") -> bytes:
    """Read exactly ``size`` bytes at ``offset`` (looping over short reads).

    Raises:
        ReadError: the read failed.
        TruncatedError: the file ended first.
    """
    chunks = []
    got = 0
    while got < size:
        try:
            chunk = os.pread(fd, size - got, offset + got)
        except OSError as exc:
            raise ReadError(f"{field}: read failed: {exc.strerror}", errno=exc.errno, path=path, field=field) from exc
        if not chunk:
            raise TruncatedError(
                f"{field}: needed {size} bytes at offset {offset}, the file ended after {got}",
                path=path, field=field,
            )
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# --------------------------------------------------------------------------------------------
# Writing


def temp_prefix(final_path: str) -> str:
    """The prefix of every temporary file written for ``final_path``."""
    folder, name = os.path.split(final_path)
    return os.path.join(folder, f".{name}{_TMP_MARK}")


def _pid_alive(pid: int, since: float | None = None) -> bool:
    """Whether process ``pid`` runs and could be the writer of a temporary made at ``since``
    (a Unix time): a zombie has stopped writing, and a process started after the file was
    made is another one that reused the pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return True        # no /proc (not Linux): the signal probe is all there is
    if stat_fields[0] in (b"Z", b"X"):
        return False       # a zombie or dead process: exited, not yet reaped
    if since is not None:
        try:
            with open("/proc/stat", "rb") as f:
                btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
            started = btime + int(stat_fields[19]) / os.sysconf("SC_CLK_TCK")
        except (OSError, StopIteration, ValueError, IndexError):
            return True
        if started > since + 2:
            return False   # started after the temporary was written: the pid was reused
    return True


def _sweep(folder: str, wanted: Callable[[str], bool]) -> list[str]:
    """Remove the temporaries ``<stem>.zbtmp.<pid>[.<anything>]`` (files or folders) in
    ``folder`` whose stem is ``wanted`` and whose writer no longer runs; the paths removed."""
    removed: list[str] = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    for entry in entries:
        stem, mark, rest = entry.partition(_TMP_MARK)
        pid_text = rest.split(".", 1)[0]
        if not mark or not pid_text.isdigit() or not wanted(stem):
            continue
        path = os.path.join(folder, entry)
        try:
            if _pid_alive(int(pid_text), os.lstat(path).st_mtime):
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def sweep_orphans(folder: str | os.PathLike[str], stems: set[str] | None = None) -> list[str]:
    """Remove every temporary (file or folder) in ``folder`` that a writer which no longer
    runs left behind: names ``[.]<stem>.zbtmp.<pid>[.<anything>]``, restricted to ``stems``
    when given. Unlike :func:`cleanup_orphans` it finds temporaries whatever final name they
    were for (a build id the next run never uses, a conversion's folder).

    Returns:
        The paths removed.
    """
    return _sweep(os.fspath(folder), lambda stem: stems is None or stem.lstrip(".") in stems)


def cleanup_orphans(final_path: str | os.PathLike[str]) -> list[str]:
    """Remove temporary files left for ``final_path`` by writers that no longer run.

    Temporary names carry the writer's pid; a file whose pid is alive (and started before the
    file was written: not a reused pid, not a zombie) is left alone (it may be another writer
    at work).

    Returns:
        The paths removed.
    """
    folder, name = os.path.split(os.path.abspath(os.fspath(final_path)))
    return _sweep(folder, lambda stem: stem == f".{name}")


_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``);
    False where the system or the file system cannot."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (_errno.EINVAL, _errno.ENOSYS, _errno.ENOTSUP, _errno.EOPNOTSUPP):
        return False
    raise WriteError(f"replacing {b}: {os.strerror(err)}", errno=err, path=b, operation="renameat2")


def replace_folder(new: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Put the complete folder ``new`` in the place of the folder ``dst`` and delete the old
    one. On Linux the two are swapped in one step (``RENAME_EXCHANGE``), so a reader that
    opens ``dst`` finds the old dataset or the new one, never neither; elsewhere the old
    folder is first renamed aside (a reader opening ``dst`` in that instant finds nothing).
    A killed process leaves the old folder under ``new``'s temporary name, which
    :func:`sweep_orphans` removes."""
    new, dst = os.fspath(new), os.fspath(dst)
    if _exchange(new, dst):
        old = new
    else:
        old = f"{new}.old"
        try:
            io_call("rename", os.rename, dst, old)
            io_call("rename", os.rename, new, dst)
        except OSError as exc:
            raise WriteError(f"replacing {dst}: {exc.strerror}", errno=exc.errno, path=dst,
                             operation="rename") from None
    fsync_dir(os.path.dirname(os.path.abspath(dst)))
    shutil.rmtree(old, ignore_errors=True)


class AtomicFile:
    """A file written under a temporary name and renamed into place on :meth:`commit`.

    Use as a context manager: leaving the block normally commits, an exception aborts (the
    temporary file is removed and the final name keeps its previous content, if any)::

        with AtomicFile("data.batch") as f:
            f.write(header)
            f.pwrite(block, offset)

    Args:
        path: the final file name.
        mode: permission bits of the new file (before the umask).

    Raises:
        WriteError: creating the temporary file failed (``errno`` kept).
    """

    def __init__(self, path: str | os.PathLike[str], *, mode: int = 0o644) -> None:
        self.path = os.path.abspath(os.fspath(local_destination(path, field="output_path")))
        folder = os.path.dirname(self.path)
        if os.path.isdir(self.path):
            raise ConfigError("output_path: is a directory", path=self.path, field="output_path")
        cleanup_orphans(self.path)
        self.tmp_path = f"{temp_prefix(self.path)}{os.getpid()}.{secrets.token_hex(4)}"
        self._fd: int | None = None
        self._done = False
        self.size = 0
        try:
            self._fd = io_call(
                "open", os.open, self.tmp_path,
                os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode,
            )
        except OSError as exc:
            if not os.path.isdir(folder):
                raise WriteError(
                    "output_path: the destination folder does not exist",
                    errno=exc.errno, path=self.path, field="output_path", operation="open",
                ) from exc
            raise WriteError(
                f"output_path: cannot create the temporary file: {exc.strerror}",
                errno=exc.errno, path=self.path, field="output_path", operation="open",
            ) from exc

    @property
    def fd(self) -> int:
        """The temporary file's descriptor."""
        if self._fd is None:
            raise ConfigError("the file is closed", path=self.path, field="fd")
        return self._fd

    def _fail(self, operation: str, exc: OSError) -> WriteError:
        self.abort()
        return WriteError(
            f"{operation} failed: {exc.strerror or exc}", errno=exc.errno, path=self.path,
            field="file", operation=operation,
        )

    def write(self, data: Any) -> None:
        """Append ``data`` (any buffer) at the current end, looping over short writes.

        A short write followed by an error (``EFBIG``, ``ENOSPC``) raises with that error's
        ``errno``; a write that makes no progress raises ``ENOSPC``.
        """
        self.pwrite(data, self.size)

    def pwrite(self, data: Any, offset: int) -> None:
        """Write ``data`` (any buffer) at ``offset``, looping over short writes."""
        view = memoryview(data).cast("B")
        done = 0
        total = len(view)
        fd = self.fd
        try:
            while done < total:
                n = io_call("pwrite", os.pwrite, fd, view[done:], offset + done)
                if n <= 0:
                    raise OSError(_errno.ENOSPC, os.strerror(_errno.ENOSPC))
                done += n
        except OSError as exc:
            raise self._fail("write", exc) from exc
        self.size = max(self.size, offset + total)

    def pread_into(self, buf: Any, offset: int) -> None:
        """Read back ``len(buf)`` bytes written at ``offset`` into ``buf`` (a writable buffer).

        Raises:
            WriteError: the read failed or the file is shorter (the file is discarded).
        """
        view = memoryview(buf).cast("B")
        done = 0
        try:
            while done < len(view):
                n = io_call("preadv", os.preadv, self.fd, [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(_errno.EIO, "the file ended before the bytes written")
                done += n
        except OSError as exc:
            raise self._fail("read", exc) from exc

    def truncate(self, size: int) -> None:
        """Set the temporary file's size (sparse extension, for writers that fill in place)."""
        try:
            io_call("ftruncate", os.ftruncate, self.fd, size)
        except OSError as exc:
            raise self._fail("ftruncate", exc) from exc
        self.size = size

    def commit(self) -> None:
        """``fsync`` the file, rename it over the final name, ``fsync`` the folder.

        Raises:
            WriteError: any of these calls failed; the temporary file is removed, the final
                name keeps its previous content, and nothing is retried.
        """
        if self._done:
            return
        fd = self.fd
        try:
            io_call("fsync", os.fsync, fd)
        except OSError as exc:
            raise self._fail("fsync", exc) from exc
        try:
            io_call("close", os.close, fd)
        except OSError as exc:
            self._fd = None
            raise self._fail("close", exc) from exc
        self._fd = None
        try:
            io_call("rename", os.replace, self.tmp_path, self.path)
        except OSError as exc:
            raise self._fail("rename", exc) from exc
        self._done = True
        folder = os.path.dirname(self.path)
        try:
            dfd = io_call("open", os.open, folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as exc:
            raise WriteError(
                f"fsync of the folder failed: {exc.strerror}", errno=exc.errno, path=self.path,
                field="file", operation="fsync_dir",
            ) from exc
        try:
            io_call("fsync", os.fsync, dfd)
        except OSError as exc:
            # The rename happened; the folder entry may not be durable. Report, never retry.
            raise WriteError(
                f"fsync of the folder failed: {exc.strerror}", errno=exc.errno, path=self.path,
                field="file", operation="fsync_dir",
            ) from exc
        finally:
            os.close(dfd)

    def abort(self) -> None:
        """Close and remove the temporary file; the final name is untouched."""
        if self._done:
            return
        self._done = True
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        try:
            os.unlink(self.tmp_path)
        except OSError:
            pass

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.abort()
