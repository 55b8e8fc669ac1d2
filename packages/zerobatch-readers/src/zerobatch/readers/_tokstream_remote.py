"""A TOKSTREAM dataset at a URL: its shards fetched on first use into the local cache
(:mod:`zerobatch.readers.remote`), their data files as sparse local copies that gain checked
blocks as reads need them.

Opening a remote dataset reads ``manifest.json`` and nothing else (one request, whatever the
number of shards; nothing is listed). A shard costs, the first time a read touches it, one
request per index file (``checksums.bin``, ``documents.index``, ``metadata.index``), made in
parallel and kept in the cache; then each read fetches just the checksum blocks under its
windows that the cache does not hold.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from zerobatch.core.io import AtomicFile, pwrite_all
from zerobatch.core.remote import ObjectStore
from zerobatch.formats import tokstream as T
from zerobatch.formats.errors import CorruptError, IntegrityError, TruncatedError, ZerobatchError
from zerobatch.readers._tokstream_shard import ChunkChecks, Shard, block_digests
from zerobatch.readers.backends import DataFile
from zerobatch.readers.remote import FETCH_TRIES, CacheDir, Fetcher, RemoteBackend, RWLock
from zerobatch.readers.remote import runs as _runs

if TYPE_CHECKING:
    from zerobatch.readers.backends import Backend

__all__ = ["FETCH_TRIES", "RemoteShard", "RemoteShards"]


class RemoteShard(Shard):
    """One shard of a remote dataset, its files in the local cache folder ``path``.

    Args:
        shards: the reader's :class:`RemoteShards` (store, cache, pools).
        entry, manifest, index, backends: as for :class:`Shard`.
    """

    def __init__(self, shards: RemoteShards, entry: T.ShardEntry, manifest: T.DatasetManifest, index: int,
                 backends: dict[str, Backend]) -> None:
        self.remote = shards
        self.key = entry.name
        self.url = shards.store.name(entry.name)
        self._fds: dict[str, int] = {}
        path = shards.cache.folder("tokstream", entry.build_id)
        super().__init__(path, entry, manifest, index, backends, True, path=path)

    # -- opening: the small files whole, the data files as sparse copies ------------------

    def _check_listing(self) -> None:
        """Nothing to list: the manifest names every object of the shard."""

    # The digests are fetched when the shard is first read; the document and metadata indexes
    # only when a read needs them (boundaries, documents, metadata), so that token windows
    # cost one request per shard before their blocks.

    @property
    def documents(self) -> Any:
        if not self._indexes_loaded and not self._closed:
            self.load_indexes()
        return self._documents

    @documents.setter
    def documents(self, value: Any) -> None:
        self._documents = value

    @property
    def metadata_index(self) -> Any:
        if not self._indexes_loaded and not self._closed:
            self.load_indexes()
        return self._metadata_index

    @metadata_index.setter
    def metadata_index(self, value: Any) -> None:
        self._metadata_index = value

    @property
    def indexes_loaded(self) -> bool:
        return self._indexes_loaded

    def _open(self, manifest: T.DatasetManifest) -> None:
        self._manifest = manifest
        self._indexes_loaded, self._closed = False, False
        self._documents = self._metadata_index = None
        self._index_lock = threading.Lock()
        self._fetch_small(("checksums.bin",), refetch=False, data=True)
        try:
            self._open_cached(manifest)
        except (IntegrityError, CorruptError, TruncatedError):
            # a damaged cache entry (a disk fault, a file edited by hand): fetched again once;
            # a second failure is the remote object's and is raised
            self._close_files()
            self._fetch_small(("checksums.bin",), refetch=True, data=True)
            self._open_cached(manifest)

    def _open_cached(self, manifest: T.DatasetManifest) -> None:
        self._open_data(manifest)
        for fname in self.backends:
            self.digests(fname)           # the digest list against the manifest, now

    def load_indexes(self) -> None:
        """Fetch (or find in the cache), map and check the document and metadata indexes."""
        with self._index_lock:
            if self._indexes_loaded:
                return
            names = tuple(f for f in ("documents.index", "metadata.index") if f in self.entry.files)
            self._fetch_small(names, refetch=False)
            try:
                Shard._open_indexes(self, self._manifest)
            except (IntegrityError, CorruptError, TruncatedError):
                self._fetch_small(names, refetch=True)
                Shard._open_indexes(self, self._manifest)
            self._indexes_loaded = True

    def _fetch_small(self, names: tuple[str, ...], *, refetch: bool, data: bool = False) -> None:
        e = self.entry
        todo = [f for f in names if refetch or not self._whole(f)]

        def fetch(fname: str) -> None:
            want = e.files[fname].size + T.TRAILER_SIZE
            data = self.remote.store.get(f"{self.key}/{fname}", limit=want, field=fname)
            if len(data) != want:
                raise TruncatedError(f"{fname}: {len(data)} bytes, the manifest says {want} (payload and trailer)",
                                     path=f"{self.url}/{fname}", field="size")
            with AtomicFile(os.path.join(self.path, fname)) as f:
                f.write(data)
        self.remote.fetcher.run_all([lambda f=f: fetch(f) for f in todo])
        if data:
            for fname in self.backends:
                self._sparse_copy(fname)

    def _whole(self, fname: str) -> bool:
        try:
            return os.stat(os.path.join(self.path, fname)).st_size == self.entry.files[fname].size + T.TRAILER_SIZE
        except OSError:
            return False

    def _sparse_copy(self, fname: str) -> None:
        """Open the sparse local copy of data file ``fname`` (made, under a temporary name then
        renamed, when missing or of the wrong size): its payload's blocks are fetched on
        demand; its trailer is written now (the remote object's bytes are checked by their
        digests, not by their trailer)."""
        path = os.path.join(self.path, fname)
        size = self.entry.files[fname].size
        if self._whole(fname):
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        else:
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.ftruncate(fd, size)
                pwrite_all(fd, T.pack_trailer(self.build_id, T.FILE_KINDS[fname]), size)
                os.replace(tmp, path)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        old = self._fds.pop(fname, None)
        if old is not None:
            os.close(old)
        self._fds[fname] = fd

    def _register(self, fname: str) -> None:
        fd = self._fds[fname]
        f = DataFile(os.path.join(self.path, fname), self.entry.files[fname].size,
                     lambda: os.dup(fd), fname)
        self.backends[fname].set(self.index, f)     # type: ignore[attr-defined]

    # -- blocks ---------------------------------------------------------------------------

    def check_chunk(self, fname: str, c: int, count: int = 1) -> None:
        """Blocks ``[c, c + count)`` of ``fname`` held and checked: those the local copy does
        not hold (their bytes do not match their digests) are fetched, checked and written.

        Raises:
            IntegrityError: a range fetched :data:`FETCH_TRIES` times never matched its
                digests (naming the URL and the byte range).
            ReadError, TruncatedError, NotFoundError: the store failed (after retries).
        """
        fd = self._fds.get(fname)
        if fd is None:                       # an index file: a whole local copy
            super().check_chunk(fname, c, count)
            return
        size, block = self.entry.files[fname].size, self.block
        want = self.digests(fname)[c:c + count]
        a, b = c * block, min((c + count) * block, size)
        have = block_digests(os.pread(fd, b - a, a), block)
        missing = np.flatnonzero(have != want)
        if missing.size:
            self.fetch(fname, (c + missing).tolist())

    def ensure(self, fname: str, blocks: list[int]) -> None:
        """:meth:`check_chunk` for the sorted blocks ``blocks`` of data file ``fname``: the
        local copy read once per run of consecutive blocks, the missing ones fetched at once."""
        fd = self._fds[fname]
        size, block = self.entry.files[fname].size, self.block
        digests = self.digests(fname)
        missing: list[int] = []
        for first, stop in _runs(blocks):
            a, b = first * block, min(stop * block, size)
            have = block_digests(os.pread(fd, b - a, a), block)
            missing += (first + np.flatnonzero(have != digests[first:stop])).tolist()
        if missing:
            self.fetch(fname, missing)

    def fetch(self, fname: str, blocks: list[int]) -> None:
        """Fetch blocks ``blocks`` (sorted) of data file ``fname``: runs of consecutive blocks
        as ranges of one request (obstore merges close ones), each checked against its
        digests and written into the local copy."""
        size, block = self.entry.files[fname].size, self.block
        digests = self.digests(fname)
        runs = _runs(blocks)
        fd = self._fds[fname]
        written = 0
        for _ in range(FETCH_TRIES):
            starts = [r[0] * block for r in runs]
            stops = [min(r[1] * block, size) for r in runs]
            parts = self.remote.store.get_ranges(f"{self.key}/{fname}", starts, stops)
            bad = []
            for run, a, part in zip(runs, starts, parts, strict=True):
                if (block_digests(part, block) == digests[run[0]:run[1]]).all():
                    pwrite_all(fd, part, a)
                    written += len(part)
                else:
                    bad.append(run)
            if not bad:
                break
            runs = bad
        else:
            a, b = runs[0][0] * block, min(runs[0][1] * block, size)
            raise IntegrityError(f"{fname}: bytes [{a}, {b}) did not match their checksums in {FETCH_TRIES} "
                                 f"fetches (the object differs from its dataset's digests)",
                                 path=f"{self.url}/{fname}", field="xxh3")
        self.remote.fetched(written)

    def check_file(self, fname: str) -> list[str]:
        """As :meth:`Shard.check_file`; a data file is fetched whole into the cache first (its
        bytes checked as they arrive)."""
        if fname in self._fds:
            n = T.num_chunks(self.entry.files[fname].size, self.block)
            step = max(1, (64 << 20) // self.block)
            try:
                for c in range(0, n, step):
                    self.check_chunk(fname, c, min(step, n - c))
            except IntegrityError as exc:
                return [exc.message]
            return []
        if fname in ("documents.index", "metadata.index"):
            self.load_indexes()
        return super().check_file(fname)

    def _close_files(self) -> None:
        super().close()
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}

    def close(self) -> None:
        self._closed = True
        self._close_files()

    def unlinked(self) -> bool:
        """Whether another process evicted this shard's copy (its files unlinked)."""
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_nlink == 0:
                    return True
        return False


