"""Read LLMBATCH (ZeroBatch v2) files: memory-mapped, validated on open, zero-copy.

:class:`BatchFileReader` maps the whole file and checks, before it returns a single token,
that the header is well formed (magic, version, dtype, geometry with checked 64-bit
arithmetic) and that the file holds exactly what the header describes. Files written by
zerobatch also carry checksums: the header and the trailer are checked on open, and each
batch the first time it is read (``verify=True``, the default).

The file is mapped copy-on-write (``MAP_PRIVATE``, with ``MAP_NORESERVE`` so a mapping larger
than memory needs no commit charge): views and ``int32`` tensors share the page cache with
no copy, a tensor written to in place changes this process's private copy of the page and
never the file. Should the system refuse such a mapping, the reader falls back to a
read-only shared one.

Limits (documented in ``docs/formats/llmbatch.md``): a file must not be truncated or rewritten
in place while mapped (the kernel then raises SIGBUS in the reader); zerobatch writers only
ever replace files by renaming.

This module never imports torch: the seed's ``read_batch_torch`` is on the reader of
``zerobatch.batch_loader`` (``zerobatch.adapters.torch.BatchFileReader``), which subclasses this one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno as _errno
import mmap
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from zerobatch.core import LLMBatchSlots, parse_llmbatch_header, xxh3_64
from zerobatch.core.io import open_regular_file, pread_exact
from zerobatch.formats import llmbatch as L
from zerobatch.formats.errors import ConfigError, IntegrityError, ReadError
from zerobatch.readers.base import BatchReader, OpensOnFirstUse
from zerobatch.readers.remote import RemoteItems

__all__ = ["BatchFileReader", "VerifyReport"]

_INT64 = np.dtype(np.int64)
_INT32 = np.dtype(np.int32)
_NUMPY_DTYPES: dict[Any, np.dtype] = {}


def _numpy_dtype(dtype: Any) -> np.dtype:
    """int64 / int32 / uint32 from a NumPy dtype or type, a torch dtype or a name (cached)."""
    try:
        return _NUMPY_DTYPES[dtype]
    except (KeyError, TypeError):
        pass
    if dtype is None:
        dt = _INT64
    else:
        name = str(dtype)
        if name.startswith("torch."):
            name = {"long": "int64", "int": "int32"}.get(name[6:], name[6:])
        else:
            try:
                name = np.dtype(dtype).name
            except TypeError:
                name = ""
        if name not in ("int64", "int32", "uint32"):
            raise ConfigError(f"dtype must be int64, int32 or uint32, got {dtype!r}", field="dtype")
        dt = np.dtype(name)
    try:
        _NUMPY_DTYPES[dtype] = dt
    except TypeError:
        pass
    return dt


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """The result of :meth:`BatchFileReader.verify`.

    Attributes:
        path: the file checked.
        num_batches: batches checked.
        has_checksums: the file carries per-batch checksums (files from the seed's writer
            do not; only their structure can be checked).
        bad_batches: indices of batches whose checksum does not match (at most 100 listed).
        num_bad_batches: how many batches do not match.
        padding_ok: all page padding is zero.
        max_token: the largest token id found.
        max_token_ok: it equals the header's ``max_token`` (``True`` when the header has none).
    """

    path: str
    num_batches: int
    has_checksums: bool
    bad_batches: tuple[int, ...]
    num_bad_batches: int
    padding_ok: bool
    max_token: int
    max_token_ok: bool

    @property
    def ok(self) -> bool:
        """No fault found."""
        return self.num_bad_batches == 0 and self.padding_ok and self.max_token_ok


class BatchFileReader(RemoteItems, OpensOnFirstUse, BatchReader):
    """Zero-copy, validated access to the batches of an LLMBATCH file.

    Args:
        path: the ``.batch`` file, or its URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``,
            ``file://``; ``docs/object-storage.md``).
        verify: check each batch against its checksum the first time it is read (files with
            checksums only). The header and the trailer are always checked on open; a file
            at a URL is always checked (a batch's checksum is how its cached copy is known).
        storage_options, cache_dir, cache_limit, fetch_threads: a URL's store configuration,
            local cache folder, its byte limit and requests in flight (as for
            :class:`~zerobatch.readers.tokstream.TokenStreamReader`).

    A file at a URL costs three requests to open (its size, header and checksum trailer);
    each batch is then fetched by exact byte range the first time a read (or
    :meth:`prefetch`) needs it, checked against its checksum, and kept in a sparse local copy
    in the cache folder that every process of the machine shares.

    Raises:
        NotFoundError: the file does not exist.
        FormatError: not a regular file, or any fault in the header or layout (its
            subclasses ``TruncatedError``, ``CorruptError``, ``IntegrityError``,
            ``UnsupportedVersionError`` and ``LimitExceededError`` say which).
        ReadError: the operating system refused to open or map the file.

    Example::

        reader = BatchFileReader("dataset.batch")
        arr = reader.read_batch(0)           # (batch_size, seq_len) uint32, read-only, no copy
        i64 = reader.read_batch_numpy(0)     # int64 (one conversion)
        i32 = reader.read_batch_numpy(0, dtype=np.int32)   # shares the file's pages
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True,
                 storage_options: dict[str, Any] | None = None, cache_dir: str | os.PathLike[str] | None = None,
                 cache_limit: int | None = None, fetch_threads: int | None = None) -> None:
        self._locate(path, storage_options, cache_dir, cache_limit, fetch_threads)
        self.verify_batches = bool(verify) or self._remote is not None
        self._expected_fingerprint: str | None = None
        self._open()

    # ---------------------------------------------------------------------------------------
    # opening

    def _fetch_layout(self) -> str:
        """A file at a URL: its header and trailer fetched and checked, its sparse local copy
        made (or found) in the cache; returns the copy's path."""
        from zerobatch.readers.remote import RemoteFile
        r = self._remote
        if r is None:
            raise ConfigError("the file is not read from a URL", path=self.path, field="path")
        size = r.size("")
        head = bytes(r.store.get_range(r.name, 0, min(size, L.HEADER_SIZE)))
        header = parse_llmbatch_header(head, size, path=self.path)
        if not header.has_checksums or header.build_id is None:
            raise ConfigError("checksums: the file has no batch checksums (a file of the seed's writer), and every "
                              "byte read from a URL is checked: rewrite it with zerobatch convert, or read a local "
                              "copy", path=self.path, field="checksums")
        a = header.trailer_offset
        trailer = r.store.get_range(r.name, a, a + header.trailer_size)
        folder = r.cache.folder("llmbatch", header.build_id.hex())
        old = self.__dict__.get("_copy")
        if old is not None:
            old.close()
        self._copy = RemoteFile(r, r.name, os.path.join(folder, "file.batch"), size, [(0, head), (a, trailer)])
        return self._copy.path

    def _open(self) -> None:
        if self._remote is None:
            self._copy = None
        # a reader unpickled in a worker has no _copy until this open: reads check for one
        # only after touching the reader (which opens it), never before
        local = self.path if self._remote is None else self._fetch_layout()
        fd, st = open_regular_file(local)
        try:
            size = st.st_size
            head = pread_exact(fd, min(size, L.HEADER_SIZE), 0, path=self.path, field="header")
            header = parse_llmbatch_header(head, size, path=self.path)
            mm, writable = self._map(fd, size)
        finally:
            os.close(fd)
        self.header = header
        self._mm = mm
        self.writable_mapping = writable
        if header.has_checksums:
            trailer = memoryview(mm)[header.trailer_offset:header.trailer_offset + header.trailer_size]
            got = xxh3_64(trailer)
            trailer.release()
            if got != header.trailer_hash:
                raise IntegrityError(
                    f"trailer_hash: the checksum trailer does not match its hash (stored "
                    f"0x{header.trailer_hash:016x}, computed 0x{got:016x})",
                    path=self.path, field="trailer_hash")
            # the build id binds the geometry and max_token to the batch checksums: a header
            # edited and re-hashed (seq_len, batch_size, max_token ...) is refused here
            trailer = memoryview(mm)[header.trailer_offset:header.trailer_offset + header.trailer_size]
            bound = L.build_id(head[:40], header.max_token or 0, trailer)
            trailer.release()
            if bound != header.build_id:
                raise IntegrityError(
                    "build_id: the header's geometry (batch_size, seq_len, num_batches, seed, total_records) or "
                    "max_token is not the one its batch checksums were written with (an edited header)",
                    path=self.path, field="build_id")
        self.fingerprint = (header.build_id.hex() if header.build_id is not None
                            else f"legacy:{size}:{xxh3_64(head):016x}")
        if self._expected_fingerprint is not None and self.fingerprint != self._expected_fingerprint:
            raise IntegrityError(
                f"fingerprint: the file changed since this reader was pickled (was "
                f"{self._expected_fingerprint}, now {self.fingerprint})",
                path=self.path, field="fingerprint")
        # what this reader checked: the batches that match their checksums, the batches known
        # to hold no id of 2**31 or more (the kernel sets the bits)
        nbytes = max((header.num_batches + 7) // 8, 1)
        self._verified = np.zeros(nbytes, np.uint8)
        self._int32_ok = np.zeros(nbytes, np.uint8)
        self._slots = LLMBatchSlots(mm, header, verify=self.verify_batches, verified=self._verified,
                                    int32_ok=self._int32_ok, path=self.path)
        self._shape = (header.batch_size, header.seq_len)
        # Bound methods of the compiled slots: the hot paths are one Python call deep.
        self._view_u32 = self._slots.view_uint32
        self._view_i32 = self._slots.view_int32
        self._new_i64 = self._slots.new_int64
        self._read_into = self._slots.read_into
        if self._copy is not None:
            self._remote_units(header)

    def _remote_units(self, header: Any) -> None:
        """A file at a URL: its batches are the units of the local copy (each batch's slot
        fetched and checked before a read of it), and every read goes through them."""
        copy, slots = self._copy, self._slots
        if copy is None:
            raise ConfigError("the file is not read from a URL", path=self.path, field="path")
        first, slot, end = L.HEADER_SIZE, header.padded_batch_bytes, header.trailer_offset

        def spans(units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            a = first + units * slot
            return a, np.minimum(a + slot, end)

        def check(units: list[int]) -> list[int]:
            bad: list[int] = []
            for u in units:
                bad += slots.verify_range(u, u + 1)
            return bad
        copy.units(header.num_batches, spans, check)
        ensure = copy.ensure

        def ensuring(read: Callable[..., Any]) -> Callable[..., Any]:
            def call(i: Any, *args: Any) -> Any:
                ensure(i)
                return read(i, *args)
            return call
        self._view_u32 = ensuring(slots.view_uint32)
        self._view_i32 = ensuring(slots.view_int32)
        self._new_i64 = ensuring(slots.new_int64)
        self._read_into = ensuring(slots.read_into)

    def _map(self, fd: int, size: int) -> tuple[mmap.mmap, bool]:
        try:
            flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_NORESERVE", 0)
            return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE), True
        except OSError as exc:
            if exc.errno not in (_errno.ENOMEM, _errno.EPERM, _errno.EACCES):
                raise ReadError(f"file: cannot map: {exc.strerror}", errno=exc.errno,
                                path=self.path, field="file") from exc
        try:
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ), False
        except OSError as exc:
            raise ReadError(f"file: cannot map: {exc.strerror}", errno=exc.errno,
                            path=self.path, field="file") from exc

    # ---------------------------------------------------------------------------------------
    # header fields

    @property
    def num_batches(self) -> int:
        """Batches in the file."""
        return self.header.num_batches

    @property
    def batch_size(self) -> int:
        """Samples per batch."""
        return self.header.batch_size

    @property
    def seq_len(self) -> int:
        """Tokens per sample."""
        return self.header.seq_len

    @property
    def seed(self) -> int:
        """The writer's shuffle seed."""
        return self.header.seed

    @property
    def total_records(self) -> int:
        """Source records before batching."""
        return self.header.total_records

    @property
    def max_token(self) -> int | None:
        """Largest token id in the file, when the file records it."""
        return self.header.max_token

    @property
    def num_tokens(self) -> int:
        """Tokens in the file."""
        return self.header.num_tokens

    def __len__(self) -> int:
        return self.header.num_batches

    # ---------------------------------------------------------------------------------------
    # reading

    def read_batch(self, batch_index: int) -> np.ndarray:
        """Batch ``batch_index`` as a read-only ``uint32`` view ``[batch_size, seq_len]``, no copy.

        Raises:
            IndexError: ``batch_index`` outside ``[0, num_batches)`` (negative included).
            IntegrityError: the batch does not match its checksum.
        """
        return self._view_u32(batch_index)

    __getitem__ = read_batch

    def __iter__(self) -> Iterator[np.ndarray]:
        nb = self.header.num_batches
        for i in range(nb):
            if self._copy is not None and i % 16 == 0:      # a URL: the next batches fetched ahead
                self.prefetch(np.arange(i + 16, min(nb, i + 32)) if i else np.arange(0, min(nb, 32)))
            yield self.read_batch(i)

    def read_batch_numpy(self, batch_index: int, dtype: Any = np.int64, out: np.ndarray | None = None) -> np.ndarray:
        """Batch ``batch_index`` as a NumPy array.

        Args:
            batch_index: in ``[0, num_batches)``.
            dtype: ``int64`` (a new array, one conversion), ``int32`` (a writable view of the
                mapped file, no copy; refused if a token id is 2**31 or more) or ``uint32``
                (the read-only view of :meth:`read_batch`).
            out: a writable C-contiguous ``int64``/``int32``/``uint32`` array of
                ``batch_size * seq_len`` elements to fill instead (``dtype`` is then ``out``'s).

        Raises:
            IndexError, IntegrityError: as :meth:`read_batch`.
            ConfigError: a bad ``dtype`` or ``out``, or ``int32`` and a token id of 2**31 or more.
        """
        if out is not None:
            return self._read_into(batch_index, out)
        dt = _numpy_dtype(dtype)
        if dt == _INT64:
            return self._new_i64(batch_index)
        if dt == _INT32:
            return self._view_i32(batch_index)
        return self._view_u32(batch_index)

    def read_batch_torch(self, batch_index: int, dtype: Any = None, out: Any = None) -> Any:
        """The seed's torch read, which lives with torch in the adapters: use the reader of
        ``zerobatch.batch_loader`` (``zerobatch.adapters.torch.BatchFileReader``).

        Raises:
            ConfigError: always, naming what to install and import.
        """
        raise ConfigError("read_batch_torch needs PyTorch and zerobatch-adapters: pip install "
                          "'zerobatch-adapters[torch]' and use zerobatch.batch_loader.BatchFileReader",
                          field="torch")

    def read_batches(self, indices: Any, dtype: Any = np.int64, out: np.ndarray | None = None) -> np.ndarray:
        """Gather several batches into one ``[k, batch_size, seq_len]`` array, GIL released.

        Args:
            indices: batch indices (any order, repeats allowed).
            dtype: ``int64``, ``int32`` or ``uint32`` (copies; see :meth:`read_batch_numpy`).
            out: optional writable C-contiguous array of ``k * batch_size * seq_len`` elements.

        Raises:
            IndexError, IntegrityError, ConfigError: as :meth:`read_batch_numpy`.
        """
        idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        if out is None:
            out = np.empty((idx.size, *self._shape), _numpy_dtype(dtype))
        if self._copy is not None:
            self._copy.ensure(idx)
        return self._slots.gather(idx, out)

    def read_into(self, items: Any, out: Any) -> Any:
        """The batch read sources call: the batches ``items`` into ``out`` (a writable
        C-contiguous ``int64`` / ``int32`` / ``uint32`` buffer of ``len(items) * batch_size *
        seq_len`` elements), converting on the way, each batch checked against its checksum
        the first time; GIL released.

        Raises:
            OutOfRangeError, IntegrityError, ConfigError: as :meth:`read_batches`.
        """
        idx = np.ascontiguousarray(items, dtype=np.int64).reshape(-1)
        if self._copy is not None:
            self._copy.ensure(idx)
        return self._slots.gather(idx, out)

    def read_async(self, pool: Any, items: Any, out: Any) -> Any:
        """:meth:`read_into` queued on ``pool`` as one compiled task (checks and conversion
        run without the GIL from start to finish); returns its ticket (``wait()`` returns
        ``out``). Indices and ``out`` are checked now.

        Raises:
            OutOfRangeError, ConfigError: now; IntegrityError: from ``wait()``.
        """
        if self._copy is not None:          # the fetch runs on the pool's thread, then the gather
            return BatchReader.read_async(self, pool, items, out)
        return self._slots.gather_async(pool, np.ascontiguousarray(items, dtype=np.int64).reshape(-1), out)

    def views_async(self, pool: Any, items: Any) -> Any:
        """The batches ``items`` as zero-copy ``int32`` views of the mapped file, checked on
        ``pool``: one compiled task hashes each batch not checked before and scans it once for
        ids of 2**31 or more (GIL released), while the views are made here. ``wait()`` returns
        them once every batch passed: one ``[k, batch_size, seq_len]`` view when ``items`` are
        evenly spaced (consecutive batches, or a rank's share of them), else a list of such
        views, one per evenly spaced run of ``items`` in order.

        Raises:
            IndexError: an index out of range (now).
            IntegrityError, ConfigError: from ``wait()``, as :meth:`read_batch_numpy`.
        """
        idx = np.ascontiguousarray(items, dtype=np.int64).reshape(-1)
        if self._copy is not None:         # a file at a URL: each batch fetched, then checked (a run each)
            return pool.call(lambda: [self._view_i32(i)[None] for i in idx.tolist()])
        ticket = self._slots.check_async(pool, idx, True)
        views = self._slots.int32_views
        runs = [views[a:b + 1:step] for a, b, step in _even_runs(idx.tolist())]
        return _Views(ticket, runs[0] if len(runs) == 1 else runs)

    def advise(self, start: int, stop: int, advice: str = "willneed") -> None:
        """Hint the kernel about batches ``[start, stop)``: ``"willneed"`` reads them ahead
        in the background, ``"sequential"`` / ``"random"`` set the read-ahead policy,
        ``"dontneed"`` drops them from this process's working set."""
        nb = self.header.num_batches
        start, stop = max(0, min(start, nb)), max(0, min(stop, nb))
        if stop <= start or self._mm is None:
            return
        if self._copy is not None:
            if advice == "willneed":
                self.prefetch(np.arange(start, stop))
            return
        flag = {"willneed": mmap.MADV_WILLNEED, "sequential": mmap.MADV_SEQUENTIAL,
                "random": mmap.MADV_RANDOM, "dontneed": mmap.MADV_DONTNEED}.get(advice)
        if flag is None:
            raise ConfigError(f"advice must be willneed, sequential, random or dontneed, got {advice!r}",
                              field="advice")
        page = mmap.PAGESIZE
        begin = L.HEADER_SIZE + start * self.header.padded_batch_bytes
        end = L.HEADER_SIZE + stop * self.header.padded_batch_bytes
        begin -= begin % page
        try:
            self._mm.madvise(flag, begin, end - begin)
        except (OSError, ValueError):
            pass  # advice only: never fail a read because a hint was refused

    def is_verified(self, batch_index: int) -> bool:
        """Whether this reader has checked batch ``batch_index`` against its checksum."""
        return self._slots.is_verified(batch_index)

    def verify(self, progress: Callable[[int, int], None] | None = None, *, chunk: int = 1024) -> VerifyReport:
        """Check the whole file: every batch checksum, zero padding, the header's ``max_token``.

        Args:
            progress: called as ``progress(done, total)`` after each chunk of batches.
            chunk: batches per step (the GIL is released within a step).

        Returns:
            A :class:`VerifyReport`; this method does not raise on a bad batch.
        """
        nb = self.header.num_batches
        bad: list[int] = []
        num_bad = 0
        padding_ok = True
        max_tok = 0
        for start in range(0, nb, chunk):
            stop = min(nb, start + chunk)
            if self._copy is not None:      # fetched (and checked) first; what stays bad is reported
                with contextlib.suppress(IntegrityError):
                    self._copy.ensure(np.arange(start, stop))
            found = self._slots.verify_range(start, stop)
            num_bad += len(found)
            bad.extend(found[:max(0, 100 - len(bad))])
            padding_ok = padding_ok and self._slots.padding_is_zero(start, stop)
            max_tok = max(max_tok, self._slots.max_token(start, stop))
            if progress is not None:
                progress(stop, nb)
        max_ok = self.header.max_token is None or self.header.max_token == max_tok
        return VerifyReport(self.path, nb, self.header.has_checksums, tuple(bad), num_bad,
                            padding_ok, max_tok, max_ok)

    # ---------------------------------------------------------------------------------------
    # lifetime

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._mm is None

    def close(self) -> None:
        """Drop this reader's references to the mapping. The pages stay mapped as long as a
        view or tensor handed out still refers to them (unmapping under a live view would
        crash its next access), and are unmapped with the last of them."""
        if self.__dict__.pop("_unpickled", None) is not None:
            return      # unpickled, never opened: nothing to release
        if self._mm is None:
            return
        self._mm = None
        if self._copy is not None:
            self._copy.close()
        self._slots = None  # type: ignore[assignment]
        self._view_u32 = self._view_i32 = self._new_i64 = self._read_into = _closed  # type: ignore[assignment]

    def __enter__(self) -> BatchFileReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Pickle as the path: each process maps the file itself (spawn / forkserver workers).
        state = {"path": self.path, "verify": self.verify_batches, "fingerprint": self.fingerprint}
        if self._remote is not None:
            state.update(path=self._url, remote=self._remote.options)
        return state

    def _unpickled_attributes(self, state: dict[str, Any]) -> dict[str, Any]:
        remote, path = None, state["path"]
        if state.get("remote") is not None:
            from zerobatch.readers.remote import RemoteOptions
            remote = RemoteOptions(path, **state["remote"])
            return {"path": remote.url, "_url": path, "_remote": remote,
                    "verify_batches": state["verify"]}
        return {"path": path, "verify_batches": state["verify"], "_remote": None}

    def _reopen(self, state: dict[str, Any]) -> None:
        self._expected_fingerprint = state["fingerprint"]
        self._open()

    def __repr__(self) -> str:
        h = self.header
        return (f"BatchFileReader({self.path!r}, num_batches={h.num_batches}, batch_size={h.batch_size}, "
                f"seq_len={h.seq_len})")


def _closed(*args: Any, **kwargs: Any) -> Any:
    raise ConfigError("the reader is closed", field="reader")


def _even_runs(items: list[int]) -> list[tuple[int, int, int]]:
    """``(first, last, step)`` of the maximal evenly spaced increasing runs of ``items``, in
    order (a block shuffle's reads are consecutive batches but at a block's end)."""
    out: list[tuple[int, int, int]] = []
    i, n = 0, len(items)
    while i < n:
        j = i + 1
        step = items[j] - items[i] if j < n and items[j] > items[i] else 1
        while j < n and items[j] - items[j - 1] == step:
            j += 1
        out.append((items[i], items[j - 1], step))
        i = j
    return out


class _Views:
    """Views handed out once the check queued for them has passed."""

    __slots__ = ("ticket", "views")

    def __init__(self, ticket: Any, views: Any) -> None:
        self.ticket, self.views = ticket, views

    def wait(self) -> Any:
        self.ticket.wait()
        return self.views

    def cancel(self, wait: bool = True) -> bool:
        return bool(self.ticket.cancel())
