"""Read TOKSTREAM datasets (``docs/formats/tokstream.md``): token windows across shards,
whole documents, validated at open.

:class:`TokenStreamReader` opens ``manifest.json`` and every shard file it names, and refuses
at open, with a typed error naming the file and the field: a missing or extra file, a file
whose size disagrees with the manifest, a file from another build (its trailer's build id),
a document index that does not start at 0, end at the token count or increase, and a
metadata index that does not start at 0 or end at the size of ``metadata.bin``. Files are
mapped read-only with mappings that hold no descriptor (a dataset of thousands of shards
costs no file descriptors with the mmap backend; the pread backend keeps at most
``max_open_files`` open, least recently used closed first);
windows are gathered by a compiled kernel with the GIL released, which also refuses token
ids at or above the vocabulary on first use.

One reader may be shared by threads: results are those of one thread (chunks are checked by
one thread at a time; pread descriptors stay open until the read that pinned them is done).
It pickles as its folder and options, and works in forked, forkserver and spawned workers.

Checksums (``verify=True``, the default): each shard's ``checksums.bin`` holds the XXH3
digest of every 16 MiB chunk of its data files. The index files are checked in full at open
(a writer keeps each within 64 MiB); a chunk of ``tokens.bin`` or ``metadata.bin`` is checked
the first time a read touches it, so a flipped bit is an :class:`IntegrityError` naming the
file and the chunk, never a wrong token. :meth:`TokenStreamReader.verify` checks everything.
"""

from __future__ import annotations

import dataclasses
import operator
import io
import json
import os
import pickle
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, overload

import numpy as np

from zerobatch.core import FileMapping, WindowGather, xxh3_64
from zerobatch.core.checks import as_positions, check_count
from zerobatch.core.io import open_regular_file, pread_exact
from zerobatch.core.pool import shared_pool
from zerobatch.formats import tokstream as T
from zerobatch.formats.errors import (ConfigError, CorruptError, IntegrityError, LimitExceededError, NotFoundError,
                                     OutOfRangeError, ReadError, TruncatedError, ZerobatchError)

__all__ = ["TokenStreamReader", "WindowMetadata"]

