"""Read TOKSTREAM datasets (``docs/formats/tokstream.md``): token windows across shards,
whole documents, validated at open.

:class:`TokenStreamReader` opens ``manifest.json`` and every shard file it names, and refuses
at open, with a typed error naming the file and the field: a missing or extra file, a file
whose size disagrees with the manifest, a file from another build (its trailer's build id),
a document index that does not start at 0, end at the token count or increase, and a
metadata index that does not start at 0 or end at the size of ``metadata.bin``. The data
files are read through a storage backend (:mod:`zerobatch.readers.backends`): mapped with
mappings that hold no descriptor (``"mmap"``: thousands of shards cost no descriptors), or
read with ``pread`` through a bounded cache of descriptors (``"pread"``); windows are gathered
by a compiled kernel with the GIL released, which also refuses token ids at or above the
vocabulary on first use.

Every read goes one way: the backend holds the files open for the kernel (descriptors pinned
for ``pread``), and the kernel gathers, checking in the same GIL-free pass each ``tokens.bin``
block it copies from that no read checked before (:class:`~zerobatch.core.BlockChecks`).

One reader may be shared by threads: results are those of one thread (a block's check is
recorded atomically; pread descriptors stay open until the read that pinned them is done).
It pickles as its folder and options, and works in forked, forkserver and spawned workers.

Checksums (``verify=True``, the default): each shard's ``checksums.bin`` holds the XXH3
digest of every block of its data files (1 KiB by default from format version 2, 16 MiB in
version 1). The index files are checked in full at open (a writer keeps each within 64 MiB); a
block of ``tokens.bin`` or ``metadata.bin`` is checked the first time a read touches it, so a
flipped bit is an :class:`IntegrityError` naming the file and the block, never a wrong token.
:meth:`TokenStreamReader.verify` checks everything.

A dataset at a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``) is read through the
object-storage backend (:mod:`zerobatch.readers.remote`): opening reads the manifest alone,
a shard's indexes are fetched the first time a read touches it, and each read fetches the
checksum blocks under its windows (checked, kept in a bounded local cache) before the same
kernels read them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from zerobatch.core import BlockChecks, WindowGather, flat_layout, xxh3_64
from zerobatch.core.checks import as_positions, check_count
from zerobatch.core.io import read_document
from zerobatch.core.pool import run_io, shared_pool
from zerobatch.core.remote import ObjectStore, is_url, local_path, open_store, redact
from zerobatch.formats import tokstream as T
from zerobatch.formats.errors import (ConfigError, CorruptError, LimitExceededError, NotFoundError, OutOfRangeError,
                                     ZerobatchError)
from zerobatch.readers._tokstream_metadata import MetadataObjects, WindowMetadata, decoder
from zerobatch.readers._tokstream_shard import LocalShards, Shard
from zerobatch.readers._tokstream_remote import RemoteShards
from zerobatch.readers.backends import Backend, open_backend
from zerobatch.readers.remote import DEFAULT_CACHE_LIMIT, DEFAULT_FETCH_THREADS, CacheDir, Fetcher, RemoteBackend, \
    cache_root, launch_shared
from zerobatch.readers.base import FETCHED, MAPPED, Access, BatchReader, OpensOnFirstUse

__all__ = ["LOSS_MASK_DIR", "STREAMS", "TokenStreamReader", "VerifyReport", "WindowMetadata", "open_loss_mask"]

#: The folder of a chat dataset's loss mask (a TOKSTREAM dataset of 0/1 per token, ``convert --chat``).
LOSS_MASK_DIR = T.LOSS_MASK_DIR
#: The streams a dataset may carry beside its tokens (:meth:`TokenStreamReader.stream`).
STREAMS = ("loss_mask",)

#: The files read through the storage backend (the index files and digests are small and
#: mapped at open); with metadata, ``metadata.bin`` gets a quarter of ``max_open_files``.
BACKEND_FILES = ("tokens.bin", "metadata.bin")
METADATA_FILES_SHARE = 4


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



class TokenStreamReader(OpensOnFirstUse, BatchReader):
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
        verify: check checksums: index files in full at open, each checksum block of token
            and metadata data (1 KiB; 16 MiB in version 1 datasets) the first time a read
            touches it (``IntegrityError`` naming the file and the block). ``False`` skips
            them (trusted data, or to measure). Datasets at URLs are always checked.
        max_open_files: pread backend: descriptors kept open at most (least recently used
            closed first); default a quarter of ``RLIMIT_NOFILE``, at most 1024. A batch
            touching more shards than that is read shard piece by shard piece.
        storage_options: a URL's store configuration (credentials, ``endpoint``, ``region``,
            ...: see :mod:`zerobatch.core.remote`); the standard environment is read too.
        cache_dir: a URL's local cache folder (default ``$ZEROBATCH_CACHE_DIR``, else
            ``~/.cache/zerobatch``), shared by the processes of the machine.
        cache_limit: bytes of disk the cache folder is kept under (default 16 GiB).
        fetch_threads: a URL's requests in flight at most (default 32).

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
                 verify: bool = True, max_open_files: int | None = None,
                 storage_options: dict[str, Any] | None = None, cache_dir: str | os.PathLike[str] | None = None,
                 cache_limit: int | None = None, fetch_threads: int | None = None) -> None:
        folder = local_path(folder)
        self._store: ObjectStore | None = None
        self._remote_options = {"storage_options": storage_options, "cache_dir": cache_dir,
                                "cache_limit": cache_limit, "fetch_threads": fetch_threads}
        if is_url(folder):
            self._store = open_store(folder, storage_options)
            # requests within a budget per prefix, shared by the processes of the host
            self._store.limit(cache_root(cache_dir))
            self.folder = self._store.url
            backend = "remote"
        else:
            self.folder = os.path.abspath(os.fspath(folder))
        if not isinstance(verify, bool):
            raise ConfigError(f"verify must be True or False, got {verify!r}", field="verify")
        self.verify_checksums = verify
        if backend not in ("mmap", "pread", "remote") or (backend == "remote" and self._store is None):
            raise ConfigError(f"backend must be 'mmap' or 'pread', got {backend!r}", field="backend")
        self.backend = backend
        self.num_threads = check_count(num_threads, "num_threads", minimum=1, maximum=256)
        self.manifest = m = self._read_manifest()
        self.vocab_size = m.vocab_size
        self.token_dtype = np.dtype(m.token_dtype)
        self.itemsize = T.record_itemsize(m.token_dtype, m.metadata)
        self._decode = decoder(m.codec, self.folder)
        # the shards, whichever storage holds them: the one read path calls the same methods
        # of both (held, fetch, indexed, document_bounds, ahead, close)
        self._shards: LocalShards | RemoteShards = LocalShards()
        self._gather: WindowGather | None = None
        self._backends: dict[str, Backend] = {}
        counts = [e.num_tokens for e in m.shards]
        self.cum_tokens = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self.cum_documents = np.concatenate(
            [[0], np.cumsum([e.num_documents for e in m.shards], dtype=np.int64)]).astype(np.int64)
        self.num_tokens = int(self.cum_tokens[-1])
        self.num_documents = int(self.cum_documents[-1])
        if self._store is not None:
            self._open_remote(self._store, max_open_files)
        else:
            self._open_local(backend, verify, max_open_files)
        self.closed = False         # last: an unpickled reader's other threads wait until here

    def _read_manifest(self) -> T.DatasetManifest:
        """The dataset's manifest, read (or fetched: one request) and parsed, its build id
        checked."""
        if self._store is not None:
            store = self._store
            path = store.name(T.MANIFEST_NAME)

            def fetch() -> bytes:
                try:
                    return store.get(T.MANIFEST_NAME, limit=T.MAX_MANIFEST_BYTES, field="manifest")
                except NotFoundError:
                    raise NotFoundError("manifest.json: not found (not a tokstream dataset, or unfinished)",
                                        path=path, field="manifest") from None
            # the processes of one launch on a host read one fetch of it (and so one version)
            return launch_shared(self._remote_options["cache_dir"], path, fetch, lambda raw: self._parse(raw, path))
        else:
            path = os.path.join(self.folder, T.MANIFEST_NAME)
            try:
                raw = read_document(path, limit=T.MAX_MANIFEST_BYTES, field="manifest")
            except FileNotFoundError:
                raise NotFoundError("manifest.json: not found (not a tokstream dataset, or unfinished)", path=path,
                                    field="manifest") from None
        return self._parse(raw, path)

    @staticmethod
    def _parse(raw: bytes, path: str) -> T.DatasetManifest:
        m = T.parse_manifest(raw, path=path)
        ids, record = T.build_id_material(m.options(), m.shards)
        if f"{xxh3_64(ids):016x}{xxh3_64(record):016x}" != m.build_id:
            raise CorruptError("build_id: the manifest does not hash to its build id (a field was changed after "
                               "assemble)", path=path, field="build_id")
        return m

    def _open_local(self, backend: str, verify: bool, max_open_files: int | None) -> None:
        """Local files: every shard opened and checked now, through ``backend``."""
        m = self.manifest
        options: dict[str, Any] = {}
        if backend == "pread":
            if max_open_files is not None:
                max_open_files = check_count(max_open_files, "max_open_files", minimum=2)
                options["max_open_files"] = max_open_files
        try:
            for fname in BACKEND_FILES[:2 if m.metadata else 1]:
                kw = dict(options)
                if "max_open_files" in kw and m.metadata:
                    share = max(2, kw["max_open_files"] // METADATA_FILES_SHARE)
                    kw["max_open_files"] = share if fname == "metadata.bin" else max(2, kw["max_open_files"] - share)
                self._backends[fname] = open_backend(backend, **kw)
            for k, entry in enumerate(m.shards):
                self._shards.append(Shard(self.folder, entry, m, k, self._backends, verify))
        except BaseException:
            self.close()
            raise
        self._tokens = self._backends["tokens.bin"]
        self._checks = BlockChecks([T.num_chunks(e.files["tokens.bin"].size, m.block) if verify else 0
                                    for e in m.shards], m.block)
        if verify:
            for sh in self._shards:
                sh.give_digests(self._checks)
        if self._shards:
            bases = self._tokens.addresses()
            self._gather = WindowGather(bases, self.cum_tokens, self.itemsize, self.token_dtype.itemsize,
                                        self.vocab_size, [os.path.join(s.path, "tokens.bin") for s in self._shards],
                                        [s.documents for s in self._shards],
                                        [s.metadata_index for s in self._shards] if m.metadata else None,
                                        num_shards=len(self._shards), checks=self._checks if verify else None)

    def _open_remote(self, store: ObjectStore, max_open_files: int | None) -> None:
        """The object-storage backend (see :mod:`zerobatch.readers.remote`): nothing fetched
        but the manifest; every shard on first use."""
        m, opts = self.manifest, self._remote_options
        n = len(m.shards)
        for fname in BACKEND_FILES[:2 if m.metadata else 1]:
            self._backends[fname] = RemoteBackend(n, max_open_files=max_open_files)
        self._tokens = self._backends["tokens.bin"]
        # a remote reader always checks: a block's digest is how it knows its copy holds it
        self._checks = BlockChecks([T.num_chunks(e.files["tokens.bin"].size, m.block) for e in m.shards], m.block)
        limit = DEFAULT_CACHE_LIMIT if opts["cache_limit"] is None else opts["cache_limit"]
        threads = DEFAULT_FETCH_THREADS if opts["fetch_threads"] is None else opts["fetch_threads"]
        self._shards = RemoteShards(store, m, self._backends, self._checks,  # type: ignore[arg-type]
                                    CacheDir(cache_root(opts["cache_dir"]), limit), Fetcher(threads))
        if n:
            self._gather = WindowGather(None, self.cum_tokens, self.itemsize, self.token_dtype.itemsize,
                                        self.vocab_size, [store.name(f"{e.name}/tokens.bin") for e in m.shards],
                                        num_shards=n)

    @property
    def build_id(self) -> str:
        """The dataset's build id (its manifest's): its identity in a loader's state."""
        return self.manifest.build_id

    @property
    def access(self) -> Access:
        """What reaching the dataset's bytes costs (:class:`~zerobatch.readers.base.Access`)."""
        return MAPPED if self._store is None else FETCHED

    @property
    def remote(self) -> bool:
        """Whether the dataset is read from object storage."""
        return self._store is not None

    @property
    def store(self) -> ObjectStore | None:
        """The object store of a dataset at a URL (its request and byte counters), else
        ``None``."""
        return self._store

    def io_counters(self) -> dict[str, float]:
        """What reading has cost so far in this process, for a dataset at a URL (empty for
        a local one): ``requests``, ``bytes_fetched`` (the ranges asked for),
        ``bytes_transferred`` (with the gaps of merged requests), ``retries``, ``throttled_seconds``
        (waits for the request budgets), ``checked_bytes`` (hashed to check blocks and
        pages of digests) and ``cache_hit_bytes`` (found already in the local copy when
        checked). Counters only grow; cheap enough to read every step."""
        store = self._store
        if store is None:
            return {}
        out: dict[str, float] = {"requests": store.requests, "bytes_fetched": store.bytes_fetched,
                                 "bytes_transferred": store.bytes_transferred, "retries": store.retries,
                                 "throttled_seconds": store.throttled_seconds}
        counters = getattr(self._shards, "counters", None)
        if counters is not None:
            out.update(counters())
        return out

    def _gather_for(self, starts: Any, length: int) -> WindowGather:
        """The window kernels ready for windows ``[start, start + length)``: with the indexes
        of every shard the windows touch (those of a dataset at a URL fetched on first use;
        a local dataset's are all mapped at open)."""
        gather = self._ready()
        if self._shards.all_indexed:
            return gather
        st = as_positions(starts, "starts")
        return self._indexed(st, st + check_count(length, "length"))

    def _indexed(self, starts: np.ndarray, stops: np.ndarray) -> WindowGather:
        """:meth:`_gather_for` of the ranges ``[starts, stops)``."""
        touched = self._shards_of(starts, stops).tolist() if starts.size else []
        self._gather = gather = self._shards.indexed(self._ready(), touched, self._make_gather)
        return gather

    def _make_gather(self, documents: list[Any], metadata: list[Any] | None) -> WindowGather:
        """The window kernels again, over these document (and metadata) indexes."""
        m = self.manifest
        return WindowGather(None, self.cum_tokens, self.itemsize, self.token_dtype.itemsize, self.vocab_size,
                            self._ready().paths, documents, metadata, num_shards=len(m.shards))

    def prefetch(self, starts: Any = None, length: int | None = None, stops: Any = None, *,
                 documents: Any = None) -> None:
        """Read-ahead hint: fetch, in the background, the blocks a later read will ask for:
        of the windows ``[start, start + length)``, the ranges ``[start, stop)``, or the
        ``documents`` (their first ``length`` tokens when given). Data read where it lies
        (:attr:`access` not ``fetched``): nothing. Errors are left to that read.

        Args:
            starts, length, stops: windows or ranges, as for :meth:`windows`.
            documents: document indices instead.
        """
        if not self.access.fetched or self._gather is None or self.closed:
            return
        for stream in list(self.__dict__.get("_streams", {}).values()):
            # the streams read with the tokens (a loss mask): their blocks hinted with these,
            # fetched at the same time on their own read-ahead pool (no second round trip)
            stream.prefetch(starts, length, stops, documents=documents)
        shards = self._shards
        if documents is not None:
            docs = as_positions(documents, "documents")
            width = None if length is None else check_count(length, "length")
        else:
            first = as_positions(starts, "starts")
            last = first + check_count(length, "length") if stops is None else as_positions(stops, "stops")

        def run() -> None:
            with contextlib.suppress(ZerobatchError, OSError):
                if documents is not None:
                    a, b = self.document_spans(docs)
                    span = (a, b if width is None else np.minimum(b, a + width))
                else:
                    span = (first, last)
                with shards.held():
                    self._fetch_tokens(*span)
        shards.ahead(run)

    def stream(self, name: str) -> TokenStreamReader:
        """The dataset's named stream read alongside its tokens, one value per token: today
        ``"loss_mask"`` (``convert --chat``; :func:`open_loss_mask` checks it is the one the
        manifest names). Opened once per process and kept: read-ahead hints for the tokens
        cover it too, and :meth:`close` closes it.

        Raises:
            ConfigError: another name.
            NotFoundError / CorruptError: as :func:`open_loss_mask`.
        """
        if name not in STREAMS:
            raise ConfigError(f"stream: one of {STREAMS}, got {name!r}", path=self.folder, field="stream")
        streams = self.__dict__.setdefault("_streams", {})
        with OpensOnFirstUse._reopen_lock:
            if name not in streams:
                streams[name] = open_loss_mask(self)
        return streams[name]

    def _fetch_tokens(self, starts: np.ndarray, stops: np.ndarray,
                      streams: tuple[TokenStreamReader, ...] = ()) -> None:
        """Every ``tokens.bin`` block the ranges touch held where the kernels read it (at a
        URL: fetched into the local copies and checked; locally: there already), and with
        ``streams`` (read in the same kernel call: a loss mask) the streams' blocks under the
        same ranges too, fetched at the same time (each reader with blocks to fetch on a thread
        of its own: one round trip, not one per stream). (Under :meth:`held` of each.)"""
        if not streams:
            self._shards.fetch(self._ready(), starts, stops)
            return
        todo = [r for r in (self, *streams) if r._shards.unfetched(r._ready(), starts, stops)]
        if len(todo) > 1:
            run_io(lambda r: r._shards.fetch(r._ready(), starts, stops), todo, len(todo), "zerobatch-stream-fetch")
        elif todo:
            todo[0]._shards.fetch(todo[0]._ready(), starts, stops)

    def __len__(self) -> int:
        """Tokens in the dataset."""
        return self.num_tokens

    def _check_open(self) -> None:
        if self.closed:
            raise ConfigError("the reader is closed", path=self.folder, field="reader")

    def _ready(self) -> WindowGather:
        self._check_open()
        if self._gather is None:
            raise OutOfRangeError("the dataset holds no tokens", path=self.folder, field="starts")
        return self._gather

    # -----------------------------------------------------------------------------------------
    # the one read path: plan, check the chunks, hold the files, gather

    def _shards_of(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """The shards the ranges ``[starts, stops)`` touch."""
        n = len(self._shards)
        first = np.searchsorted(self.cum_tokens, np.clip(starts, 0, self.num_tokens), side="right") - 1
        last = np.searchsorted(self.cum_tokens, np.clip(np.maximum(stops - 1, starts), 0, self.num_tokens),
                               side="right") - 1
        if starts.size == 0:
            return np.zeros(0, np.int64)
        if (last == first).all():
            touched = np.unique(first)
        else:
            touched = np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first.tolist(), last.tolist(),
                                                                                     strict=True)]))
        return touched[(touched >= 0) & (touched < n)]

    def _label_stream(self, label_mask: str | None, labels: Any) -> TokenStreamReader | None:
        """The stream masking a read's labels (:meth:`stream`), or ``None``."""
        if label_mask is None:
            return None
        if labels is None:
            raise ConfigError("label_mask: it masks labels; pass labels too", path=self.folder, field="labels")
        return self.stream(label_mask)

    def _read(self, starts: np.ndarray, stops: np.ndarray, gather: Callable[..., Any],
              piecewise: Callable[[], Any] | None = None, stream: TokenStreamReader | None = None) -> Any:
        """The one read path: ``gather(fds)`` (``gather(fds, stream_fds)`` with ``stream``, a
        loss mask read in the same kernel call) over the ranges ``[starts, stops)``, with
        every file they touch held for the kernel: the blocks where the kernel reads them
        (at a URL: the missing ones fetched and checked first, both datasets' at once), the
        shards' copies held against eviction, the descriptors pinned (``fds``: a descriptor
        backend's table, else ``None`` for mapped files); ``piecewise()`` instead when they
        touch more files than may be open at once. (The kernel checks the blocks it reads
        that were never checked.)"""
        readers = (self,) if stream is None else (self, stream)
        if all(r._tokens.kernel_access == "address" for r in readers):
            return gather(*(None for _ in readers))       # mapped: nothing to fetch, hold or pin
        with contextlib.ExitStack() as held:
            for r in readers:
                held.enter_context(r._shards.held())
            self._fetch_tokens(starts, stops, readers[1:])
            touched = self._shards_of(starts, stops) if starts.size else ()
            with contextlib.ExitStack() as pins:
                tables = [None if r._tokens.kernel_access == "address" else pins.enter_context(r._tokens.pinned(touched))
                          for r in readers]
                if all(t is not None or r._tokens.kernel_access == "address" for r, t in zip(readers, tables,
                                                                                            strict=True)):
                    return gather(*tables)
            if piecewise is None:
                raise LimitExceededError(f"one read touches more shards than max_open_files allows "
                                         f"({getattr(self._tokens, 'limit', 0)})", path=self.folder,
                                         field="max_open_files")
            return piecewise()

    def _labels_piecewise(self, stream: TokenStreamReader | None, flat: np.ndarray, starts: np.ndarray,
                          stops: np.ndarray, labels: np.ndarray, shift: int, ignore_id: int, *,
                          windows: bool) -> None:
        """The labels of a read whose tokens were read piecewise (more shards than
        descriptors): the one place labels are masked outside the kernels. ``flat``: the
        tokens of the ranges ``[starts, stops)`` back to back; the labels are each range's
        tokens ``[shift, n)``, ``ignore_id`` where ``stream`` is 0 (read piecewise too, at the
        same positions the kernel reads), written as windows' rows (``windows``: ``n - shift``
        per range) or in the tokens' layout (each range's last ``shift`` labels ``ignore_id``)."""
        lens = stops - starts
        want = int((lens - shift).sum()) if windows else flat.size
        if shift not in (0, 1):
            raise ConfigError(f"label_shift must be 0 or 1, got {shift}", field="label_shift")
        if not isinstance(labels, np.ndarray) or labels.dtype != flat.dtype or labels.size != want \
                or not labels.flags.c_contiguous or not labels.flags.writeable:
            raise ConfigError(f"labels must be a writable C-contiguous {flat.dtype} array of {want} elements",
                              field="labels")
        first = np.minimum(starts + shift, stops)
        inner = np.ones(flat.size, bool)            # the labelled tokens: each range's but its first `shift`
        if shift:
            at = (np.cumsum(lens) - lens)[lens > 0]
            inner[at] = False
        values = flat[inner]
        if stream is not None:
            keep = np.empty(values.size, flat.dtype)
            stream._ranges_piecewise(first.tolist(), stops.tolist(), keep)
            values = np.where(keep != 0, values, ignore_id)
        out = labels.reshape(-1)
        if windows or not shift:
            out[:] = values
        else:
            last = np.zeros(flat.size, bool)
            last[(np.cumsum(lens) - 1)[lens > 0]] = True
            out[~last] = values
            out[last] = ignore_id

    def windows(self, starts: Any, length: int, *, out: np.ndarray | None = None, dtype: Any = np.int64,
                labels: np.ndarray | None = None, label_mask: str | None = None, label_shift: int = 1,
                ignore_id: int = -100) -> np.ndarray:
        """Token windows ``[start, start + length)`` at global positions, as rows of ``out``
        (and their labels in the same pass).

        Windows may cross shard boundaries (each becomes several reads); the gather runs in
        ``zerobatch.core`` with the GIL released. For next-token training ask for
        ``seq_len + 1`` tokens and use ``w[:, :-1]`` / ``w[:, 1:]`` (or ``labels``).

        Args:
            starts: integer array-like of global token positions.
            length: tokens per window.
            out: a caller's C-contiguous ``int64`` or ``int32`` buffer of
                ``(len(starts), length)``; else one is allocated with ``dtype``.
            labels: optional C-contiguous output of ``out``'s dtype and
                ``len(starts) * (length - label_shift)`` elements: each window's tokens
                ``[label_shift, length)`` (``w[:, 1:]``, the next-token targets, by default),
                ``ignore_id`` where the ``label_mask`` stream is 0.
            label_mask: the name of the stream (:meth:`stream`: ``"loss_mask"``) masking
                ``labels``, read in the same compiled pass as the tokens (its blocks read for
                the first time checked; at a URL, fetched with the tokens' blocks).
            label_shift: 1 (next-token labels) or 0 (each token's own label).

        Raises:
            OutOfRangeError: a window outside ``[0, num_tokens)``.
            CorruptError: a token id at or above the vocabulary (field ``token``), or a mask
                value above 1 (naming the mask's file).
            IntegrityError: a chunk the windows touch does not match its checksum (the
                tokens' or the mask's, naming the file).
            ConfigError: an unfit ``out`` or ``labels``; a ``label_mask`` without ``labels``.
            NotFoundError: the dataset has no such stream.
        """
        if self.closed:
            self._check_open()
        if type(length) is not int or length < 0:
            length = check_count(length, "length")
        if out is None:
            out = np.empty((int(np.size(starts)), length), dtype=np.dtype(dtype))
            if out.dtype not in (np.int64, np.int32):
                raise ConfigError(f"dtype must be int64 or int32, got {out.dtype}", field="dtype")
        if self._gather is None:
            if np.size(starts):
                raise OutOfRangeError("the dataset holds no tokens", path=self.folder, field="starts")
            return out
        gather = self._gather
        pool = shared_pool(self.num_threads - 1) if self.num_threads > 1 else None
        if labels is None and label_mask is None and self._tokens.kernel_access == "address":
            # mapped files: one compiled call, which also checks the blocks no read checked
            # before (the common path of every batch: kept free of closures and copies)
            return gather.gather(starts, length, out, pool)
        return self._windows_read(starts, length, out, pool, labels, label_mask, label_shift, ignore_id)

    def _windows_read(self, starts: Any, length: int, out: np.ndarray, pool: Any, labels: Any,
                      label_mask: str | None, shift: int, ignore_id: int) -> np.ndarray:
        """:meth:`windows` through the one read path: one compiled call reads the tokens and,
        with ``labels``, the labels' stream, and writes the labels."""
        gather = self._ready()
        stream = self._label_stream(label_mask, labels)
        mask = None if stream is None else stream._ready()
        if self._tokens.kernel_access == "address" and (stream is None or stream._tokens.kernel_access == "address"):
            return gather.gather(starts, length, out, pool, labels=labels, mask=mask, label_shift=shift,
                                 ignore_id=ignore_id)
        starts = as_positions(starts, "starts")

        def piecewise() -> np.ndarray:
            for w, st in enumerate(starts.tolist()):
                self._ranges_piecewise([st], [st + length], out[w].reshape(-1))
            if labels is not None:
                self._labels_piecewise(stream, out.reshape(-1), starts, starts + length, labels, shift, ignore_id,
                                       windows=True)
            return out
        return self._read(starts, starts + length,
                          lambda fds, mfds=None: gather.gather(starts, length, out, pool, fds=fds, labels=labels,
                                                               mask=mask, mask_fds=mfds, label_shift=shift,
                                                               ignore_id=ignore_id), piecewise, stream)

    def read_into(self, items: Any, out: np.ndarray, *, labels: np.ndarray | None = None,
                  label_mask: str | None = None, ignore_id: int = -100) -> np.ndarray:
        """The batch read sources call: the windows starting at the global positions ``items``
        into the rows of ``out`` (``int64`` or ``int32``; the window length is ``out``'s row
        length), with their next-token ``labels`` masked by ``label_mask`` when given; as
        :meth:`windows`."""
        if not isinstance(out, np.ndarray) or out.ndim != 2:
            raise ConfigError("out must be a 2-D int64 or int32 array: one row per window", field="out")
        if labels is None and label_mask is None:
            return self.windows(items, out.shape[1], out=out)
        return self.windows(items, out.shape[1], out=out, labels=labels, label_mask=label_mask, ignore_id=ignore_id)

    def read_async(self, pool: Any, items: Any, out: Any, **options: Any) -> Any:
        """:meth:`read_into` queued on ``pool``: from mapped files, one compiled task (the
        checks of blocks read for the first time, and the labels and their mask, included)
        that holds no GIL from start to finish; otherwise the read as a Python call.
        ``wait()`` returns ``out``.

        Raises:
            ConfigError: an unfit ``out`` (now); the errors of :meth:`windows` (from ``wait()``).
        """
        if self._tokens.kernel_access == "address" and self._gather is not None and not self.closed \
                and isinstance(out, np.ndarray) and out.ndim == 2:
            if not options:
                return self._gather.gather_async(pool, items, out.shape[1], out)
            if set(options) <= {"labels", "label_mask", "ignore_id"}:
                stream = self._label_stream(options.get("label_mask"), options.get("labels"))
                if stream is None or stream._tokens.kernel_access == "address":
                    return self._gather.gather_async(pool, items, out.shape[1], out, labels=options.get("labels"),
                                                     mask=None if stream is None else stream._ready(),
                                                     ignore_id=options.get("ignore_id", -100))
        return super().read_async(pool, items, out, **options)

    def _ranges_piecewise(self, starts: list[int], stops: list[int], flat: np.ndarray) -> None:
        """A read over more shards than descriptors: each range, one shard piece at a time."""
        gather = self._ready()
        at = 0
        for a, b in zip(starts, stops, strict=True):
            if a < 0 or b > self.num_tokens or b < a:
                raise OutOfRangeError(f"range [{a}, {b}) is not within [0, {self.num_tokens})", path=self.folder,
                                      field="starts")
            while a < b:
                k = int(np.searchsorted(self.cum_tokens, a, side="right")) - 1
                e = min(b, int(self.cum_tokens[k + 1]))
                with self._tokens.pinned([k]) as table:
                    gather.gather_ranges([a], [e], flat[at:at + e - a], fds=table)
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
        gather = self._gather_for(starts, length)
        return gather.boundaries(starts, length, position_ids, segment_ids, cu_seqlens,
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
        self._check_open()
        if not self.manifest.metadata:
            raise ConfigError("the dataset has no metadata", path=self.folder, field="metadata")
        length = check_count(length, "length")
        if self._gather is None:
            if np.size(starts):
                raise OutOfRangeError("the dataset holds no tokens", path=self.folder, field="starts")
            empty = np.empty((0, 4), np.int64)
            return WindowMetadata(np.empty((0, length), np.int32),
                                  MetadataObjects(empty, self._shards, None, None), empty[:, :2])
        starts = as_positions(starts, "starts")
        gather = self._gather_for(starts, length)
        ids, table = self._read(starts, starts + length,
                                lambda fds: gather.metadata_ids(starts, length, ids, out, fds=fds),
                                lambda: self._metadata_in_groups(starts, length, ids, out))
        blobs = None if self._backends["metadata.bin"].kernel_access == "address" else self._read_blobs(table)
        return WindowMetadata(ids, MetadataObjects(table, self._shards, blobs, self._decode if decode else None),
                              table[:, :2])

    def _metadata_in_groups(self, starts: np.ndarray, length: int, ids: np.ndarray | None,
                            out: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """A batch over more shards than descriptors: runs of consecutive windows whose shards
        fit are numbered one run at a time, then renumbered over the batch (order of first
        appearance kept)."""
        gather = self._ready()
        limit = getattr(self._tokens, "limit", 0)
        n = starts.size
        res = np.empty((n, length), np.int32) if ids is None else ids
        if out is not None and (not isinstance(out, np.ndarray) or out.shape != (n, length)):
            raise ConfigError(f"out must be a C-contiguous int64 or int32 array of shape ({n}, {length})", field="out")
        numbers: dict[tuple[int, int], int] = {}
        rows: list[list[int]] = []
        a = 0
        while a < n:
            b = a + 1
            if self._shards_of(starts[a:b], starts[a:b] + length).size > limit:
                raise LimitExceededError(f"windows_metadata: one window touches more shards than max_open_files "
                                         f"({limit})", path=self.folder, field="max_open_files")
            while b < n and self._shards_of(starts[a:b + 1], starts[a:b + 1] + length).size <= limit:
                b += 1
            with self._tokens.pinned(self._shards_of(starts[a:b], starts[a:b] + length)) as table:
                part_ids, part = gather.metadata_ids(starts[a:b], length, res[a:b],
                                                     None if out is None else out[a:b], fds=table)
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
        """A descriptor backend: the blobs of ``table``, read now (one read per shard where
        they lie close together; else one per blob), then handed out as slices."""
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
                                segments: bool = True, labels: np.ndarray | None = None,
                                label_mask: str | None = None, label_shift: int = 1,
                                ignore_id: int = -100) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None,
                                                                np.ndarray, int]:
        """:meth:`windows` and :meth:`boundaries` in one compiled pass: each window's
        boundary outputs (and labels) are written right after its tokens, while the next
        windows' loads are in flight (the cheaper way to get both; on the calling thread).

        Args:
            starts, length, out, dtype: as for :meth:`windows` (``seq_len + 1`` tokens for
                next-token pairs).
            boundaries_length: tokens per window the boundaries cover; default
                ``length - 1``, the inputs ``w[:, :-1]`` of next-token pairs.
            position_ids, segment_ids, cu_seqlens, position_dtype, segments: as for
                :meth:`boundaries`, shaped by ``boundaries_length``.
            labels, label_mask, label_shift, ignore_id: as for :meth:`windows`.

        Returns:
            ``(tokens, position_ids, segment_ids, cu_seqlens, max_seqlen)``.

        Raises:
            As :meth:`windows` and :meth:`boundaries`.
        """
        gather = self._ready()
        length = check_count(length, "length", minimum=1)
        if out is None:
            out = np.empty((int(np.size(starts)), length), dtype=np.dtype(dtype))
            if out.dtype not in (np.int64, np.int32):
                raise ConfigError(f"dtype must be int64 or int32, got {out.dtype}", field="dtype")
        starts = as_positions(starts, "starts")
        gather = self._gather_for(starts, length)
        stream = self._label_stream(label_mask, labels)
        mask = None if stream is None else stream._ready()
        extra: dict[str, Any] = {} if labels is None else {"labels": labels, "label_mask": label_mask,
                                                           "label_shift": label_shift, "ignore_id": ignore_id}

        def piecewise() -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray, int]:
            self.windows(starts, length, out=out, **extra)
            bl = length - 1 if boundaries_length is None else boundaries_length
            return (out, *self.boundaries(starts, bl, position_ids=position_ids, segment_ids=segment_ids,
                                          cu_seqlens=cu_seqlens, position_dtype=position_dtype, segments=segments))
        return self._read(starts, starts + length,
                          lambda fds, mfds=None: gather.gather_with_boundaries(
                              starts, length, out, boundaries_length, position_ids, segment_ids, cu_seqlens,
                              position_dtype=position_dtype, segments=segments, fds=fds, labels=labels,
                              mask=mask, mask_fds=mfds, label_shift=label_shift, ignore_id=ignore_id),
                          piecewise, stream)

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

    def window(self, start: int, length: int, *, dtype: Any = np.int64) -> np.ndarray:
        """One window (see :meth:`windows`)."""
        return self.windows([start], length, dtype=dtype)[0]

    def document_spans(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, stops)``: global token positions of the documents ``indices`` (``int64``).

        Raises:
            IndexError: an index outside ``[0, num_documents)``.
            ConfigError: non-integer indices.
        """
        self._check_open()
        if self._shards.all_indexed and self._gather is not None:
            return self._gather.document_spans(indices)     # one compiled pass
        idx = as_positions(indices, "indices")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_documents):
            raise OutOfRangeError(f"a document index is outside [0, {self.num_documents})")
        shard = np.searchsorted(self.cum_documents, idx, side="right") - 1
        # the entries of these documents alone (at a URL: fetched, every shard's in parallel)
        a, b = self._shards.document_bounds(shard, idx - self.cum_documents[shard])
        base = self.cum_tokens[shard]
        return base + a, base + b

    def documents_at(self, positions: Any) -> np.ndarray:
        """The document holding each global token position (``int64``, shaped like
        ``positions``): a binary search of each shard's document index, no token read
        (provenance: which document a window's tokens come from). At a URL the indexes of the
        shards touched are fetched whole, once.

        Raises:
            IndexError: a position outside ``[0, num_tokens)``.
            ConfigError: non-integer positions.
        """
        self._check_open()
        arr = np.asarray(positions)
        pos = as_positions(arr, "positions").reshape(-1)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.num_tokens):
            raise OutOfRangeError(f"a token position is outside [0, {self.num_tokens})", field="positions")
        shard = np.searchsorted(self.cum_tokens, pos, side="right") - 1
        out = np.empty(pos.size, np.int64)
        ks = np.unique(shard).tolist()
        if not isinstance(self._shards, LocalShards):
            self._shards.load_indexes(ks)
        for k in ks:
            sel = shard == k
            docs = self._shards[k].documents if isinstance(self._shards, LocalShards) else \
                self._shards._open[k].documents
            local = (pos[sel] - self.cum_tokens[k]).astype(np.uint64)
            out[sel] = np.searchsorted(docs, local, side="right").astype(np.int64) - 1 + self.cum_documents[k]
        return out.reshape(arr.shape)

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
        flat = self.ranges(starts, stops, dtype=dt)
        if pad_to is None:
            return flat, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        out = np.full((starts.size, width), pad_id, dtype=dt)
        mask = np.arange(width)[None, :] < lengths[:, None]
        out[mask] = flat
        return out, mask

    def ranges(self, starts: Any, stops: Any, *, dtype: Any = np.int64, out: np.ndarray | None = None,
               position_ids: np.ndarray | None = None, labels: np.ndarray | None = None,
               ignore_id: int = -100, label_mask: str | None = None, label_shift: int = 1) -> np.ndarray:
        """The tokens of the ranges ``[starts[i], stops[i])`` back to back (any lengths; a range
        may cross shards), in one compiled gather: exactly these tokens are read (and, at a
        URL, fetched), nothing around them.

        Args:
            starts, stops: integer array-likes of global token positions.
            dtype: ``int64`` or ``int32`` (of a new output).
            out: a caller's C-contiguous 1-D ``int64`` or ``int32`` buffer of exactly
                ``sum(stops - starts)`` elements instead.
            position_ids: optional output of the same size (``int64`` / ``int32``): each token's
                place in its range, written in the same pass.
            labels: optional output of the same size and dtype, written in the same pass: the
                next token of the same range, ``ignore_id`` at each range's last token
                (``label_shift=0``: each token itself, for a caller that lays labels out
                itself, e.g. packing), ``ignore_id`` where the ``label_mask`` stream is 0.
            label_mask: the name of the stream masking ``labels`` (``"loss_mask"``), read in
                the same compiled pass as the tokens (see :meth:`windows`).

        Raises:
            OutOfRangeError: a range outside ``[0, num_tokens)`` or ending before it starts.
            CorruptError, IntegrityError: as :meth:`windows`.
            ConfigError: a ``dtype`` other than ``int64`` / ``int32``, or an unfit output.
        """
        self._check_open()
        a, b, flat = self._ranges_args(starts, stops, dtype, out)
        stream = self._label_stream(label_mask, labels)
        if self._gather is not None and flat.size:
            gather = self._gather
            mask = None if stream is None else stream._ready()

            def piecewise() -> None:
                self._ranges_piecewise(a.tolist(), b.tolist(), flat)
                if position_ids is not None:
                    flat_layout(flat, b - a, position_ids)
                if labels is not None:
                    self._labels_piecewise(stream, flat, a, b, labels, label_shift, ignore_id, windows=False)
            self._read(a, b, lambda fds, mfds=None: gather.gather_ranges(
                a, b, flat, fds=fds, position_ids=position_ids, labels=labels, ignore_id=ignore_id, mask=mask,
                mask_fds=mfds, label_shift=label_shift), piecewise, stream)
        return flat

    def _ranges_args(self, starts: Any, stops: Any, dtype: Any, out: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, b = as_positions(starts, "starts"), as_positions(stops, "stops")
        if a.shape != b.shape:
            raise ConfigError(f"starts and stops differ in length ({a.size} and {b.size})", field="stops")
        if a.size and (a.min() < 0 or (b < a).any() or b.max() > self.num_tokens):
            raise OutOfRangeError(f"a range is outside [0, {self.num_tokens}) or ends before it starts")
        if out is None:
            dt = np.dtype(dtype)
            if dt not in (np.int64, np.int32):
                raise ConfigError(f"dtype must be int64 or int32, got {dt}", field="dtype")
            return a, b, np.empty(int((b - a).sum()), dtype=dt)
        if not isinstance(out, np.ndarray) or out.ndim != 1 or out.dtype not in (np.int64, np.int32) \
                or out.size != int((b - a).sum()):
            raise ConfigError(f"out must be a C-contiguous 1-D int64 or int32 array of {int((b - a).sum())} "
                              f"elements", field="out")
        return a, b, out

    def ranges_async(self, pool: Any, starts: Any, stops: Any, out: np.ndarray, *,
                     position_ids: np.ndarray | None = None, labels: np.ndarray | None = None,
                     ignore_id: int = -100, label_mask: str | None = None, label_shift: int = 1) -> Any:
        """:meth:`ranges` into ``out`` queued on ``pool``: from mapped files, one compiled task
        (the checks of blocks read for the first time, the positions and labels, and the
        labels' stream, included) that holds no GIL from start to finish; otherwise the read
        as a Python call. ``wait()`` returns ``out``.

        Raises:
            OutOfRangeError, ConfigError: now; the errors of the read: from ``wait()``.
        """
        self._check_open()
        a, b, flat = self._ranges_args(starts, stops, None, out)
        stream = self._label_stream(label_mask, labels)
        if self._tokens.kernel_access == "address" and self._gather is not None and \
                (stream is None or stream._tokens.kernel_access == "address"):
            return self._gather.gather_ranges_async(pool, a, b, flat, position_ids=position_ids, labels=labels,
                                                    ignore_id=ignore_id,
                                                    mask=None if stream is None else stream._ready(),
                                                    label_shift=label_shift)
        return pool.call(lambda: self.ranges(a, b, out=flat, position_ids=position_ids, labels=labels,
                                             ignore_id=ignore_id, label_mask=label_mask, label_shift=label_shift))

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
        index is checked to increase, every token id to be below the vocabulary, every
        token's metadata id to be below its shard's metadata count and every metadata blob to
        decode with the dataset's codec: whatever a read would refuse.
        Checked chunks of ``tokens.bin`` are not checked again by later reads.

        Args:
            progress: called as ``progress(bytes_done, bytes_total)`` after each chunk.

        Returns:
            A :class:`VerifyReport`; ``report.ok`` when nothing was found.
        """
        self._check_open()
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
            try:
                problems.extend((os.path.join(sh.path, "metadata.bin"), msg)
                                for msg in sh.verify_metadata(self._decode if self.manifest.metadata else None))
            except ZerobatchError as exc:
                problems.append((exc.path or sh.path, str(exc)))
            top = sh.max_token()
            if top >= self.vocab_size:
                problems.append((os.path.join(sh.path, "tokens.bin"),
                                 f"token: id {top} is not below the vocabulary size {self.vocab_size}"))
            if self.verify_checksums and not any(p == os.path.join(sh.path, "tokens.bin") for p, _ in problems):
                self._checks.mark_shard(k)
        return VerifyReport(self.folder, len(self._shards), files, done, tuple(problems))

    def verify_indexes(self) -> None:
        """Check every index file in full (large ones are checked only at their ends at open).

        Raises:
            CorruptError: an index that does not increase, naming the file and the entry.
        """
        self._check_open()
        for s in self._shards:
            s.verify_indexes()

    def close(self) -> None:
        """Release every file (arrays still viewing a mapping keep it alive)."""
        if self.__dict__.pop("_unpickled", None) is not None:
            return      # unpickled, never opened: nothing to release
        self._gather = None
        for stream in self.__dict__.pop("_streams", {}).values():
            stream.close()
        shards = getattr(self, "_shards", None)
        if shards is not None:
            shards.close()
        self._shards = LocalShards()
        for b in getattr(self, "_backends", {}).values():
            b.close()
        self.closed = True

    def __enter__(self) -> TokenStreamReader:
        return self

    def __getstate__(self) -> dict[str, Any]:
        # Pickled as its folder and options: each process (spawn / forkserver workers) maps
        # the files itself; the build id makes sure it finds the same dataset.
        folder = self._store.root if self._store is not None else self.folder
        return {"folder": folder, "backend": self.backend, "num_threads": self.num_threads,
                "verify": self.verify_checksums, "build_id": self.manifest.build_id,
                "remote": self._remote_options}

    def _unpickled_attributes(self, state: dict[str, Any]) -> dict[str, Any]:
        folder = redact(state["folder"]) if is_url(state["folder"]) else state["folder"]
        # (not ``closed``: a read checks it first, and other threads reading while one opens the
        # reader must wait for the open rather than see attributes the open has not set yet;
        # the open sets ``closed = False`` last)
        return {"folder": folder, "backend": state["backend"], "num_threads": state["num_threads"],
                "verify_checksums": state["verify"]}

    def _reopen(self, state: dict[str, Any]) -> None:
        remote = state.get("remote") or {}
        self.__init__(state["folder"], backend="mmap" if state["backend"] == "remote" else state["backend"],
                      num_threads=state["num_threads"], verify=state["verify"], **remote)
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


def open_loss_mask(reader: TokenStreamReader) -> TokenStreamReader:
    """The loss mask of the chat dataset ``reader`` reads (``<dataset>/loss_mask``: a
    TOKSTREAM dataset of one 0/1 per token, written by ``convert --chat``), checked to be the
    one its manifest names (``loss_mask.build_id``: the mask's own build id, which covers
    every byte of it) and to have the dataset's shards and documents.

    Raises:
        NotFoundError: the dataset has no loss mask (not converted with ``--chat``).
        CorruptError: a mask of another dataset or build; a mask the manifest names that is
            missing; a ``loss_mask/`` folder without a readable mask.
    """
    remote = reader._store is not None
    base = reader._store.root if reader._store is not None else reader.folder
    path = f"{base.rstrip('/')}/{LOSS_MASK_DIR}" if remote else os.path.join(base, LOSS_MASK_DIR)
    # a local mask read through the dataset's backend (pread on a network filesystem, as its tokens)
    options = {k: v for k, v in reader._remote_options.items() if v is not None} if remote else \
        {"backend": reader.backend}
    bound = reader.manifest.loss_mask
    try:
        mask = TokenStreamReader(path, verify=reader.verify_checksums, **options)
    except NotFoundError as exc:
        if exc.path and os.path.basename(exc.path.rstrip("/")) not in (T.MANIFEST_NAME, LOSS_MASK_DIR):
            # the mask's manifest is there but a file it names is not
            raise CorruptError(f"loss_mask: {exc.message} (a damaged mask)", path=exc.path,
                               field="loss_mask") from None
        if bound is not None:
            raise CorruptError(f"loss_mask: the dataset's manifest names a loss mask (build {bound}) but "
                               f"{LOSS_MASK_DIR}/manifest.json is missing (a damaged or deleted mask)", path=path,
                               field="loss_mask") from None
        if not remote and os.path.lexists(path) and (not os.path.isdir(path) or os.listdir(path)):
            raise CorruptError(f"loss_mask: {LOSS_MASK_DIR}/ is there but holds no readable mask (its manifest.json "
                               "is missing): a damaged mask", path=path, field="loss_mask") from None
        raise NotFoundError("loss_mask: the dataset has no loss mask (convert chat data with --chat)", path=path,
                            field="loss_mask") from None
    if bound is not None and mask.manifest.build_id != bound:
        mask.close()
        raise CorruptError(f"loss_mask: its build id {mask.manifest.build_id} is not the {bound} the dataset's "
                           "manifest names (the mask of another dataset or build)", path=path, field="loss_mask")
    theirs = [(s.num_tokens, s.num_documents) for s in mask.manifest.shards]
    ours = [(s.num_tokens, s.num_documents) for s in reader.manifest.shards]
    if theirs != ours:
        mask.close()
        raise CorruptError("loss_mask: its shards and documents differ from the dataset's (a mask of another "
                           "dataset)", path=path, field="loss_mask")
    return mask
