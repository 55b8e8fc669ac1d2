"""The chunk files of a ZRECORD writer: a chunk being filled (:class:`Chunk`), and the parts
of a rebalance (:meth:`~zerobatch.writers.zrecord.ZRecordWriter.rebalance`): every live record
copied, in the order of its place in the old chunks, into new chunk files, and new offset and
check tables beside the live ones. Nothing here is visible to readers: the writer switches the
store to the new files with a rebalance journal, and removes what it made if anything fails
before that.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence

import numpy as np

from zerobatch.core.io import fsync_dir, grow_file, io_call, open_regular_file, pwrite_all
from zerobatch.formats import zrecord as Z
from zerobatch.formats.errors import CorruptError

__all__ = ["Chunk", "NewChunks", "OldChunks", "copy_live", "create_chunk", "offset_order", "write_tables"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: Bytes buffered for a new chunk before they are written (one ``pwrite``).
PIECE = 1 << 26


class Chunk:
    """A chunk file being filled (by a writer thread, or by a rebalance)."""

    __slots__ = ("id", "fd", "pos", "count", "size", "dirty", "path")

    def __init__(self, cid: int, fd: int, pos: int, count: int, size: int, path: str) -> None:
        self.id = cid
        self.fd = fd
        self.pos = pos
        self.count = count
        self.size = size
        self.dirty = False
        self.path = path


def create_chunk(folder: str, cid: int) -> Chunk:
    """A new, empty chunk file ``cid`` in the store ``folder``.

    Raises:
        OSError: from ``open``.
    """
    path = os.path.join(folder, Z.chunk_name(cid))
    fd = io_call("open", os.open, path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC, 0o644)
    return Chunk(cid, fd, 0, 0, 0, path)


def offset_order(cols: Sequence[np.ndarray]) -> np.ndarray:
    """Record indices sorted by (chunk, offset) of their first present field."""
    n = len(cols[0])
    chunk = np.full(n, np.iinfo(np.uint64).max, np.uint64)
    offset = np.zeros(n, np.uint64)
    for col in reversed(cols):
        present = col["length"] > 0
        chunk[present] = col["chunk"][present]
        offset[present] = col["offset"][present]
    return np.lexsort((offset, chunk))


class OldChunks:
    """The live chunks, read record by record (descriptors opened on first use)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._fds: dict[int, int] = {}

    def read(self, chunk: int, offset: int, length: int, what: str) -> bytes:
        """A record's container: ``length`` bytes at ``offset`` of ``chunk``.

        Raises:
            CorruptError: the chunk ends before it.
        """
        fd = self._fds.get(chunk)
        if fd is None:
            fd = self._fds[chunk] = open_regular_file(os.path.join(self.folder, Z.chunk_name(chunk)))[0]
        raw = os.pread(fd, length, offset)
        if len(raw) != length:
            raise CorruptError(f"chunk {chunk}: {what} is truncated", path=self.folder, field="chunk")
        return raw

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class NewChunks:
    """New chunk files numbered from ``first``, filled in order, ``chunk_size`` records each,
    grown in ``grow_bytes`` steps and written in pieces of at most :data:`PIECE` bytes."""

    def __init__(self, folder: str, first: int, chunk_size: int, grow_bytes: int) -> None:
        self.folder, self.next_id, self.chunk_size, self.grow_bytes = folder, first, chunk_size, grow_bytes
        self.made: list[Chunk] = []
        self.written = 0
        self._ch: Chunk | None = None
        self._pending: list[bytes] = []
        self._flushed_at = 0

    def add(self, containers: Sequence[bytes | None]) -> list[tuple[int, int, int] | None]:
        """Place one record's containers (``None``: an absent field); their entries."""
        if self._ch is None or self._ch.count >= self.chunk_size:
            self._flush()
            self._ch = create_chunk(self.folder, self.next_id)
            self.next_id += 1
            self.made.append(self._ch)
            self._flushed_at = 0
        ch = self._ch
        pos = ch.pos
        entries: list[tuple[int, int, int] | None] = []
        for raw in containers:
            if raw is None:
                entries.append(None)
                continue
            span = Z.record_span(len(raw) - Z.RECORD_HEADER_SIZE)
            entries.append((ch.id, pos, len(raw)))
            self._pending += [raw, bytes(span - len(raw))]
            pos += span
        self.written += pos - ch.pos
        ch.pos = pos
        ch.count += 1
        if ch.pos - self._flushed_at >= PIECE:
            self._flush()
        return entries

    def _flush(self) -> None:
        ch = self._ch
        if ch is None:
            return
        ch.size = grow_file(ch.fd, ch.size, ch.pos, self.grow_bytes)
        if self._pending:
            pwrite_all(ch.fd, b"".join(self._pending), self._flushed_at)
        self._pending, self._flushed_at = [], ch.pos

    def sync(self) -> None:
        """Write what is buffered and make every new chunk durable (data and names)."""
        self._flush()
        for ch in self.made:
            io_call("fdatasync", os.fdatasync, ch.fd)
        fsync_dir(os.path.join(self.folder, Z.CHUNK_DIR))

    @property
    def unfull(self) -> tuple[tuple[int, int, int], ...]:
        """The last chunk as the store's meta records an unfilled one (``()``: none)."""
        last = self.made[-1] if self.made else None
        return ((last.id, last.pos, last.count),) if last is not None and last.count < self.chunk_size else ()

    def close(self) -> None:
        for ch in self.made:
            os.close(ch.fd)

    def discard(self) -> None:
        """Close and remove every new chunk (the rebalance failed)."""
        for ch in self.made:
            os.close(ch.fd)
            os.unlink(ch.path)
        self.made = []


