"""One TOKSTREAM shard opened for reading: its files validated, its index arrays mapped, its
chunks checked against their digests (``tokens.bin``'s by the window kernels, through the
reader's :class:`~zerobatch.core.BlockChecks`). The data files' bytes are read through the
reader's storage backend (:mod:`zerobatch.readers.backends`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from zerobatch.core import FileMapping, first_unordered, hash_slots, xxh3_64
from zerobatch.core.io import open_regular_file, pread_exact
from zerobatch.formats import tokstream as T
from zerobatch.formats.errors import (CorruptError, IntegrityError, NotFoundError, ReadError, TruncatedError,
                                     ZerobatchError)
from zerobatch.readers.backends import DataFile

if TYPE_CHECKING:
    from zerobatch.core import BlockChecks, WindowGather
    from zerobatch.readers.backends import Backend

__all__ = ["FULL_INDEX_CHECK_BYTES", "VERIFY_BYTES", "LocalShards", "Shard", "block_digests"]

#: Index files up to this size are validated in full at open (monotonic offsets); larger
#: ones are checked at their ends at open and in full by ``TokenStreamReader.verify``.
FULL_INDEX_CHECK_BYTES = 64 << 20
#: ``verify`` hashes a file in reads of about this many bytes.
VERIFY_BYTES = 16 << 20


def block_digests(data: Any, block: int) -> np.ndarray:
    """The XXH3-64 digest of every ``block`` bytes of ``data`` (the last block may be shorter;
    empty data has one digest, of no bytes), as ``<u8``: whole blocks in one compiled call."""
    view = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    n = len(view)
    whole = n // block
    out = np.empty(whole + (n % block != 0 or n == 0), dtype="<u8")
    if whole:
        hash_slots(view, 0, block, whole, out[:whole])
    if whole < len(out):
        out[whole] = xxh3_64(view[whole * block:])
    return out


class Shard:
    """One shard's files: every file checked at open (listing, sizes, trailers, build ids),
    the index files and the digests mapped; the data files (``tokens.bin``, ``metadata.bin``)
    handed to the reader's backends as :class:`~zerobatch.readers.backends.DataFile` s, where
    this shard's files are number :attr:`index`.

    Args:
        folder: the dataset folder.
        entry: the shard's manifest entry.
        manifest: the dataset's manifest.
        index: the shard's place in the dataset.
        backends: the backend of each data file name (``tokens.bin``, ``metadata.bin``).
        verify: check the index files against their digests at open.
    """

    def __init__(self, folder: str, entry: T.ShardEntry, manifest: T.DatasetManifest, index: int,
                 backends: dict[str, Backend], verify: bool = True, *, path: str | None = None) -> None:
        self.entry = entry
        self.index = index
        self.verify = verify
        self.path = os.path.join(folder, entry.name) if path is None else path
        self.build_id = bytes.fromhex(entry.build_id)
        self.backends = backends
        self._lists_ok: set[str] = set()
        self._meta_ok: np.ndarray | None = None
        self._index_bytes: dict[str, memoryview] = {}
        self._maps: list[FileMapping] = []
        try:
            self._open(manifest)
        except BaseException:
            self.close()
            raise

    # -- opening ------------------------------------------------------------------------------

    def _check_listing(self) -> None:
        try:
            present = set(os.listdir(self.path))
        except FileNotFoundError:
            raise NotFoundError(f"shard {self.entry.name!r}: the folder is missing", path=self.path,
                                field="shards") from None
        except NotADirectoryError:
            raise CorruptError(f"shard {self.entry.name!r}: not a folder", path=self.path, field="shards") from None
        except OSError as exc:
            raise ReadError(f"shard {self.entry.name!r}: the folder cannot be listed: {exc.strerror}", errno=exc.errno,
                            path=self.path, field="shards") from None
        expected = set(self.entry.files) | {T.SHARD_MANIFEST_NAME}
        missing = sorted(set(self.entry.files) - present)
        if missing:
            raise NotFoundError(f"{missing[0]}: missing from shard {self.entry.name!r}",
                                path=os.path.join(self.path, missing[0]), field="files")
        extra = sorted(f for f in present - expected if not f.startswith("."))
        if extra:
            raise CorruptError(f"{extra[0]}: a file the manifest does not list in shard {self.entry.name!r}",
                               path=os.path.join(self.path, extra[0]), field="files")

    def open_checked(self, fname: str) -> int:
        """A descriptor of ``fname`` checked as at open: its size against the manifest, its
        trailer's build id and kind (so a file replaced since is refused). The caller closes it.

        Raises:
            TruncatedError, CorruptError: a file that does not belong to this shard.
        """
        path = os.path.join(self.path, fname)
        fd, st = open_regular_file(path)
        try:
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
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _map_file(self, fname: str) -> memoryview:
        """A checked file's payload, mapped (index files and digests: small, read in full)."""
        fd = self.open_checked(fname)
        try:
            size = self.entry.files[fname].size
            if size == 0:
                return memoryview(b"")
            m = FileMapping(fd, size, os.path.join(self.path, fname))
        finally:
            os.close(fd)
        self._maps.append(m)
        return memoryview(m)

    def _index(self, fname: str, count: int, end: int, end_name: str) -> np.ndarray:
        raw = self._map_file(fname)
        path = os.path.join(self.path, fname)
        self._index_bytes[fname] = raw
        idx = np.frombuffer(raw, dtype="<u8", count=count + 1)
        if idx[0] != 0:
            raise CorruptError(f"{fname}[0]: {int(idx[0])}, expected 0", path=path, field=fname)
        if int(idx[-1]) != end:
            raise CorruptError(f"{fname}[{count}]: {int(idx[-1])}, expected {end_name} {end}", path=path,
                               field=fname)
        if raw.nbytes <= FULL_INDEX_CHECK_BYTES:
            self._check_monotonic(idx, fname, path)
        return idx

    def _open(self, manifest: T.DatasetManifest) -> None:
        self._open_data(manifest)
        self._open_indexes(manifest)

    def _open_data(self, manifest: T.DatasetManifest) -> None:
        """The listing, the digests and the data files (what reading tokens needs)."""
        self._check_listing()
        e = self.entry
        self.dtype = np.dtype(T.record_dtype_descr(manifest.token_dtype, manifest.metadata))
        # the block digests of every data file (checked against the manifest on first use)
        self.block = manifest.block
        self.sums = np.frombuffer(self._map_file("checksums.bin"), dtype="<u8")
        self._ranges = T.chunk_digest_ranges(e.files, manifest.metadata, self.block)
        self.digest_bytes, self.top_bytes = T.digest_sizes(e.files, manifest.metadata, self.block,
                                                           manifest.top_digests)
        for fname in self.backends:
            # checked now; the backend maps it, or keeps the descriptor and opens it again on demand
            self._register(fname)
        if manifest.metadata and self.verify:
            self._meta_ok = np.zeros(T.num_chunks(e.files["metadata.bin"].size, self.block), np.uint8)

    def _open_indexes(self, manifest: T.DatasetManifest) -> None:
        """The document and metadata indexes, mapped and checked."""
        e = self.entry
        self.documents = self._index("documents.index", e.num_documents, e.num_tokens, "num_tokens")
        if self.verify:
            self._check_whole("documents.index")
        self.metadata_index = None
        if manifest.metadata:
            self.metadata_index = self._index("metadata.index", e.num_metadata, e.files["metadata.bin"].size,
                                              "the size of metadata.bin")
            if self.verify:
                self._check_whole("metadata.index")

    def _register(self, fname: str) -> None:
        """Hand data file ``fname`` to its backend, as file number :attr:`index`."""
        f = DataFile(os.path.join(self.path, fname), self.entry.files[fname].size,
                     lambda fname=fname: self.open_checked(fname), fname)
        k = self.backends[fname].add(f, self.open_checked(fname))
        if k != self.index:
            raise CorruptError(f"{fname}: shard {self.index} was numbered {k} by the backend",
                               path=f.path, field="shards")

    def _check_monotonic(self, idx: np.ndarray, fname: str, path: str) -> None:
        # one compiled pass over the mapped entries, no copy (134 M documents in a tenth of a
        # second)
        strict = fname == "documents.index"
        k = first_unordered(idx, strict)
        if k >= 0:
            raise CorruptError(f"{fname}[{k}]: {int(idx[k])} does not {'increase' if strict else 'grow'} "
                               f"from {int(idx[k - 1])}", path=path, field=fname)

    # -- reading ------------------------------------------------------------------------------

    def read(self, fname: str, offset: int, size: int) -> memoryview:
        """Bytes ``[offset, offset + size)`` of data file ``fname`` (through the backend)."""
        return self.backends[fname].read(self.index, offset, size)

    @property
    def records(self) -> np.ndarray | None:
        """``tokens.bin`` as a record array when the backend maps it (``None`` otherwise)."""
        view = getattr(self.backends["tokens.bin"], "view", None)
        if view is None:
            return None
        return np.frombuffer(view(self.index), dtype=self.dtype, count=self.entry.num_tokens)

    def read_records(self, local: int, count: int) -> np.ndarray:
        """Records ``[local, local + count)`` of ``tokens.bin`` (a view, or a fresh read)."""
        isz = self.dtype.itemsize
        return np.frombuffer(self.read("tokens.bin", local * isz, count * isz), dtype=self.dtype)

    def read_blobs(self, ranges: list[tuple[int, int]]) -> list[memoryview]:
        """The ``[start, stop)`` ranges of ``metadata.bin`` (checked ones), read with one
        read spanning them unless that would read over four times their bytes (plus 64 KiB),
        else one read each; returned as slices, without copying."""
        first = min(a for a, _ in ranges)
        last = max(b for _, b in ranges)
        if last - first <= 4 * sum(b - a for a, b in ranges) + (64 << 10):
            data = self.read("metadata.bin", first, last - first)
            return [data[a - first:b - first] for a, b in ranges]
        return [self.read("metadata.bin", a, b - a) for a, b in ranges]

    # -- checksums ----------------------------------------------------------------------------

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

    def chunk(self, fname: str, c: int, count: int = 1) -> Any:
        """The bytes of blocks ``[c, c + count)`` of file ``fname`` (a view of a mapping, or a
        read)."""
        size = self.entry.files[fname].size
        a, b = c * self.block, min((c + count) * self.block, size)
        if fname in self._index_bytes:
            return self._index_bytes[fname][a:b]
        if fname not in self.backends:
            # an index file not yet mapped (the check at open runs before it is)
            return self._map_file(fname)[a:b]
        return self.read(fname, a, b - a)

    def give_digests(self, checks: BlockChecks) -> None:
        """Hand ``tokens.bin``'s block digests (a view of the mapped ``checksums.bin``) and the
        manifest's checksum of them to the reader's record of checked blocks, whose kernels
        check the list before they use it."""
        a, b = self._ranges["tokens.bin"]
        checks.set_digests(self.index, self.sums[a:b], int(self.entry.files["tokens.bin"].xxh3, 16))

    def check_chunk(self, fname: str, c: int, count: int = 1) -> None:
        """Hash blocks ``[c, c + count)`` of ``fname`` (one read, one compiled call) and compare
        them with their digests.

        Raises:
            IntegrityError: naming the file, the first block that differs and its byte range.
        """
        faults = self.bad_blocks(fname, c, count, first_only=True)
        if faults:
            raise IntegrityError(faults[0], path=os.path.join(self.path, fname), field="xxh3")

    def bad_blocks(self, fname: str, c: int, count: int, *, first_only: bool = False) -> list[str]:
        """The messages of the blocks of ``[c, c + count)`` of ``fname`` that differ from their
        digests (naming the block and its byte range)."""
        want = self.digests(fname)[c:c + count]
        got = block_digests(self.chunk(fname, c, count), self.block)
        bad = np.flatnonzero(got != want)
        out = []
        for i in bad[:1].tolist() if first_only else bad.tolist():
            a = (c + i) * self.block
            b = min(a + self.block, self.entry.files[fname].size)
            out.append(f"{fname}: block {c + i} (bytes [{a}, {b})) does not match its checksum "
                       f"({int(got[i]):016x}, expected {int(want[i]):016x})")
        return out

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
            top = block_digests(raw[:self.digest_bytes], self.block)
            got = f"{xxh3_64(top.tobytes()):016x}"
            want = self.entry.files[fname].xxh3
            if got != want:
                return [f"checksums.bin: hashes to {got}, the manifest records {want}"]
            if self.top_bytes and not np.array_equal(self.sums[self.digest_bytes // 8:], top):
                return ["checksums.bin: its top-level digests do not match the digests before them"]
            return []
        self.digests(fname)
        out = []
        n, step = T.num_chunks(size, self.block), max(1, VERIFY_BYTES // self.block)
        for c in range(0, n, step):
            out += self.bad_blocks(fname, c, min(step, n - c))
        return out

    def _check_whole(self, fname: str) -> None:
        self.check_chunk(fname, 0, T.num_chunks(self.entry.files[fname].size, self.block))

    def check_metadata_range(self, a: int, b: int) -> None:
        """Check the ``metadata.bin`` chunks under bytes ``[a, b)`` not checked before."""
        ok = self._meta_ok
        if ok is None or b <= a:
            return
        first, last = a // self.block, (b - 1) // self.block + 1
        if not ok[first:last].all():
            self.check_chunk("metadata.bin", first, last - first)
            ok[first:last] = 1

    def max_token(self) -> int:
        """The largest token id in ``tokens.bin`` (read in blocks of 4 Mi records)."""
        top, n, step = 0, self.entry.num_tokens, 1 << 22
        for a in range(0, n, step):
            rec = self.read_records(a, min(step, n - a))
            tok = rec["token"] if rec.dtype.names else rec
            if tok.size:
                top = max(top, int(tok.max()))
        return top

    def verify_metadata(self, decode: Callable[[memoryview], Any] | None) -> list[str]:
        """What a read of this shard's metadata would refuse: a token's ``metadata_id`` at or
        above the shard's metadata count (other than ``NO_METADATA``), and, with ``decode``,
        blobs that do not decode. Returns the faults found (at most one of each kind)."""
        if self.metadata_index is None:
            return []
        faults = []
        count, n, step = self.entry.num_metadata, self.entry.num_tokens, 1 << 22
        for a in range(0, n, step):
            ids = self.read_records(a, min(step, n - a))["metadata_id"]
            bad = np.flatnonzero((ids >= count) & (ids != T.NO_METADATA))
            if bad.size:
                faults.append(f"metadata_id: token {a + int(bad[0])} names metadata {int(ids[bad[0]])}, the shard "
                              f"has {count}")
                break
        if decode is not None:
            idx = self.metadata_index
            size = self.entry.files["metadata.bin"].size
            for i in range(count):
                a, b = int(idx[i]), int(idx[i + 1])
                if not a <= b <= size:
                    faults.append(f"metadata.index: entry {i} ({a}, {b}) does not fit metadata.bin")
                    break
                try:
                    if b > a:
                        self.check_metadata_range(a, b)
                    decode(self.read("metadata.bin", a, b - a))
                except ZerobatchError as exc:
                    faults.append(f"metadata {i}: {exc.message}")
                    break
        return faults

    def verify_indexes(self) -> None:
        self._check_monotonic(self.documents, "documents.index", os.path.join(self.path, "documents.index"))
        if self.metadata_index is not None:
            self._check_monotonic(self.metadata_index, "metadata.index", os.path.join(self.path, "metadata.index"))

    def close(self) -> None:
        self.documents = None
        self.metadata_index = None
        self._index_bytes = {}
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a caller's array still views it; it is unmapped with the last view
        self._maps.clear()


class LocalShards(list[Shard]):
    """The shards of a dataset in a local (or network) folder, every one opened and checked
    when the reader opens: a local file is a copy that is always whole. The methods the
    reader's one read path calls on its shards, whichever storage holds them (those of
    :class:`~zerobatch.readers._tokstream_remote.RemoteShards` fetch, wait and evict), so
    here there is nothing to hold, fetch or make ready."""

    #: every shard's indexes are in the window kernels from the start
    all_indexed = True

    def held(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to hold: local files are not evicted under a read."""
        return contextlib.nullcontext()

    def unfetched(self, gather: WindowGather, starts: np.ndarray, stops: np.ndarray) -> bool:
        """Whether a block under the ranges is still to be fetched: never, here."""
        return False

    def fetch(self, gather: WindowGather, starts: np.ndarray, stops: np.ndarray) -> None:
        """Nothing to fetch."""

    def indexed(self, gather: WindowGather, touched: Any, make: Callable[..., WindowGather]) -> WindowGather:
        """The kernels with the indexes of the shards ``touched``: as opened."""
        return gather

    def ahead(self, call: Callable[[], Any]) -> None:
        """Nothing is read ahead: the files are where the kernels read them."""

    def document_bounds(self, shard: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, stops)`` in each shard's tokens of the documents ``local`` of shards
        ``shard`` (from the mapped document indexes)."""
        starts, stops = np.empty(local.size, np.int64), np.empty(local.size, np.int64)
        for k in np.unique(shard).tolist():
            sel = shard == k
            docs = self[k].documents
            starts[sel] = docs[local[sel]].astype(np.int64)
            stops[sel] = docs[local[sel] + 1].astype(np.int64)
        return starts, stops

    def close(self) -> None:
        for sh in self:
            sh.close()
        self.clear()
