"""Write flat feature matrices in two passes over sources too large for memory
(``docs/formats/features.md``).

Pass one streams every source once and computes, per feature, the exact mean and variance
(Chan's parallel update of count, mean and sum of squared deviations, in float64) and counts
the rows of every key. Pass two preallocates the matrix file and writes each source,
normalized, at its own row offset. The data files are written under temporary names, synced
and renamed; ``metadata.json`` is written last, atomically: it is the commit point, so a
reader sees the previous build or the new one, never a mix.

A source is a 2-D array (a ``np.memmap`` too: it is read a chunk of rows at a time), the
path of a Parquet file (read in record batches with pyarrow; numeric columns, all or the
ones named), or a callable returning an iterable of 2-D chunks (called once per pass).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from zerobatch.core import xxh3_64
from zerobatch.core.io import AtomicFile, make_folder, sweep_orphans
from zerobatch.formats import features as F
from zerobatch.formats.errors import ConfigError

__all__ = ["write_feature_matrix"]

_STALE = re.compile(r"^features-[0-9a-f]{16}\.(bin|sums)$")


def _chunks(source: Any, key: str, chunk_rows: int, columns: Sequence[str] | None) -> Iterator[np.ndarray]:
    if isinstance(source, np.ndarray):
        if source.ndim != 2:
            raise ConfigError(f"{key}: expected a 2-D [rows, features] array, got shape {source.shape}",
                              field="sources")
        if source.shape[0] == 0:
            yield np.asarray(source)           # no rows, but its feature count
        for at in range(0, source.shape[0], chunk_rows):
            yield np.asarray(source[at:at + chunk_rows])
        return
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not path.endswith(".parquet"):
            raise ConfigError(f"{key}: a path source must be a .parquet file, got {path!r}", field="sources")
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ConfigError("Parquet sources need pyarrow: pip install 'zerobatch-writers[parquet]'",
                              field="sources") from exc
        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=chunk_rows, columns=list(columns) if columns else None):
            cols = [batch.column(i).to_numpy(zero_copy_only=False) for i in range(batch.num_columns)]
            if any(c.dtype.kind not in "biuf" for c in cols):
                raise ConfigError(f"{key}: every Parquet column must be numeric", path=path, field="columns")
            yield np.column_stack(cols).astype(np.float64, copy=False) if cols else np.empty((batch.num_rows, 0))
        return
    if callable(source):
        for c in source():
            yield np.asarray(c)
        return
    raise ConfigError(f"{key}: a source is a 2-D array, a .parquet path or a callable returning 2-D chunks, "
                      f"got {type(source).__name__}", field="sources")


def _checked(chunk: np.ndarray, key: str, row: int, features: int | None) -> np.ndarray:
    if chunk.ndim != 2:
        raise ConfigError(f"{key}: chunks must be 2-D, got shape {chunk.shape}", field="sources")
    if chunk.dtype.kind not in "biuf":
        raise ConfigError(f"{key}: features must be numeric, got {chunk.dtype}", field="sources")
    if features is not None and chunk.shape[1] != features:
        raise ConfigError(f"{key}: {chunk.shape[1]} features at row {row}, the other sources have {features}",
                          field="sources")
    x = chunk.astype(np.float64, copy=False)
    bad = ~np.isfinite(x)
    if bad.any():
        r = int(np.argwhere(bad)[0][0])
        raise ConfigError(f"{key}: row {row + r} holds a NaN or infinite value", field="sources")
    return x


def write_feature_matrix(folder: str | os.PathLike[str], sources: Mapping[str, Any] | Sequence[tuple[str, Any]], *,
                         dtype: str = "float32", normalize: bool = True, columns: Sequence[str] | None = None,
                         chunk_rows: int = 65536, block_bytes: int = F.BLOCK_BYTES,
                         progress: Callable[[str, str, int], None] | None = None) -> F.FeatureMeta:
    """Build a feature-matrix dataset in ``folder`` from ``sources`` (key -> source, in order).

    Args:
        dtype: ``float32`` (default), ``float16`` or ``float64`` on disk.
        normalize: write ``(x - mean) / std`` per feature (population statistics over every
            source; a constant feature keeps ``std = 1``) and record the statistics.
        columns: the Parquet columns to read (default: all), also the column names recorded.
        chunk_rows: rows read and written at a time (bounds memory).
        progress: called as ``progress(pass_name, key, rows_done)``.

    Returns:
        The metadata written.

    Raises:
        ConfigError: a bad source (shape, type, NaN or infinity, a feature count that differs,
            rows that changed between the passes) or argument. WriteError: an I/O error (the
            previous build stays readable).
    """
    if dtype not in F.DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(F.DTYPES)}, got {dtype!r}", field="dtype")
    items = list(sources.items()) if isinstance(sources, Mapping) else list(sources)
    names = [k for k, _ in items]
    if not items or len(set(names)) != len(names) or not all(isinstance(k, str) and k for k in names):
        raise ConfigError("sources: give at least one source, under unique non-empty string keys", field="sources")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ConfigError(f"chunk_rows must be a positive integer, got {chunk_rows!r}", field="chunk_rows")
    folder = make_folder(folder)
    sweep_orphans(folder)      # what a killed build left (its temporaries carry a build id no run reuses)

    features, counts, mean, std = _statistics(items, chunk_rows, columns, progress)
    np_dtype, itemsize = F.DTYPES[dtype]
    row_bytes = features * itemsize
    build_id = secrets.token_hex(8)
    data_name, sums_name = F.data_file_names(build_id)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    total_rows = int(starts[-1])
    data_bytes = total_rows * row_bytes

    data = AtomicFile(os.path.join(folder, data_name))
    try:
        data.truncate(data_bytes)
        for k, (key, source) in enumerate(items):
            rows = _chunks(source, key, chunk_rows, columns)
            _write_rows(data, key, rows, int(starts[k]), counts[k], features, row_bytes, np_dtype,
                        (mean, std) if normalize else None, progress)
        sums = _block_sums(data, data_bytes, block_bytes)
        sums_file = AtomicFile(os.path.join(folder, sums_name))
        try:
            sums_file.write(sums)
            data.commit()
            sums_file.commit()
        except BaseException:
            sums_file.abort()
            raise
    except BaseException:
        data.abort()
        raise
    meta = F.FeatureMeta(
        dtype=dtype, num_rows=total_rows, num_features=features, build_id=build_id, block_bytes=block_bytes,
        sums_xxh3=f"{xxh3_64(sums):016x}",
        keys=tuple(F.KeyRange(key, int(starts[k]), int(starts[k + 1])) for k, (key, _) in enumerate(items)),
        mean=tuple(float(v) for v in mean) if normalize else None,
        std=tuple(float(v) for v in std) if normalize else None,
        columns=tuple(columns) if columns is not None else None)
    with AtomicFile(os.path.join(folder, F.METADATA)) as f:
        f.write(json.dumps(meta.to_json(xxh3_64), allow_nan=False).encode())
    for entry in os.listdir(folder):         # the previous builds' data (mapped readers keep their pages)
        if _STALE.match(entry) and entry not in (data_name, sums_name):
            try:
                os.unlink(os.path.join(folder, entry))
            except OSError:
                pass
    return meta


def _statistics(items: list[tuple[str, Any]], chunk_rows: int, columns: Sequence[str] | None,
                progress: Callable[[str, str, int], None] | None
                ) -> tuple[int, list[int], np.ndarray, np.ndarray]:
    """Pass one: ``(features, rows per source, mean, std)`` over every source, exact
    streaming (Chan et al.) population statistics; a constant feature gets ``std = 1``."""
    features: int | None = None
    n_total = 0
    mean = m2 = None
    counts = []
    for key, source in items:
        rows = 0
        for chunk in _chunks(source, key, chunk_rows, columns):
            x = _checked(chunk, key, rows, features)
            features = x.shape[1]
            if mean is None:
                mean, m2 = np.zeros(features), np.zeros(features)
            nb = x.shape[0]
            if nb:
                mb = x.mean(axis=0)
                m2b = ((x - mb) ** 2).sum(axis=0)
                n = n_total + nb
                delta = mb - mean
                mean = mean + delta * (nb / n)
                m2 = m2 + m2b + delta ** 2 * (n_total * nb / n)
                n_total = n
            rows += nb
            if progress is not None:
                progress("statistics", key, rows)
        counts.append(rows)
    if features is None or features == 0:
        raise ConfigError("sources: no source yielded a chunk with at least one feature", field="sources")
    if columns is not None and len(columns) != features:
        raise ConfigError(f"columns: {len(columns)} names for {features} features", field="columns")
    mean, m2 = np.asarray(mean), np.asarray(m2)      # set with the first chunk
    std = np.sqrt(m2 / n_total) if n_total else np.ones(features)
    return features, counts, mean, np.where(std > 0, std, 1.0)


def _write_rows(data: AtomicFile, key: str, chunks: Iterator[Any], row: int, count: int, features: int,
                row_bytes: int, np_dtype: Any, stats: tuple[np.ndarray, np.ndarray] | None,
                progress: Callable[[str, str, int], None] | None) -> None:
    """Pass two for one source: its ``count`` rows (normalized with ``stats``) at row ``row``.

    Raises:
        ConfigError: the source yields other rows than in pass one.
    """
    done = 0
    for chunk in chunks:
        x = _checked(chunk, key, done, features)
        if done + x.shape[0] > count:
            raise ConfigError(f"{key}: the source yielded more rows in the second pass", field="sources")
        if stats is not None:
            x = (x - stats[0]) / stats[1]
        data.pwrite(np.ascontiguousarray(x, dtype=np_dtype).tobytes(), (row + done) * row_bytes)
        done += x.shape[0]
        if progress is not None:
            progress("write", key, done)
    if done != count:
        raise ConfigError(f"{key}: the source yielded {done} rows in the second pass, {count} in the first",
                          field="sources")


def _block_sums(data: AtomicFile, data_bytes: int, block_bytes: int) -> bytes:
    """The XXH3-64 of each ``block_bytes`` block of what ``data`` holds, little-endian."""
    sums = bytearray()
    buf = bytearray(block_bytes)
    for at in range(0, data_bytes, block_bytes):
        view = memoryview(buf)[:min(block_bytes, data_bytes - at)]
        data.pread_into(view, at)
        sums += xxh3_64(view).to_bytes(8, "little")
    return bytes(sums)
