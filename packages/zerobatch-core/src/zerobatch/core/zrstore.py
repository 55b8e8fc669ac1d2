"""ZRECORD store files shared by the writer and the reader: locks, the commit file, the journal.

The commit protocol (``docs/formats/zrecord.md``, "Commit"):

1. A writer appends record containers past the committed write positions of its chunks and
   offset-table entries past the committed length: nothing a reader can reach.
2. ``commit()`` makes those bytes durable, then writes ``journal.zr`` atomically: the new
   commit values, the new ``meta.json`` and every in-place change of an offset table (a
   modify, a delete). That rename is the commit point.
3. It applies the journal: ``seq`` in ``commit.zr`` goes odd, the in-place entries and the new
   values are written, ``seq`` goes even (a seqlock: a reader copying entries while ``seq``
   is odd or changes copies them again), then ``meta.json``, then the journal is removed.

Replaying a journal is idempotent, so a writer killed anywhere leaves either the previous
state (no journal) or a journal that the next opener (writer, or a reader that can take the
writer's lock) applies. A rebalance journal also lists the renames that swap in its offset
tables; it is applied under ``switch.lock`` held exclusive, which opening readers hold shared.
"""

from __future__ import annotations

import dataclasses
import errno as _errno
import fcntl
import json
import os
import struct
import time
from typing import Any

import numpy as np

from zerobatch.core import xxh3_64
from zerobatch.core.io import AtomicFile, io_call, open_regular_file, pread_exact, read_document
from zerobatch.formats import zrecord as Z
from zerobatch.formats.errors import (CorruptError, ReadError, StateError, TruncatedError, WriteError,
                                     ZerobatchError)

__all__ = [
    "Journal",
    "read_commit_waiting",
    "writer_alive",
    "lock",
    "pack_journal",
    "parse_journal",
    "read_commit",
    "read_journal",
    "read_meta",
    "recover",
    "replay",
    "write_commit",
    "write_meta",
]

#: How long an opener waits for a writer that is applying a commit, or swapping files.
WAIT_SECONDS = 10.0


def lock(path: str, *, exclusive: bool, blocking: bool, create: bool = False) -> int | None:
    """Open ``path`` and ``flock`` it. Returns the descriptor, or None if the lock is taken.

    The lock file must be a regular file: a FIFO, socket, device or folder in its place is
    refused at once (opened non-blocking, so a FIFO never hangs the opener).

    Raises:
        NotFoundError: the lock file does not exist (and ``create`` is false).
        FormatError: it is not a regular file.
        ReadError: it cannot be opened.
    """
    name = os.path.basename(path)
    try:
        fd, _ = open_regular_file(path, create=create)
    except ZerobatchError as exc:
        raise type(exc)(f"lock file: {exc.message}", path=path, field=name) from exc
    op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB)
    try:
        fcntl.flock(fd, op)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as exc:
        os.close(fd)
        raise ReadError(f"lock file: flock failed: {exc.strerror}", errno=exc.errno, path=path,
                        field=name) from exc
    return fd


def writer_alive(folder: str) -> bool:
    """Whether a writer holds ``writer.lock`` now (a shared probe that never blocks)."""
    fd = lock(os.path.join(folder, Z.WRITER_LOCK_NAME), exclusive=False, blocking=False)
    if fd is None:
        return True
    os.close(fd)
    return False


def read_commit_waiting(buf: Any, folder: str, *, path: Any = None, key: int = 0) -> Z.Commit:
    """:func:`read_commit`, waiting while ``seq`` is odd only if a writer or a journal can
    explain it: applies a dead writer's journal, and refuses an odd ``seq`` nothing explains.

    Raises:
        CorruptError: ``seq`` is odd, no writer runs and there is no journal.
        StateError: a live writer kept ``seq`` odd for ``WAIT_SECONDS``.
    """
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        c = read_commit(buf, path=path, wait=0.05, key=key)
        if c is not None:
            return c
        if recover(folder):
            continue
        if not writer_alive(folder):
            c = read_commit(buf, path=path, key=key)
            if c is not None:
                return c
            raise CorruptError("commit.zr: seq is odd, yet no writer runs and no journal is left",
                               path=path, field="seq")
        if time.monotonic() > deadline:
            raise StateError("commit.zr: a writer kept seq odd for too long", path=path, field="seq")


def unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def read_commit(buf: Any, *, path: Any = None, wait: float = 0.0, key: int = 0) -> Z.Commit | None:
    """The committed values of a mapped ``commit.zr``, read under its seqlock; ``key``: the
    store key its checksum is XORed with.

    Returns None when ``seq`` stays odd for ``wait`` seconds (a writer died while applying a
    journal: the caller recovers).

    Raises:
        TruncatedError: fewer bytes than the commit values.
    """
    view = memoryview(buf) if not hasattr(buf, "_m") else memoryview(buf._m)  # the twin FileMapping
    if len(view) < Z.COMMIT_STRUCT.size:
        raise TruncatedError(f"commit.zr: {len(view)} bytes, fewer than {Z.COMMIT_STRUCT.size}", path=path,
                             field="commit.zr")
    deadline = time.monotonic() + wait
    while True:
        s1 = struct.unpack_from("<Q", view, 16)[0]
        raw = bytes(view[:Z.COMMIT_STRUCT.size])
        s2 = struct.unpack_from("<Q", view, 16)[0]
        if s1 == s2 and not s1 & 1:
            return Z.unpack_commit(raw, xxh3_64, path=path, key=key)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.001)


def write_commit(fd: int, c: Z.Commit, *, path: Any, key: int, updates: list[tuple[int, bytes, int]] = ()) -> int:
    """Publish ``c`` in ``commit.zr`` (open read-write) under the seqlock, checksummed with the
    store ``key``; returns the new seq.

    ``updates`` are ``(fd, bytes, offset)`` writes (entries and their checks) made while
    ``seq`` is odd.
    """
    raw = os.pread(fd, Z.COMMIT_STRUCT.size, 0)
    seq = struct.unpack_from("<Q", raw, 16)[0] if len(raw) >= 24 else 0
    odd = seq + 1 if not seq & 1 else seq
    try:
        io_call("pwrite", os.pwrite, fd, struct.pack("<Q", odd), 16)
        for tfd, data, offset in updates:
            io_call("pwrite", os.pwrite, tfd, data, offset)
        packed = Z.pack_commit(dataclasses.replace(c, seq=odd), xxh3_64, key)
        io_call("pwrite", os.pwrite, fd, packed[:16], 0)
        io_call("pwrite", os.pwrite, fd, packed[24:Z.COMMIT_STRUCT.size], 24)
        io_call("pwrite", os.pwrite, fd, struct.pack("<Q", odd + 1), 16)
    except OSError as exc:
        raise WriteError(f"commit.zr: write failed: {exc.strerror}", errno=exc.errno, path=path,
                         field="commit.zr", operation="pwrite") from exc
    return odd + 1


def write_meta(folder: str, meta: Z.StoreMeta) -> None:
    with AtomicFile(os.path.join(folder, Z.META_NAME)) as f:
        f.write(json.dumps(meta.to_json(), indent=1, sort_keys=True).encode())


@dataclasses.dataclass(frozen=True)
class Journal:
    kind: int
    commit: Z.Commit
    meta: Z.StoreMeta
    updates: np.ndarray  # JOURNAL_UPDATE_DTYPE
    renames: tuple[tuple[str, str], ...]


