"""The object-storage backend: datasets at a URL, read by exact byte ranges into a bounded
local cache, and read from there by the same compiled kernels as local files.

A remote reader never downloads a data file whole. It keeps, per shard file, a **sparse local
copy** in the cache folder (its size, a zero-filled payload that takes no disk until written,
the format's trailer): before a kernel reads a range, the checksum blocks under it that the
copy does not hold yet are fetched (neighbouring ranges coalesced, many requests in flight,
the GIL released), checked against their digests and written into the copy; then the kernel
reads the copy through a descriptor, exactly as the ``pread`` backend reads a network
filesystem. A block is known to be held only once its digest matched, so a partial or
damaged copy (a process killed mid-write, a disk fault) is found and fetched again, and every
byte a reader delivers was checked.

The cache folder (``cache_dir``; default ``$ZEROBATCH_CACHE_DIR``, else
``~/.cache/zerobatch``) is shared by every process of the machine: small files (indexes,
digests) are written whole under a temporary name and renamed; sparse copies are created the
same way and then only gain checked blocks. It is kept under ``cache_limit`` bytes of disk
(default 16 GiB) by evicting whole shard copies, least recently used first: a process unlinks a
copy (another process that has it open keeps reading its own, intact, until it lets it go)
and drops its own copies only between reads, never under a kernel.

Fetching runs on two small thread pools per process (made again after a fork): one for the
requests (leaf work: fetch, check, write), one for the read-ahead the loader asks for
(``prefetch``), which waits on the first and never the other way round.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from zerobatch.core.checks import check_count
from zerobatch.core.io import pwrite_all
from zerobatch.core.pool import io_executor
from zerobatch.formats.errors import ConfigError, IntegrityError, NotFoundError, ZerobatchError
from zerobatch.readers.backends import DataFile, PreadBackend
from zerobatch.readers.base import FETCHED, MAPPED, Access

__all__ = ["DEFAULT_CACHE_LIMIT", "FETCH_TRIES", "CacheDir", "Fetcher", "RWLock", "RemoteBackend", "RemoteFile",
           "HostLocks", "RemoteItems", "RemoteOptions", "cache_root", "fetch_checked", "launch_id", "launch_shared", "open_sparse", "runs", "whole_copy"]

_Parsed = TypeVar("_Parsed")

#: Bytes of disk the cache folder is kept under by default.
DEFAULT_CACHE_LIMIT = 16 << 30
#: Requests in flight per process at most (each a ranged GET of one object).
DEFAULT_FETCH_THREADS = 32
_IO_PREFIX = "zerobatch-fetch"
#: Read-ahead tasks run at once (each a step's fetches, which wait on the request pool). The
#: loader reads a remote source's first step alone, so these never delay the first batch;
#: with steps that each cost a round trip or two (windows shuffled within shards), 8 pipeline
#: them: 17 -> 33 steps/s against 2 (tools/bench_remote_peers.py's server, 20 ms per request);
#: on a request-bound server (windows shuffled over 1,024 shards) it changes nothing.
DEFAULT_READ_AHEAD = 8
#: Tries of a range whose bytes do not match their checksums (damaged in flight) before the
#: read fails with an ``IntegrityError`` naming the URL and the range.
FETCH_TRIES = 3


def open_sparse(path: str, size: int, tail: bytes = b"") -> int:
    """A read-write descriptor of the sparse local copy ``path``: ``size`` bytes (zeros that take
    no disk until written) then ``tail``; made under a temporary name and renamed when missing
    or of another size, so another process sees no half-made copy."""
    try:
        if os.stat(path).st_size == size + len(tail):
            return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        pass
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.ftruncate(fd, size)
        if tail:
            pwrite_all(fd, tail, size)
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


def fetch_checked(store: Any, key: str, starts: Sequence[int], stops: Sequence[int],
                  accept: Callable[[list[int], list[Any]], list[int]], *, path: str, field: str,
                  against: str = "their checksums", coalesce: int | None = None) -> None:
    """The one fetch loop of every remote reader: ranges ``[starts[i], stops[i])`` of object
    ``key`` fetched in one request (obstore merges close ranges), handed to ``accept(which,
    parts)`` (the range numbers and their bytes), which checks them, writes those that
    matched into the local copy and returns the numbers of those that did not; those are
    fetched again, :data:`FETCH_TRIES` fetches in all. ``coalesce``: ranges at most this many
    bytes apart go in one request (default: the store's own gap).

    Raises:
        IntegrityError: a range never matched (naming ``path``, the first such range and
            ``field``: the object differs from the digests it is checked against).
        ReadError, TruncatedError, NotFoundError: the store failed (after its own retries).
    """
    todo = list(range(len(starts)))
    for _ in range(FETCH_TRIES):
        if not todo:
            return
        kw = {} if coalesce is None else {"coalesce": coalesce}
        parts = store.get_ranges(key, [starts[i] for i in todo], [stops[i] for i in todo], **kw)
        todo = accept(todo, parts)
    if todo:
        a, b = int(starts[todo[0]]), int(stops[todo[0]])
        raise IntegrityError(f"{path.rpartition('/')[2]}: bytes [{a}, {b}) did not match {against} in {FETCH_TRIES} "
                             f"fetches (the object differs from the digests it is checked against)", path=path,
                             field=field)


def whole_copy(path: Any, *, storage_options: dict[str, Any] | None = None, cache_dir: Any = None,
               cache_limit: int | None = None) -> str:
    """A local file holding the whole of ``path``: a local path (or ``file://`` URL) as it is,
    a local file being a copy that is always whole; an object at a URL fetched whole, as it is
    now, through the one fetch loop (:func:`fetch_checked`, the store's retries and counters)
    into the cache folder (renamed into place: other processes see a whole copy or none).

    For formats checked as a whole (one checksum over the file), which check the copy
    themselves; formats with digests per range read through sparse copies
    (:class:`RemoteFile`) and fetch only what reads need.

    Raises:
        NotFoundError: no such object.
        ReadError, TruncatedError: the store failed (after retries).
    """
    from zerobatch.core import xxh3_64
    from zerobatch.core.io import AtomicFile
    from zerobatch.core.remote import local_or_none
    local = local_or_none(path)
    if local is not None:
        return local
    remote = RemoteOptions(os.fspath(path), storage_options, cache_dir, cache_limit)
    size = remote.size("")
    folder = remote.cache.folder("whole", f"{xxh3_64(remote.url.encode()):016x}")
    dest = os.path.join(folder, remote.name or "object")
    with AtomicFile(dest) as f:
        def accept(which: list[int], parts: list[Any]) -> list[int]:
            f.write(parts[0])
            return []
        if size:
            fetch_checked(remote.store, remote.name, [0], [size], accept, path=remote.url, field="object")
    if remote.cache.added(size):
        remote.cache.evict(lambda p: p == folder, lambda p: False)
    return dest


def launch_id() -> str | None:
    """What the processes of one launch of a job on one host have in common, and no other
    launch has: ``$ZEROBATCH_RUN_ID`` when set; under torchrun, the folder its agent made for
    this attempt (``$TORCHELASTIC_ERROR_FILE`` less the local rank: new at every start and
    restart); under Slurm, the job, step and restart count; else ``None``."""
    explicit = os.environ.get("ZEROBATCH_RUN_ID")
    if explicit:
        return f"run:{explicit}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        return f"torchrun:{os.path.dirname(os.path.dirname(error_file))}"
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    if job and step:
        return f"slurm:{job}.{step}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return None


def launch_shared(cache_dir: Any, url: str, fetch: Callable[[], bytes],
                  parse: Callable[[bytes], _Parsed]) -> _Parsed:
    """``parse(fetch())`` for a small object every process of a launch must read alike (a
    dataset's manifest): the first process of the host to ask fetches it and leaves its bytes
    in the cache folder; the others of the same launch (:func:`launch_id`) wait for it and read
    them there. A start or restart of a job on a host then costs one request, not one per
    process, and its processes cannot see two versions of the dataset. Outside a known launch
    every process fetches.

    Raises:
        whatever ``fetch`` and ``parse`` raise (a copy in the cache that does not parse is
        fetched again).
    """
    from zerobatch.core import xxh3_64
    from zerobatch.core.io import AtomicFile
    launch = launch_id()
    if launch is None:
        return parse(fetch())
    root = cache_root(cache_dir)
    folder = os.path.join(root, "launch")
    key = f"{launch}\n{url}".encode()
    name = f"{xxh3_64(key):016x}"
    path = os.path.join(folder, name)
    with CacheDir(root, DEFAULT_CACHE_LIMIT).locks.hold(f"launch.{name}", 0, [(0, 1)]):
        try:
            with open(path, "rb") as f:
                return parse(f.read())
        except (OSError, ZerobatchError):
            pass
        data = fetch()
        parsed = parse(data)
        os.makedirs(folder, exist_ok=True)
        with AtomicFile(path) as out:
            out.write(data)
        _sweep(folder, keep=path)
        return parsed


def _sweep(folder: str, keep: str, age: float = 86400.0) -> None:
    """Remove the files of ``folder`` not used for ``age`` seconds (other launches' copies)."""
    import time
    now = time.time()
    for e in _scandir(folder):
        with contextlib.suppress(OSError):
            if e.path != keep and now - e.stat(follow_symlinks=False).st_mtime > age:
                os.unlink(e.path)


class RemoteItems:
    """What a single-file reader (LLMBATCH, LLMCHNK) offers about its URL: :attr:`remote`,
    :attr:`store` and :meth:`prefetch` of items (its ``_remote`` options and ``_copy``)."""

    _remote: RemoteOptions | None
    _copy: RemoteFile | None
    path: str

    def _locate(self, path: Any, storage_options: dict[str, Any] | None, cache_dir: Any, cache_limit: int | None,
                fetch_threads: int | None) -> None:
        """``path`` (a local path, a ``file://`` URL or an object-store URL) as :attr:`path`
        (the URL without secrets, for messages) and, for a URL, the store and cache."""
        from zerobatch.core.remote import is_url, local_path
        path = local_path(path)
        self._remote, self._copy = None, None
        if is_url(path):
            self._remote = RemoteOptions(path, storage_options, cache_dir, cache_limit, fetch_threads)
            self._url = path
            self.path = self._remote.url
        else:
            self.path = os.fspath(path)

    @property
    def remote(self) -> bool:
        """Whether the file is read from a URL (object storage)."""
        return self._remote is not None

    @property
    def access(self) -> Access:
        """What reaching the file's bytes costs (:class:`~zerobatch.readers.base.Access`)."""
        return MAPPED if self._remote is None else FETCHED

    @property
    def store(self) -> Any:
        """The object store of a file at a URL (its request and byte counters), else ``None``."""
        return None if self._remote is None else self._remote.store

    def prefetch(self, indices: Any) -> None:
        """Read-ahead hint: a file at a URL fetches items ``indices`` (batches, records) in the
        background (errors are left to the read that needs them). Local files: nothing."""
        if self._copy is not None:
            self._copy.prefetch(np.array(indices, dtype=np.int64, copy=True))


def runs(units: Iterable[int]) -> list[tuple[int, int]]:
    """``[first, stop)`` runs of consecutive numbers of the sorted ``units`` (found by NumPy:
    Python works per run, not per unit)."""
    a = np.asarray(units if isinstance(units, (list, np.ndarray)) else list(units), dtype=np.int64).reshape(-1)
    if not a.size:
        return []
    cut = np.flatnonzero(np.diff(a) != 1) + 1
    firsts = a[np.concatenate([[0], cut])]
    stops = a[np.concatenate([cut - 1, [a.size - 1]])] + 1
    return list(zip(firsts.tolist(), stops.tolist(), strict=True))


def cache_root(cache_dir: str | os.PathLike[str] | None) -> str:
    """The cache folder: ``cache_dir``, else ``$ZEROBATCH_CACHE_DIR``, else
    ``~/.cache/zerobatch`` (``$XDG_CACHE_HOME`` honoured)."""
    if cache_dir is None:
        cache_dir = os.environ.get("ZEROBATCH_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "zerobatch")
    return os.path.abspath(os.fspath(cache_dir))


class RWLock:
    """Many readers or one writer (reads hold it shared from the block check to the end of
    the kernel; eviction of this process's copies holds it alone)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._readers:
                self._cond.wait()
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


#: Offsets in a lock file are ``slot << 48`` plus a byte offset in one object (objects are
#: far smaller than 2**48 bytes): one lock file per shard, a slot per object of it.
_SLOT_SHIFT = 48
_FLOCK = "hhqqi4x"     # struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid


class HostLocks:
    """Byte-range locks shared by the processes of a host (those sharing one cache folder), so
    that they fetch a range once between them: a process about to fetch ranges of an object
    locks them (Linux open-file-description locks on a small lock file per shard in the cache
    folder, ``locks/``), checks its copy again when it had to wait (the holder has fetched
    them meanwhile) and fetches only what is still missing.

    No cycle of waits: the ranges of one call are taken in ascending order; the only locks
    taken while others are held are a shard's opening and its pages of digests, whose holders
    wait for nothing; and a process lets go of the ranges it fetches ahead of their digests
    (:meth:`try_hold`, never waited for) before it waits for anyone else's. A holder killed mid-fetch
    leaves no lock (the kernel drops it with the process); a holder stuck on the network
    holds its ranges no longer than the store's retry budget.

    Threads of one process share one lock description per file (their locks never exclude
    each other: within a process the readers already claim ranges before fetching); a forked
    child opens its own. Where the platform has no such locks, nothing is locked and every
    process fetches for itself, as before.
    """

    #: Lock files kept open per process at most (those holding no lock are closed first).
    MAX_OPEN = 64

    def __init__(self, root: str) -> None:
        self.root = os.path.join(root, "locks")
        self._fds: collections.OrderedDict[str, list[int]] = collections.OrderedDict()   # name -> [fd, holds]
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.disabled = False              # the file system refuses such locks: none taken

    def __getstate__(self) -> dict[str, Any]:
        return {"root": os.path.dirname(self.root)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["root"])

    def _acquire(self, name: str) -> int:
        """The descriptor of lock file ``name``, counted as in use until :meth:`_release`."""
        with self._lock:
            if self._pid != os.getpid():          # a forked child: its own descriptions
                self._fds, self._pid = collections.OrderedDict(), os.getpid()
            entry = self._fds.get(name)
            if entry is None:
                os.makedirs(self.root, exist_ok=True)
                entry = [os.open(os.path.join(self.root, name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644), 0]
                self._fds[name] = entry
                # the least recently used with no lock held go (their descriptions hold none)
                for old in [k for k, (_, holds) in self._fds.items() if not holds and k != name]:
                    if len(self._fds) <= self.MAX_OPEN:
                        break
                    with contextlib.suppress(OSError):
                        os.close(self._fds.pop(old)[0])
            self._fds.move_to_end(name)
            entry[1] += 1
            return entry[0]

    def _release(self, name: str) -> None:
        with self._lock:
            entry = self._fds.get(name)
            if entry is not None:
                entry[1] -= 1

    @staticmethod
    def _ranges(slot: int, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        base = slot << _SLOT_SHIFT
        out: list[tuple[int, int]] = []
        for a, b in sorted((base + int(a), base + int(b)) for a, b in ranges if b > a):
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        return out

    def _set(self, fd: int, kind: int, a: int, b: int, *, wait: bool) -> bool:
        """Lock (or unlock) ``[a, b)``; ``False``: another holds it (``wait=False``). A file
        system without such locks (some network file systems) turns locking off: every
        process then fetches for itself, as without this class."""
        import errno
        import fcntl
        import struct
        cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
        try:
            fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, a, b - a, 0))
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False
            if exc.errno in (errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                self.disabled = True
                return True
            raise
        return True

    @contextlib.contextmanager
    def hold(self, name: str, slot: int, ranges: Iterable[tuple[int, int]]) -> Iterator[bool]:
        """Hold byte ranges ``[a, b)`` of object ``slot`` of lock file ``name``; yields whether
        another process held any of them first (the caller then checks its copy again)."""
        import fcntl
        if self.disabled or not hasattr(fcntl, "F_OFD_SETLKW"):
            yield False
            return
        fd = self._acquire(name)
        got, waited = [], False
        try:
            for a, b in self._ranges(slot, ranges):
                if not self._set(fd, fcntl.F_WRLCK, a, b, wait=False):
                    waited = True
                    self._set(fd, fcntl.F_WRLCK, a, b, wait=True)
                got.append((a, b))
            yield waited
        finally:
            for a, b in got:
                with contextlib.suppress(OSError):
                    self._set(fd, fcntl.F_UNLCK, a, b, wait=False)
            self._release(name)

    def try_hold(self, name: str, slot: int, ranges: Iterable[tuple[int, int]]) -> Callable[[], None] | None:
        """Hold the ranges if no other process holds any of them now: the function that lets
        them go, or ``None`` (nothing held)."""
        import fcntl
        if self.disabled or not hasattr(fcntl, "F_OFD_SETLKW"):
            return lambda: None
        fd = self._acquire(name)
        got: list[tuple[int, int]] = []

        def release() -> None:
            for a, b in got:
                with contextlib.suppress(OSError):
                    self._set(fd, fcntl.F_UNLCK, a, b, wait=False)
            self._release(name)
        for a, b in self._ranges(slot, ranges):
            if not self._set(fd, fcntl.F_WRLCK, a, b, wait=False):
                release()
                return None
            got.append((a, b))
        return release

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                for fd, _ in self._fds.values():
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._fds = collections.OrderedDict()


_HOST_LOCKS: dict[str, HostLocks] = {}
_HOST_LOCKS_LOCK = threading.Lock()


class CacheDir:
    """One cache folder: a sub-folder per cached shard (``<kind>/<build id>``), its disk use
    kept under ``limit`` (see the module documentation).

    Args:
        root: the folder (created if missing).
        limit: bytes of disk to stay under.
    """

    def __init__(self, root: str, limit: int) -> None:
        self.root = root
        self.limit = check_count(limit, "cache_limit", minimum=1 << 20)
        os.makedirs(root, exist_ok=True)
        self._since_scan = 0
        self._lock = threading.Lock()

    @property
    def locks(self) -> HostLocks:
        """The folder's :class:`HostLocks` (one per folder and process)."""
        with _HOST_LOCKS_LOCK:
            locks = _HOST_LOCKS.get(self.root)
            if locks is None:
                locks = _HOST_LOCKS[self.root] = HostLocks(self.root)
            return locks

    def folder(self, kind: str, build_id: str) -> str:
        """The folder of one cached shard (created), marked as used now."""
        path = os.path.join(self.root, kind, build_id)
        os.makedirs(path, exist_ok=True)
        self.touch(path)
        return path

    @staticmethod
    def touch(path: str) -> None:
        with contextlib.suppress(OSError):
            os.utime(path)

    def added(self, nbytes: int) -> bool:
        """Count ``nbytes`` written; ``True`` when it is time to check the folder's size (every
        eighth of the limit written by this process)."""
        with self._lock:
            self._since_scan += nbytes
            if self._since_scan < self.limit // 8:
                return False
            self._since_scan = 0
            return True

    def usage(self) -> list[tuple[float, int, str]]:
        """``(last use, bytes on disk, folder)`` of every cached shard."""
        out = []
        for kind in _scandir(self.root):
            if not kind.is_dir(follow_symlinks=False):
                continue
            for shard in _scandir(kind.path):
                if not shard.is_dir(follow_symlinks=False):
                    continue
                used = 0
                for f in _scandir(shard.path):
                    with contextlib.suppress(OSError):
                        used += f.stat(follow_symlinks=False).st_blocks * 512
                with contextlib.suppress(OSError):
                    out.append((shard.stat(follow_symlinks=False).st_mtime, used, shard.path))
        return out

    def evict(self, keep: Callable[[str], bool], drop_own: Callable[[str], bool]) -> int:
        """Remove least recently used shard folders until the folder holds at most 80 % of
        the limit. ``keep(path)``: never remove it (a shard a read holds now);
        ``drop_own(path)``: this process lets its copy go (its descriptors closed, its checks
        forgotten) and returns whether it held one. Returns the bytes removed."""
        entries = sorted(self.usage())
        total = sum(u for _, u, _ in entries)
        target = self.limit * 8 // 10
        freed = 0
        for _, used, path in entries:
            if total - freed <= target:
                break
            if keep(path):
                continue
            drop_own(path)
            shutil.rmtree(path, ignore_errors=True)
            freed += used
        return freed


def _scandir(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


class Fetcher:
    """The request pool and the read-ahead pool of one reader, made again in a forked child
    (threads do not survive a fork)."""

    def __init__(self, threads: int = DEFAULT_FETCH_THREADS, read_ahead: int = DEFAULT_READ_AHEAD) -> None:
        self.threads = check_count(threads, "fetch_threads", minimum=1, maximum=1024)
        self.read_ahead = read_ahead
        self._pid = -1
        self._io: ThreadPoolExecutor | None = None
        self._ahead: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _pools(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        pid = os.getpid()
        if self._pid != pid or self._io is None or self._ahead is None:
            with self._lock:
                if self._pid != pid or self._io is None or self._ahead is None:
                    self._io = io_executor(self.threads, _IO_PREFIX)
                    self._ahead = io_executor(self.read_ahead, "zerobatch-read-ahead")
                    self._pid = pid
        return self._io, self._ahead

    def run_all(self, calls: Iterable[Callable[[], Any]]) -> list[Any]:
        """Run ``calls`` on the request pool (one inline when there is just one); the first
        error is raised once all have finished."""
        calls = list(calls)
        if len(calls) == 1 or threading.current_thread().name.startswith(_IO_PREFIX):
            # one call, or nested in a request-pool task (waiting there for tasks queued
            # behind it could starve the pool): inline
            return [c() for c in calls]
        io, _ = self._pools()
        futures = [io.submit(c) for c in calls]
        out, first = [], None
        for f in futures:
            try:
                out.append(f.result())
            except BaseException as exc:    # noqa: BLE001 - re-raised below, after the others finish
                first = first or exc
        if first is not None:
            raise first
        return out

    def ahead(self, call: Callable[[], Any]) -> Future[Any]:
        """Run ``call`` on the read-ahead pool (its errors are the later read's to raise)."""
        _, ahead = self._pools()
        return ahead.submit(call)

    def close(self) -> None:
        for p in (self._io, self._ahead):
            if p is not None and self._pid == os.getpid():
                p.shutdown(wait=False, cancel_futures=True)
        self._io = self._ahead = None


class RemoteBackend(PreadBackend):
    """The descriptor backend over the sparse local copies of remote files: as
    :class:`PreadBackend`, but files are numbered up front (one per shard, opened only once
    their shard was fetched) and a kernel's table opens only the files it reads, never every
    file of the dataset (opening one means fetching its shard's indexes)."""

    name = "remote"
    kernel_access = "descriptor"
    open_all_that_fit = False

    def __init__(self, count: int, *, max_open_files: int | None = None) -> None:
        super().__init__(max_open_files=max_open_files)
        self.files = [None] * count           # type: ignore[list-item]
        self.table = np.full(count, -1, dtype=np.intc)

    def set(self, k: int, file: DataFile) -> None:
        """File ``k`` is now ``file`` (its shard was fetched, or fetched again)."""
        with self.lock:
            if k in self._open:
                self._close(k)
            self.files[k] = file

    def forget(self, k: int) -> None:
        """Close file ``k`` (its copy is being dropped)."""
        with self.lock:
            if k in self._open:
                self._close(k)
            self.files[k] = None              # type: ignore[call-overload]

    def add(self, file: DataFile, fd: int | None = None) -> int:
        raise ConfigError("remote files are numbered up front; use set()", field="backend")

    def _get(self, k: int, keep: frozenset[int] = frozenset()) -> int:
        if self.files[k] is None:
            raise ConfigError(f"file {k} is read before its shard was fetched", field="backend")
        return super()._get(k, keep)


class RemoteOptions:
    """How a single-file reader (LLMBATCH, LLMCHNK, a feature matrix) reaches a URL: the
    store, the cache folder and the pools, from the reader's keyword arguments.

    Args:
        url: the object's (or the dataset folder's) URL.
        storage_options, cache_dir, cache_limit, fetch_threads: as for
            :class:`~zerobatch.readers.tokstream.TokenStreamReader`.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, cache_limit: int | None = None,
                 fetch_threads: int | None = None) -> None:
        from zerobatch.core.remote import open_store, split_url
        self.options = {"storage_options": storage_options, "cache_dir": cache_dir, "cache_limit": cache_limit,
                        "fetch_threads": fetch_threads}
        root, self.key = split_url(url)
        parent, _, self.name = self.key.rpartition("/")
        self.store = open_store(f"{root}/{parent}" if parent else root, storage_options)
        self.store.limit(cache_root(cache_dir))     # a budget per prefix, shared by the host's processes
        self.url = self.store.name(self.name)
        self.cache = CacheDir(cache_root(cache_dir), DEFAULT_CACHE_LIMIT if cache_limit is None else cache_limit)
        self.fetcher = Fetcher(DEFAULT_FETCH_THREADS if fetch_threads is None else fetch_threads)

    def size(self, name: str) -> int:
        """The size of object ``name`` (next to the URL's object; ``""``: that object).

        Raises:
            NotFoundError: there is none.
        """
        key = name or self.name
        size = self.store.head(key)
        if size is None:
            raise NotFoundError("no such object", path=self.store.name(key), field="path")
        return size


class RemoteFile:
    """A remote object read through a **sparse local copy** in the cache folder: the copy has
    the object's size, holds the ``parts`` given (the header, tables and trailer the reader
    fetched and parsed to open it) and gains the reader's *units* (batches, records, checksum
    blocks) as reads need them. A unit counts as held once the reader's check of the copy
    (its checksum) passed, so a damaged or partial copy is fetched again and every byte
    delivered was checked. Several processes may share one copy: they write only bytes that
    are the object's, at the object's offsets.

    Args:
        remote: the store, cache and pools (:class:`RemoteOptions`).
        key: the object, relative to the store.
        path: the local copy (made under a temporary name and renamed when missing or of
            another size).
        size: the object's size.
        parts: ``(offset, bytes)`` written into the copy now.

    Call :meth:`units` once the reader can check the copy, then :meth:`ensure` before each
    read.
    """

    def __init__(self, remote: RemoteOptions, key: str, path: str, size: int,
                 parts: Iterable[tuple[int, Any]] = ()) -> None:
        self.remote, self.key, self.path, self.size = remote, key, path, size
        self.url = remote.store.name(key)
        fd = open_sparse(path, size)
        self.fd = fd
        try:
            for offset, data in parts:     # the same bytes again when the copy existed: harmless
                pwrite_all(fd, data, offset)
        except BaseException:
            os.close(fd)
            raise
        self._lock = threading.Lock()
        self._inflight: dict[int, threading.Event] = {}
        self.held = np.zeros(0, bool)
        self._spans: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None
        self._check: Callable[[list[int]], list[int]] | None = None

    def units(self, count: int, spans: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
              check: Callable[[list[int]], list[int]]) -> None:
        """The reader's units: ``count`` of them, ``spans(units)`` their byte ranges
        ``(starts, stops)`` in the object, ``check(units)`` those whose bytes in the local copy
        do not match their checksums."""
        self.held = np.zeros(count, bool)
        self._spans, self._check = spans, check

    def prefetch(self, units: Any) -> None:
        """:meth:`ensure` ``units`` in the background (errors are left to the read)."""
        def run() -> None:
            with contextlib.suppress(Exception):
                self.ensure(units)
        self.remote.fetcher.ahead(run)

    def ensure(self, units: Any) -> None:
        """Units ``units`` held and checked in the local copy: those another thread is fetching
        are waited for, the others checked in the copy and the missing ones fetched (each
        range checked, :data:`FETCH_TRIES` tries). Units outside ``[0, count)`` are left to the
        reader's own index check.

        Raises:
            IntegrityError: a range never matched its checksum (naming the URL and range).
            ReadError, TruncatedError, NotFoundError: the store failed (after retries).
        """
        u = np.asarray(units, dtype=np.int64).reshape(-1)
        held = self.held
        u = u[(u >= 0) & (u < held.size)]
        if not u.size or held[u].all():
            return
        todo = np.unique(u[~held[u]]).tolist()
        mine, waits = [], []
        with self._lock:
            for k in todo:
                if held[k]:
                    continue
                ev = self._inflight.get(k)
                if ev is None:
                    self._inflight[k] = threading.Event()
                    mine.append(k)
                else:
                    waits.append((k, ev))
        try:
            if mine:
                self._load(mine)
        finally:
            with self._lock:
                for k in mine:
                    self._inflight.pop(k).set()
        for _, ev in waits:
            ev.wait()
        left = [k for k, _ in waits if not held[k]]
        if left:                          # their fetcher failed: try once more here (its error
            self._load(left)              # was that thread's to raise)

    def _load(self, units: list[int]) -> None:
        if self._check is None or self._spans is None:
            raise ConfigError("RemoteFile.units() must be called before a read", path=self.url, field="units")
        bad = self._check(units)
        self.held[np.setdiff1d(units, bad)] = True
        if not bad:
            return
        starts, stops = self._spans(np.asarray(bad, np.int64))
        name = f"{os.path.basename(os.path.dirname(self.path))}.{os.path.basename(self.path)}"
        with self.remote.cache.locks.hold(name, 0, zip(starts.tolist(), stops.tolist())) as waited:
            if waited:                    # another process of the host fetched them meanwhile
                again = set(self._check(bad))
                self.held[[u for u in bad if u not in again]] = True
                bad = [u for u in bad if u in again]
                if not bad:
                    return
                starts, stops = self._spans(np.asarray(bad, np.int64))
            self._fetch(bad, starts, stops, self._check)

    def _fetch(self, bad: list[int], starts: np.ndarray, stops: np.ndarray,
               check: Callable[[list[int]], list[int]]) -> None:
        def accept(which: list[int], parts: list[Any]) -> list[int]:
            written = 0
            for i, part in zip(which, parts, strict=True):
                pwrite_all(self.fd, part, int(starts[i]))
                written += len(part)
            if self.remote.cache.added(written):
                self.maybe_evict()
            units = [bad[i] for i in which]          # checked in the copy: the reader's own check
            again = set(check(units))
            self.held[[u for u in units if u not in again]] = True
            return [i for i, u in zip(which, units, strict=True) if u in again]
        fetch_checked(self.remote.store, self.key, starts.tolist(), stops.tolist(), accept, path=self.url,
                      field="checksum", against="their checksum")

    def maybe_evict(self) -> None:
        """Keep the cache folder under its limit (this copy's folder is kept)."""
        own = os.path.dirname(self.path)
        self.remote.cache.evict(lambda path: path == own, lambda path: False)

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
