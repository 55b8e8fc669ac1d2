"""Read flat feature matrices as windows of rows that never cross a key boundary
(``docs/formats/features.md``).

Window ``g`` of the dataset is found by a binary search over the cumulative window counts of
the keys (compiled, O(log K)); a single window is a zero-copy view of the mapped matrix, a
batch of windows one compiled copy into a ``[B, W, features]`` array. Every block of the
matrix is checked against its XXH3-64 the first time a read touches it.

A :class:`FeatureMatrix` pickles as its folder and options and opens lazily, in each process,
on first use: it works in ``torch.utils.data.DataLoader`` workers under ``fork``,
``forkserver`` and ``spawn`` without copying the matrix, and its index is NumPy arrays (no
per-key Python objects for forked workers to copy).
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np

from zerobatch.core import gather_rows, locate_windows, xxh3_64
from zerobatch.core.checks import check_count
from zerobatch.core.io import open_regular_file, pread_exact
from zerobatch.core.remote import is_url, local_path
from zerobatch.formats import features as F
from zerobatch.formats.errors import (ConfigError, CorruptError, IntegrityError, LimitExceededError, ReadError,
                                      TruncatedError)
from zerobatch.readers.base import FETCHED, MAPPED, Access, BatchReader

__all__ = ["FeatureMatrix"]


class FeatureMatrix(BatchReader):
    """Windows of ``window`` rows of a feature-matrix dataset.

    Args:
        folder: the dataset folder, or its URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``,
            ``file://``; ``docs/object-storage.md``).
        window: rows per window (``W``).
        stride: rows between the starts of consecutive windows of a key (default 1).
        horizon: rows after each window handed out as its target (0: none).
        verify: check each block's checksum the first time a read touches it (always, for
            a dataset at a URL).
        storage_options, cache_dir, cache_limit, fetch_threads: a URL's store configuration,
            local cache folder, its byte limit and requests in flight (as for
            :class:`~zerobatch.readers.tokstream.TokenStreamReader`).

    A dataset at a URL costs two requests to open (its metadata and its checksum file); each
    block of the matrix is fetched by exact byte range the first time a read (or
    :meth:`prefetch`) touches it, checked, and kept in a sparse local copy in the cache
    folder.

    Key ``k`` with ``n`` rows has ``max(0, (n - W - horizon) // stride + 1)`` windows; window
    ``j`` of it covers rows ``[start + j*stride, start + j*stride + W)`` and its target the
    next ``horizon`` rows.

    Raises:
        NotFoundError, ReadError: a missing or unreadable file.
        FormatError: bad metadata, data or checksum files (sizes, digest), naming the file
            and field.
    """

    def __init__(self, folder: str | os.PathLike[str], window: int, *, stride: int = 1, horizon: int = 0,
                 verify: bool = True, storage_options: dict[str, Any] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, cache_limit: int | None = None,
                 fetch_threads: int | None = None) -> None:
        folder = local_path(folder)
        self._remote_options: dict[str, Any] | None = None
        if is_url(folder):
            self._url = folder.rstrip("/")
            self._remote_options = {"storage_options": storage_options, "cache_dir": cache_dir,
                                    "cache_limit": cache_limit, "fetch_threads": fetch_threads}
            self.folder = ""
            verify = True
        else:
            self.folder = os.path.abspath(os.fspath(folder))
        self.window = check_count(window, "window", minimum=1)
        self.stride = check_count(stride, "stride", minimum=1)
        self.horizon = check_count(horizon, "horizon")
        self.verify_blocks = bool(verify)
        self._expected_build: str | None = None
        self._open_pid: int | None = None
        self._ensure()

    # -- opening (lazily, once per process) -----------------------------------------------------

    def _open_remote(self) -> None:
        """A dataset at a URL: its metadata and checksums fetched and checked, its matrix a
        sparse local copy in the cache whose blocks are fetched as reads touch them."""
        from zerobatch.readers.remote import RemoteFile, RemoteOptions
        if self._remote_options is None:
            raise ConfigError("the dataset is not read from a URL", path=self.folder, field="path")
        r = RemoteOptions(f"{self._url}/{F.METADATA}", **self._remote_options)
        self.folder = r.store.url
        path = r.url
        raw = r.store.get(F.METADATA, limit=F.MAX_METADATA_BYTES, field="metadata")
        meta = F.parse_metadata(raw, path=path, digest=xxh3_64)
        if self._expected_build is not None and meta.build_id != self._expected_build:
            raise IntegrityError(f"build_id: the dataset was rebuilt since this reader was made (was "
                                 f"{self._expected_build}, now {meta.build_id})", path=path, field="build_id")
        data_name, sums_name = F.data_file_names(meta.build_id)
        sums_path = r.store.name(sums_name)
        want = 8 * meta.num_blocks
        sums_raw = r.store.get(sums_name, limit=want, field="file") if want else b""
        if len(sums_raw) != want:
            raise TruncatedError(f"file: {len(sums_raw)} bytes, the checksums of {meta.num_blocks} blocks need {want}",
                                 path=sums_path, field="file")
        if f"{xxh3_64(sums_raw):016x}" != meta.sums_xxh3:
            raise IntegrityError("sums_xxh3: the checksum file does not match the metadata", path=sums_path,
                                 field="sums_xxh3")
        old = self.__dict__.get("_copy")
        if old is not None:
            old.close()
        self._copy = copy = None
        mm = None
        if meta.data_bytes:
            folder = r.cache.folder("features", meta.build_id)
            copy = RemoteFile(r, data_name, os.path.join(folder, data_name), meta.data_bytes)
            try:
                mm = mmap.mmap(copy.fd, meta.data_bytes, access=mmap.ACCESS_READ)
            except OSError as exc:
                raise ReadError(f"file: cannot map: {exc.strerror}", errno=exc.errno, path=copy.path,
                                field="file") from exc
            sums, block, size = np.frombuffer(sums_raw, "<u8"), meta.block_bytes, meta.data_bytes
            view = memoryview(mm)

            def spans(units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
                return units * block, np.minimum((units + 1) * block, size)

            def check(units: list[int]) -> list[int]:
                return [k for k in units if xxh3_64(view[k * block:min((k + 1) * block, size)]) != int(sums[k])]
            copy.units(meta.num_blocks, spans, check)
            self._copy = copy
        self._opened(meta, r.store.name(data_name), mm, sums_raw)

    def _ensure(self) -> None:
        if self._open_pid == os.getpid():
            return
        if self._remote_options is not None:
            self._open_remote()
            return
        path = os.path.join(self.folder, F.METADATA)
        fd, st = open_regular_file(path)
        try:
            if st.st_size > F.MAX_METADATA_BYTES:
                raise LimitExceededError(f"metadata: {st.st_size} bytes exceeds {F.MAX_METADATA_BYTES}", path=path,
                                         field="metadata")
            raw = pread_exact(fd, st.st_size, 0, path=path, field="metadata")
        finally:
            os.close(fd)
        meta = F.parse_metadata(raw, path=path, digest=xxh3_64)
        if self._expected_build is not None and meta.build_id != self._expected_build:
            raise IntegrityError(f"build_id: the dataset was rebuilt since this reader was made (was "
                                 f"{self._expected_build}, now {meta.build_id})", path=path, field="build_id")
        data_name, sums_name = F.data_file_names(meta.build_id)
        data_path, sums_path = os.path.join(self.folder, data_name), os.path.join(self.folder, sums_name)
        fd, st = open_regular_file(sums_path)
        try:
            want = 8 * meta.num_blocks
            if st.st_size != want:
                raise (TruncatedError if st.st_size < want else CorruptError)(
                    f"file: {st.st_size} bytes, the checksums of {meta.num_blocks} blocks need {want}", path=sums_path,
                    field="file")
            sums_raw = pread_exact(fd, want, 0, path=sums_path, field="file")
        finally:
            os.close(fd)
        if f"{xxh3_64(sums_raw):016x}" != meta.sums_xxh3:
            raise IntegrityError("sums_xxh3: the checksum file does not match the metadata", path=sums_path,
                                 field="sums_xxh3")
        fd, st = open_regular_file(data_path)
        try:
            if st.st_size != meta.data_bytes:
                raise (TruncatedError if st.st_size < meta.data_bytes else CorruptError)(
                    f"file: {st.st_size} bytes, {meta.num_rows} rows of {meta.num_features} {meta.dtype} need "
                    f"{meta.data_bytes}", path=data_path, field="file")
            mm = None
            if meta.data_bytes:
                try:
                    mm = mmap.mmap(fd, meta.data_bytes, access=mmap.ACCESS_READ)
                except OSError as exc:
                    raise ReadError(f"file: cannot map: {exc.strerror}", errno=exc.errno, path=data_path,
                                    field="file") from exc
        finally:
            os.close(fd)
        self._copy = None
        self._opened(meta, data_path, mm, sums_raw)

    def _opened(self, meta: F.FeatureMeta, data_path: str, mm: mmap.mmap | None, sums_raw: bytes) -> None:
        self.meta = meta
        self.data_path = data_path
        self._mm = mm
        self._sums = np.frombuffer(sums_raw, "<u8")
        self._verified = np.zeros(meta.num_blocks, bool)
        buf = mm if mm is not None else b""
        self.matrix = np.frombuffer(buf, meta.np_dtype).reshape(meta.num_rows, meta.num_features)
        self._row_bytes = meta.num_features * meta.itemsize
        self.key_names = np.array([k.key for k in meta.keys]) if meta.keys else np.array([], dtype=str)
        self.key_starts = np.array([k.start for k in meta.keys], np.int64)
        self.key_stops = np.array([k.stop for k in meta.keys], np.int64)
        span = self.window + self.horizon
        lengths = self.key_stops - self.key_starts
        counts = np.where(lengths >= span, (lengths - span) // self.stride + 1, 0)
        self.key_windows = counts.astype(np.int64)
        self._cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._expected_build = meta.build_id
        self._open_pid = os.getpid()

    # -- geometry ---------------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return self.meta.num_rows

    @property
    def num_features(self) -> int:
        return self.meta.num_features

    @property
    def build_id(self) -> str:
        return self.meta.build_id

    @property
    def mean(self) -> np.ndarray | None:
        return None if self.meta.mean is None else np.array(self.meta.mean)

    @property
    def std(self) -> np.ndarray | None:
        return None if self.meta.std is None else np.array(self.meta.std)

    def __len__(self) -> int:
        """Windows in the dataset."""
        self._ensure()
        return int(self._cum[-1])

    def locate(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(key index, first row)`` of each global window index (compiled binary search).

        Raises:
            IndexError: an index outside ``[0, len(self))``.
        """
        self._ensure()
        idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        rows, keys = np.empty(idx.size, np.int64), np.empty(idx.size, np.int64)
        locate_windows(self._cum, self.key_starts, self.stride, idx, rows, keys)
        return keys, rows

    def key_rows(self, key: str) -> np.ndarray:
        """All rows of ``key`` (a read-only view)."""
        self._ensure()
        hits = np.flatnonzero(self.key_names == key)
        if not hits.size:
            raise KeyError(f"no key {key!r}")
        a, b = int(self.key_starts[hits[0]]), int(self.key_stops[hits[0]])
        self._check_rows(a, b)
        return self.matrix[a:b]

    # -- checksums --------------------------------------------------------------------------------

    def _check_rows(self, a: int, b: int) -> None:
        if not self.verify_blocks or b <= a:
            return
        block = self.meta.block_bytes
        first, last = a * self._row_bytes // block, (b * self._row_bytes - 1) // block
        todo = np.flatnonzero(~self._verified[first:last + 1])
        if not todo.size:
            return
        if self._copy is not None:
            self._copy.ensure(todo + first)
        view = memoryview(self._mm)  # type: ignore[arg-type]
        try:
            for k in (todo + first).tolist():
                lo, hi = k * block, min((k + 1) * block, self.meta.data_bytes)
                got = xxh3_64(view[lo:hi])
                if got != int(self._sums[k]):
                    raise IntegrityError(f"block_checksum: block {k} (bytes {lo}..{hi}) does not match its checksum "
                                         f"(stored 0x{int(self._sums[k]):016x}, computed 0x{got:016x})",
                                         path=self.data_path, field="block_checksum")
                self._verified[k] = True
        finally:
            view.release()

    def _check_windows(self, rows: np.ndarray) -> None:
        if not self.verify_blocks or not rows.size:
            return
        span = self.window + self.horizon
        block = self.meta.block_bytes
        firsts = rows * self._row_bytes // block
        lasts = ((rows + span) * self._row_bytes - 1) // block
        if self._verified[firsts].all() and self._verified[lasts].all() and (lasts - firsts <= 1).all():
            return
        if self._copy is not None:                 # every block of the batch in one fetch
            self._copy.ensure(_blocks(firsts, lasts))
        for r in rows.tolist():
            self._check_rows(r, r + span)

    # -- reading ----------------------------------------------------------------------------------

    def window_at(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Window ``i``: ``(x, y)`` read-only views of the matrix (``y`` is ``None`` without a
        horizon)."""
        keys, rows = self.locate([i])
        r = int(rows[0])
        w, h = self.window, self.horizon
        self._check_rows(r, r + w + h)
        return self.matrix[r:r + w], (self.matrix[r + w:r + w + h] if h else None)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        return self.window_at(i)

    def windows(self, indices: Any, *, out: np.ndarray | None = None,
                target_out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Windows at ``indices`` copied into ``[B, W, features]`` (and targets into
        ``[B, horizon, features]``) in one compiled call each."""
        keys, rows = self.locate(indices)
        self._check_windows(rows)
        b, f, dt = rows.size, self.num_features, self.matrix.dtype
        if out is None:
            out = np.empty((b, self.window, f), dt)
        elif out.shape != (b, self.window, f) or out.dtype != dt:
            raise ConfigError(f"out must be {dt} of shape {(b, self.window, f)}", field="out")
        buf = self._mm if self._mm is not None else b""
        gather_rows(buf, self._row_bytes, self.num_rows, rows, self.window, out)
        y = None
        if self.horizon:
            if target_out is None:
                target_out = np.empty((b, self.horizon, f), dt)
            elif target_out.shape != (b, self.horizon, f) or target_out.dtype != dt:
                raise ConfigError(f"target_out must be {dt} of shape {(b, self.horizon, f)}", field="target_out")
            gather_rows(buf, self._row_bytes, self.num_rows, rows + self.window, self.horizon, target_out)
            y = target_out
        return out, y

    @property
    def access(self) -> Access:
        """What reaching the dataset's bytes costs (:class:`~zerobatch.readers.base.Access`)."""
        return MAPPED if self._remote_options is None else FETCHED

    @property
    def remote(self) -> bool:
        """Whether the dataset is read from a URL (object storage)."""
        return self._remote_options is not None

    @property
    def store(self) -> Any:
        """The object store of a dataset at a URL (its request and byte counters), else ``None``."""
        self._ensure()
        return None if self._copy is None else self._copy.remote.store

    def prefetch(self, indices: Any) -> None:
        """Read-ahead hint: a dataset at a URL fetches the blocks of windows ``indices`` in the
        background (errors are left to the read that needs them). Local datasets: nothing."""
        self._ensure()
        if self._copy is None:
            return
        _, rows = self.locate(indices)
        block = self.meta.block_bytes
        self._copy.prefetch(_blocks(rows * self._row_bytes // block,
                                    ((rows + self.window + self.horizon) * self._row_bytes - 1) // block))

    @property
    def row_bytes(self) -> int:
        """Bytes per row of the matrix."""
        return self._row_bytes

    def read_into(self, items: Any, out: np.ndarray, *, target_out: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray | None]:
        """The batch read sources call: :meth:`windows` ``items`` into ``out`` (and the
        targets into ``target_out`` with a horizon)."""
        return self.windows(items, out=out, target_out=target_out)

    def verify(self) -> None:
        """Check every block (raises ``IntegrityError`` naming the first bad one)."""
        self._ensure()
        self._check_rows(0, self.num_rows)

    # -- processes --------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "window": self.window, "stride": self.stride, "horizon": self.horizon,
                "verify": self.verify_blocks, "build": self._expected_build, "remote": self._remote_options,
                "url": self.__dict__.get("_url")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.folder, self.window, self.stride = state["folder"], state["window"], state["stride"]
        self.horizon, self.verify_blocks = state["horizon"], state["verify"]
        self._expected_build = state["build"]
        self._remote_options, self._url = state.get("remote"), state.get("url")
        self._open_pid = None         # opened on first use in this process

    def __getattr__(self, name: str) -> Any:
        # the lazily opened parts of an unpickled reader
        if name in ("meta", "matrix", "data_path", "key_names", "key_starts", "key_stops", "key_windows", "_mm",
                    "_sums", "_verified", "_cum", "_row_bytes", "_copy"):
            self._ensure()
            return self.__dict__[name]
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"FeatureMatrix({self.folder!r}, window={self.window}, stride={self.stride}, horizon={self.horizon})"



def _blocks(firsts: np.ndarray, lasts: np.ndarray) -> np.ndarray:
    """The sorted distinct blocks of the ranges ``[firsts[i], lasts[i]]``."""
    if not firsts.size:
        return np.zeros(0, np.int64)
    counts = (lasts - firsts + 1).astype(np.int64)
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.unique(np.repeat(firsts, counts) + np.arange(int(counts.sum())) - offsets)