#: Index files up to this size are validated in full at open (monotonic offsets); larger
#: ones are checked at their ends at open and in full by :meth:`TokenStreamReader.verify`.
FULL_INDEX_CHECK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What :meth:`TokenStreamReader.verify` found.

    Attributes:
        folder: the dataset.
        shards, files: how many shards and files were checked.
        bytes_checked: payload bytes hashed.
        problems: ``(path, message)`` per fault: a chunk whose digest differs, a digest list
            that disagrees with the manifest, an index that does not increase, a token id at
            or above the vocabulary (the first per shard and kind).
    """

    folder: str
    shards: int
    files: int
    bytes_checked: int
    problems: tuple[tuple[str, str], ...]

    @property
    def ok(self) -> bool:
        return not self.problems


class MetadataObjects(Sequence[Any]):
    """The distinct metadata objects of a batch, each decoded when first accessed.

    A sequence: ``objects[i]`` is the object that ``ids == i`` refers to. Blobs are
    ``memoryview`` slices of ``metadata.bin`` (of the mapping, or of the batch's reads in
    the pread backend), never copied; with ``decode`` each is decoded on first access and
    kept, so a training step that reads only the ids pays for no Python objects.
    """

    __slots__ = ("_table", "_shards", "_blobs", "_decode", "_cache", "_n")

    def __init__(self, table: np.ndarray, shards: list[_Shard], blobs: list[memoryview] | None,
                 decode: Callable[[memoryview], Any] | None) -> None:
        self._n = len(table)
        self._table = table
        self._shards = shards
        self._blobs = blobs                  # pread backend: read with the batch
        self._decode = decode
        self._cache: dict[int, Any] = {}

    def _blob(self, i: int) -> memoryview:
        if self._blobs is not None:
            return self._blobs[i]
        k, _, a, b = self._table[i].tolist()
        shard = self._shards[k]
        shard.check_metadata_range(a, b)
        return shard.metadata_bin[a:b]

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = operator.index(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise OutOfRangeError(f"metadata object {i} of {self._n}")
        if i not in self._cache:
            blob = self._blob(i)
            self._cache[i] = blob if self._decode is None else self._decode(blob)
        return self._cache[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"MetadataObjects({self._n} objects)"


class WindowMetadata(NamedTuple):
    """The metadata of one window, or of a batch of windows.

    ``ids`` holds one ``int32`` per token (shape ``(length,)`` for a window, ``(B, length)``
    for a batch): an index into ``objects``, or -1 where no metadata covers the token.
    ``objects`` (:class:`MetadataObjects`) are the distinct metadata in order of first
    appearance, decoded on access; ``keys`` names each as ``(shard, shard-local metadata
    id)`` (``int64 (len(objects), 2)``), stable across batches, so a caller may cache
    decoded objects by key.
    """

    ids: np.ndarray
    objects: MetadataObjects
    keys: np.ndarray


class _Shard:
    """One shard's open files: the token mapping and the two index arrays."""

    def __init__(self, folder: str, entry: T.ShardEntry, manifest: T.DatasetManifest, backend: str,
                 verify: bool = True) -> None:
        self.entry = entry
        self.backend = backend
        self.verify = verify
        self._lists_ok: set[str] = set()
        self._meta_ok: np.ndarray | None = None
        self._index_bytes: dict[str, memoryview] = {}
        self.fd_cache: _FdCache | None = None      # pread backend: descriptors on demand
        self.index = -1
        self.path = os.path.join(folder, entry.name)
        self.build_id = bytes.fromhex(entry.build_id)
        self._maps: list[FileMapping] = []
        self._fds: list[int] = []
        try:
            self._open(manifest)
        except BaseException:
            self.close()
            raise

    def _check_listing(self) -> None:
        try:
            present = set(os.listdir(self.path))
        except FileNotFoundError:
            raise NotFoundError(f"shard {self.entry.name!r}: the folder is missing", path=self.path,
                                field="shards") from None
        expected = set(self.entry.files) | {T.SHARD_MANIFEST_NAME}
        missing = sorted(set(self.entry.files) - present)
        if missing:
            raise NotFoundError(f"{missing[0]}: missing from shard {self.entry.name!r}",
                                path=os.path.join(self.path, missing[0]), field="files")
        extra = sorted(f for f in present - expected if not f.startswith("."))
        if extra:
            raise CorruptError(f"{extra[0]}: a file the manifest does not list in shard {self.entry.name!r}",
                               path=os.path.join(self.path, extra[0]), field="files")

    def _open_file(self, fname: str) -> tuple[int, int, str]:
        path = os.path.join(self.path, fname)
        fd, st = open_regular_file(path)
        self._fds.append(fd)
        want = self.entry.files[fname].size + T.TRAILER_SIZE
        if st.st_size < want:
            raise TruncatedError(f"size: {st.st_size} bytes, the manifest says {want} (payload and trailer)",
                                 path=path, field="size")
        if st.st_size > want:
            raise CorruptError(f"size: {st.st_size} bytes, the manifest says {want} (payload and trailer)",
                               path=path, field="size")
        build_id, kind = T.unpack_trailer(pread_exact(fd, T.TRAILER_SIZE, want - T.TRAILER_SIZE, path=path,
                                                      field="trailer"), path=path)
        if build_id != self.build_id:
            raise CorruptError(f"build_id: the file belongs to build {build_id.hex()}, the shard to "
                               f"{self.entry.build_id}", path=path, field="build_id")
        if kind != T.FILE_KINDS[fname]:
            raise CorruptError(f"trailer: file kind {kind} is not {fname}'s", path=path, field="trailer")
        return fd, want - T.TRAILER_SIZE, path

    def _map(self, fd: int, size: int, path: str) -> memoryview:
        """A read-only mapping that holds no descriptor (the caller may close ``fd``)."""
        if size == 0:
            return memoryview(b"")
        m = FileMapping(fd, size, path)
        self._maps.append(m)
        return memoryview(m)

    def _release(self, fd: int) -> None:
        """Close a descriptor this shard no longer needs (its mapping stays valid)."""
        self._fds.remove(fd)
        os.close(fd)

    def _index(self, fname: str, count: int, end: int, end_name: str) -> np.ndarray:
        fd, size, path = self._open_file(fname)
        raw = self._map(fd, size, path)
        self._index_bytes[fname] = raw
        idx = np.frombuffer(raw, dtype="<u8", count=count + 1)
        self._release(fd)
        if idx[0] != 0:
            raise CorruptError(f"{fname}[0]: {int(idx[0])}, expected 0", path=path, field=fname)
        if int(idx[-1]) != end:
            raise CorruptError(f"{fname}[{count}]: {int(idx[-1])}, expected {end_name} {end}", path=path,
                               field=fname)
        if size <= FULL_INDEX_CHECK_BYTES:
            self._check_monotonic(idx, fname, path)
        return idx

    def _check_monotonic(self, idx: np.ndarray, fname: str, path: str) -> None:
        strict = fname == "documents.index"
        steps = np.diff(idx.astype(np.int64, copy=False)) if idx.size > 1 else np.zeros(0, np.int64)
        bad = np.flatnonzero(steps <= 0) if strict else np.flatnonzero(idx[1:] < idx[:-1])
        if bad.size:
            k = int(bad[0]) + 1
            raise CorruptError(f"{fname}[{k}]: {int(idx[k])} does not {'increase' if strict else 'grow'} "
                               f"from {int(idx[k - 1])}", path=path, field=fname)

    def digests(self, fname: str) -> np.ndarray:
        """The chunk digests of data file ``fname``, checked (once) against the manifest's
        checksum of that file.

        Raises:
            IntegrityError: ``checksums.bin`` does not hold the digests the manifest records.
        """
        a, b = self._ranges[fname]
        sums = self.sums[a:b]
        if fname not in self._lists_ok:
            got = f"{xxh3_64(sums.tobytes()):016x}"
            if got != self.entry.files[fname].xxh3:
                raise IntegrityError(f"checksums.bin: the chunk digests of {fname} hash to {got}, the manifest "
                                     f"records {self.entry.files[fname].xxh3}",
                                     path=os.path.join(self.path, "checksums.bin"), field=f"{fname}.xxh3")
            self._lists_ok.add(fname)
        return sums

    def chunk(self, fname: str, c: int) -> Any:
        """The bytes of chunk ``c`` of data file ``fname`` (a view of the mapping, or a read)."""
        size = self.entry.files[fname].size
        a, b = c * T.CHECKSUM_CHUNK, min((c + 1) * T.CHECKSUM_CHUNK, size)
        if fname in self._index_bytes:
            return self._index_bytes[fname][a:b]
        if self.backend == "mmap":
            return (self.tokens if fname == "tokens.bin" else self.metadata_bin)[a:b]
        # a descriptor of its own: the cache's may be pinned for the gather that asked for this
        fd = self.reopen(fname)
        try:
            return memoryview(self._pread(fd, b - a, a, fname))
        finally:
            os.close(fd)

    def check_chunk(self, fname: str, c: int) -> None:
        """Hash chunk ``c`` of ``fname`` and compare it with its digest.

        Raises:
            IntegrityError: naming the file, the chunk and its byte range.
        """
        want = int(self.digests(fname)[c])
        got = xxh3_64(self.chunk(fname, c))
        if got != want:
            a = c * T.CHECKSUM_CHUNK
            b = min(a + T.CHECKSUM_CHUNK, self.entry.files[fname].size)
            raise IntegrityError(f"{fname}: chunk {c} (bytes [{a}, {b})) does not match its checksum "
                                 f"({got:016x}, expected {want:016x})", path=os.path.join(self.path, fname),
                                 field="xxh3")

    def check_file(self, fname: str) -> list[str]:
        """Hash every chunk of ``fname``: the messages of the chunks that differ from their
        digests (``checksums.bin``: its own checksum in the manifest).

        Raises:
            IntegrityError: the digest list of ``fname`` disagrees with the manifest.
            ReadError, TruncatedError: a read failed (pread backend).
        """
        size = self.entry.files[fname].size
        if fname == "checksums.bin":
            raw = self.sums.view(np.uint8)
            digests = [xxh3_64(raw[a:a + T.CHECKSUM_CHUNK]) for a in range(0, max(size, 1), T.CHECKSUM_CHUNK)]
            got = f"{xxh3_64(np.asarray(digests, dtype='<u8').tobytes()):016x}"
            want = self.entry.files[fname].xxh3
            return [] if got == want else [f"checksums.bin: hashes to {got}, the manifest records {want}"]
        out = []
        for c in range(T.num_chunks(size)):
            try:
                self.check_chunk(fname, c)
            except IntegrityError as exc:
                out.append(str(exc))
        return out

    def max_token(self) -> int:
        """The largest token id in ``tokens.bin`` (read in blocks of 4 Mi records)."""
        top, n, step = 0, self.entry.num_tokens, 1 << 22
        for a in range(0, n, step):
            rec = self.read_records(a, min(step, n - a))
            tok = rec["token"] if rec.dtype.names else rec
            if tok.size:
                top = max(top, int(tok.max()))
        return top

    def _check_whole(self, fname: str) -> None:
        for c in range(T.num_chunks(self.entry.files[fname].size)):
            self.check_chunk(fname, c)

    def check_metadata_range(self, a: int, b: int) -> None:
        """Check the ``metadata.bin`` chunks under bytes ``[a, b)`` not checked before."""
        ok = self._meta_ok
        if ok is None or b <= a:
            return
        for c in range(a // T.CHECKSUM_CHUNK, (b - 1) // T.CHECKSUM_CHUNK + 1):
            if not ok[c]:
                self.check_chunk("metadata.bin", c)
                ok[c] = 1

    def _open(self, manifest: T.DatasetManifest) -> None:
        self._check_listing()
        e = self.entry
        self.dtype = np.dtype(T.record_dtype_descr(manifest.token_dtype, manifest.metadata))
        # the chunk digests of every data file (checked against the manifest on first use)
        fd, size, path = self._open_file("checksums.bin")
        self.sums = np.frombuffer(self._map(fd, size, path), dtype="<u8")
        self._release(fd)
        self._ranges = T.chunk_digest_ranges(e.files, manifest.metadata)
        fd, size, path = self._open_file("tokens.bin")
        self.tokens_fd = fd
        if self.backend == "mmap":
            self.tokens = self._map(fd, size, path)
            self.records = np.frombuffer(self.tokens, dtype=self.dtype, count=e.num_tokens)
            self.address = self.records.ctypes.data if size else 0
            self._release(fd)
            self.tokens_fd = -1
        else:
            # pread backend: checked now, opened again on demand through the reader's cache
            self.tokens, self.records, self.address = None, None, 0
            self._release(fd)
            self.tokens_fd = -1
        self.documents = self._index("documents.index", e.num_documents, e.num_tokens, "num_tokens")
        if self.verify:
            self._check_whole("documents.index")
        self.metadata_index = None
        self.metadata_bin = memoryview(b"")
        if manifest.metadata:
            fd, bin_size, path = self._open_file("metadata.bin")
            self.metadata_fd = fd
            if self.backend == "mmap":
                self.metadata_bin = self._map(fd, bin_size, path)
            self._release(fd)
            self.metadata_fd = -1
            self.metadata_index = self._index("metadata.index", e.num_metadata, bin_size, "the size of metadata.bin")
            if self.verify:
                self._check_whole("metadata.index")
                self._meta_ok = np.zeros(T.num_chunks(bin_size), np.uint8)

    def reopen(self, fname: str) -> int:
        """A new descriptor of ``fname`` (pread backend), checked again as at open (size,
        trailer, build id, kind) so that a replaced file is refused; ``POSIX_FADV_RANDOM``."""
        fd, _, _ = self._open_file(fname)
        self._fds.remove(fd)
        self._advise_random(fd)
        return fd

    def _pread_cached(self, fname: str, size: int, offset: int) -> bytearray:
        # the cache's descriptor, held (under its lock) until the read is done
        cache = self.fd_cache
        if cache is None:
            raise ConfigError("this shard is read through mappings, not descriptors", path=self.path, field="backend")
        with cache.lock:
            return self._pread(cache.get(self, fname), size, offset, fname)

    @staticmethod
    def _advise_random(fd: int) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    def _pread(self, fd: int, size: int, offset: int, fname: str) -> bytearray:
        """Exactly ``size`` bytes at ``offset`` into a new writable buffer (``preadv``)."""
        buf = bytearray(size)
        view, done = memoryview(buf), 0
        path = os.path.join(self.path, fname)
        while done < size:
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except InterruptedError:
                continue
            except OSError as exc:
                raise ReadError(f"{fname}: read failed: {exc.strerror}", errno=exc.errno, path=path,
                                field=fname) from exc
            if n == 0:
                raise TruncatedError(f"{fname}: ended before byte {offset + size} (the file shrank after open)",
                                     path=path, field=fname)
            done += n
        return buf

    def read_records(self, local: int, count: int) -> np.ndarray:
        """Records ``[local, local + count)`` of ``tokens.bin`` (a view, or a fresh read)."""
        if self.records is not None:
            return self.records[local:local + count]
        raw = self._pread_cached("tokens.bin", count * self.dtype.itemsize, local * self.dtype.itemsize)
        return np.frombuffer(raw, dtype=self.dtype)

    def read_metadata(self, start: int, stop: int) -> memoryview:
        """Bytes ``[start, stop)`` of ``metadata.bin`` (a view of the mapping, or one read)."""
        if self.backend == "mmap":
            return self.metadata_bin[start:stop]
        return memoryview(self._pread_cached("metadata.bin", stop - start, start))

    def read_blobs(self, ranges: list[tuple[int, int]]) -> list[memoryview]:
        """The ``[start, stop)`` ranges of ``metadata.bin`` (checked ones), read with one
        ``pread`` spanning them unless that would read over four times their bytes (plus
        64 KiB), else one read each; returned as slices, without copying."""
        first = min(a for a, _ in ranges)
        last = max(b for _, b in ranges)
        if last - first <= 4 * sum(b - a for a, b in ranges) + (64 << 10):
            data = self.read_metadata(first, last)
            return [data[a - first:b - first] for a, b in ranges]
        return [self.read_metadata(a, b) for a, b in ranges]

    def verify_indexes(self) -> None:
        self._check_monotonic(self.documents, "documents.index", os.path.join(self.path, "documents.index"))
        if self.metadata_index is not None:
            self._check_monotonic(self.metadata_index, "metadata.index", os.path.join(self.path, "metadata.index"))

    def close(self) -> None:
        self.records = None
        self.documents = None
        self.metadata_index = None
        self.metadata_bin = None
        self.tokens = None
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a caller's array still views it; it is unmapped with the last view
        self._maps.clear()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


class _FdCache:
    """Descriptors of the pread backend's data files, at most ``limit`` open (least recently
    used closed first), so a dataset of thousands of shards reads under a small
    ``RLIMIT_NOFILE``. The token file descriptors are mirrored into ``table`` (one per shard,
    -1 when closed), which the compiled gather reads; :meth:`pin` opens a batch's shards."""

    def __init__(self, limit: int, table: np.ndarray) -> None:
        self.limit = limit
        self.table = table
        self.open: OrderedDict[tuple[int, str], int] = OrderedDict()
        # held from pin to the end of the gather that uses the pinned descriptors, so that no
        # other thread closes one (and the OS reuses its number) while a read is under way
        self.lock = threading.RLock()
        # every data file of the dataset fits under the limit: once all token files are open
        # nothing is ever closed, and batches skip the pinning
        self.all_open = False

    def get(self, shard: _Shard, fname: str, keep: frozenset[int] = frozenset()) -> int:
        key = (shard.index, fname)
        fd = self.open.get(key)
        if fd is not None:
            self.open.move_to_end(key)
            return fd
        while len(self.open) >= self.limit:
            victim = next((k for k in self.open if k[0] not in keep), None)
            if victim is None:
                break
            self._close(victim)
        fd = shard.reopen(fname)
        self.open[key] = fd
        if fname == "tokens.bin":
            self.table[shard.index] = fd
        return fd

    def _close(self, key: tuple[int, str]) -> None:
        fd = self.open.pop(key)
        if key[1] == "tokens.bin":
            self.table[key[0]] = -1
        os.close(fd)

    def pin(self, shards: list[_Shard], indices: np.ndarray) -> None:
        keep = frozenset(indices.tolist())
        for k in keep:
            self.get(shards[k], "tokens.bin", keep)

    def close(self) -> None:
        for key in list(self.open):
            self._close(key)


class TokenStreamReader:
    """A TOKSTREAM dataset opened for reading: windows and documents, in global positions.

    Args:
        folder: the dataset folder (holding ``manifest.json``).
        backend: ``"mmap"`` (default; local files) maps the token and metadata files;
            ``"pread"`` (network filesystems) reads each window piece with ``pread`` into a
            preallocated buffer, checked for its full length, after
            ``posix_fadvise(RANDOM)`` on every data file. Index files are mapped in both.
        num_threads: threads a batch of windows is split over (the calling thread plus
            ``num_threads - 1`` workers of the shared pool, all without the GIL); 1 copies
            on the calling thread only.
        verify: check checksums: index files in full at open, each 16 MiB chunk of token
            and metadata data the first time a read touches it (``IntegrityError`` naming
            the file and the chunk). ``False`` skips them (trusted data, or to measure).
        max_open_files: pread backend: descriptors kept open at most (least recently used
            closed first); default a quarter of ``RLIMIT_NOFILE``, at most 1024. A batch
            touching more shards than that is read shard piece by shard piece.

    Attributes:
        num_tokens, num_documents: totals over all shards (64-bit).
        manifest: the parsed :class:`~zerobatch.formats.tokstream.DatasetManifest`.

    Raises:
        NotFoundError: no manifest, or a shard file missing.
        FormatError: (``CorruptError``, ``TruncatedError``, ``UnsupportedVersionError``,
            ``LimitExceededError``) the manifest or a shard file is damaged or inconsistent;
            the error names the file and the field.
    """

    def __init__(self, folder: str | os.PathLike[str], *, backend: str = "mmap", num_threads: int = 1,
                 verify: bool = True, max_open_files: int | None = None) -> None:
        self.folder = os.path.abspath(os.fspath(folder))
        if not isinstance(verify, bool):
            raise ConfigError(f"verify must be True or False, got {verify!r}", field="verify")
        self.verify_checksums = verify
        if backend not in ("mmap", "pread"):
            raise ConfigError(f"backend must be 'mmap' or 'pread', got {backend!r}", field="backend")
        self.backend = backend
        self.num_threads = check_count(num_threads, "num_threads", minimum=1, maximum=256)
        path = os.path.join(self.folder, T.MANIFEST_NAME)
        try:
            fd, st = open_regular_file(path)
        except FileNotFoundError:
            raise NotFoundError("manifest.json: not found (not a tokstream dataset, or unfinished)", path=path,
                                field="manifest") from None
        try:
            if st.st_size > T.MAX_MANIFEST_BYTES:
                raise CorruptError(f"manifest: {st.st_size} bytes is too large", path=path, field="manifest")
            raw = pread_exact(fd, st.st_size, 0, path=path, field="manifest")
        finally:
            os.close(fd)
        self.manifest = T.parse_manifest(raw, path=path)
        m = self.manifest
        ids, record = T.build_id_material(m.options(), m.shards)
        if f"{xxh3_64(ids):016x}{xxh3_64(record):016x}" != m.build_id:
            raise CorruptError("build_id: the manifest does not hash to its build id (a field was changed after "
                               "assemble)", path=path, field="build_id")
        self.vocab_size = m.vocab_size
        self.token_dtype = np.dtype(m.token_dtype)
        self.itemsize = T.record_itemsize(m.token_dtype, m.metadata)
        self._shards: list[_Shard] = []
        self._fd_table = np.full(len(m.shards), -1, dtype=np.intc)
        self._fd_cache: _FdCache | None = None
        if backend == "pread":
            if max_open_files is None:
                soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                max_open_files = 1024 if soft == resource.RLIM_INFINITY else max(2, min(1024, soft // 4))
            self._fd_cache = _FdCache(check_count(max_open_files, "max_open_files", minimum=2), self._fd_table)
        try:
            for k, entry in enumerate(m.shards):
                sh = _Shard(self.folder, entry, m, backend, verify)
                sh.index, sh.fd_cache = k, self._fd_cache
                self._shards.append(sh)
        except BaseException:
            self.close()
            raise
        counts = [e.num_tokens for e in m.shards]
        self.cum_tokens = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self.cum_documents = np.concatenate(
            [[0], np.cumsum([e.num_documents for e in m.shards], dtype=np.int64)]).astype(np.int64)
        self.num_tokens = int(self.cum_tokens[-1])
        self.num_documents = int(self.cum_documents[-1])
        self._gather = None
        if self._shards:
            self._gather = WindowGather(np.array([s.address for s in self._shards], dtype=np.uint64),
                                        self.cum_tokens, self.itemsize, self.token_dtype.itemsize,
                                        self.vocab_size, [os.path.join(s.path, "tokens.bin") for s in self._shards],
                                        [s.documents for s in self._shards],
                                        None if backend == "mmap" else self._fd_table,
                                        [s.metadata_index for s in self._shards] if m.metadata else None,
                                        [T.num_chunks(e.files["tokens.bin"].size) for e in m.shards] if verify else None,
                                        self._check_tokens_chunk if verify else None, T.CHECKSUM_CHUNK)
        self.closed = False

    def _check_tokens_chunk(self, shard: int, chunk: int) -> None:
        self._shards[shard].check_chunk("tokens.bin", chunk)

    def __len__(self) -> int:
        """Tokens in the dataset."""
        return self.num_tokens

    def _ready(self) -> None:
        if self.closed:
            raise ConfigError("the reader is closed", path=self.folder, field="reader")

    def windows(self, starts: Any, length: int, *, out: np.ndarray | None = None,
                dtype: Any = np.int64) -> np.ndarray:
        """Token windows ``[start, start + length)`` at global positions, as rows of ``out``.

        Windows may cross shard boundaries (each becomes several reads); the gather runs in
        ``zerobatch.core`` with the GIL released. For next-token training ask for
        ``seq_len + 1`` tokens and use ``w[:, :-1]`` / ``w[:, 1:]``.

        Args:
            starts: integer array-like of global token positions.
            length: tokens per window.
            out: a caller's C-contiguous ``int64`` or ``int32`` buffer of
                ``(len(starts), length)``; else one is allocated with ``dtype``.

        Raises:
            IndexError: a window outside ``[0, num_tokens)``.
            CorruptError: a token id at or above the vocabulary (field ``token``).
            ConfigError: an unfit ``out``.
        """
        self._ready()
        if out is None:
            length = check_count(length, "length")
            out = np.empty((int(np.size(starts)), length), dtype=np.dtype(dtype))
            if out.dtype not in (np.int64, np.int32):
                raise ConfigError(f"dtype must be int64 or int32, got {out.dtype}", field="dtype")
        if self._gather is None:
            if np.size(starts):
                raise OutOfRangeError("the dataset holds no tokens")
            return out
        pool = shared_pool(self.num_threads - 1) if self.num_threads > 1 else None
        if self._fd_cache is not None:
            with self._fd_cache.lock:
                starts = as_positions(starts, "starts")
                if not self._pin(starts, starts + check_count(length, "length")):
                    for w, st in enumerate(starts.tolist()):     # more shards than descriptors
                        self._ranges_piecewise([st], [st + length], out[w].reshape(-1))
                    return out
                return self._gather.gather(starts, length, out, pool)
        return self._gather.gather(starts, length, out, pool)

    def _pin(self, starts: np.ndarray, stops: np.ndarray) -> bool:
        """pread backend: open the token files of the shards ``[starts, stops)`` touch;
        False when they are more than the descriptor limit (then nothing is pinned)."""
        cache = self._fd_cache
        if starts.size == 0 or cache is None or cache.all_open:
            return True
        if len(self._shards) * (2 if self.manifest.metadata else 1) <= cache.limit:
            cache.pin(self._shards, np.arange(len(self._shards)))
            cache.all_open = True
            return True
        first = np.searchsorted(self.cum_tokens, np.clip(starts, 0, self.num_tokens), side="right") - 1
        last = np.searchsorted(self.cum_tokens, np.clip(np.maximum(stops - 1, starts), 0, self.num_tokens),
                               side="right") - 1
        span = last - first
        if span.max() == 0:
            touched = np.unique(np.clip(first, 0, len(self._shards) - 1))
        else:
            touched = np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first.tolist(), last.tolist(),
                                                                                     strict=True)]))
            touched = touched[(touched >= 0) & (touched < len(self._shards))]
        if touched.size > cache.limit:
            return False
        cache.pin(self._shards, touched)
        return True

    def _ranges_piecewise(self, starts: list[int], stops: list[int], flat: np.ndarray) -> None:
        """pread backend, a batch over more shards than descriptors: each range is read one
        shard piece at a time."""
        gather = self._gather
        if gather is None:
            raise OutOfRangeError("the dataset holds no tokens")
        at = 0
        for a, b in zip(starts, stops, strict=True):
            if a < 0 or b > self.num_tokens or b < a:
                raise OutOfRangeError(f"range [{a}, {b}) is not within [0, {self.num_tokens})")
            while a < b:
                k = int(np.searchsorted(self.cum_tokens, a, side="right")) - 1
                e = min(b, int(self.cum_tokens[k + 1]))
                self._pin(np.array([a]), np.array([e]))
                gather.gather_ranges([a], [e], flat[at:at + e - a])
                at += e - a
                a = e

    def boundaries(self, starts: Any, length: int, *, position_ids: np.ndarray | None = None,
                   segment_ids: np.ndarray | None = None, cu_seqlens: np.ndarray | None = None,
                   position_dtype: Any = np.int64,
                   segments: bool = True) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray, int]:
        """Document boundaries inside the windows ``[start, start + length)``, compiled.

        Each window is cut into segments at every document start inside it. Returns
        ``(position_ids, segment_ids, cu_seqlens, max_seqlen)``: ``int64 (B, L)`` positions
        restarting at 0 at each segment, ``int32 (B, L)`` segment numbers per window,
        ``int32`` cumulative segment starts over the flattened batch ending with ``B * L``
        (the ``cu_seqlens`` of variable-length attention kernels), and the longest segment.
        For next-token pairs, pass the same ``length`` as the inputs (``seq_len``). The three
        arrays may be caller buffers reused from batch to batch; ``position_dtype=np.int32``
        and ``segments=False`` halve the bytes written, and ``position_dtype=None`` leaves
        only ``cu_seqlens`` and ``max_seqlen`` (see
        :meth:`zerobatch.core.WindowGather.boundaries`).

        Raises:
            IndexError: a window outside ``[0, num_tokens)``.
        """
        self._ready()
        if self._gather is None:
            raise OutOfRangeError("the dataset holds no tokens")
        return self._gather.boundaries(starts, length, position_ids, segment_ids, cu_seqlens,
                                       position_dtype=position_dtype, segments=segments)

    def windows_metadata(self, starts: Any, length: int, *, ids: np.ndarray | None = None,
                         out: np.ndarray | None = None, decode: bool = True) -> WindowMetadata:
        """The metadata of a batch of windows ``[start, start + length)``.

        The per-token metadata ids of every window are read and deduplicated over the batch
        in one compiled call without the GIL (:meth:`zerobatch.core.WindowGather.metadata_ids`:
        a run of tokens under one metadata object costs one lookup); given ``out``, the same
        pass also copies the windows' tokens into it, as :meth:`windows` would, so tokens and
        metadata cost one read of the records. Then, per shard, the
        index entries of the distinct ids are read at once (one coalesced ``metadata.index``
        access) and their blobs are taken from ``metadata.bin`` as ``memoryview`` slices
        without copying: slices of the mapping (mmap backend), or of one ``pread`` covering
        them (pread backend; separate reads where they lie far apart).

        Args:
            starts: integer array-like of global token positions.
            length: tokens per window (``seq_len + 1`` to match next-token windows).
            ids: optional caller buffer, C-contiguous ``int32 (len(starts), length)``.
            out: optional token buffer, as for :meth:`windows` (filled in the same pass).
            decode: decode each blob with the dataset's codec (``json``, ``numpy``,
                ``bytes``; ``pickle`` only if the dataset was written with it); else the
                objects are the blobs as ``memoryview`` slices.

        Returns:
            :class:`WindowMetadata` with ``ids`` of shape ``(len(starts), length)``.

        Raises:
            ConfigError: the dataset has no metadata; an unfit ``ids``.
            IndexError: a window outside ``[0, num_tokens)``.
            CorruptError: a token's metadata id not below its shard's metadata count (field
                ``metadata_id``), or index entries that do not fit ``metadata.bin`` (field
                ``metadata.index``).
        """
        self._ready()
        if not self.manifest.metadata:
            raise ConfigError("the dataset has no metadata", path=self.folder, field="metadata")
        if self._gather is None:
            if np.size(starts):
                raise OutOfRangeError("the dataset holds no tokens")
            empty = np.empty((0, 4), np.int64)
            return WindowMetadata(np.empty((0, check_count(length, "length")), np.int32),
                                  MetadataObjects(empty, self._shards, None, None), empty[:, :2])
        blobs = None
        if self._fd_cache is not None:
            with self._fd_cache.lock:
                starts = as_positions(starts, "starts")
                if self._pin(starts, starts + check_count(length, "length")):
                    ids, table = self._gather.metadata_ids(starts, length, ids, out)
                else:
                    ids, table = self._metadata_in_groups(starts, length, ids, out)
                blobs = self._read_blobs(table)
        else:
            ids, table = self._gather.metadata_ids(starts, length, ids, out)
        return WindowMetadata(ids, MetadataObjects(table, self._shards, blobs, self._decode if decode else None),
                              table[:, :2])

    def _metadata_in_groups(self, starts: np.ndarray, length: int, ids: np.ndarray | None,
                            out: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """pread backend, a batch over more shards than descriptors: runs of consecutive
        windows whose shards fit are numbered one run at a time, then renumbered over the
        batch (order of first appearance kept)."""
        gather = self._gather
        if gather is None:
            raise OutOfRangeError("the dataset holds no tokens")
        n = starts.size
        res = np.empty((n, length), np.int32) if ids is None else ids
        if out is not None and (not isinstance(out, np.ndarray) or out.shape != (n, length)):
            raise ConfigError(f"out must be a C-contiguous int64 or int32 array of shape ({n}, {length})", field="out")
        numbers: dict[tuple[int, int], int] = {}
        rows: list[list[int]] = []
        a = 0
        while a < n:
            b = a + 1
            if not self._pin(starts[a:b], starts[a:b] + length):
                raise LimitExceededError(f"windows_metadata: one window touches more shards than max_open_files "
                                         f"({self._fd_cache.limit if self._fd_cache else 0})", field="max_open_files")
            while b < n and self._pin(starts[a:b + 1], starts[a:b + 1] + length):
                b += 1
            self._pin(starts[a:b], starts[a:b] + length)
            part_ids, part = gather.metadata_ids(starts[a:b], length, res[a:b],
                                                        None if out is None else out[a:b])
            remap = np.empty(len(part), np.int32)
            for k, row in enumerate(part.tolist()):
                key = (row[0], row[1])
                if key not in numbers:
                    numbers[key] = len(numbers)
                    rows.append(row)
                remap[k] = numbers[key]
            if len(part):
                part_ids[...] = np.where(part_ids >= 0, remap[np.maximum(part_ids, 0)], -1)
            a = b
        return res, np.array(rows, dtype=np.int64).reshape(-1, 4)

    def _read_blobs(self, table: np.ndarray) -> list[memoryview]:
        """pread backend: the blobs of ``table``, read now (one read per shard where they lie
        close together; else one per blob), then handed out as slices."""
        got: list[memoryview] = [memoryview(b"")] * len(table)
        rows = table.tolist()
        by_shard: dict[int, list[int]] = {}
        for i, (k, _, _, _) in enumerate(rows):
            by_shard.setdefault(k, []).append(i)
        for k, sel in by_shard.items():
            for i in sel:
                self._shards[k].check_metadata_range(rows[i][2], rows[i][3])
            got_k = self._shards[k].read_blobs([(rows[i][2], rows[i][3]) for i in sel])
            for i, b in zip(sel, got_k, strict=True):
                got[i] = b
        return got


    def windows_with_boundaries(self, starts: Any, length: int, *, out: np.ndarray | None = None,
                                dtype: Any = np.int64, boundaries_length: int | None = None,
                                position_ids: np.ndarray | None = None, segment_ids: np.ndarray | None = None,
                                cu_seqlens: np.ndarray | None = None, position_dtype: Any = np.int64,
                                segments: bool = True) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None,
                                                                np.ndarray, int]:
        """:meth:`windows` and :meth:`boundaries` in one compiled pass: each window's
        boundary outputs are written right after its tokens, while the next windows' loads
        are in flight (the cheaper way to get both; on the calling thread).

        Args:
            starts, length, out, dtype: as for :meth:`windows` (``seq_len + 1`` tokens for
                next-token pairs).
            boundaries_length: tokens per window the boundaries cover; default
                ``length - 1``, the inputs ``w[:, :-1]`` of next-token pairs.
            position_ids, segment_ids, cu_seqlens, position_dtype, segments: as for
                :meth:`boundaries`, shaped by ``boundaries_length``.

        Returns:
            ``(tokens, position_ids, segment_ids, cu_seqlens, max_seqlen)``.

        Raises:
            As :meth:`windows` and :meth:`boundaries`.
        """
        self._ready()
        if out is None:
            n = check_count(length, "length", minimum=1)
            out = np.empty((int(np.size(starts)), n), dtype=np.dtype(dtype))
            if out.dtype not in (np.int64, np.int32):
                raise ConfigError(f"dtype must be int64 or int32, got {out.dtype}", field="dtype")
        if self._gather is None:
            raise OutOfRangeError("the dataset holds no tokens")
        if self._fd_cache is not None:
            with self._fd_cache.lock:
                starts = as_positions(starts, "starts")
                if not self._pin(starts, starts + check_count(length, "length")):
                    self.windows(starts, length, out=out)
                    bl = length - 1 if boundaries_length is None else boundaries_length
                    return (out, *self.boundaries(starts, bl, position_ids=position_ids, segment_ids=segment_ids,
                                                  cu_seqlens=cu_seqlens, position_dtype=position_dtype,
                                                  segments=segments))
                return self._gather.gather_with_boundaries(starts, length, out, boundaries_length, position_ids,
                                                           segment_ids, cu_seqlens, position_dtype=position_dtype,
                                                           segments=segments)
        return self._gather.gather_with_boundaries(starts, length, out, boundaries_length, position_ids,
                                                   segment_ids, cu_seqlens, position_dtype=position_dtype,
                                                   segments=segments)

    def window_metadata(self, start: int, length: int, *, decode: bool = True) -> WindowMetadata:
        """The metadata of the window ``[start, start + length)`` (see :meth:`windows_metadata`).

        Returns:
            :class:`WindowMetadata` with ``ids`` of shape ``(length,)``.
        """
        start = check_count(start, "start")
        length = check_count(length, "length")
        if self.manifest.metadata and start + length > self.num_tokens:
            raise OutOfRangeError(f"window [{start}, {start + length}) is outside [0, {self.num_tokens})")
        m = self.windows_metadata(np.array([start], np.int64), length, decode=decode)
        return WindowMetadata(m.ids[0], m.objects, m.keys)

    def _decode(self, blob: memoryview) -> Any:
        codec = self.manifest.codec
        try:
            if codec == "json":
                return json.loads(bytes(blob))
            if codec == "numpy":
                return np.load(io.BytesIO(blob), allow_pickle=False)
            if codec == "pickle":
                return pickle.loads(blob)
            return blob
        except (ValueError, EOFError, pickle.UnpicklingError) as exc:
            raise CorruptError(f"metadata: a blob does not decode as {codec} ({exc})", path=self.folder,
                               field="metadata") from None

    def window(self, start: int, length: int, *, dtype: Any = np.int64) -> np.ndarray:
        """One window (see :meth:`windows`)."""
        return self.windows([start], length, dtype=dtype)[0]

    def document_spans(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, stops)``: global token positions of the documents ``indices`` (``int64``).

        Raises:
            IndexError: an index outside ``[0, num_documents)``.
            ConfigError: non-integer indices.
        """
        self._ready()
        idx = as_positions(indices, "indices")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_documents):
            raise OutOfRangeError(f"a document index is outside [0, {self.num_documents})")
        shard = np.searchsorted(self.cum_documents, idx, side="right") - 1
        if idx.size and shard[0] == shard[-1] and (shard == shard[0]).all():   # one shard: no masks
            k = int(shard[0])
            docs, local = self._shards[k].documents, idx - self.cum_documents[k]
            base = self.cum_tokens[k]
            return base + docs[local].astype(np.int64), base + docs[local + 1].astype(np.int64)
        starts = np.empty(idx.size, dtype=np.int64)
        stops = np.empty(idx.size, dtype=np.int64)
        for k in np.unique(shard).tolist():
            sel = shard == k
            local = idx[sel] - self.cum_documents[k]
            docs = self._shards[k].documents
            base = self.cum_tokens[k]
            starts[sel] = base + docs[local].astype(np.int64)
            stops[sel] = base + docs[local + 1].astype(np.int64)
        return starts, stops

    def document_span(self, i: int) -> tuple[int, int]:
        """``(start, stop)``: global token positions of document ``i``."""
        starts, stops = self.document_spans([i])
        return int(starts[0]), int(stops[0])

    def document(self, i: int, *, dtype: Any = np.int64) -> np.ndarray:
        """The tokens of document ``i`` (a new array)."""
        start, stop = self.document_span(i)
        return self.windows([start], stop - start, dtype=dtype)[0]

    def documents(self, indices: Any, *, pad_to: int | None = None, pad_id: int = 0,
                  dtype: Any = np.int64) -> tuple[np.ndarray, np.ndarray]:
        """Whole documents, in document mode.

        Args:
            indices: document indices (for a shuffle, from an
                ``IndexSampler(GlobalRandomOrder(reader.num_documents), B)``).
            pad_to: ``None`` for flat output; else the row length of a padded batch
                (longer documents are truncated to it).
            pad_id: the id written into padding.
            dtype: ``int64`` or ``int32``.

        Returns:
            Flat: ``(tokens, offsets)``, the documents back to back and ``len + 1``
            ``int64`` offsets (document ``k`` is ``tokens[offsets[k]:offsets[k + 1]]``).
            Padded: ``(tokens, mask)``, ``(len, pad_to)`` ids and a boolean mask of the real
            tokens.

        Raises:
            IndexError: an index outside ``[0, num_documents)``.
        """
        starts, stops = self.document_spans(indices)
        dt = np.dtype(dtype)
        if dt not in (np.int64, np.int32):
            raise ConfigError(f"dtype must be int64 or int32, got {dt}", field="dtype")
        if pad_to is not None:
            width = check_count(pad_to, "pad_to")
            stops = np.minimum(stops, starts + width)
        lengths = stops - starts
        flat = np.empty(int(lengths.sum()), dtype=dt)
        if self._gather is not None and flat.size:
            if self._fd_cache is not None:
                with self._fd_cache.lock:
                    if self._pin(starts, stops):
                        self._gather.gather_ranges(starts, stops, flat)
                    else:
                        self._ranges_piecewise(starts.tolist(), stops.tolist(), flat)
            else:
                self._gather.gather_ranges(starts, stops, flat)
        if pad_to is None:
            return flat, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        out = np.full((starts.size, width), pad_id, dtype=dt)
        mask = np.arange(width)[None, :] < lengths[:, None]
        out[mask] = flat
        return out, mask

    @staticmethod
    def _stride(length: int, stride: int | None) -> tuple[int, int]:
        length = check_count(length, "length", minimum=1)
        step = max(length - 1, 1) if stride is None else check_count(stride, "stride", minimum=1)
        return length, step

    def num_windows(self, length: int, stride: int | None = None) -> int:
        """How many windows of ``length`` tokens start every ``stride`` tokens (default:
        ``length - 1``, so next-token windows of ``seq_len + 1`` share one token)."""
        length, step = self._stride(length, stride)
        return 0 if self.num_tokens < length else (self.num_tokens - length) // step + 1

    def window_starts(self, indices: Any, length: int, stride: int | None = None) -> np.ndarray:
        """Global starts of windows ``indices`` (window ``k`` starts at ``k * stride``), e.g.
        for the indices of an ``IndexSampler(GlobalRandomOrder(reader.num_windows(L)), B)``.

        Raises:
            IndexError: an index outside ``[0, num_windows(length, stride))``.
        """
        length, step = self._stride(length, stride)
        n = self.num_windows(length, step)
        idx = as_positions(indices, "indices")
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise OutOfRangeError(f"a window index is outside [0, {n})")
        return idx * step

    def verify(self, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
        """Check the whole dataset and report every fault found (nothing is raised for them).

        Every chunk of every shard file is hashed and compared with its digest (and the
        digest lists with the manifest, and ``checksums.bin`` with its own checksum), every
        index is checked to increase, and every token id to be below the vocabulary.
        Checked chunks of ``tokens.bin`` are not checked again by later reads.

        Args:
            progress: called as ``progress(bytes_done, bytes_total)`` after each chunk.

        Returns:
            A :class:`VerifyReport`; ``report.ok`` when nothing was found.
        """
        self._ready()
        problems: list[tuple[str, str]] = []
        total = sum(f.size for e in self.manifest.shards for f in e.files.values())
        done = files = 0
        for k, sh in enumerate(self._shards):
            for fname in (*T.data_files(self.manifest.metadata), "checksums.bin"):
                files += 1
                path = os.path.join(sh.path, fname)
                try:
                    bad = sh.check_file(fname)
                except ZerobatchError as exc:
                    problems.append((path, str(exc)))
                    bad = []
                problems.extend((path, msg) for msg in bad)
                done += sh.entry.files[fname].size
                if progress is not None:
                    progress(done, total)
            try:
                sh.verify_indexes()
            except CorruptError as exc:
                problems.append((exc.path or sh.path, str(exc)))
            top = sh.max_token()
            if top >= self.vocab_size:
                problems.append((os.path.join(sh.path, "tokens.bin"),
                                 f"token: id {top} is not below the vocabulary size {self.vocab_size}"))
            if self._gather is not None and self.verify_checksums and not any(p == os.path.join(sh.path, "tokens.bin")
                                                                             for p, _ in problems):
                self._gather.mark_checked(k)
        return VerifyReport(self.folder, len(self._shards), files, done, tuple(problems))

    def verify_indexes(self) -> None:
        """Check every index file in full (large ones are checked only at their ends at open).

        Raises:
            CorruptError: an index that does not increase, naming the file and the entry.
        """
        self._ready()
        for s in self._shards:
            s.verify_indexes()

    def close(self) -> None:
        """Release every file (arrays still viewing a mapping keep it alive)."""
        self._gather = None
        if getattr(self, "_fd_cache", None) is not None:
            self._fd_cache.close()
        for s in getattr(self, "_shards", []):
            s.close()
        self._shards = []
        self.closed = True

    def __enter__(self) -> TokenStreamReader:
        return self

    def __getstate__(self) -> dict[str, Any]:
        # Pickled as its folder and options: each process (spawn / forkserver workers) maps
        # the files itself; the build id makes sure it finds the same dataset.
        return {"folder": self.folder, "backend": self.backend, "num_threads": self.num_threads,
                "verify": self.verify_checksums, "build_id": self.manifest.build_id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"], backend=state["backend"], num_threads=state["num_threads"],
                      verify=state["verify"])
        if self.manifest.build_id != state["build_id"]:
            build = self.manifest.build_id
            self.close()
            raise CorruptError(f"build_id: the dataset is now build {build}, the pickled reader read build "
                               f"{state['build_id']}", path=os.path.join(state["folder"], T.MANIFEST_NAME),
                               field="build_id")

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TokenStreamReader({self.folder!r}, tokens={getattr(self, 'num_tokens', '?')}, "
                f"documents={getattr(self, 'num_documents', '?')}, shards={len(self._shards)})")