def pack_journal(j: Journal) -> bytes:
    extra = json.dumps({"meta": j.meta.to_json(), "renames": [list(r) for r in j.renames]},
                       sort_keys=True).encode()
    body = extra + np.ascontiguousarray(j.updates, dtype=Z.JOURNAL_UPDATE_DTYPE).tobytes()
    c = j.commit
    head = Z.JOURNAL_HEADER.pack(Z.JOURNAL_MAGIC, j.kind, 0, c.generation, c.epoch, c.length, c.num_chunks,
                                 len(j.updates), len(extra), xxh3_64(body))
    return head + body


def parse_journal(raw: bytes, *, path: Any = None) -> Journal:
    """Parse ``journal.zr``; a torn or damaged journal raises CorruptError."""
    hs = Z.JOURNAL_HEADER.size
    if len(raw) < hs:
        raise CorruptError("journal.zr: shorter than its header", path=path, field="journal.zr")
    magic, kind, _res, gen, epoch, length, nch, nupd, nextra, digest = Z.JOURNAL_HEADER.unpack_from(raw)
    if magic != Z.JOURNAL_MAGIC or kind not in (Z.JOURNAL_KIND_COMMIT, Z.JOURNAL_KIND_REBALANCE):
        raise CorruptError("journal.zr: bad magic or kind", path=path, field="magic")
    if hs + nextra + nupd * Z.JOURNAL_UPDATE_DTYPE.itemsize != len(raw):
        raise CorruptError("journal.zr: sizes disagree with the file", path=path, field="size")
    body = raw[hs:]
    if xxh3_64(body) != digest:
        raise CorruptError("journal.zr: checksum mismatch", path=path, field="checksum")
    from zerobatch.formats.strict_json import loads_strict

    extra = loads_strict(body[:nextra], error=CorruptError, field="journal.zr", path=path)
    meta = Z.parse_meta(json.dumps(extra["meta"]), path=path)
    renames = tuple((str(a), str(b)) for a, b in extra["renames"])
    for a, b in renames:
        if "/" in a or "/" in b or a in ("", ".", "..") or not b.endswith((".offset", ".check")):
            raise CorruptError("journal.zr: a rename outside the store's offset tables", path=path,
                               field="renames")
    updates = np.frombuffer(body, dtype=Z.JOURNAL_UPDATE_DTYPE, count=nupd, offset=nextra)
    return Journal(kind, Z.Commit(0, length, nch, gen, epoch), meta, updates, renames)


def read_journal(jpath: str) -> Journal:
    """Read and parse ``journal.zr``, allocating no more than its header says it holds and
    refusing a sparse file (a journal is written whole, so one with holes is damage)."""
    rfd, st = open_regular_file(jpath)
    try:
        head = os.pread(rfd, Z.JOURNAL_HEADER.size, 0)
        if len(head) == Z.JOURNAL_HEADER.size:
            nupd, nextra = Z.JOURNAL_HEADER.unpack_from(head)[7:9]
            want = Z.JOURNAL_HEADER.size + nextra + nupd * Z.JOURNAL_UPDATE_DTYPE.itemsize
            if nextra > 4 * Z.MAX_META_BYTES or want != st.st_size:
                raise CorruptError(f"journal.zr: its header describes {want} bytes, the file holds {st.st_size}",
                                   path=jpath, field="size")
            if st.st_blocks * 512 + 65536 < st.st_size:
                raise CorruptError("journal.zr: a sparse file (a journal is written whole)", path=jpath,
                                   field="size")
        # A journal is renamed into place whole: a damaged one is damage, never a torn write.
        raw = pread_exact(rfd, st.st_size, 0, path=jpath, field="journal.zr") if len(head) == Z.JOURNAL_HEADER.size else head
    finally:
        os.close(rfd)
    return parse_journal(raw, path=jpath)


def read_meta(mpath: str) -> Z.StoreMeta:
    """Read and parse ``meta.json`` (a regular file, at most ``MAX_META_BYTES``)."""
    return Z.parse_meta(read_document(mpath, limit=Z.MAX_META_BYTES, field="meta.json"), path=mpath)


