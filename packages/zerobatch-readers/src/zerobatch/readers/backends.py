"""Storage backends: how a reader reaches the bytes of its data files.

A reader validates its files (format, sizes, build ids) and then reads every byte of them
through one :class:`Backend`, never through a branch of its own. Two backends exist:

- :class:`MmapBackend` (local files): every file is mapped read-only at open, with mappings
  that hold no descriptor; reads are views of the mapping, and the compiled kernels read the
  mapped memory directly (:meth:`Backend.addresses`);
- :class:`PreadBackend` (network filesystems): files are opened on demand through a bounded
  cache of descriptors (least recently used closed first, so thousands of files read under a
  small ``RLIMIT_NOFILE``); every open is checked again as at open (a replaced file is
  refused); reads are ``pread`` calls checked for their full length, and the kernels read
  through a table of descriptors that :meth:`Backend.pinned` holds open for them.

A third backend (object storage) is a new subclass: :meth:`Backend.read` by byte ranges, and
no addresses or descriptors for the kernels (:attr:`Backend.kernel_access` ``"none"``), so a
reader serves its kernels from byte ranges read ahead of them.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import numpy as np

from zerobatch.core import FileMapping
from zerobatch.core.checks import check_count
from zerobatch.formats.errors import ConfigError, ReadError, TruncatedError

__all__ = ["BACKENDS", "Backend", "DataFile", "MmapBackend", "PreadBackend", "open_backend"]


class DataFile:
    """One data file as a backend sees it.

    Args:
        path: the file (named in errors).
        size: its payload bytes (what reads may reach; a trailer after it is the reader's).
        open_checked: opens the file and checks it as the reader did at open (size, trailer,
            build id), returning the descriptor; the backend owns and closes it.
        name: the file's role, for messages (``"tokens.bin"``).
    """

    __slots__ = ("path", "size", "open_checked", "name")

    def __init__(self, path: str, size: int, open_checked: Callable[[], int], name: str = "") -> None:
        self.path, self.size, self.open_checked = path, size, open_checked
        self.name = name or os.path.basename(path)


class Backend(ABC):
    """The bytes of a dataset's data files (see the module documentation).

    Attributes:
        name: the backend's name (``"mmap"``, ``"pread"``).
        kernel_access: how compiled kernels read the files: ``"address"`` (mapped memory,
            :meth:`addresses`), ``"descriptor"`` (a table of descriptors, :meth:`pinned`).
    """

    name: ClassVar[str] = ""
    kernel_access: ClassVar[str] = ""

    def __init__(self) -> None:
        self.files: list[DataFile] = []

    @abstractmethod
    def add(self, file: DataFile, fd: int | None = None) -> int:
        """Take a data file the reader has just checked (``fd``: its open descriptor, which
        the backend now owns); returns the file's number."""

    @abstractmethod
    def read(self, k: int, offset: int, size: int) -> memoryview:
        """Exactly bytes ``[offset, offset + size)`` of file ``k`` (a view of a mapping, or a
        buffer of its own; never shorter).

        Raises:
            ReadError: the read failed (``errno`` kept).
            TruncatedError: the file ended before (it shrank after open).
        """

    def addresses(self) -> np.ndarray | None:
        """``uint64`` address of each file's mapped payload (0 for an empty one), or ``None``
        when the kernels cannot read the files' memory."""
        return None

    @contextlib.contextmanager
    def pinned(self, files: Iterable[int]) -> Iterator[np.ndarray | None]:
        """Hold ``files`` open for a kernel: yields the ``intc`` descriptor table (one entry per
        file, -1 where closed) with every file of ``files`` open until the block ends, or
        ``None`` when they are more than can be open at once (read them piece by piece)."""
        yield None

    def advise_random(self) -> None:  # noqa: B027 - optional hint
        """Hint that reads will be random (``POSIX_FADV_RANDOM`` / ``MADV_RANDOM``)."""

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release every mapping and descriptor (views handed out keep their mapping)."""


class MmapBackend(Backend):
    """Every file mapped read-only when it is added (see the module documentation)."""

    name = "mmap"
    kernel_access = "address"

    def __init__(self) -> None:
        super().__init__()
        self._maps: list[FileMapping | None] = []
        self._views: list[memoryview] = []
        self._addresses = np.zeros(0, np.uint64)

    def add(self, file: DataFile, fd: int | None = None) -> int:
        if fd is None and file.size:
            fd = file.open_checked()
        try:
            m = FileMapping(fd, file.size, file.path) if file.size else None
        finally:
            if fd is not None:
                os.close(fd)
        self.files.append(file)
        self._maps.append(m)
        self._views.append(memoryview(b"") if m is None else memoryview(m))
        self._addresses = np.append(self._addresses, np.uint64(0 if m is None else m.address))
        return len(self.files) - 1

    def read(self, k: int, offset: int, size: int) -> memoryview:
        return self._views[k][offset:offset + size]

    def view(self, k: int) -> memoryview:
        """The whole payload of file ``k``, mapped."""
        return self._views[k]

    def addresses(self) -> np.ndarray:
        return self._addresses

    def advise_random(self) -> None:
        for m in self._maps:
            if m is not None:
                m.advise("random")

    def close(self) -> None:
        self._views = []
        for m in self._maps:
            if m is None:
                continue
            try:
                m.close()
            except BufferError:
                pass  # a caller's array still views it; it is unmapped with the last view
        self._maps = []


class PreadBackend(Backend):
    """Files read with ``pread`` through a bounded cache of descriptors.

    Args:
        files: the data files.
        max_open_files: descriptors kept open at most (least recently used closed first);
            default a quarter of ``RLIMIT_NOFILE``, at most 1024.
    """

    name = "pread"
    kernel_access = "descriptor"
    #: When every file fits under the limit, the first kernel opens them all and nothing is
    #: closed again (later kernels skip the pinning).
    open_all_that_fit: ClassVar[bool] = True

    def __init__(self, *, max_open_files: int | None = None) -> None:
        super().__init__()
        if max_open_files is None:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            max_open_files = 1024 if soft == resource.RLIM_INFINITY else max(2, min(1024, soft // 4))
        self.limit = check_count(max_open_files, "max_open_files", minimum=2)
        self.table = np.full(0, -1, dtype=np.intc)
        self._open: OrderedDict[int, int] = OrderedDict()
        # held from pin to the end of the kernel that uses the pinned descriptors, so that no
        # other thread closes one (and the OS reuses its number) while a read is under way
        self.lock = threading.RLock()
        # every file fits under the limit: once all are open nothing is ever closed, and
        # kernels skip the pinning
        self._all_open = False

    def add(self, file: DataFile, fd: int | None = None) -> int:
        with self.lock:
            self.files.append(file)
            self.table = np.append(self.table, np.intc(-1))
            self._all_open = False
            k = len(self.files) - 1
            if fd is not None:
                if len(self._open) < self.limit:     # the cache's first descriptors
                    self._adopt(k, fd)
                else:
                    os.close(fd)
            return k

    def _adopt(self, k: int, fd: int) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._open[k] = fd
        self.table[k] = fd

    def _get(self, k: int, keep: frozenset[int] = frozenset()) -> int:
        fd = self._open.get(k)
        if fd is not None:
            self._open.move_to_end(k)
            return fd
        while len(self._open) >= self.limit:
            victim = next((v for v in self._open if v not in keep), None)
            if victim is None:
                break
            self._close(victim)
        fd = self.files[k].open_checked()
        self._adopt(k, fd)
        return fd

    def _close(self, k: int) -> None:
        fd = self._open.pop(k)
        self.table[k] = -1
        os.close(fd)

    def read(self, k: int, offset: int, size: int) -> memoryview:
        with self.lock:
            return memoryview(self._pread(self._get(k), k, size, offset))

    def read_unpinned(self, k: int, offset: int, size: int) -> memoryview:
        """:meth:`read` on a descriptor of its own (the cache's may be pinned for the kernel
        that asked for these bytes)."""
        fd = self.files[k].open_checked()
        try:
            return memoryview(self._pread(fd, k, size, offset))
        finally:
            os.close(fd)

    def _pread(self, fd: int, k: int, size: int, offset: int) -> bytearray:
        buf = bytearray(size)
        view, done = memoryview(buf), 0
        f = self.files[k]
        while done < size:
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except InterruptedError:
                continue
            except OSError as exc:
                raise ReadError(f"{f.name}: read failed: {exc.strerror}", errno=exc.errno, path=f.path,
                                field=f.name) from exc
            if n == 0:
                raise TruncatedError(f"{f.name}: ended before byte {offset + size} (the file shrank after open)",
                                     path=f.path, field=f.name)
            done += n
        return buf

    @contextlib.contextmanager
    def pinned(self, files: Iterable[int]) -> Iterator[np.ndarray | None]:
        with self.lock:
            if self._all_open:
                yield self.table
                return
            if self.open_all_that_fit and len(self.files) <= self.limit:
                for k in range(len(self.files)):
                    self._get(k)
                self._all_open = True
                yield self.table
                return
            keep = frozenset(int(k) for k in files)
            if len(keep) > self.limit:
                yield None
                return
            for k in keep:
                self._get(k, keep)
            yield self.table

    @property
    def open_files(self) -> int:
        """Descriptors open now."""
        return len(self._open)

    def close(self) -> None:
        with self.lock:
            for k in list(self._open):
                self._close(k)


#: The backends by name.
BACKENDS: dict[str, type[Backend]] = {"mmap": MmapBackend, "pread": PreadBackend}


def open_backend(name: str, **options: Any) -> Backend:
    """A new, empty backend ``name`` (``options``: ``max_open_files`` for ``"pread"``).

    Raises:
        ConfigError: an unknown backend.
    """
    cls = BACKENDS.get(name)
    if cls is None:
        raise ConfigError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}", field="backend")
    if cls is PreadBackend:
        return cls(**options)
    return cls()
