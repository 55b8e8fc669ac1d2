"""A ZRECORD store at a URL, read through a local mirror (read-only).

A store in object storage is a snapshot: the folder of a closed store, uploaded with
``commit.zr`` last (``zerobatch.writers.remote.publish_zrecord`` does so). Opening it costs two
requests in parallel (``meta.json`` and ``commit.zr``), whatever the number of records and
chunks: no LIST, no HEAD. The reader then reads a **mirror** in the cache folder, the store's
files as the compiled kernels expect them:

- ``meta.json`` and ``commit.zr``, fetched whole, and empty lock files (no writer ever runs on
  a mirror: a remote store is read-only);
- each field's offset table and check file as sparse copies of the committed entries,
  fetched by pages of :data:`PAGE_ENTRIES` entries the first time a gather touches them (the
  entries' CRC-32 checks, made by the kernel on every snapshot, cover them);
- each chunk as a sparse copy that gains exactly the records gathers need (a record's byte
  range ``[offset, offset + length)`` from its entry; neighbouring records in one request),
  checked by the kernel against each record's xxh3 checksum (always on for a store at a URL).

A range that fails its check is fetched again (:data:`~zerobatch.readers.remote.FETCH_TRIES`
tries), then the gather fails with an ``IntegrityError`` naming the object's URL and the byte
range: never a wrong record.

The mirror's folder is named by a digest of ``meta.json`` and ``commit.zr``, so a store
replaced at the URL (a new commit uploaded) gets a new mirror, and several processes of the
machine share one: they write only the object's own bytes at its own offsets. The mirror is
one entry of the cache folder (evicted whole, least recently used first, never while this
process reads it); its disk use is the records read. Once the records this process wrote
into it take half the cache limit on disk (counted in file-system blocks), the next gather
**rotates** it: the chunk copies are
unlinked (a batch's zero-copy views, and other processes, keep the copies they hold until
they let them go), the reader maps the store afresh and fetches records again as gathers need
them, so a store larger than the cache is read within it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import numpy as np

from zerobatch.core import xxh3_64
from zerobatch.core.io import pwrite_all
from zerobatch.formats import zrecord as Z
from zerobatch.formats.errors import CorruptError, IntegrityError, StateError
from zerobatch.readers.remote import FETCH_TRIES, RemoteOptions, RWLock, fetch_checked, open_sparse, runs

__all__ = ["PAGE_ENTRIES", "StoreMirror"]

#: Offset-table entries fetched per request unit (64 KiB of entries, 16 KiB of checks).
PAGE_ENTRIES = 4096
#: The file-system block a write into a sparse copy allocates (4 KiB on ext4, xfs, tmpfs).
_FS_BLOCK = 4096


def _write_whole(path: str, data: bytes) -> None:
    """``path`` holding ``data``, written under a temporary name and renamed (unless it
    already holds it: a mirror another process made)."""
    with contextlib.suppress(OSError):
        if os.path.getsize(path) == len(data):
            with open(path, "rb") as f:
                if f.read() == data:
                    return
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class StoreMirror:
    """The local mirror of the ZRECORD store at ``url`` (see the module documentation).

    Args:
        url: the store folder's URL.
        storage_options, cache_dir, cache_limit, fetch_threads: as for
            :class:`~zerobatch.readers.tokstream.TokenStreamReader`.

    Raises:
        NotFoundError: no ``meta.json`` or ``commit.zr`` at the URL.
        CorruptError / UnsupportedVersionError: a damaged store, or one copied while a writer
            ran (``meta.json`` and ``commit.zr`` of different commits).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, cache_dir: Any = None,
                 cache_limit: int | None = None, fetch_threads: int | None = None) -> None:
        self.source_url = url.rstrip("/")
        self.remote = RemoteOptions(f"{self.source_url}/{Z.META_NAME}", storage_options, cache_dir, cache_limit,
                                    fetch_threads)
        self.options = self.remote.options
        store = self.store = self.remote.store
        self.url = store.name("")
        meta_raw, commit_raw = self.remote.fetcher.run_all([
            lambda: store.get(Z.META_NAME, limit=Z.MAX_META_BYTES, field="meta.json"),
            lambda: bytes(store.get_ranges(Z.COMMIT_NAME, [0], [Z.COMMIT_SIZE], field="commit.zr")[0])])
        meta = Z.parse_meta(meta_raw, path=store.name(Z.META_NAME))
        commit = Z.unpack_commit(commit_raw, xxh3_64, path=store.name(Z.COMMIT_NAME), key=meta.key)
        if commit.seq & 1:
            raise StateError("commit.zr: a writer was applying a commit when the store was copied (odd seq): "
                             "upload a closed store", path=store.name(Z.COMMIT_NAME), field="seq")
        if (meta.generation, meta.length, meta.num_chunks, meta.epoch) != (
                commit.generation, commit.length, commit.num_chunks, commit.epoch):
            raise CorruptError(f"meta.json (generation {meta.generation}, {meta.length} records) and commit.zr "
                               f"(generation {commit.generation}, {commit.length} records) are of different "
                               "commits: the store was copied while a writer ran, or is being replaced (upload a "
                               "closed store, commit.zr last)", path=self.url, field="generation")
        self.meta, self.length, self._raw = meta, commit.length, (meta_raw, commit_raw, commit.epoch)
        digest = xxh3_64(meta_raw + commit_raw)
        self.folder = self.remote.cache.folder("zrecord", f"{digest:016x}")
        self._tables: list[tuple[int, int]] = []
        self._chunks: dict[int, int] = {}
        self._lock = threading.Lock()
        #: held shared while records are fetched and written and until the kernels have read
        #: them; exclusive to rotate
        self.lock = RWLock()
        #: chunk bytes this process wrote since the last rotation, and the rotations so far
        self.written, self.rotations = 0, 0
        self.budget = self.remote.cache.limit // 2
        self._materialize()

    def _materialize(self) -> None:
        """The mirror's files (again, when another process evicted the folder): meta.json,
        commit.zr, the lock files, the sparse tables; this process's pages and records
        counted as not held."""
        meta_raw, commit_raw, epoch = self._raw
        os.makedirs(os.path.join(self.folder, Z.CHUNK_DIR), exist_ok=True)
        _write_whole(os.path.join(self.folder, Z.META_NAME), meta_raw)
        _write_whole(os.path.join(self.folder, Z.COMMIT_NAME), commit_raw)
        for name in (Z.SWITCH_LOCK_NAME, Z.WRITER_LOCK_NAME, Z.epoch_lock_name(epoch)):
            os.close(os.open(os.path.join(self.folder, name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
        n = max(self.length, 1)           # a table is never mapped empty
        self._close_tables()
        for f in self.meta.fields:
            self._tables.append((open_sparse(os.path.join(self.folder, Z.offset_name(f.name)), n * Z.ENTRY_SIZE),
                                 open_sparse(os.path.join(self.folder, Z.check_name(f.name)), n * Z.CHECK_SIZE)))
        pages = -(-self.length // PAGE_ENTRIES)
        self._pages = [np.zeros(pages, bool) for _ in self.meta.fields]
        self._held = [np.zeros(self.length, bool) for _ in self.meta.fields]

    def over_budget(self) -> bool:
        """Whether the records this process wrote into the mirror since the last rotation
        take more than half the cache limit on disk."""
        return self.written > self.budget

    def rotate(self) -> None:
        """Drop this mirror's chunk copies (see the module documentation); the caller then
        maps the store afresh. Waits for fetches and reads in flight."""
        with self.lock.exclusive():
            with self._lock:
                fds, self._chunks = list(self._chunks.values()), {}
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            chunk_dir = os.path.join(self.folder, Z.CHUNK_DIR)
            with contextlib.suppress(OSError):
                for e in os.scandir(chunk_dir):
                    with contextlib.suppress(OSError):
                        os.unlink(e.path)
            self._materialize()
            self.written = 0
            self.rotations += 1

    # -- entries ---------------------------------------------------------------------------

    def _indices(self, idx: np.ndarray) -> np.ndarray:
        """``idx`` with negative indices counted from the end, those out of range dropped
        (the kernel's index check reports them)."""
        i = np.where(idx < 0, idx + self.length, idx)
        return i[(i >= 0) & (i < self.length)]

    def ensure_entries(self, idx: np.ndarray, fnos: list[int]) -> None:
        """The table pages of ``idx`` in fields ``fnos`` present in the mirror (fetched now,
        both tables of every field in parallel)."""
        pages = np.unique(self._indices(idx) // PAGE_ENTRIES)
        calls, done = [], []
        for k in dict.fromkeys(fnos):
            need = pages[~self._pages[k][pages]]
            if not need.size:
                continue
            spans = [(a * PAGE_ENTRIES, min(self.length, b * PAGE_ENTRIES)) for a, b in runs(need.tolist())]
            name = self.meta.fields[k].name
            for fd, obj, unit in ((self._tables[k][0], Z.offset_name(name), Z.ENTRY_SIZE),
                                  (self._tables[k][1], Z.check_name(name), Z.CHECK_SIZE)):
                calls.append(lambda fd=fd, obj=obj, unit=unit, spans=spans: self._fetch(
                    obj, fd, [a * unit for a, _ in spans], [b * unit for _, b in spans]))
            done.append((k, need))
        if calls:
            with self.lock.shared():
                self.remote.fetcher.run_all(calls)
            for k, need in done:
                self._pages[k][need] = True

    def forget_entries(self, k: int, index: int) -> None:
        """The page of entry ``index`` of field ``k`` is fetched again by the next gather."""
        i = index + self.length if index < 0 else index
        if 0 <= i < self.length:
            self._pages[k][i // PAGE_ENTRIES] = False

    # -- records ---------------------------------------------------------------------------

    def _chunk_fd(self, c: int) -> int:
        fd = self._chunks.get(c)
        if fd is None:
            with self._lock:
                fd = self._chunks.get(c)
                if fd is None:
                    # never truncated: pwrite extends it, so processes sharing it only ever add bytes
                    fd = os.open(os.path.join(self.folder, Z.chunk_name(c)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                 0o644)
                    self._chunks[c] = fd
        return fd

    def ensure_records(self, k: int, idx: np.ndarray, col: np.ndarray) -> None:
        """The records of field ``k`` at ``idx`` (their entries ``col``) present in the
        mirror: those this process has not fetched yet are fetched, by chunk, in parallel."""
        i = np.where(idx < 0, idx + self.length, idx)
        held = self._held[k]
        ok = (i >= 0) & (i < self.length)
        m = ok & (col["length"] > 0)
        m[m] = ~held[i[m]]
        if not m.any():
            return
        ents, which = col[m], i[m]
        calls = []
        for c in np.unique(ents["chunk"]).tolist():
            sel = ents[ents["chunk"] == c]
            # one range per offset (a record gathered twice), sorted
            order = np.argsort(sel["offset"], kind="stable")
            o, ln = sel["offset"][order].astype(np.int64), sel["length"][order].astype(np.int64)
            starts, first = np.unique(o, return_index=True)
            stops = starts + np.maximum.reduceat(ln, first)
            calls.append(lambda c=c, a=starts, b=stops: self._fetch(Z.chunk_name(c), self._chunk_fd(c),
                                                                   a.tolist(), b.tolist()))
        with self.lock.shared():
            self.remote.fetcher.run_all(calls)
        held[which] = True

    def forget_record(self, k: int, index: int) -> None:
        """Record ``index`` of field ``k`` is fetched again by the next gather."""
        i = index + self.length if index < 0 else index
        if 0 <= i < self.length:
            self._held[k][i] = False

    def record_error(self, k: int, index: int, entry: Any, what: str) -> IntegrityError:
        """The error of a record that failed its check after :data:`FETCH_TRIES` fetches."""
        c, off, ln = int(entry["chunk"]), int(entry["offset"]), int(entry["length"])
        name = self.meta.fields[k].name
        return IntegrityError(f"{name}: record {index}, bytes [{off}, {off + ln}): {what} in {FETCH_TRIES} fetches "
                              "(the object differs from the checksums it carries)",
                              path=self.store.name(Z.chunk_name(c)), field=name)

    # -- fetching --------------------------------------------------------------------------

    def _fetch(self, obj: str, fd: int, starts: list[int], stops: list[int]) -> None:
        """Ranges of object ``obj`` written into its sparse copy ``fd``, unchecked here: each
        record is checked by the gather kernel against its ``.check`` entry as it is read, and a
        record that fails is fetched again from there (:meth:`forget_record`)."""
        def accept(which: list[int], parts: list[Any]) -> list[int]:
            written = disk = 0
            for i, part in zip(which, parts, strict=True):
                a = starts[i]
                pwrite_all(fd, part, a)
                written += len(part)
                # the disk a sparse copy spends: whole file-system blocks (at most; neighbours share)
                disk += -(-(a + len(part)) // _FS_BLOCK) * _FS_BLOCK - a // _FS_BLOCK * _FS_BLOCK
            if obj.startswith(Z.CHUNK_DIR):
                with self._lock:
                    self.written += disk
            if self.remote.cache.added(written):
                self.remote.cache.evict(lambda path: path == self.folder, lambda path: False)
            return []
        fetch_checked(self.store, obj, starts, stops, accept, path=self.store.name(obj), field="record")

    def _close_tables(self) -> None:
        fds = [fd for pair in self._tables for fd in pair]
        self._tables = []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            fds = list(self._chunks.values())
            self._chunks = {}
        self._close_tables()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
