"""Read ZRECORD stores: threaded, checked gathers with zero-copy raw records.

:class:`ZRecordStore` maps ``commit.zr``, the offset tables and, on first use, the chunks.
A gather copies the requested entries under the commit file's seqlock (so every record of
a batch comes from one committed state, even while a writer commits), then checks each
record (the chunk exists and holds the entry, the container's magic, xxh3 checksum, codec,
field number and lengths) and copies, inflates or views it, in compiled code with the GIL
released, split over a reader pool when the batch is large.

What a gather returns (:class:`RecordBatch`) per field:

- fixed-shape fields: one ``[n, *shape]`` array filled in place (absent records are zeros,
  ``batch.present(name)`` says which);
- variable-length ``raw`` fields: one array per record that is a *view into the mapped
  chunk* (zero copy), ``None`` for an absent record;
- variable-length ``flate`` fields: one array per record, views into one buffer the batch
  owns, inflated there.

``batch.release()`` hands the batch to the cleaner thread, which drops its buffers off the
training thread; views keep the mapping (or buffer) they point into alive, so a view used
after ``release()`` is still memory-safe, but the batch itself refuses further use.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from zerobatch.core import (FileMapping, buffer_views, check_records, inflate_records, publish_chunk, record_views,
                            snapshot_entries, zrstore)
from zerobatch.core.io import open_regular_file
from zerobatch.core.pool import shared_pool
from zerobatch.core.status import STATUS, raise_for_status
from zerobatch.formats import zrecord as Z
from zerobatch.formats.errors import (
    ConfigError,
    CorruptError,
    NotFoundError,
    StateError,
    TruncatedError,
)
from zerobatch.readers.base import FETCHED, MAPPED, Access
from zerobatch.readers.remote import FETCH_TRIES

__all__ = ["FieldView", "RecordBatch", "ZRecordStore"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class _Cleaner:
    """The cleaner: one daemon thread dropping released batches' buffers (the seed's gc_task
    queue). Freeing a large inflated buffer costs an ``munmap``; here it is not the caller's."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def put(self, item: Any) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():
                self._queue = queue.SimpleQueue()
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, args=(self._queue,), name="zrecord-cleaner",
                                                daemon=True)
                self._thread.start()
            self._queue.put(item)

    @staticmethod
    def _run(q: queue.SimpleQueue[Any]) -> None:
        while True:
            item = q.get()
            del item


CLEANER = _Cleaner()