class RemoteShards:
    """The shards of one remote dataset, each fetched on first use (``shards[k]``), with the
    store, the cache and the pools they share, and the bookkeeping that lets several threads
    fetch at once: blocks claimed by one thread are waited for by the others.

    Args:
        store: the dataset's :class:`~zerobatch.core.remote.ObjectStore`.
        manifest: its manifest.
        backends: the reader's :class:`~zerobatch.readers.remote.RemoteBackend` s.
        checks: the reader's record of checked ``tokens.bin`` blocks.
        cache: the cache folder.
        fetcher: the pools.
    """

    def __init__(self, store: ObjectStore, manifest: T.DatasetManifest, backends: dict[str, RemoteBackend],
                 checks: ChunkChecks, cache: CacheDir, fetcher: Fetcher) -> None:
        self.store, self.manifest, self.backends = store, manifest, backends
        self.checks, self.cache, self.fetcher = checks, cache, fetcher
        self._open: dict[int, RemoteShard] = {}
        self._locks = [threading.Lock() for _ in range(min(len(manifest.shards), 4096))]
        self.lock = RWLock()
        self.inflight: dict[tuple[int, int], threading.Event] = {}
        self._used: set[int] = set()
        self._scan_due = False

    def __len__(self) -> int:
        return len(self.manifest.shards)

    def __getitem__(self, k: int) -> RemoteShard:
        sh = self._open.get(k)
        if sh is not None:
            return sh
        if not 0 <= k < len(self):
            raise IndexError(k)
        with self._locks[k % len(self._locks)]:
            sh = self._open.get(k)
            if sh is None:
                sh = RemoteShard(self, self.manifest.shards[k], self.manifest, k, self.backends)  # type: ignore[arg-type]
                self._open[k] = sh
        return sh

    def __iter__(self) -> Iterator[RemoteShard]:
        for k in range(len(self)):
            yield self[k]

    def opened(self) -> list[RemoteShard]:
        return list(self._open.values())

    def open_all(self, ks: list[int]) -> None:
        """Fetch the shards ``ks`` not fetched yet, in parallel."""
        todo = [k for k in ks if k not in self._open]
        if todo:
            self.fetcher.run_all([lambda k=k: self[k] for k in todo])

    def load_indexes(self, ks: list[int]) -> None:
        """Shards ``ks`` fetched with their document and metadata indexes, in parallel (one
        task per shard: its digests, then its indexes)."""
        todo = [k for k in ks if k not in self._open or not self._open[k].indexes_loaded]
        if todo:
            self.fetcher.run_all([lambda k=k: self[k].load_indexes() for k in todo])

    def fetched(self, nbytes: int) -> None:
        """``nbytes`` written into the cache (from any request thread: the cache counts under
        its lock); the folder is measured at the next :meth:`maybe_evict` when it is time."""
        if self.cache.added(nbytes):
            self._scan_due = True

    def use(self, ks: list[int]) -> None:
        self._used.update(ks)

    # -- eviction ----------------------------------------------------------------------------

    def maybe_evict(self) -> None:
        """Keep the cache folder under its limit (between reads: under the exclusive lock)."""
        if not self._scan_due:
            return
        self._scan_due = False
        with self.lock.exclusive():
            for k in self._used:
                sh = self._open.get(k)
                if sh is not None:
                    self.cache.touch(sh.path)
            self._used.clear()
            for sh in self.opened():
                if sh.unlinked():
                    self.drop(sh.index)
            by_path = {sh.path: sh.index for sh in self.opened()}

            def drop_own(path: str) -> bool:
                k = by_path.get(path)
                if k is None:
                    return False
                self.drop(k)
                return True
            self.cache.evict(lambda path: False, drop_own)

    def drop(self, k: int) -> None:
        """Let shard ``k``'s copy go (under the exclusive lock): descriptors closed, its blocks
        unchecked, its indexes fetched again on next use."""
        sh = self._open.pop(k, None)
        if sh is None:
            return
        for b in self.backends.values():
            b.forget(k)
        sh.close()
        self.checks.reset(k)

    def close(self) -> None:
        for sh in self.opened():
            with contextlib.suppress(ZerobatchError, OSError):
                sh.close()
        self._open = {}
        self.fetcher.close()


def placeholder_documents(num_tokens: int) -> np.ndarray:
    """The documents index the window kernels are given for a shard not fetched yet (never
    read: only the shards a read touches are consulted, and those are fetched first)."""
    return np.array([0, num_tokens], dtype=np.uint64)
