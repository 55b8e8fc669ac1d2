"""Write ZRECORD stores: append, modify, delete, commit, rebalance.

One :class:`ZRecordWriter` per store at a time (``writer.lock``, an exclusive ``flock``);
any number of readers (:class:`zerobatch.readers.zrecord.ZRecordStore`) meanwhile. Nothing a
writer does is visible before :meth:`~ZRecordWriter.commit`; a writer killed at any point
leaves the last committed state, which the next opener completes from the journal if the
kill came after the commit point (see :mod:`zerobatch.core.zrstore`).

Each writer thread owns one chunk: :meth:`~ZRecordWriter.append` writes into the calling
thread's chunk, :meth:`~ZRecordWriter.extend` fans records out over ``num_writers`` threads
(compression and ``pwrite`` release the GIL, so they overlap). A chunk holds ``chunk_size``
records, then its thread opens a new one. Chunk files grow in sparse ``chunk_grow_bytes``
steps and offset tables ``OFFSET_GROW_ENTRIES`` entries at a time, with ``ftruncate``; no
file a reader may have mapped ever shrinks.

Records are written with ``pwrite`` rather than through a writable mapping (the seed's
design): a full disk under a sparse mapping is a ``SIGBUS``, under ``pwrite`` an ``ENOSPC``
that becomes a :class:`~zerobatch.formats.errors.WriteError`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import secrets
import shutil
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from zerobatch.core import xxh3_64
from zerobatch.core import zrstore
from zerobatch.core.io import (AtomicFile, cleanup_orphans, fsync_dir, grow_file, io_call, local_destination,
                               open_regular_file, pread_exact, pwrite_all, pwritev_all, sweep_orphans)
from zerobatch.core.pool import io_executor
from zerobatch.formats import zrecord as Z
from zerobatch.formats.errors import (ConfigError, CorruptError, IntegrityError, NotFoundError, OutOfRangeError,
                                      ReadError, StateError, UnsupportedVersionError, WriteError, ZerobatchError)
from zerobatch.writers._zrecord_chunks import (Chunk, NewChunks, OldChunks, copy_live, create_chunk,
                                               write_tables)

__all__ = ["ZRecordWriter"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class ZRecordWriter:
    """Open (or create) a store for writing.

    Args:
        path: the store's folder.
        fields: the fields (:class:`~zerobatch.formats.zrecord.FieldSpec` or dicts with
            ``name``, ``dtype``, ``shape``, ``compress``) to create a new store; None opens an
            existing one. Creating refuses a folder that exists and is not empty.
        chunk_size: records per chunk (new stores).
        level: deflate level of ``flate`` fields.
        num_writers: threads :meth:`extend` writes with (each owns a chunk).
        chunk_grow_bytes: the sparse growth step of chunk files.

    Raises:
        StateError: another writer holds the store.
        ConfigError: bad fields, or creating into a non-empty folder.
        NotFoundError / CorruptError: opening a folder that is not a valid store.
    """

    def __init__(self, path: str | os.PathLike[str], fields: Sequence[Any] | None = None, *,
                 chunk_size: int = 8192, level: int = 6, num_writers: int = 2,
                 chunk_grow_bytes: int = Z.CHUNK_GROW_BYTES) -> None:
        self.path = os.path.abspath(os.fspath(local_destination(path)))
        if not 1 <= num_writers <= 64:
            raise ConfigError(f"num_writers must be 1 to 64, got {num_writers}", path=self.path,
                              field="num_writers")
        if not 0 <= level <= 9:
            raise ConfigError(f"level must be 0 to 9, got {level}", path=self.path, field="level")
        if chunk_grow_bytes < 1 << 16 or chunk_grow_bytes % Z.RECORD_ALIGN:
            raise ConfigError("chunk_grow_bytes must be a multiple of 16, at least 64 KiB", path=self.path,
                              field="chunk_grow_bytes")
        self.level = level
        self.num_writers = num_writers
        self.chunk_grow_bytes = chunk_grow_bytes
        self._lock = threading.RLock()
        self._local = threading.local()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = True
        self._writer_fd: int | None = None
        if fields is not None:
            self._create(Z.check_fields(fields), chunk_size)
        self._open()

    # ----------------------------------------------------------------------------------------
    # Creating and opening

    def _create(self, fields: tuple[Z.FieldSpec, ...], chunk_size: int) -> None:
        if not isinstance(chunk_size, int) or not 1 <= chunk_size < 1 << 32:
            raise ConfigError(f"chunk_size must be 1 to 2**32-1 records, got {chunk_size!r}", path=self.path,
                              field="chunk_size")
        if os.path.exists(self.path):
            if not os.path.isdir(self.path):
                raise ConfigError("path: exists and is not a folder", path=self.path, field="path")
            if os.listdir(self.path):
                raise ConfigError("path: the output folder is not empty", path=self.path, field="path")
        parent = os.path.dirname(self.path)
        if not os.path.isdir(parent):
            raise ConfigError("path: the parent folder does not exist", path=self.path, field="path")
        sweep_orphans(parent, {os.path.basename(self.path)})   # a killed create's temporary folder
        tmp = os.path.join(parent, f".{os.path.basename(self.path)}.zbtmp.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            os.mkdir(tmp)
            os.mkdir(os.path.join(tmp, Z.CHUNK_DIR))
            for name in (Z.WRITER_LOCK_NAME, Z.SWITCH_LOCK_NAME, Z.epoch_lock_name(0)):
                os.close(os.open(os.path.join(tmp, name), os.O_CREAT | os.O_WRONLY | _O_CLOEXEC, 0o644))
            for f in fields:
                with AtomicFile(os.path.join(tmp, Z.offset_name(f.name))) as af:
                    af.truncate(Z.OFFSET_GROW_ENTRIES * Z.ENTRY_SIZE)
                with AtomicFile(os.path.join(tmp, Z.check_name(f.name))) as af:
                    af.truncate(Z.OFFSET_GROW_ENTRIES * Z.CHECK_SIZE)
            store_id = secrets.randbits(64) or 1
            with AtomicFile(os.path.join(tmp, Z.COMMIT_NAME)) as af:
                af.write(Z.pack_commit(Z.Commit(0, 0, 0, 0, 0), xxh3_64, store_id))
            zrstore.write_meta(tmp, Z.StoreMeta(0, 0, chunk_size, fields, store_id=store_id))
            fsync_dir(os.path.join(tmp, Z.CHUNK_DIR))
            fsync_dir(tmp)
            if os.path.isdir(self.path):
                os.rmdir(self.path)  # empty (checked above); rename cannot replace it on every OS
            io_call("rename", os.rename, tmp, self.path)
            fsync_dir(parent)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise WriteError(f"path: cannot create the store: {exc.strerror or exc}", errno=exc.errno,
                             path=self.path, field="path", operation="create") from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _open(self) -> None:
        if not os.path.isdir(self.path):
            raise NotFoundError("path: no such folder", path=self.path, field="path")
        fd = zrstore.lock(os.path.join(self.path, Z.WRITER_LOCK_NAME), exclusive=True, blocking=False)
        if fd is None:
            raise StateError("writer.lock: another writer has this store open", path=self.path,
                             field="writer.lock")
        self._writer_fd = fd
        try:
            try:
                zrstore.recover(self.path, writer_fd=fd)
                self._load()
            except ZerobatchError:
                raise
            except OSError as exc:
                # what the typed opens above do not cover (a folder that vanished, a loop ...)
                cls = WriteError if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else ReadError
                where = exc.filename or self.path
                raise cls(f"cannot open the store: {exc.strerror or exc}", errno=exc.errno, path=where,
                          field=os.path.basename(os.fspath(where))) from exc
        except BaseException:
            self._close_files()
            zrstore.unlock(fd)
            self._writer_fd = None
            raise
        self._closed = False

    def _open_rw(self, path: str, what: str) -> int:
        """A store file opened read-write; a read-only one is a WriteError(EACCES) as for every
        writer, anything but a regular file a typed error."""
        try:
            return open_regular_file(path, write=True)[0]
        except ReadError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise WriteError(f"{what}: cannot open for writing: {os.strerror(exc.errno)}", errno=exc.errno,
                                 path=path, field=what, operation="open") from exc
            raise
        except NotFoundError as exc:
            raise NotFoundError(f"{what}: missing", path=path, field=what) from exc

    def _load(self) -> None:
        self._commit_fd = -1
        self._tables, self._checks = [], []
        self._chunks, self._full, self._free = {}, [], []
        mpath = os.path.join(self.path, Z.META_NAME)
        meta = zrstore.read_meta(mpath)
        if meta.version < Z.VERSION:
            raise UnsupportedVersionError(
                f"meta.json: a version {meta.version} store (zerobatch 0.1: no checksum or store identity, so a "
                f"writer cannot trust it); read it with ZRecordStore and write a new store", path=mpath,
                field="version")
        cpath = os.path.join(self.path, Z.COMMIT_NAME)
        self._commit_fd = self._open_rw(cpath, Z.COMMIT_NAME)
        commit = zrstore.read_commit(os.pread(self._commit_fd, Z.COMMIT_STRUCT.size, 0), path=cpath, key=meta.key)
        if commit is None:
            raise CorruptError("commit.zr: seq is odd with no journal to finish it", path=cpath, field="seq")
        if (commit.length, commit.num_chunks, commit.generation, commit.epoch) != (
                meta.length, meta.num_chunks, meta.generation, meta.epoch):
            raise CorruptError("meta.json: length, chunks, generation or epoch disagree with commit.zr",
                               path=mpath, field="length")
        self.meta = meta
        self.fields = meta.fields
        self._field_no = {f.name: i for i, f in enumerate(meta.fields)}
        self.chunk_size = meta.chunk_size
        self._length = meta.length
        self._committed_length = meta.length
        self._num_chunks = meta.num_chunks
        self._committed_chunks = meta.num_chunks
        self._generation = meta.generation
        self._epoch = meta.epoch
        self._written = meta.written_bytes
        self._overlay: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._changed = False
        self._table_entries: list[int] = []
        self._table_dirty = [False] * len(meta.fields)
        for f in meta.fields:
            held = []
            for name, unit, fds in ((Z.offset_name(f.name), Z.ENTRY_SIZE, self._tables),
                                    (Z.check_name(f.name), Z.CHECK_SIZE, self._checks)):
                tpath = os.path.join(self.path, name)
                fds.append(self._open_rw(tpath, name))   # owned from here: _close_files closes it
                size = os.fstat(fds[-1]).st_size
                if size % unit or size // unit < meta.length:
                    raise CorruptError(f"{name}: {size} bytes cannot hold {meta.length} entries", path=tpath,
                                       field=name)
                held.append(size // unit)
            self._table_entries.append(min(held))
        for k in range(len(meta.fields)):
            # the first and last committed entries carry the store key: a table of another
            # store is refused before this writer extends it
            for index in {0, meta.length - 1} if meta.length else ():
                self._read_entries(k, index, 1)
        cdir = os.path.join(self.path, Z.CHUNK_DIR)
        if not os.path.isdir(cdir) or os.path.islink(cdir):
            raise CorruptError("chunk: the chunk folder is missing or not a folder", path=cdir, field="chunk")
        retired = {c for _, ids in meta.retired for c in ids}
        for name in os.listdir(cdir):
            stem = name[:-3] if name.endswith(".zr") else ""
            if stem.isdigit() and int(stem) >= meta.num_chunks and int(stem) not in retired:
                io_call("unlink", os.unlink, os.path.join(cdir, name))  # an uncommitted chunk of a killed writer
        for f in meta.fields:
            cleanup_orphans(os.path.join(self.path, Z.offset_name(f.name)))
            cleanup_orphans(os.path.join(self.path, Z.check_name(f.name)))
        self._new_chunk_files = False
        for cid, pos, count in meta.unfull:
            cpath_ = os.path.join(self.path, Z.chunk_name(cid))
            cfd = self._open_rw(cpath_, f"chunk {cid}")
            size = os.fstat(cfd).st_size
            if size < pos:
                os.close(cfd)
                raise CorruptError(f"chunk {cid}: {size} bytes, shorter than its write position {pos}",
                                   path=cpath_, field="write_pos")
            ch = Chunk(cid, cfd, pos, count, size, cpath_)
            self._chunks[cid] = ch
            self._free.append(ch)
        self._local = threading.local()
        self._retire()

    # ----------------------------------------------------------------------------------------
    # Records

    def __len__(self) -> int:
        """Records, counting changes not yet committed."""
        return self._length

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("the writer is closed", path=self.path, field="writer")

    def _encode(self, k: int, value: Any) -> list[Any] | None:
        """The container of field k's value: [header, payload, pad], or None for absent."""
        if value is None:
            return None
        spec = self.fields[k]
        if spec.dtype == "bytes" and isinstance(value, (bytes, bytearray, memoryview)):
            payload = memoryview(value).cast("B")
        else:
            arr = np.asarray(value)
            if arr.dtype != spec.np_dtype:
                if arr.size and arr.dtype.kind != spec.np_dtype.kind and not (
                        arr.dtype.kind in "iub" and spec.np_dtype.kind in "iuf"):
                    raise ConfigError(f"{spec.name}: a {arr.dtype} value for a {spec.dtype} field", path=self.path,
                                      field=spec.name)
                cast = arr.astype(spec.np_dtype)
                if not np.array_equal(cast, arr):
                    raise ConfigError(f"{spec.name}: values do not fit {spec.dtype}", path=self.path, field=spec.name)
                arr = cast
            if spec.shape is not None and arr.shape != spec.shape:
                raise ConfigError(f"{spec.name}: shape {arr.shape}, the field's is {spec.shape}", path=self.path,
                                  field=spec.name)
            payload = memoryview(np.ascontiguousarray(arr)).cast("B")
        logical = len(payload)
        if spec.codec == 1:
            # a raw deflate stream (zlib.compress takes wbits from Python 3.11 only)
            z = zlib.compressobj(self.level, zlib.DEFLATED, -15)
            payload = z.compress(payload) + z.flush()
        stored = len(payload)
        if Z.RECORD_HEADER_SIZE + stored >= 1 << 32:
            raise ConfigError(f"{spec.name}: a record of {stored} bytes does not fit a 4 GiB entry",
                              path=self.path, field=spec.name)
        tail = Z.RECORD_HEADER.pack(0, logical, spec.codec, Z.RECORD_MAGIC, k)[8:]
        digest = xxh3_64(tail + bytes(payload)) ^ self.meta.key
        header = digest.to_bytes(8, "little") + tail
        span = Z.record_span(stored)
        return [header, payload, bytes(span - Z.RECORD_HEADER_SIZE - stored)]

    def _normalize(self, record: Any) -> list[Any]:
        if isinstance(record, Mapping):
            unknown = set(record) - set(self._field_no)
            if unknown:
                raise ConfigError(f"record: unknown fields {sorted(unknown)}", path=self.path, field="record")
            return [record.get(f.name) for f in self.fields]
        if isinstance(record, tuple):
            if len(record) != len(self.fields):
                raise ConfigError(f"record: a tuple of {len(record)} values for {len(self.fields)} fields",
                                  path=self.path, field="record")
            return list(record)
        if len(self.fields) == 1:
            return [record]
        raise ConfigError(f"record: a mapping of field names, or a tuple of {len(self.fields)} values",
                          path=self.path, field="record")

    def _thread_chunk(self) -> Chunk:
        ch = getattr(self._local, "chunk", None)
        if ch is not None and ch.count < self.chunk_size:
            return ch
        with self._lock:
            if self._free:
                ch = self._free.pop()
            else:
                cid = self._num_chunks
                try:
                    ch = create_chunk(self.path, cid)
                except OSError as exc:
                    raise WriteError(f"chunk {cid}: cannot create: {exc.strerror}", errno=exc.errno,
                                     path=os.path.join(self.path, Z.chunk_name(cid)), field="chunk",
                                     operation="open") from exc
                self._num_chunks += 1
                self._new_chunk_files = True
                self._chunks[cid] = ch
        self._local.chunk = ch
        return ch

    def _write_record(self, values: list[Any]) -> list[tuple[int, int, int]]:
        """Write one record's containers into this thread's chunk; their entries."""
        parts = [self._encode(k, v) for k, v in enumerate(values)]
        ch = self._thread_chunk()
        entries = []
        bufs: list[Any] = []
        pos = ch.pos
        for p in parts:
            if p is None:
                entries.append((0, 0, 0))
                continue
            n = len(p[0]) + len(p[1]) + len(p[2])
            entries.append((ch.id, pos, len(p[0]) + len(p[1])))
            bufs.extend(p)
            pos += n
        try:
            ch.size = grow_file(ch.fd, ch.size, pos, self.chunk_grow_bytes)
            pwritev_all(ch.fd, bufs, ch.pos)
        except OSError as exc:
            raise WriteError(f"chunk {ch.id}: write failed: {exc.strerror}", errno=exc.errno, path=ch.path,
                             field="chunk", operation="pwrite") from exc
        with self._lock:
            self._written += pos - ch.pos
            self._changed = True
        ch.pos = pos
        ch.count += 1
        ch.dirty = True
        if ch.count >= self.chunk_size:
            with self._lock:
                self._chunks.pop(ch.id, None)
                self._full.append(ch)
            self._local.chunk = None
        return entries

    def _set_entry(self, k: int, index: int, entry: tuple[int, int, int]) -> None:
        """Point field k of ``index`` at ``entry`` (caller holds the lock)."""
        if index < self._committed_length:
            self._overlay[(k, index)] = entry
            return
        self._overlay.pop((k, index), None)
        self._write_entries(k, index, np.array([entry], dtype=Z.ENTRY_DTYPE))

    def _write_entries(self, k: int, first: int, entries: np.ndarray) -> None:
        """Write entries (and their checks) at ``first`` and on, past the committed length,
        growing the table and check files a step at a time (caller holds the lock)."""
        end = first + len(entries)
        name = self.fields[k].name
        try:
            if end > self._table_entries[k]:
                total = grow_file(self._tables[k], self._table_entries[k] * Z.ENTRY_SIZE, end * Z.ENTRY_SIZE,
                                  Z.OFFSET_GROW_ENTRIES * Z.ENTRY_SIZE) // Z.ENTRY_SIZE
                io_call("ftruncate", os.ftruncate, self._checks[k], total * Z.CHECK_SIZE)
                self._table_entries[k] = total
            pwrite_all(self._tables[k], entries.tobytes(), first * Z.ENTRY_SIZE)
            pwrite_all(self._checks[k], Z.entry_checks(entries, first, k, self.meta.key).tobytes(), first * Z.CHECK_SIZE)
        except OSError as exc:
            raise WriteError(f"{name}.offset: write failed: {exc.strerror}", errno=exc.errno, path=self.path,
                             field="offset", operation="pwrite") from exc
        self._table_dirty[k] = True

    def _get_entry(self, k: int, index: int) -> tuple[int, int, int]:
        got = self._overlay.get((k, index))
        if got is not None:
            return got
        e = self._read_entries(k, index, 1)[0]
        return int(e["chunk"]), int(e["offset"]), int(e["length"])

    def _read_entries(self, k: int, first: int, count: int) -> np.ndarray:
        """Entries as written (overlay not applied), checked against their CRCs."""
        raw = os.pread(self._tables[k], count * Z.ENTRY_SIZE, first * Z.ENTRY_SIZE) if count else b""
        chk = os.pread(self._checks[k], count * Z.CHECK_SIZE, first * Z.CHECK_SIZE) if count else b""
        name = self.fields[k].name
        if len(raw) != count * Z.ENTRY_SIZE or len(chk) != count * Z.CHECK_SIZE:
            raise CorruptError(f"{name}.offset: shorter than the store", path=self.path, field="offset")
        entries = np.frombuffer(raw, dtype=Z.ENTRY_DTYPE).copy()
        bad = np.flatnonzero(Z.entry_checks(entries, first, k, self.meta.key) != np.frombuffer(chk, "<u4"))
        if bad.size:
            raise IntegrityError(f"{name}.offset: the entry of record {first + int(bad[0])} fails its check",
                                 path=os.path.join(self.path, Z.offset_name(name)), field="offset")
        return entries

    def append(self, record: Any) -> int:
        """Append one record: a mapping of field names to values (missing fields are absent),
        a tuple of values in field order (None: absent), or, in a single-field store, the
        value itself. Returns its index."""
        self._check_open()
        entries = self._write_record(self._normalize(record))
        with self._lock:
            index = self._length
            for k, e in enumerate(entries):
                self._set_entry(k, index, e)
            self._length += 1
        return index

    def extend(self, records: Iterable[Any], *, batch: int = 256,
               progress: Callable[[int], None] | None = None) -> range:
        """Append many records over ``num_writers`` threads, in order; returns their indices.

        ``progress(n)`` is called after every ``n`` records written."""
        self._check_open()
        if self._pool is None:
            self._pool = io_executor(self.num_writers, "zrecord-writer")
        start = self._length
        pending: list[concurrent.futures.Future[Any]] = []
        it = iter(records)
        while True:
            group = [self._normalize(r) for _, r in zip(range(batch), it, strict=False)]
            if not group:
                break
            with self._lock:
                first = self._length
                self._length += len(group)
            pending.append(self._pool.submit(self._write_group, first, group))
            if len(pending) >= 2 * self.num_writers:
                done = pending.pop(0).result()
                if progress is not None:
                    progress(done)
        for fut in pending:
            done = fut.result()
            if progress is not None:
                progress(done)
        return range(start, self._length)

    def _write_group(self, first: int, group: list[list[Any]]) -> int:
        entries = [self._write_record(values) for values in group]
        with self._lock:
            for k in range(len(self.fields)):
                col = [e[k] for e in entries]
                if first >= self._committed_length:
                    for i in range(len(col)):
                        self._overlay.pop((k, first + i), None)
                    self._write_entries(k, first, np.array(col, dtype=Z.ENTRY_DTYPE))
                else:
                    for i, e in enumerate(col):
                        self._set_entry(k, first + i, e)
        return len(group)

    def modify(self, index: int, record: Any) -> None:
        """Replace fields of record ``index``: the new values are appended, their entries
        repointed. Fields the mapping leaves out keep their values; None makes one absent."""
        self._check_open()
        if isinstance(record, Mapping):
            values = self._normalize(record)
            keep = [f.name not in record for f in self.fields]
        else:
            values = self._normalize(record)
            keep = [False] * len(self.fields)
        index = self._index(index)
        entries = self._write_record([None if kp else v for v, kp in zip(values, keep, strict=True)])
        with self._lock:
            if index >= self._length:
                raise OutOfRangeError(f"index {index} is out of range for a store of {self._length} records")
            for k, e in enumerate(entries):
                if not keep[k]:
                    self._set_entry(k, index, e)

    def delete(self, index: int) -> None:
        """Delete record ``index``: the last record moves into its place (so indices are not
        stable across deletes), and the length drops by one."""
        self._check_open()
        with self._lock:
            index = self._index(index)
            last = self._length - 1
            if index != last:
                for k in range(len(self.fields)):
                    self._set_entry(k, index, self._get_entry(k, last))
            for k in range(len(self.fields)):
                self._overlay.pop((k, last), None)
            self._length -= 1
            self._changed = True

    def _index(self, index: int) -> int:
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise ConfigError(f"index must be an integer, got {index!r}", path=self.path, field="index")
        i = int(index)
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise OutOfRangeError(f"index {index} is out of range for a store of {self._length} records")
        return i

    # ----------------------------------------------------------------------------------------
    # Commit

    def _meta(self, **changes: Any) -> Z.StoreMeta:
        unfull = tuple(sorted((c.id, c.pos, c.count) for c in self._chunks.values()))
        base = Z.StoreMeta(self._length, self._num_chunks, self.chunk_size, self.fields, unfull,
                           self._generation + 1, self._epoch, self._written, self.meta.retired,
                           self.meta.first_chunk, self.meta.store_id)
        return base if not changes else _replace(base, **changes)

    def commit(self) -> None:
        """Make every change so far durable and visible to readers, atomically (nothing to
        do when nothing changed since the last commit)."""
        self._check_open()
        with self._lock:
            if not self._changed:
                self._retire()
                return
            self._sync_data()
            meta = self._meta()
            updates = np.zeros(len(self._overlay), dtype=Z.JOURNAL_UPDATE_DTYPE)
            for i, ((k, index), (c, off, ln)) in enumerate(sorted(self._overlay.items())):
                updates[i] = (index, k, c, off, ln, 0)
            self._apply(zrstore.Journal(Z.JOURNAL_KIND_COMMIT,
                                        Z.Commit(0, meta.length, meta.num_chunks, meta.generation, meta.epoch),
                                        meta, updates, ()))
            self._overlay.clear()
            self._changed = False
            self._committed_length = self._length
            self._committed_chunks = self._num_chunks
            self._generation = meta.generation
            self.meta = meta
            for ch in self._full:
                os.close(ch.fd)
            self._full.clear()
        self._retire()

    def _sync_data(self) -> None:
        try:
            for ch in [*self._chunks.values(), *self._full]:
                if ch.dirty:
                    io_call("fdatasync", os.fdatasync, ch.fd)
                    ch.dirty = False
            for k, fd in enumerate(self._tables):
                if self._table_dirty[k]:
                    io_call("fdatasync", os.fdatasync, fd)
                    io_call("fdatasync", os.fdatasync, self._checks[k])
                    self._table_dirty[k] = False
            if self._new_chunk_files:
                fsync_dir(os.path.join(self.path, Z.CHUNK_DIR))
                self._new_chunk_files = False
        except OSError as exc:
            raise WriteError(f"sync failed: {exc.strerror}", errno=exc.errno, path=self.path, field="sync",
                             operation="fsync") from exc

    def _apply(self, journal: zrstore.Journal) -> None:
        with AtomicFile(os.path.join(self.path, Z.JOURNAL_NAME)) as f:
            f.write(zrstore.pack_journal(journal))
        # The commit point has passed: from here a kill is finished by the next opener.
        zrstore.replay(self.path, journal)

    def _retire(self) -> None:
        """Remove chunks a rebalance replaced once no reader of their epoch is left.

        Only what a checksummed ``meta.json`` lists as retired (chunks below the first live
        one, of older epochs: :func:`~zerobatch.formats.zrecord.parse_meta` refuses anything
        else), and only after the committed offset tables are found to point into none of
        them: a writer never deletes a file that the committed state references.
        """
        if not self.meta.retired:
            return
        kept, free = [], []
        for epoch, ids in self.meta.retired:
            lpath = os.path.join(self.path, Z.epoch_lock_name(epoch))
            try:
                fd = zrstore.lock(lpath, exclusive=True, blocking=False)
            except NotFoundError:
                fd = -1
            if fd is None:
                kept.append((epoch, ids))   # a reader of that epoch is still open
            else:
                free.append((lpath, fd, ids))
        try:
            self._check_unreferenced({c for _, _, ids in free for c in ids})
            for lpath, fd, ids in free:
                for c in ids:
                    with contextlib.suppress(FileNotFoundError):
                        io_call("unlink", os.unlink, os.path.join(self.path, Z.chunk_name(c)))
                if fd >= 0:
                    os.unlink(lpath)
        finally:
            for _, fd, _ in free:
                if fd >= 0:
                    os.close(fd)
        if len(kept) != len(self.meta.retired):
            self.meta = _replace(self.meta, retired=tuple(kept))
            zrstore.write_meta(self.path, self.meta)

    def _check_unreferenced(self, chunks: set[int]) -> None:
        """Refuse (deleting nothing) if any committed entry, damaged or not, points into
        ``chunks``."""
        if not chunks:
            return
        doomed = np.fromiter(chunks, np.uint32, len(chunks))
        step = 1 << 20
        for k, fd in enumerate(self._tables):
            for first in range(0, self._committed_length, step):
                count = min(step, self._committed_length - first)
                col = np.frombuffer(pread_exact(fd, count * Z.ENTRY_SIZE, first * Z.ENTRY_SIZE, path=self.path,
                                                field="offset"), Z.ENTRY_DTYPE)
                live = col["chunk"][col["length"] > 0]
                hit = np.isin(live, doomed)
                if hit.any():
                    c = int(live[np.argmax(hit)])
                    raise CorruptError(
                        f"{self.fields[k].name}.offset: a committed record points into chunk {c}, which meta.json "
                        "lists as retired; nothing was deleted", path=os.path.join(self.path, Z.chunk_name(c)),
                        field="retired")

    # ----------------------------------------------------------------------------------------
    # Rebalance

    def utilization(self) -> dict[str, float]:
        """``records``: live records / (chunk_size * live chunks), the seed's figure; ``bytes``:
        bytes of live records / bytes written to live chunks. Counts committed state."""
        self._check_open()
        live_chunks = self._num_chunks - self.meta.first_chunk
        live_bytes = 0
        for k in range(len(self.fields)):
            lengths = self._table_column(k)["length"].astype(np.int64)
            live_bytes += int(((lengths + Z.RECORD_ALIGN - 1) // Z.RECORD_ALIGN * Z.RECORD_ALIGN).sum())
        return {
            "records": self._length / (self.chunk_size * live_chunks) if live_chunks else 1.0,
            "bytes": live_bytes / self._written if self._written else 1.0,
            "chunks": float(live_chunks),
        }

    def _table_column(self, k: int) -> np.ndarray:
        col = self._read_entries(k, 0, self._length)
        for (kk, index), e in self._overlay.items():
            if kk == k and index < self._length:
                col[index] = e
        return col

    def rebalance(self, *, report: Callable[[str], None] | None = print) -> dict[str, float]:
        """Rewrite every live record, in offset order, into new chunks and switch to them
        atomically; the old chunks are removed once no reader uses them. Manual only.

        Prints (through ``report``) the utilization first, and returns it."""
        self._check_open()
        self.commit()
        with self._lock:
            before = self.utilization()
            if report is not None:
                report(f"{self.path}: utilization {before['records']:.3f} (live records / chunk_size x "
                       f"{int(before['chunks'])} chunks), {before['bytes']:.3f} of the bytes written are live")
            names = [f.name for f in self.fields]
            cols = [self._table_column(k) for k in range(len(self.fields))]
            old_chunks = tuple(range(self.meta.first_chunk, self._num_chunks))
            new_first = self._num_chunks
            old = OldChunks(self.path)
            new = NewChunks(self.path, new_first, self.chunk_size, self.chunk_grow_bytes)
            tables: list[tuple[str, str]] = []
            epoch = self._epoch + 1
            try:
                new_cols = copy_live(cols, names, self._length, old, new)
                new.sync()
                write_tables(self.path, names, new_cols, self._length, tables, self.meta.key)
                os.close(os.open(os.path.join(self.path, Z.epoch_lock_name(epoch)),
                                 os.O_CREAT | os.O_WRONLY | _O_CLOEXEC, 0o644))
                fsync_dir(self.path)
            except OSError as exc:
                new.discard()
                for tmp, _ in tables:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.path, tmp))
                raise WriteError(f"rebalance failed: {exc.strerror}", errno=exc.errno, path=self.path,
                                 field="rebalance", operation="rebalance") from exc
            finally:
                old.close()
            meta = Z.StoreMeta(self._length, new.next_id, self.chunk_size, self.fields, new.unfull,
                               self._generation + 1, epoch, new.written,
                               (*self.meta.retired, (self._epoch, old_chunks)), new_first, self.meta.store_id)
            sfd = zrstore.lock(os.path.join(self.path, Z.SWITCH_LOCK_NAME), exclusive=True, blocking=True)
            try:
                self._apply(zrstore.Journal(Z.JOURNAL_KIND_REBALANCE,
                                            Z.Commit(0, meta.length, meta.num_chunks, meta.generation, epoch),
                                            meta, np.zeros(0, Z.JOURNAL_UPDATE_DTYPE), tuple(tables)))
            finally:
                zrstore.unlock(sfd)
            new.close()
            self._close_files()
            self._load()
            return self.utilization()

    # ----------------------------------------------------------------------------------------
    # Closing

    def _close_files(self) -> None:
        for ch in [*getattr(self, "_chunks", {}).values(), *getattr(self, "_full", ())]:
            os.close(ch.fd)
        self._chunks, self._full, self._free = {}, [], []
        for fd in [*getattr(self, "_tables", ()), *getattr(self, "_checks", ())]:
            os.close(fd)
        self._tables = []
        self._checks = []
        if getattr(self, "_commit_fd", -1) >= 0:
            os.close(self._commit_fd)
        self._commit_fd = -1

    def close(self, *, commit: bool = True) -> None:
        """Commit (unless ``commit=False``: uncommitted changes are dropped) and release the
        store. Idempotent."""
        if self._closed:
            return
        try:
            if commit:
                self.commit()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            self._closed = True
            self._close_files()
            zrstore.unlock(self._writer_fd)
            self._writer_fd = None

    def abort(self) -> None:
        """Drop uncommitted changes and release the store."""
        self.close(commit=False)

    def __enter__(self) -> ZRecordWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(commit=exc_type is None)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close(commit=False)
            except Exception:
                pass


def _replace(meta: Z.StoreMeta, **changes: Any) -> Z.StoreMeta:
    import dataclasses

    return dataclasses.replace(meta, **changes)