class _Generation:
    """What a reader maps for one rebalance epoch, and the state the kernels read it through:
    the commit file's mapping, each field's offset table and check file (their addresses and
    the entries both cover, by field number), the chunk registry (addresses and sizes the
    kernels read without the GIL, the mappings that keep them valid) and the shared lock on
    ``epoch-<E>.lock`` that keeps the epoch's chunks on disk. A gather holds its generation
    from start to end, so a reopen on another thread never pulls chunks from under it; the
    lock goes with the last user.

    Tables and chunks are only ever replaced by larger mappings of the same file, and every
    replaced mapping (and every outgrown address array) is kept until the generation goes, so
    whatever a kernel running on another thread read stays mapped.
    """

    __slots__ = ("commit_map", "epoch", "first_chunk", "epoch_fd", "table_addr", "check_addr", "table_entries",
                 "tables", "chunk_base", "chunk_size", "chunk_maps", "chunk_sizes", "maps", "_kept", "__weakref__")

    def __init__(self, commit_map: Any, epoch: int, first_chunk: int, num_fields: int) -> None:
        self.commit_map = commit_map
        self.epoch = epoch
        self.first_chunk = first_chunk   # chunks below it were retired by a rebalance
        self.epoch_fd: int | None = None
        self.table_addr = np.zeros(num_fields, np.uint64)
        self.check_addr = np.zeros(num_fields, np.uint64)
        self.table_entries = np.zeros(num_fields, np.uint64)
        self.tables: list[Any] = [None] * num_fields
        self.chunk_base = np.zeros(16, np.uint64)
        self.chunk_size = np.zeros(16, np.uint64)
        self.chunk_maps: list[Any] = [None] * 16
        self.chunk_sizes: dict[int, int] = {}
        self.maps = 0  # chunk mappings made so far: a check that failed before one may pass now
        self._kept: list[Any] = []

    def set_table(self, k: int, table: Any, check: Any) -> None:
        """Field ``k``'s offset table and check file (the entries usable are those both cover)."""
        if self.tables[k] is not None:
            self._kept.append(self.tables[k])       # a snapshot running now may read it
        self.tables[k] = (table, check)
        self.table_addr[k] = table.address
        self.check_addr[k] = check.address
        self.table_entries[k] = min(len(table) // Z.ENTRY_SIZE, len(check) // Z.CHECK_SIZE)

    def set_chunk(self, c: int, mapping: Any, size: int) -> None:
        """Chunk ``c``'s (larger) mapping, published to the kernels base first."""
        if c >= len(self.chunk_base):
            cap = max(c + 1, 2 * len(self.chunk_base))
            base, sizes = np.zeros(cap, np.uint64), np.zeros(cap, np.uint64)
            base[:len(self.chunk_base)] = self.chunk_base
            sizes[:len(self.chunk_size)] = self.chunk_size
            self._kept.append((self.chunk_base, self.chunk_size))   # a kernel may still read them
            self.chunk_maps.extend([None] * (cap - len(self.chunk_maps)))
            self.chunk_base, self.chunk_size = base, sizes
        if self.chunk_maps[c] is not None:
            self._kept.append(self.chunk_maps[c])
        self.chunk_maps[c] = mapping
        publish_chunk(self.chunk_base, self.chunk_size, c, mapping.address, size)
        self.chunk_sizes[c] = size
        self.maps += 1

    def release(self) -> None:
        fd, self.epoch_fd = self.epoch_fd, None
        zrstore.unlock(fd)

    def __del__(self) -> None:
        self.release()


#: What a failed record check means, by status, for the error message.
_RECORD_FAULTS = {
    STATUS.ZB_E_MAGIC: "bad magic",
    STATUS.ZB_E_FIELD: "a field of its container disagrees (codec, field, length, a length that is not a whole "
                       "number of items, or the inflated size)",
    STATUS.ZB_E_OVERFLOW: "offset + length overflows",
    STATUS.ZB_E_CHECKSUM: "checksum mismatch",
}


class RecordBatch:
    """The records of one gather, by field; see the module docstring. Release it with
    :meth:`release` (or a ``with`` block)."""

    __slots__ = ("indices", "_data", "_present", "_buffers", "_released")

    def __init__(self, indices: np.ndarray, data: dict[str, Any], present: dict[str, np.ndarray],
                 buffers: list[Any]) -> None:
        self.indices = indices
        self._data = data
        self._present = present
        self._buffers = buffers
        self._released = False

    def __getitem__(self, name: str) -> Any:
        if self._released:
            raise StateError("the batch was released", field=name)
        try:
            return self._data[name]
        except KeyError:
            raise KeyError(f"field {name!r} was not gathered (gathered: {sorted(self._data)})") from None

    def present(self, name: str) -> np.ndarray:
        """Boolean mask: which records of field ``name`` exist (not absent)."""
        if self._released:
            raise StateError("the batch was released", field=name)
        return self._present[name]

    def keys(self) -> list[str]:
        return list(self._data)

    def __len__(self) -> int:
        return len(self.indices)

    def release(self) -> None:
        """Hand the batch's buffers to the cleaner. Idempotent."""
        if self._released:
            return
        self._released = True
        item = (self._data, self._buffers)
        self._data, self._buffers = {}, []
        CLEANER.put(item)

    def __enter__(self) -> RecordBatch:
        return self

    def __exit__(self, *_: Any) -> None:
        self.release()


class _Rotated(Exception):
    """A gather's mapping is older than the mirror's chunk copies (see ``_rotate``)."""


class FieldView:
    """``store[name]``: the NumPy-style projection of one field (``view[indices]``,
    ``view[i]``, ``view[a:b]``, ``len(view)``)."""

    def __init__(self, store: ZRecordStore, name: str) -> None:
        self.store = store
        self.name = name
        self.spec = store.meta.field(name)

    def __len__(self) -> int:
        return len(self.store)

    @property
    def dtype(self) -> np.dtype:
        return self.spec.np_dtype

    @property
    def shape(self) -> tuple[int, ...] | None:
        return None if self.spec.shape is None else (len(self.store), *self.spec.shape)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            batch = self.store.gather(np.array([key], np.int64), [self.name])
            value = batch[self.name][0]
            return value.copy() if value is not None else None
        if isinstance(key, slice):
            key = np.arange(*key.indices(len(self.store)), dtype=np.int64)
        batch = self.store.gather(key, [self.name])
        return batch[self.name]

    def __iter__(self) -> Iterator[Any]:
        for start in range(0, len(self.store), 256):
            for value in self[start:start + 256]:
                yield value


class ZRecordStore:
    """A ZRECORD store open for reading.

    Args:
        path: the store's folder, or its URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``,
            ``file://``): a store in object storage is read-only, through a local mirror that
            gains the table pages and records gathers need (:mod:`zerobatch.readers._zrecord_remote`).
        num_threads: threads a gather splits over (the caller and ``num_threads - 1`` pool
            workers, shared by every reader in the process). 2 on a 2-core machine.
        verify: check every record's xxh3 checksum on every read (the cost is a hash of the
            stored bytes; ``tools/compare_zrecord.py`` measures it).
        max_record_bytes: the largest record (after inflating) a variable-length field may
            declare: a record claiming more is refused before any memory is allocated.
        storage_options, cache_dir, cache_limit, fetch_threads: a store at a URL: as for
            :class:`~zerobatch.readers.tokstream.TokenStreamReader` (records are then always
            checked, whatever ``verify`` says).

    Raises:
        NotFoundError: not a store.
        CorruptError / TruncatedError / UnsupportedVersionError: a damaged or lying store.
    """

    def __init__(self, path: str | os.PathLike[str], *, num_threads: int = 2, verify: bool = True,
                 max_record_bytes: int = 1 << 30, storage_options: dict[str, Any] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, cache_limit: int | None = None,
                 fetch_threads: int | None = None) -> None:
        from zerobatch.core.remote import is_url, local_path
        path = local_path(path)
        self._mirror: Any = None
        self._remote_args: tuple[str, dict[str, Any]] | None = None
        if is_url(path):
            from zerobatch.readers._zrecord_remote import StoreMirror
            self._mirror = StoreMirror(path, storage_options, cache_dir, cache_limit, fetch_threads)
            self.path, self._root = self._mirror.url, self._mirror.folder
            verify = True
        else:
            self.path = self._root = os.path.abspath(os.fspath(path))
        if not 1 <= num_threads <= 64:
            raise ConfigError(f"num_threads must be 1 to 64, got {num_threads}", path=self.path,
                              field="num_threads")
        if not 0 < max_record_bytes < 1 << 32:
            raise ConfigError("max_record_bytes must be in (0, 2**32)", path=self.path, field="max_record_bytes")
        self.num_threads = num_threads
        self.verify = verify
        self.max_record_bytes = max_record_bytes
        self._pool = shared_pool(num_threads - 1) if num_threads > 1 else None
        self._lock = threading.RLock()     # held to map or reopen, never while reading
        self._gen: _Generation | None = None
        self._closed = False
        self._store_id: int | None = None   # set by the first open; a reopen must find the same store
        self._pending = False
        self._open()

    # ----------------------------------------------------------------------------------------
    # Opening

    def _open(self) -> None:
        mpath = os.path.join(self._root, Z.META_NAME)
        if not os.path.isdir(self._root):
            raise NotFoundError("path: no such folder", path=self.path, field="path")
        if not os.path.lexists(mpath):
            raise NotFoundError("meta.json: not a ZRECORD store (no meta.json)", path=self.path, field="meta.json")
        cpath = os.path.join(self._root, Z.COMMIT_NAME)
        for _ in range(3):
            if os.path.lexists(os.path.join(self._root, Z.JOURNAL_NAME)):
                self._maybe_recover()
            sfd = zrstore.lock(os.path.join(self._root, Z.SWITCH_LOCK_NAME), exclusive=False, blocking=True)
            try:
                if self._rebalance_journal():
                    continue
                key = zrstore.read_meta(mpath).key   # the store key (it never changes)
                if self._store_id is not None and key != self._store_id:
                    raise CorruptError(f"store_id: the store is now {key:016x}, this reader opened "
                                       f"{self._store_id:016x} (replaced since)", path=mpath, field="store_id")
                cfd, st = open_regular_file(cpath)
                try:
                    if st.st_size < Z.COMMIT_SIZE:
                        raise TruncatedError(f"commit.zr: {st.st_size} bytes, fewer than {Z.COMMIT_SIZE}",
                                             path=cpath, field="commit.zr")
                    commit_map = FileMapping(cfd, Z.COMMIT_SIZE, cpath)
                finally:
                    os.close(cfd)
                commit = zrstore.read_commit(commit_map, path=cpath, key=key)
                if commit is None:
                    zrstore.unlock(sfd)
                    sfd = None
                    zrstore.read_commit_waiting(commit_map, self._root, path=cpath, key=key)
                    continue
                meta = self._read_meta(mpath, commit)
                if meta.key != key:
                    raise CorruptError("meta.json: the store was replaced while opening", path=mpath, field="store_id")
                gen = _Generation(commit_map, commit.epoch, meta.first_chunk, len(meta.fields))
                for k, f in enumerate(meta.fields):
                    self._map_table(gen, k, f, commit.length)
                gen.epoch_fd = zrstore.lock(os.path.join(self._root, Z.epoch_lock_name(commit.epoch)),
                                            exclusive=False, blocking=True)
            finally:
                zrstore.unlock(sfd)
            self.meta = meta
            self.fields = meta.fields
            self._key = key
            self._key32 = Z.key32(key)
            self._store_id = key
            self._field_no = {f.name: k for k, f in enumerate(meta.fields)}
            self._commit_map = commit_map
            self._gen = gen  # the previous one goes with its last user
            return
        raise StateError("switch.lock: the store kept changing under the reader", path=self.path, field="switch.lock")

    def _name(self, rel: str) -> str:
        """A file of the store, for messages (its URL for a store at a URL)."""
        return f"{self.path}/{rel}" if self._mirror is not None else os.path.join(self.path, rel)

    @property
    def access(self) -> Access:
        """What reaching the store's bytes costs (:class:`~zerobatch.readers.base.Access`)."""
        return FETCHED if self.remote else MAPPED

    @property
    def remote(self) -> bool:
        """Whether the store is read from a URL (object storage; read-only)."""
        return self._mirror is not None or self.__dict__.get("_remote_args") is not None

    @property
    def store(self) -> Any:
        """The object store of a store at a URL (its request and byte counters), else ``None``."""
        if self.remote:
            self._check_open()
        return None if self._mirror is None else self._mirror.store

    def prefetch(self, indices: Any, fields: Sequence[str] | None = None) -> None:
        """Read-ahead hint: a store at a URL fetches the entries and records of ``indices``
        (of ``fields``, default all) in the background (errors are left to the gather that
        needs them). A local store: nothing."""
        if not self.remote:
            return
        self._check_open()
        idx = np.array(indices, dtype=np.int64, copy=True).reshape(-1)
        fnos = self._fnos(self.keys() if fields is None else list(fields))

        def run() -> None:
            with contextlib.suppress(Exception):
                _, entries, _, _ = self._snapshot(idx, fnos)
                for j, k in enumerate(fnos):
                    self._mirror.ensure_records(k, idx, entries[:, j])
        self._mirror.remote.fetcher.ahead(run)

    @property
    def fingerprint(self) -> str:
        """The store's identity (``store_id`` in hex): constant while records are appended,
        modified or rebalanced, different for any other store. Empty for a version 1 store,
        which has none."""
        return f"{self._store_id:016x}" if self._store_id else ""

    def _rebalance_journal(self) -> bool:
        """Under switch.lock (shared): a journal now is a rebalance whose writer died."""
        jpath = os.path.join(self._root, Z.JOURNAL_NAME)
        if not os.path.lexists(jpath):
            return False
        try:
            fd, st = open_regular_file(jpath)
        except NotFoundError:
            return False
        try:
            head = os.pread(fd, Z.JOURNAL_HEADER.size, 0)
        finally:
            os.close(fd)
        if len(head) == Z.JOURNAL_HEADER.size and Z.JOURNAL_HEADER.unpack_from(head)[1] == Z.JOURNAL_KIND_REBALANCE:
            return True
        return False

    def _maybe_recover(self) -> None:
        """A journal exists: a live writer is finishing it (wait), or a dead one left it (apply)."""
        zrstore.recover(self._root)

    def _read_meta(self, mpath: str, commit: Z.Commit) -> Z.StoreMeta:
        for attempt in range(100):
            meta = zrstore.read_meta(mpath)
            if meta.generation == commit.generation:
                if (meta.length, meta.num_chunks, meta.epoch) != (commit.length, commit.num_chunks, commit.epoch):
                    raise CorruptError(
                        f"meta.json: length {meta.length}, {meta.num_chunks} chunks, epoch {meta.epoch} disagree "
                        f"with commit.zr ({commit.length}, {commit.num_chunks}, {commit.epoch})",
                        path=mpath, field="length")
                return meta
            if meta.generation + 1 == commit.generation and attempt < 99:
                time.sleep(0.01)  # a writer is between publishing a commit and rewriting meta.json
                continue
            break
        raise CorruptError(f"meta.json: generation {meta.generation} does not match commit.zr's {commit.generation}",
                           path=mpath, field="generation")

    def _map_table(self, gen: _Generation, k: int, f: Z.FieldSpec, length: int) -> None:
        maps = []
        for name, unit in ((Z.offset_name(f.name), Z.ENTRY_SIZE), (Z.check_name(f.name), Z.CHECK_SIZE)):
            tpath = os.path.join(self._root, name)
            try:
                fd, st = open_regular_file(tpath)
            except NotFoundError:
                raise NotFoundError(f"{name}: missing", path=tpath, field=name) from None
            try:
                if st.st_size % unit:
                    raise CorruptError(f"{name}: {st.st_size} bytes is not a whole number of {unit}-byte entries",
                                       path=tpath, field=name)
                if st.st_size // unit < length:
                    raise TruncatedError(f"{name}: {st.st_size // unit} entries, the store has {length} records",
                                         path=tpath, field=name)
                maps.append(FileMapping(fd, st.st_size, tpath))
            finally:
                os.close(fd)
        gen.set_table(k, maps[0], maps[1])

    def _map_chunk(self, gen: _Generation, c: int, field: str, index: int, maps_before: int) -> None:
        """Map chunk c (again, if it grew) in ``gen``, for a check that started when
        ``gen.maps`` was ``maps_before``."""
        cpath = os.path.join(self._root, Z.chunk_name(c))
        with self._lock:
            if gen.maps != maps_before:
                return  # another thread mapped meanwhile: check again first
            if self._mirror is not None and self._gen is not gen:
                raise _Rotated()          # the mirror's copies went with a rotation: gather again
            try:
                fd, st = open_regular_file(cpath)
            except NotFoundError:
                raise CorruptError(f"{field}.offset: record {index} points into chunk {c}, which does not exist",
                                   path=cpath, field="chunk_id") from None
            try:
                if st.st_size <= gen.chunk_sizes.get(c, -1):
                    raise CorruptError(f"{field}.offset: the entry of record {index} runs past the end of chunk "
                                       f"{c} ({st.st_size} bytes)", path=cpath, field="offset")
                gen.set_chunk(c, FileMapping(fd, st.st_size, cpath), st.st_size)
            finally:
                os.close(fd)

    # ----------------------------------------------------------------------------------------
    # Reading

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("the store is closed", path=self.path, field="store")
        if self._pending:
            self._ensure()

    def __len__(self) -> int:
        self._check_open()
        return zrstore.read_commit_waiting(self._commit_map, self._root, path=self.path, key=self._key).length

    def keys(self) -> list[str]:
        return [f.name for f in self.fields]

    def __getitem__(self, name: str) -> FieldView:
        self._check_open()
        if name not in self._field_no:
            raise KeyError(f"no field {name!r} (fields: {self.keys()})")
        return FieldView(self, name)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Records in index order, as ``{field: value}`` (copies), 256 per gather."""
        n = len(self)
        for start in range(0, n, 256):
            idx = np.arange(start, min(n, start + 256), dtype=np.int64)
            with self.gather(idx) as batch:
                for i in range(len(idx)):
                    yield {f.name: _copy(batch[f.name][i]) for f in self.fields}

    def _snapshot(self, idx: np.ndarray, fnos: list[int]) -> tuple[_Generation, np.ndarray, int, int]:
        """The entries of ``idx`` in the fields ``fnos``, all of one committed state: the
        kernel's signals are acted on here (a writer committing: read again; a table mapped
        too short: map it; a rebalance: reopen), its errors raised."""
        deadline = None
        entries = np.empty((idx.size, len(fnos)), Z.ENTRY_DTYPE)
        mirror, tries = self._mirror, 1
        if mirror is not None:
            mirror.ensure_entries(idx, fnos)
        while True:
            gen = self._gen
            if gen is None:
                raise StateError("the store is closed", path=self.path, field="store")
            status, length, nchunks, bad = snapshot_entries(gen.commit_map, gen.epoch, gen.table_addr,
                                                            gen.check_addr, gen.table_entries, fnos, idx, entries,
                                                            self._key32)
            if status == STATUS.ZB_OK:
                return gen, entries, length, nchunks
            if status == STATUS.ZB_E_CHECKSUM and mirror is not None and tries < FETCH_TRIES:
                tries += 1                # damaged in flight or in the mirror: fetch the page again
                mirror.forget_entries(fnos[bad % len(fnos)], int(idx[bad // len(fnos)]))
                mirror.ensure_entries(idx, fnos)
                continue
            if status == STATUS.ZB_E_CHECKSUM:
                name = self.fields[fnos[bad % len(fnos)]].name
                raise_for_status(status, f"{name}.offset: the entry of record {int(idx[bad // len(fnos)])} fails its "
                                 f"check (CRC-32 in {name}.check)", path=self._name(Z.offset_name(name)),
                                 field="offset")
            if status == STATUS.ZB_E_INDEX:
                raise_for_status(status, f"index {int(idx[bad])} is out of range for a store of {length} records",
                                 path=self.path, field="index")
            if status == STATUS.ZB_NEED_TABLE:
                k = fnos[bad]
                with self._lock:
                    c = zrstore.read_commit_waiting(gen.commit_map, self._root, path=self.path, key=self._key)
                    self._map_table(gen, k, self.fields[k], c.length)
            elif status == STATUS.ZB_STALE:
                with self._lock:
                    if self._gen is gen:   # else another thread reopened already
                        self._open()
            elif status == STATUS.ZB_RETRY:   # a writer is applying a commit
                if deadline is None:
                    deadline = time.monotonic() + 0.05
                elif time.monotonic() > deadline:
                    zrstore.read_commit_waiting(gen.commit_map, self._root, path=self.path, key=self._key)
                    deadline = None
                time.sleep(0)
            else:
                raise_for_status(status, "an offset-table snapshot failed", path=self.path, field="offset")

    def gather(self, indices: Any, fields: Sequence[str] | None = None, *, zero_copy: bool = False) -> RecordBatch:
        """The records at ``indices`` (any integer array; negative counts from the end), in
        request order, of ``fields`` (default: all).

        ``zero_copy=True`` returns raw fixed-shape fields as per-record views into the
        mapped chunks too, instead of one stacked copy.

        Raises:
            IndexError: an index outside the store.
            IntegrityError / CorruptError / LimitExceededError: a damaged record, naming the
                chunk file, the field and the record.
        """
        self._check_open()
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu" and idx.size:
            raise ConfigError(f"indices must be integers, got {idx.dtype}", path=self.path, field="indices")
        idx = np.ascontiguousarray(idx.reshape(-1), dtype=np.int64)
        fnos = self._fnos(self.keys() if fields is None else list(fields))
        for _ in range(8):
            if self._mirror is not None and self._mirror.over_budget():
                self._rotate()
            gen, entries, length, nchunks = self._snapshot(idx, fnos)
            data: dict[str, Any] = {}
            present: dict[str, np.ndarray] = {}
            buffers: list[Any] = []
            try:
                for j, k in enumerate(fnos):
                    spec = self.fields[k]
                    col = entries[:, j] if len(fnos) > 1 else entries.reshape(-1)
                    data[spec.name], present[spec.name] = self._field(gen, idx, col, nchunks, k, spec, zero_copy,
                                                                      buffers)
            except _Rotated:
                continue              # the mirror was rotated under this gather: again, afresh
            return RecordBatch(idx, data, present, buffers)
        raise StateError("the mirror of the store kept rotating under one gather (a batch larger than half the "
                         "cache limit: raise cache_limit)", path=self.path, field="cache_limit")

    def _rotate(self) -> None:
        """A store at a URL whose mirror passed its share of the cache: drop the chunk copies
        and map the store afresh (gathers holding the old mapping keep it)."""
        with self._lock:
            if self._mirror.over_budget():
                self._mirror.rotate()
                self._open()

    def _fnos(self, names: list[str]) -> list[int]:
        fnos = []
        for name in names:
            if name not in self._field_no:
                raise KeyError(f"no field {name!r} (fields: {self.keys()})")
            fnos.append(self._field_no[name])
        return fnos

    def _check(self, gen: _Generation, idx: np.ndarray, col: np.ndarray, nchunks: int, k: int,
               spec: Z.FieldSpec, out: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        max_len = spec.fixed_bytes or self.max_record_bytes
        mirror, tries = self._mirror, {}
        if mirror is not None:
            mirror.ensure_records(k, idx, col)
        while True:
            maps_before = gen.maps
            status, bad, need, payload, lens = check_records(
                col, gen.chunk_base, gen.chunk_size, nchunks, k, spec.codec, spec.fixed_bytes, max_len,
                spec.np_dtype.itemsize, self.verify, out, self._pool, self.num_threads, self._key, gen.first_chunk)
            if status == STATUS.ZB_NEED_CHUNK:
                self._map_chunk(gen, need, spec.name, int(idx[bad]), maps_before)
                continue
            if status != STATUS.ZB_OK and mirror is not None and status in _RECORD_FAULTS:
                if self._gen is not gen:
                    raise _Rotated()      # fetched into the new copies, read through the old mapping
                # damaged in flight or in the mirror: fetch the record again, then give up
                i = int(idx[bad])
                tries[i] = tries.get(i, 1) + 1
                if tries[i] > FETCH_TRIES:
                    raise mirror.record_error(k, i, col[bad], _RECORD_FAULTS[status])
                mirror.forget_record(k, i)
                mirror.ensure_records(k, idx[bad:bad + 1], col[bad:bad + 1])
                continue
            if status != STATUS.ZB_OK:
                self._raise(status, bad, idx, col, spec)
            return payload, lens

    def _raise(self, status: int, pos: int, idx: np.ndarray, col: np.ndarray, spec: Z.FieldSpec) -> None:
        e = col[pos]
        c, off, ln = int(e["chunk"]), int(e["offset"]), int(e["length"])
        what = _RECORD_FAULTS.get(status, "damaged")
        if status == STATUS.ZB_E_LIMIT:
            what = f"declares more than max_record_bytes ({self.max_record_bytes})"
        raise_for_status(status, f"{spec.name}: record {int(idx[pos])} (chunk {c}, offset {off}, {ln} bytes): {what}",
                         path=self._name(Z.chunk_name(c)), field=spec.name)

    def _field(self, gen: _Generation, idx: np.ndarray, col: np.ndarray, nchunks: int, k: int,
               spec: Z.FieldSpec, zero_copy: bool, buffers: list[Any]) -> tuple[Any, np.ndarray]:
        n = len(idx)
        dt = spec.np_dtype
        if spec.shape is not None and not (zero_copy and spec.codec == 0):
            out = np.empty((n, *spec.shape), dt)
            _, lens = self._check(gen, idx, col, nchunks, k, spec, out.reshape(-1).view(np.uint8))
            return out, lens >= 0
        payload, lens = self._check(gen, idx, col, nchunks, k, spec, None)
        present = lens >= 0
        if spec.codec == 0:
            return record_views(gen.chunk_base, gen.chunk_size, gen.chunk_maps, col["chunk"], payload, lens, dt,
                                spec.shape), present
        sizes = np.where(present, lens, 0).astype(np.uint64)
        offsets = np.zeros(n, np.uint64)
        if n > 1:
            np.cumsum(sizes[:-1], out=offsets[1:])
        buf = np.empty(int(sizes.sum()) + 16, np.uint8)  # never empty: a zero-length view still has a base
        buffers.append(buf)
        status, bad = inflate_records(col, gen.chunk_base, gen.chunk_size, payload, lens, buf, offsets, self._pool,
                                      self.num_threads)
        if status != STATUS.ZB_OK:
            self._raise(status, bad, idx, col, spec)
        return buffer_views(buf, offsets, lens, dt, spec.shape), present

    def verify_all(self, *, batch: int = 4096) -> int:
        """Read and check every record of every field, checksums included (even when the
        store was opened with ``verify=False``); returns the records checked."""
        n = len(self)
        verify, self.verify = self.verify, True
        try:
            for start in range(0, n, batch):
                self.gather(np.arange(start, min(n, start + batch), dtype=np.int64)).release()
        finally:
            self.verify = verify
        return n

    # ----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the store's locks and mappings (live views keep theirs). Idempotent."""
        if self._closed:
            return
        self._closed = True
        gen, self._gen = self._gen, None
        if gen is not None:
            gen.release()
        if self._mirror is not None:
            self._mirror.close()

    def __enter__(self) -> ZRecordStore:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass

    def __getstate__(self) -> dict[str, Any]:
        """Pickles as its arguments and the store's identity: a process that unpickles it (a
        spawned DataLoader worker) opens the store itself, on first use (so an error reaches
        the caller as a typed error, not as a worker dying in unpickling), and refuses a store
        replaced since."""
        state = {"path": self.path, "num_threads": self.num_threads, "verify": self.verify,
                 "max_record_bytes": self.max_record_bytes, "store_id": self._store_id}
        if self._mirror is not None:
            state.update(path=self._mirror.source_url, remote=self._mirror.options)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._mirror = None
        self._remote_args = None
        if state.get("remote") is not None:
            # the mirror is made (two requests) on first use, like the open, not in unpickling
            from zerobatch.core.remote import redact
            self._remote_args = (state["path"], state["remote"])
            self.path = redact(state["path"].rstrip("/"))
        else:
            self.path = self._root = state["path"]
        self.num_threads, self.verify = state["num_threads"], state["verify"]
        self.max_record_bytes = state["max_record_bytes"]
        self._pool = shared_pool(self.num_threads - 1) if self.num_threads > 1 else None
        self._lock = threading.RLock()
        self._gen = None
        self._closed = False
        self._store_id = state["store_id"]
        self._pending = True

    def _ensure(self) -> None:
        """Open an unpickled reader (once, on first use)."""
        with self._lock:
            if self._pending:
                if self._remote_args is not None:
                    from zerobatch.readers._zrecord_remote import StoreMirror
                    url, options = self._remote_args
                    self._mirror = StoreMirror(url, **options)
                    self.path, self._root = self._mirror.url, self._mirror.folder
                    self._remote_args = None
                self._open()
                self._pending = False

    def __getattr__(self, name: str) -> Any:
        # the parts an unpickled reader opens on first use
        if name in ("meta", "fields", "_key", "_key32", "_field_no", "_commit_map") and self.__dict__.get("_pending"):
            self._ensure()
            return self.__dict__[name]
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"ZRecordStore({self.path!r}, fields={self.keys()})"


def _copy(value: Any) -> Any:
    return None if value is None else np.array(value, copy=True)