def copy_live(cols: Sequence[np.ndarray], names: Sequence[str], length: int, old: OldChunks,
              new: NewChunks) -> list[np.ndarray]:
    """Copy records ``0 .. length - 1`` (their entries ``cols``, one column per field) from
    ``old`` into ``new`` in offset order; the new entry columns."""
    new_cols = [np.zeros(max(length, 1), Z.ENTRY_DTYPE) for _ in cols]
    for index in offset_order(cols).tolist():
        containers: list[bytes | None] = []
        for k, col in enumerate(cols):
            c, off, ln = int(col[index]["chunk"]), int(col[index]["offset"]), int(col[index]["length"])
            containers.append(old.read(c, off, ln, f"record {index} of {names[k]}") if ln else None)
        for k, entry in enumerate(new.add(containers)):
            if entry is not None:
                new_cols[k][index] = entry
    return new_cols


def write_tables(folder: str, names: Sequence[str], new_cols: Sequence[np.ndarray], length: int,
                 made: list[tuple[str, str]], key: int) -> None:
    """Write each field's new offset and check table under a temporary name, durable, and
    list ``(temporary, final)`` in ``made`` as each is created (so a failure can remove them)."""
    entries = max(Z.OFFSET_GROW_ENTRIES, -(-length // Z.OFFSET_GROW_ENTRIES) * Z.OFFSET_GROW_ENTRIES)
    for k, name in enumerate(names):
        col = new_cols[k][:length]
        for final, unit, data in ((Z.offset_name(name), Z.ENTRY_SIZE, col.tobytes()),
                                  (Z.check_name(name), Z.CHECK_SIZE, Z.entry_checks(col, 0, k, key).tobytes())):
            tmp = f".{final}.zbtmp.{os.getpid()}.{secrets.token_hex(4)}"
            fd = io_call("open", os.open, os.path.join(folder, tmp),
                         os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
            made.append((tmp, final))
            try:
                io_call("ftruncate", os.ftruncate, fd, entries * unit)
                pwrite_all(fd, data, 0)
                io_call("fsync", os.fsync, fd)
            finally:
                os.close(fd)
