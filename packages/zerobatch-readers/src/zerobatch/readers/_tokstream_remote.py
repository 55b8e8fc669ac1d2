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
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from zerobatch.core import BlockChecks, xxh3_64
from zerobatch.core.io import AtomicFile, pwrite_all
from zerobatch.core.remote import ObjectStore
from zerobatch.formats import tokstream as T
from zerobatch.formats.errors import CorruptError, IntegrityError, TruncatedError, ZerobatchError
from zerobatch.readers._tokstream_shard import Shard, block_digests
from zerobatch.readers.backends import DataFile
from zerobatch.readers.remote import FETCH_TRIES, CacheDir, Fetcher, RemoteBackend, RWLock, fetch_checked
from zerobatch.readers.remote import open_sparse
from zerobatch.readers.remote import runs as _runs

if TYPE_CHECKING:
    from zerobatch.core import WindowGather
    from zerobatch.readers.backends import Backend

__all__ = ["FETCH_TRIES", "RemoteShard", "RemoteShards"]


class RemoteShard(Shard):
    """One shard of a remote dataset, its files in the local cache folder ``path``.

    Args:
        shards: the reader's :class:`RemoteShards` (store, cache, pools).
        entry, manifest, index, backends: as for :class:`Shard`.
    """

    def __init__(self, shards: RemoteShards, entry: T.ShardEntry, manifest: T.DatasetManifest, index: int,
                 backends: dict[str, Backend], want: list[tuple[str, int, int]] | None = None) -> None:
        self.remote = shards
        self.key = entry.name
        self.url = shards.store.name(entry.name)
        self._fds: dict[str, int] = {}
        # blocks ``[first, stop)`` of files a read is about to need: their pages of digests
        # come with the top level, in the same request when they are near it
        self._want = want or []
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
        self._pages_lock = threading.Lock()
        self._pages_cond = threading.Condition(threading.Lock())
        self._pages_claimed: set[int] = set()     # pages a thread is fetching
        e = self.entry
        self.digest_bytes, self.top_bytes = T.digest_sizes(e.files, manifest.metadata, manifest.block,
                                                           manifest.top_digests)
        self._fetch_digests(refetch=False)
        try:
            self._open_cached(manifest)
        except (IntegrityError, CorruptError, TruncatedError):
            # a damaged cache entry (a disk fault, a file edited by hand): fetched again once;
            # a second failure is the remote object's and is raised
            self._close_files()
            self._fetch_digests(refetch=True)
            self._open_cached(manifest)

    def _lock(self, fname: str, ranges: Any) -> Any:
        """Hold byte ranges of object ``fname`` of this shard against the other processes of
        the host (:class:`~zerobatch.readers.remote.HostLocks`): yields whether one held
        them first."""
        return self.remote.cache.locks.hold(self.entry.build_id, _SLOTS[fname], ranges)

    def _fetch_digests(self, *, refetch: bool) -> None:
        """Version 1: ``checksums.bin`` whole. Version 2: its top-level digests only (checked
        against the manifest; ``8 / block`` of the digest list, itself ``8 / block`` of the
        data), written into a sparse copy whose pages of digests are fetched as reads need
        them (:meth:`_digests_of`). One process of the host opens the shard at a time: the
        others find its copy made."""
        with self._lock("open", [(0, 1)]):
            self._fetch_digests_locked(refetch=refetch)

    def _fetch_digests_locked(self, *, refetch: bool) -> None:
        if not self.top_bytes:
            self._fetch_small(("checksums.bin",), refetch=refetch, data=True)
            return
        e, d, t = self.entry, self.digest_bytes, self.top_bytes
        path = os.path.join(self.path, "checksums.bin")
        top = None
        if not refetch and self._whole("checksums.bin"):
            with open(path, "rb") as f:
                f.seek(d)
                local = np.frombuffer(f.read(t), dtype="<u8")
            if local.nbytes == t and f"{xxh3_64(local.tobytes()):016x}" == e.files["checksums.bin"].xxh3:
                top = local
        pages: list[int] = []
        if top is None:
            block = self._manifest.block
            ranges = T.chunk_digest_ranges(e.files, self._manifest.metadata, block)
            for fname, first, stop in self._want:
                a = ranges[fname][0]
                pages += range((a + first) * 8 // block, ((a + stop) * 8 - 1) // block + 1)
            pages = sorted(set(pages))
            runs = _runs(pages)
            starts = [d] + [r[0] * block for r in runs]
            stops = [d + t] + [min(r[1] * block, d) for r in runs]
            parts: list[Any] = [None] * len(starts)
            want = e.files["checksums.bin"].xxh3

            def accept(which: list[int], got: list[Any]) -> list[int]:
                # the top level against the manifest; pages kept, checked against it below
                for i, part in zip(which, got, strict=True):
                    parts[i] = part
                return [0] if 0 in which and f"{xxh3_64(bytes(parts[0])):016x}" != want else []
            fetch_checked(self.remote.store, f"{self.key}/checksums.bin", starts, stops, accept,
                          path=f"{self.url}/checksums.bin", field="checksums.bin.xxh3",
                          against="the manifest's digest of the top-level digests")
            top = np.frombuffer(bytes(parts[0]), "<u8")
            if refetch:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        for fname in (*self.backends, "checksums.bin"):
            self._sparse_copy(fname)
        sums_fd = self._fds.pop("checksums.bin")
        self._sums_fd = sums_fd
        pwrite_all(sums_fd, top.tobytes(), d)
        self._top = top.copy()
        self._page_ok = np.zeros(top.size, bool)
        if pages:                          # the pages fetched with the top level, checked now
            self._accept_pages(runs, starts[1:], parts[1:])

    def _open_cached(self, manifest: T.DatasetManifest) -> None:
        self._open_data(manifest)
        if not self.top_bytes:
            for fname in self.backends:
                self.digests(fname)       # the digest list against the manifest, now

    # -- digests (version 2: by pages, each checked against the top level) -------------------

    def digests(self, fname: str) -> np.ndarray:
        """The whole digest list of ``fname`` (version 2: every page of it fetched and checked)."""
        if not self.top_bytes:
            return super().digests(fname)
        a, b = self._ranges[fname]
        return self._digests_of(fname, 0, b - a)

    def _digests_of(self, fname: str, first: int, stop: int) -> np.ndarray:
        """Digests ``[first, stop)`` of ``fname``'s list, their pages held and checked."""
        if not self.top_bytes:
            return super().digests(fname)[first:stop]
        a, _ = self._ranges[fname]
        block = self.block
        p0, p1 = (a + first) * 8 // block, ((a + stop) * 8 - 1) // block + 1
        if not self._page_ok[p0:p1].all():
            self._fetch_pages(p0, p1)
        return self.sums[a + first:a + stop]

    def _accept_pages(self, runs: list[tuple[int, int]], starts: list[int], parts: list[Any]) -> None:
        """Pages of digests fetched as ``runs``: those matching the top level written into the
        local copy and marked held (the others stay missing)."""
        block = self._manifest.block
        for (r0, _), s0, part in zip(runs, starts, parts, strict=True):
            ok = self.remote.digests(part, block) == self._top[r0:r0 + -(-len(part) // block)]
            if ok.all():
                pwrite_all(self._sums_fd, part, s0)
                self.remote.fetched(len(part))
                self._page_ok[r0:r0 + ok.size] = True

    def _fetch_pages(self, p0: int, p1: int, pages: list[int] | None = None) -> None:
        """Pages ``[p0, p1)`` (or the sorted ``pages``) of the digest list held: those the
        local copy holds (checked against the top level) kept, the others fetched (one
        request) and checked. Threads fetch different pages of a shard at once (a sequential
        read keeps several runs of blocks, each with its own pages, in flight); a page another
        thread is fetching is waited for, not fetched twice."""
        want = [p for p in (range(p0, p1) if pages is None else pages) if not self._page_ok[p]]
        tried: set[int] = set()
        while want:
            with self._pages_cond:
                want = [p for p in want if not self._page_ok[p]]
                mine = [p for p in want if p not in self._pages_claimed and p not in tried]
                if not mine:
                    if not want or all(p in tried for p in want):
                        return          # what is left failed in this thread: the read raises
                    self._pages_cond.wait()
                    continue
                self._pages_claimed.update(mine)
            try:
                tried.update(mine)
                self._fetch_claimed_pages(mine)
            finally:
                with self._pages_cond:
                    self._pages_claimed.difference_update(mine)
                    self._pages_cond.notify_all()

    def _fetch_claimed_pages(self, todo: list[int]) -> None:
        block, d = self.block, self.digest_bytes
        self._pages_held(todo)
        missing = [p for p in todo if not self._page_ok[p]]
        if not missing:
            return
        with self._lock("checksums.bin", [(r0 * block, min(r1 * block, d)) for r0, r1 in _runs(missing)]):
            # read the copy again under the lock: another process may have fetched them (and
            # let go) since they were found missing
            self._pages_held(missing)
            missing = [p for p in missing if not self._page_ok[p]]
            if not missing:
                return
            runs = _runs(missing)
            starts = [r[0] * block for r in runs]
            stops = [min(r[1] * block, d) for r in runs]

            def accept(which: list[int], parts: list[Any]) -> list[int]:
                self._accept_pages([runs[i] for i in which], [starts[i] for i in which], parts)
                return [i for i in which if not self._page_ok[runs[i][0]:runs[i][1]].all()]
            # pages at most one page apart in one request: a page is a block (1 KiB), and
            # pages merged across the store's usual gap (16 KiB, for blocks of tokens) fetched
            # 0.13 bytes of gaps per byte delivered on shuffled 2,049-token windows
            fetch_checked(self.remote.store, f"{self.key}/checksums.bin", starts, stops, accept,
                          path=f"{self.url}/checksums.bin", field="checksums.bin",
                          against="their top-level digests", coalesce=block)

    def _pages_held(self, pages: list[int]) -> None:
        """Mark held the ``pages`` of digests the local copy holds (checked against the top
        level)."""
        block, d, fd = self.block, self.digest_bytes, self._sums_fd
        for r0, r1 in _runs(pages):
            a, b = r0 * block, min(r1 * block, d)
            have = self.remote.digests(os.pread(fd, b - a, a), block)
            for p in range(r0, r1):
                if have[p - r0] == self._top[p]:
                    self._page_ok[p] = True

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
            with self._lock(fname, [(0, want)]) as waited:
                if waited and not refetch and self._whole(fname):
                    return                  # another process of the host fetched it meanwhile
                data = self.remote.store.get(f"{self.key}/{fname}", limit=want, field=fname)
                if len(data) != want:
                    raise TruncatedError(f"{fname}: {len(data)} bytes, the manifest says {want} (payload and "
                                         f"trailer)", path=f"{self.url}/{fname}", field="size")
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
        size = self.entry.files[fname].size
        fd = open_sparse(os.path.join(self.path, fname), size, T.pack_trailer(self.build_id, T.FILE_KINDS[fname]))
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
        want = self._digests_of(fname, c, c + count)
        a, b = c * block, min((c + count) * block, size)
        have = self.remote.digests(os.pread(fd, b - a, a), block, held=want)
        missing = np.flatnonzero(have != want)
        if missing.size:
            self.fetch(fname, (c + missing).tolist())

    def document_bounds(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, stops)``: token offsets in the shard of its documents ``local``. From the
        whole index once it is loaded; before that, from the blocks of ``documents.index``
        under those entries alone, fetched into a sparse copy of their own and each checked
        against its digest (a batch of documents then costs a block of index per document,
        not the shard's whole index).

        Raises:
            CorruptError: an entry out of order or past the shard's tokens.
        """
        if self._indexes_loaded:
            docs = self._documents
            return docs[local].astype(np.int64), docs[local + 1].astype(np.int64)
        fname, block = "documents.index", self.block
        with self._pages_lock:
            fd = self.__dict__.get("_part_fd")
            if fd is None:
                fd = self._part_fd = open_sparse(os.path.join(self.path, f"{fname}.part"),
                                                 self.entry.files[fname].size)
                self._part_ok = np.zeros(T.num_chunks(self.entry.files[fname].size, block), bool)
        first, last = local * 8 // block, (local * 8 + 15) // block
        blocks = np.unique(np.concatenate([first, last]))
        todo = blocks[~self._part_ok[blocks]]
        if todo.size:
            self.ensure(fname, todo.tolist(), fd=fd)
            self._part_ok[todo] = True
        entries = np.empty((local.size, 2), dtype="<u8")
        for i, j in enumerate(local.tolist()):
            entries[i] = np.frombuffer(os.pread(fd, 16, 8 * j), dtype="<u8")
        starts, stops = entries[:, 0].astype(np.int64), entries[:, 1].astype(np.int64)
        bad = np.flatnonzero((starts > stops) | (stops > self.entry.num_tokens))
        if bad.size:
            j = int(local[bad[0]])
            raise CorruptError(f"documents.index[{j}]: document {j} spans [{int(starts[bad[0]])}, "
                               f"{int(stops[bad[0]])}), outside the shard's {self.entry.num_tokens} tokens",
                               path=f"{self.url}/{fname}", field=fname)
        return starts, stops

    def data_fd(self, fname: str) -> int | None:
        """The descriptor of data file ``fname``'s local copy (``None``: not open)."""
        return self._fds.get(fname)

    def fetch_digests(self, fname: str, runs: list[tuple[int, int]]) -> None:
        """The pages of digests of blocks ``runs`` (``(first, stop)``) of data file ``fname``
        held: the missing ones fetched in one request."""
        if not self.top_bytes:
            return                        # version 1: the digests came whole with the shard
        a, block = self._ranges[fname][0], self.block
        pages = sorted({p for r0, r1 in runs for p in range((a + r0) * 8 // block, ((a + r1) * 8 - 1) // block + 1)})
        if not self._page_ok[pages].all():
            self._fetch_pages(0, 0, pages)

    def ensure(self, fname: str, blocks: list[int], *, fd: int | None = None,
               fetched: dict[tuple[int, int], Any] | None = None) -> None:
        """:meth:`check_chunk` for the sorted blocks ``blocks`` of data file ``fname``: the
        local copy read once per run of consecutive blocks, the missing ones fetched at once
        (``fd``: another local copy than the data file's; ``fetched``: runs already fetched,
        by ``(first, stop)``, checked here before any new request)."""
        fd = self._fds[fname] if fd is None else fd
        if fetched:
            block, written = self.block, 0
            for (r0, r1), part in fetched.items():
                if (self.remote.digests(part, block) == self._digests_of(fname, r0, r1)).all():
                    pwrite_all(fd, part, r0 * block)
                    written += len(part)
            self.remote.fetched(written)
        missing = self._missing(fname, blocks, fd)
        if missing:
            self.fetch(fname, missing, fd=fd)

    def fetch(self, fname: str, blocks: list[int], *, fd: int | None = None) -> None:
        """Fetch blocks ``blocks`` (sorted) of data file ``fname``: runs of consecutive blocks
        as ranges of one request (obstore merges close ones), each checked against its
        digests and written into the local copy."""
        size, block = self.entry.files[fname].size, self.block
        fd = self._fds[fname] if fd is None else fd
        with self._lock(fname, [(r0 * block, min(r1 * block, size)) for r0, r1 in _runs(blocks)]):
            # checked again under the lock, waited for or not: another process of the host may
            # have fetched them (and let go) since they were found missing
            blocks = self._missing(fname, blocks, fd)
            if blocks:
                self._fetch_locked(fname, blocks, fd)

    def _missing(self, fname: str, blocks: list[int], fd: int) -> list[int]:
        """The blocks of ``blocks`` (sorted) of ``fname`` the local copy ``fd`` does not hold."""
        size, block = self.entry.files[fname].size, self.block
        missing: list[int] = []
        for first, stop in _runs(blocks):
            a, b = first * block, min(stop * block, size)
            want = self._digests_of(fname, first, stop)
            have = self.remote.digests(os.pread(fd, b - a, a), block, held=want)
            missing += (first + np.flatnonzero(have != want)).tolist()
        return missing

    def _fetch_locked(self, fname: str, blocks: list[int], fd: int) -> None:
        size, block = self.entry.files[fname].size, self.block
        runs = _runs(blocks)
        starts = [r[0] * block for r in runs]
        stops = [min(r[1] * block, size) for r in runs]

        def accept(which: list[int], parts: list[Any]) -> list[int]:
            bad, written = [], 0
            for i, part in zip(which, parts, strict=True):
                r0, r1 = runs[i]
                if (self.remote.digests(part, block) == self._digests_of(fname, r0, r1)).all():
                    pwrite_all(fd, part, starts[i])
                    written += len(part)
                else:
                    bad.append(i)
            self.remote.fetched(written)
            return bad
        fetch_checked(self.remote.store, f"{self.key}/{fname}", starts, stops, accept, path=f"{self.url}/{fname}",
                      field="xxh3")

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
        if fname == "checksums.bin" and self.top_bytes:
            self._digests_of(T.data_files(self._manifest.metadata)[0], 0, self.digest_bytes // 8)
        return super().check_file(fname)

    def _close_files(self) -> None:
        super().close()
        for name in ("_sums_fd", "_part_fd"):
            fd = self.__dict__.pop(name, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
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
                 checks: BlockChecks, cache: CacheDir, fetcher: Fetcher) -> None:
        self.store, self.manifest, self.backends = store, manifest, backends
        self.checks, self.cache, self.fetcher = checks, cache, fetcher
        self._open: dict[int, RemoteShard] = {}
        self._locks = [threading.Lock() for _ in range(min(len(manifest.shards), 4096))]
        self.lock = RWLock()
        self._depth = threading.local()         # reads this thread holds (held() nests)
        self._used: set[int] = set()
        self._scan_due = False
        self._indexed: frozenset[int] | set[int] = frozenset()     # shards whose indexes the kernels have
        # bytes hashed to check them (local copies and fetched parts), bytes found held in the
        # local copies when checked: the loader's metrics
        self._counts = [0, 0]
        self._counts_lock = threading.Lock()

    def digests(self, data: Any, block: int, held: Any = None) -> np.ndarray:
        """``block_digests(data, block)``, counted as checksum work; ``held``: the digests the
        local copy must match (the bytes that do are counted as found in the cache)."""
        out = block_digests(data, block)
        found = 0
        if held is not None:
            found = min(len(data), int(np.count_nonzero(out == held)) * block)
        with self._counts_lock:
            self._counts[0] += len(data)
            self._counts[1] += found
        return out

    def counters(self) -> dict[str, int]:
        """``{"checked_bytes", "cache_hit_bytes"}`` so far (see :meth:`digests`)."""
        with self._counts_lock:
            return {"checked_bytes": self._counts[0], "cache_hit_bytes": self._counts[1]}

    # -- the read path's calls (as LocalShards') ---------------------------------------------

    @property
    def all_indexed(self) -> bool:
        """Whether the window kernels have every shard's indexes."""
        return len(self._indexed) == len(self)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A read's hold on the local copies: shared with other reads, never with eviction,
        which runs when the outermost hold of the thread ends (a read made inside another,
        as a piecewise read is, neither waits for itself nor evicts under it)."""
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        try:
            if depth:
                yield
            else:
                with self.lock.shared():
                    yield
        finally:
            self._depth.n = depth
            if not depth:
                self.maybe_evict()

    def unfetched(self, gather: WindowGather, starts: np.ndarray, stops: np.ndarray) -> bool:
        """Whether a ``tokens.bin`` block under the ranges was never checked here (not held
        in the local copies yet)."""
        return bool(len(gather.unchecked_chunks(starts, None, stops, self.checks.addresses, self.manifest.block,
                                                cap=1)))

    def fetch(self, gather: WindowGather, starts: np.ndarray, stops: np.ndarray) -> None:
        """Every ``tokens.bin`` block the ranges touch held in the local copies, checked
        (under :meth:`held`). The blocks no read checked are listed, claimed and marked in
        compiled calls (no Python per block); blocks another thread claimed are waited for,
        not fetched twice; runs of blocks of different shards are fetched in parallel."""
        checks, block = self.checks, self.manifest.block
        while True:
            with checks.lock:
                todo = gather.unchecked_chunks(starts, None, stops, checks.addresses, block, cap=1 << 16)
                if not len(todo):
                    return
                mine = todo[checks.claim(todo)]
                if not len(mine):
                    checks.lock.wait()          # other threads fetch them: woken when they are done
                    continue
            try:
                mine = mine[np.lexsort((mine[:, 1], mine[:, 0]))]
                cut = np.flatnonzero(np.diff(mine[:, 0])) + 1
                self.fetch_blocks({int(part[0, 0]): part[:, 1].tolist() for part in np.split(mine, cut)})
                with checks.lock:
                    checks.mark_pairs(mine)
            finally:
                with checks.lock:
                    checks.release(mine)
                    checks.lock.notify_all()

    def ahead(self, call: Callable[[], Any]) -> Any:
        """``call()`` on the read-ahead pool (a hint: its errors are left to the read)."""
        return self.fetcher.ahead(call)

    def indexed(self, gather: WindowGather, touched: Any,
                make: Callable[[list[Any], list[Any] | None], WindowGather]) -> WindowGather:
        """The window kernels with the indexes of every shard in ``touched`` (fetched now when
        not yet, in parallel; the kernels are made again, ``make(documents, metadata)``, when
        a shard was added)."""
        need = [k for k in touched if k not in self._indexed]
        if not need:
            return gather
        self.load_indexes(need)
        loaded = {sh.index: sh for sh in self.opened() if sh.indexes_loaded}
        m = self.manifest
        docs = [loaded[k].documents if k in loaded else placeholder_documents(e.num_tokens)
                for k, e in enumerate(m.shards)]
        meta = None
        if m.metadata:
            meta = [loaded[k].metadata_index if k in loaded else np.zeros(1, np.uint64) for k in range(len(m.shards))]
        gather = make(docs, meta)
        self._indexed = self._indexed | set(loaded)
        return gather

    def __len__(self) -> int:
        return len(self.manifest.shards)

    def __getitem__(self, k: int) -> RemoteShard:
        return self.get(k)

    def get(self, k: int, want: list[tuple[str, int, int]] | None = None) -> RemoteShard:
        """Shard ``k``, fetched now if not yet (``want``: as for :meth:`open_all`)."""
        sh = self._open.get(k)
        if sh is not None:
            return sh
        if not 0 <= k < len(self):
            raise IndexError(k)
        with self._locks[k % len(self._locks)]:
            sh = self._open.get(k)
            if sh is None:
                sh = RemoteShard(self, self.manifest.shards[k], self.manifest, k, self.backends,  # type: ignore[arg-type]
                                 want)
                self._open[k] = sh
        return sh

    def __iter__(self) -> Iterator[RemoteShard]:
        for k in range(len(self)):
            yield self[k]

    def opened(self) -> list[RemoteShard]:
        return list(self._open.values())

    def open_all(self, ks: list[int], want: dict[int, list[tuple[str, int, int]]] | None = None) -> None:
        """Fetch the shards ``ks`` not fetched yet, in parallel; ``want[k]``: the blocks
        ``(file, first, stop)`` of shard ``k`` a read is about to need (their digests come in
        the shard's first request)."""
        todo = [k for k in ks if k not in self._open]
        if todo:
            want = want or {}
            self.fetcher.run_all([lambda k=k: self.get(k, want.get(k)) for k in todo])

    def fetch_blocks(self, by_shard: dict[int, list[int]], fname: str = "tokens.bin") -> None:
        """Blocks ``by_shard[k]`` (sorted) of data file ``fname`` of shards ``k`` held and
        checked in the local copies. What can be known missing without the digests (a shard
        with no local copy yet, runs that are holes in its copy) is fetched *at the same time*
        as the shards' top-level digests and pages of digests, all in one round of requests,
        and checked once both are in: a shard touched for the first time costs one round
        trip, not two (not three when its next blocks need a new page of digests)."""
        want = {k: [(fname, r0, r1) for r0, r1 in _runs(bl)] for k, bl in by_shard.items()}
        fresh = {k: bl for k, bl in by_shard.items() if self._missing_for_sure(k, fname, bl)}
        # fetched before the digests only while no other process of the host fetches them,
        # and held until they are checked into the copy; a busy one is left to the checked
        # path, which waits for the other process and reads its copy. The held ones are
        # checked in first and let go before any other shard's blocks are waited for: a
        # process never waits on another while holding what that one may wait for.
        releases = {}
        for k in list(fresh):
            size, block = self.manifest.shards[k].files[fname].size, self.manifest.block
            release = self.cache.locks.try_hold(self.manifest.shards[k].build_id, _SLOTS[fname],
                                                [(a * block, min(b * block, size)) for a, b in _runs(fresh[k])])
            if release is None:
                del fresh[k]
            elif not self._missing_for_sure(k, fname, fresh[k]):
                # another process fetched them between the look and the lock, and let go:
                # the checked path reads its copy
                release()
                del fresh[k]
            else:
                releases[k] = release
        got: dict[int, dict[tuple[int, int], Any]] = {}

        def opened(k: int) -> None:
            # the shard's top level (with the pages near it), then any other page the blocks need
            self.get(k, want[k]).fetch_digests(fname, _runs(by_shard[k]))

        def raw(k: int) -> None:
            entry, block = self.manifest.shards[k], self.manifest.block
            size = entry.files[fname].size
            runs = _runs(fresh[k])
            parts = self.store.get_ranges(f"{entry.name}/{fname}", [a * block for a, _ in runs],
                                          [min(b * block, size) for _, b in runs])
            got[k] = dict(zip(runs, parts, strict=True))
        try:
            self.fetcher.run_all([lambda k=k: opened(k) for k in by_shard] + [lambda k=k: raw(k) for k in fresh])
            self.use(list(by_shard))
            self.fetcher.run_all([lambda k=k: self[k].ensure(fname, by_shard[k], fetched=got.get(k)) for k in fresh])
        finally:
            for release in releases.values():
                release()
        self.fetcher.run_all([lambda k=k, bl=bl: self[k].ensure(fname, bl) for k, bl in by_shard.items()
                              if k not in fresh])

    def _missing_for_sure(self, k: int, fname: str, blocks: list[int]) -> bool:
        """Whether none of ``blocks`` of shard ``k``'s ``fname`` can be in the cache: the shard
        has no local copy, or every run of them is a hole in it (never written)."""
        sh = self._open.get(k)
        if sh is None:
            entry = self.manifest.shards[k]
            return not os.path.lexists(os.path.join(self.cache.root, "tokstream", entry.build_id, fname))
        fd = sh.data_fd(fname)
        if fd is None:
            return False
        block = self.manifest.block
        for r0, r1 in _runs(blocks):
            try:
                if os.lseek(fd, r0 * block, os.SEEK_DATA) < r1 * block:
                    return False
            except OSError:               # ENXIO: no data after the offset (a hole to the end)
                continue
        return True

    def load_indexes(self, ks: list[int]) -> None:
        """Shards ``ks`` fetched with their document and metadata indexes, in parallel (one
        task per shard: its digests, then its indexes)."""
        todo = [k for k in ks if k not in self._open or not self._open[k].indexes_loaded]
        if todo:
            self.fetcher.run_all([lambda k=k: self.get(k, self._index_blocks(k)).load_indexes() for k in todo])

    def document_bounds(self, shard: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, stops)`` in each shard's tokens of the documents ``local`` of shards
        ``shard``, every shard's entries fetched in parallel (:meth:`RemoteShard.document_bounds`)."""
        starts, stops = np.empty(local.size, np.int64), np.empty(local.size, np.int64)
        ks = np.unique(shard).tolist()
        block = self.manifest.block

        def one(k: int) -> None:
            sel = shard == k
            mine = local[sel]
            want = [("documents.index", int(b), int(b) + 1) for b in np.unique(np.concatenate(
                [mine * 8 // block, (mine * 8 + 15) // block]))]
            starts[sel], stops[sel] = self.get(k, want).document_bounds(mine)
        self.fetcher.run_all([lambda k=k: one(k) for k in ks])
        return starts, stops

    def _index_blocks(self, k: int) -> list[tuple[str, int, int]]:
        """Every block of shard ``k``'s index files (their digests fetched with the shard's)."""
        e, block = self.manifest.shards[k], self.manifest.block
        return [(f, 0, T.num_chunks(e.files[f].size, block)) for f in ("documents.index", "metadata.index")
                if f in e.files]

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


#: Each object of a shard's lock file (:meth:`RemoteShard._lock`); ``open``: the shard's opening.
_SLOTS = {"tokens.bin": 0, "metadata.bin": 1, "checksums.bin": 2, "documents.index": 3, "metadata.index": 4,
          "open": 5}


def placeholder_documents(num_tokens: int) -> np.ndarray:
    """The documents index the window kernels are given for a shard not fetched yet (never
    read: only the shards a read touches are consulted, and those are fetched first)."""
    return np.array([0, num_tokens], dtype=np.uint64)