def replay(folder: str, j: Journal) -> None:
    """Apply a journal (idempotent). The caller holds ``writer.lock`` (and, for a rebalance,
    ``switch.lock``) exclusive."""
    for src, dst in j.renames:
        s = os.path.join(folder, src)
        if os.path.exists(s):
            os.rename(s, os.path.join(folder, dst))
    cpath = os.path.join(folder, Z.COMMIT_NAME)
    cfd = open_regular_file(cpath, write=True)[0]
    tfds: dict[tuple[int, int], int] = {}
    try:
        updates = []
        for u in j.updates:
            f = int(u["field"])
            if f >= len(j.meta.fields):
                raise CorruptError("journal.zr: an update names a field that does not exist", path=folder,
                                   field="updates")
            if (f, 0) not in tfds:
                for kind, name in ((0, Z.offset_name(j.meta.fields[f].name)), (1, Z.check_name(j.meta.fields[f].name))):
                    tfds[(f, kind)] = open_regular_file(os.path.join(folder, name), write=True)[0]
            entry = np.zeros(1, Z.ENTRY_DTYPE)
            entry["chunk"], entry["offset"], entry["length"] = u["chunk"], u["offset"], u["length"]
            index = int(u["index"])
            updates.append((tfds[(f, 0)], entry.tobytes(), index * Z.ENTRY_SIZE))
            updates.append((tfds[(f, 1)], Z.entry_checks(entry, index, f, j.meta.key).tobytes(),
                            index * Z.CHECK_SIZE))
        write_commit(cfd, j.commit, path=cpath, key=j.meta.key, updates=updates)
        for fd in [*tfds.values(), cfd]:
            io_call("fsync", os.fsync, fd)
    finally:
        for fd in [*tfds.values(), cfd]:
            os.close(fd)
    write_meta(folder, j.meta)
    io_call("unlink", os.unlink, os.path.join(folder, Z.JOURNAL_NAME))
    dfd = os.open(folder, os.O_RDONLY)
    try:
        io_call("fsync", os.fsync, dfd)
    finally:
        os.close(dfd)


def recover(folder: str, *, writer_fd: int | None = None) -> bool:
    """Apply a journal left by a writer that died. Returns True if one was applied.

    A reader calls this without ``writer_fd``: it takes ``writer.lock`` without blocking and
    waits (up to ``WAIT_SECONDS``) while a live writer holds it.

    Raises:
        StateError: a live writer kept the lock the whole time.
        ReadError: the store is read-only to this process (its owner must open it once).
    """
    jpath = os.path.join(folder, Z.JOURNAL_NAME)
    if not os.path.exists(jpath):
        return False
    own = writer_fd is None
    fd = writer_fd
    if own:
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            fd = lock(os.path.join(folder, Z.WRITER_LOCK_NAME), exclusive=True, blocking=False)
            if fd is not None:
                break
            if not os.path.exists(jpath):
                return False
            if time.monotonic() > deadline:
                raise StateError("journal.zr: a writer holds writer.lock and has not finished its commit",
                                 path=folder, field="writer.lock")
            time.sleep(0.01)
    sfd = lock(os.path.join(folder, Z.SWITCH_LOCK_NAME), exclusive=True, blocking=True)
    try:
        if not os.path.exists(jpath):
            return False
        j = read_journal(jpath)
        mpath = os.path.join(folder, Z.META_NAME)
        current = read_meta(mpath)
        if current.store_id != j.meta.store_id or current.fields != j.meta.fields:
            raise CorruptError("journal.zr: the journal of another store (its store_id or fields differ from "
                               "meta.json's)", path=jpath, field="store_id")
        if not os.access(folder, os.W_OK):
            raise ReadError("journal.zr: a writer died mid-commit and this process cannot write the store "
                            "to finish it", errno=_errno.EACCES, path=jpath, field="journal.zr")
        replay(folder, j)
        return True
    finally:
        unlock(sfd)
        if own:
            unlock(fd)
