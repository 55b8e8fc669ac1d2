"""Write LLMBATCH (ZeroBatch v2) files: pre-formed, page-aligned ``[batch_size, seq_len]`` batches.

Three entry points, all atomic (temporary file in the same folder, ``fsync``, rename,
``fsync`` of the folder):

- :func:`write_batch_file`: the seed's writer, from an array of records held in memory (or
  a ``np.memmap``);
- :func:`write_batch_dataset`: the seed's streaming writer, from an iterator of records; it
  never holds the token data in memory (each record goes straight to its final place in the
  file), only the shuffle permutation: 12 bytes per record below 2**32 records;
- :class:`LLMBatchWriter`: appends batches that are already formed, in order.

**Shuffle.** Both seed writers shuffle records with
``numpy.random.default_rng(seed).permutation(total_records)`` (NumPy's PCG64): output slot
``k`` (batch ``k // batch_size``, row ``k % batch_size``) holds input record ``perm[k]``, and
the records at ``perm[num_batches * batch_size:]`` are dropped. The two writers therefore
produce byte-identical files from the same records and seed. ``shuffle=False`` keeps input
order.

Every file carries the zerobatch integrity extension (``docs/formats/llmbatch.md``): per-batch
XXH3-64 checksums in a trailer after the last batch, the largest token id, a content-derived
build id and a header checksum. A reader written from the seed's spec ignores all of it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from zerobatch.core import hash_slots, llmbatch_geometry, max_u32, pack_llmbatch_header, xxh3_64
from zerobatch.core.io import AtomicFile, local_destination
from zerobatch.formats import llmbatch as L
from zerobatch.formats.errors import ConfigError, LimitExceededError

__all__ = ["LLMBatchWriter", "write_batch_dataset", "write_batch_file"]

#: Bytes written per system call when batches are written in order.
WRITE_GROUP_BYTES = 8 << 20


def _check_seed32(seed: Any) -> int:
    if isinstance(seed, bool) or not hasattr(seed, "__index__"):
        raise ConfigError(f"seed must be an integer, got {seed!r}", field="seed")
    s = seed.__index__()
    if not 0 <= s < 2**32:
        raise ConfigError(f"seed must be between 0 and 2**32-1 (the header's u32 field), got {s}", field="seed")
    return s


def _check_records(n: Any, name: str) -> int:
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        raise ConfigError(f"{name} must be an integer, got {n!r}", field=name)
    v = n.__index__()
    if v < 0:
        raise ConfigError(f"{name} must be >= 0, got {v}", field=name)
    if v >= 2**32:
        raise LimitExceededError(
            f"{name}: {v} records do not fit the header's u32 total_records field (max 2**32-1)",
            field=name)
    return v


def _as_tokens_u32(arr: Any, seq_len: int, what: str) -> np.ndarray:
    """``arr`` as a C-contiguous little-endian uint32 array ``[k, seq_len]``.

    Integer input of any width is accepted when every value lies in ``[0, 2**32)``; floats,
    booleans and out-of-range values are refused rather than silently truncated.
    """
    a = np.asarray(arr)
    if a.ndim == 1:
        a = a.reshape(1, -1)
    if a.ndim != 2 or a.shape[1] != seq_len:
        raise ConfigError(f"{what}: expected records of {seq_len} tokens, got shape {np.shape(arr)}",
                          field="tokens")
    if a.dtype.kind not in "ui" or a.dtype == np.bool_:
        raise ConfigError(f"{what}: tokens must be integers, got dtype {a.dtype}", field="tokens")
    if a.dtype != np.dtype("<u4"):
        if a.size and (a.dtype.kind == "i" or a.dtype.itemsize > 4):
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= 2**32:
                raise ConfigError(f"{what}: token ids must lie in [0, 2**32), found {lo if lo < 0 else hi}",
                                  field="tokens")
        a = a.astype("<u4")
    return np.ascontiguousarray(a)


def _shuffle_permutation(n: int, seed: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng(seed).permutation(n).astype(np.int64, copy=False)


def _finish(f: AtomicFile, *, batch_size: int, seq_len: int, num_batches: int, seed: int,
            total_records: int, max_token: int, checksums: np.ndarray, padded: int) -> None:
    """Write the trailer and the header (last, so a torn file never looks complete)."""
    trailer = np.ascontiguousarray(checksums, dtype="<u8")
    trailer_offset = L.HEADER_SIZE + num_batches * padded
    if num_batches:
        f.pwrite(trailer, trailer_offset)
    plain = pack_llmbatch_header(batch_size=batch_size, seq_len=seq_len, num_batches=num_batches,
                                 seed=seed, total_records=total_records, extension=False)
    header = pack_llmbatch_header(
        batch_size=batch_size, seq_len=seq_len, num_batches=num_batches, seed=seed,
        total_records=total_records, extension=True, checksums=True, max_token=max_token,
        trailer_hash=xxh3_64(trailer), build_id=L.build_id(plain[:40], max_token, trailer))
    f.pwrite(header, 0)
    if f.size != trailer_offset + trailer.nbytes:
        f.truncate(trailer_offset + trailer.nbytes)


class LLMBatchWriter:
    """Append pre-formed ``[batch_size, seq_len]`` batches to a new LLMBATCH file, in order.

    Use as a context manager; leaving the block normally commits the file atomically, an
    exception discards it::

        with LLMBatchWriter("out.batch", batch_size=32, seq_len=512) as w:
            for batch in batches:
                w.write_batch(batch)

    Memory stays bounded (one write group of about 8 MiB, plus 8 bytes per batch for the
    checksum trailer).

    Args:
        output_path: the file to create (replaced atomically if it exists).
        batch_size: samples per batch.
        seq_len: tokens per sample.
        seed: recorded in the header (the seed the records were shuffled with, if any).
        total_records: recorded in the header; defaults to ``num_batches * batch_size``.

    Raises:
        ConfigError: bad geometry or seed.
        WriteError: the file cannot be created or written (``errno`` kept).
    """

    def __init__(self, output_path: str | os.PathLike[str], *, batch_size: int, seq_len: int,
                 seed: int = 0, total_records: int | None = None) -> None:
        self.raw_batch_bytes, self.padded_batch_bytes = llmbatch_geometry(batch_size, seq_len)
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = _check_seed32(seed)
        self.total_records = None if total_records is None else _check_records(total_records, "total_records")
        self.path = os.fspath(local_destination(output_path, field="output_path"))
        self.num_batches = 0
        self.max_token = 0
        self._checksums: list[np.ndarray] = []
        self._group_batches = max(1, WRITE_GROUP_BYTES // self.padded_batch_bytes)
        self._group = np.zeros((self._group_batches, self.padded_batch_bytes // 4), dtype="<u4")
        self._filled = 0
        self._file: AtomicFile | None = AtomicFile(self.path)
        self._file.pwrite(bytes(L.HEADER_SIZE), 0)

    def write_batch(self, batch: Any) -> None:
        """Append one batch: ``batch_size * seq_len`` integer tokens in ``[0, 2**32)``.

        Raises:
            ConfigError: wrong shape, non-integer or out-of-range tokens.
            WriteError: the write failed (the file is discarded).
        """
        tokens = _as_tokens_u32(np.asarray(batch).reshape(-1, self.seq_len), self.seq_len, "write_batch")
        if tokens.shape[0] != self.batch_size:
            raise ConfigError(f"write_batch: expected {self.batch_size} rows of {self.seq_len} tokens, "
                              f"got {tokens.shape[0]}", field="batch")
        self._group[self._filled, :tokens.size] = tokens.reshape(-1)
        self._filled += 1
        if self._filled == self._group_batches:
            self._flush()

    def write_batches(self, batches: Any) -> None:
        """Append ``[k, batch_size, seq_len]`` batches."""
        arr = np.asarray(batches)
        for b in arr.reshape(-1, self.batch_size, self.seq_len):
            self.write_batch(b)

    def _flush(self) -> None:
        if not self._filled or self._file is None:
            return
        group = self._group[:self._filled]
        self.max_token = max(self.max_token, max_u32(group))
        sums = hash_slots(group, 0, self.padded_batch_bytes, self._filled)
        offset = L.HEADER_SIZE + self.num_batches * self.padded_batch_bytes
        self._file.pwrite(group, offset)
        self._checksums.append(sums)
        self.num_batches += self._filled
        self._filled = 0

    def close(self) -> int:
        """Write the trailer and header and commit the file atomically.

        Returns:
            The number of batches written.
        """
        if self._file is None:
            return self.num_batches
        f = self._file
        try:
            self._flush()
            total = self.total_records if self.total_records is not None else self.num_batches * self.batch_size
            total = _check_records(total, "total_records")
            if total < self.num_batches * self.batch_size:
                raise ConfigError(f"total_records {total} is less than the {self.num_batches * self.batch_size} "
                                  f"records written", field="total_records")
            sums = np.concatenate(self._checksums) if self._checksums else np.zeros(0, np.uint64)
            _finish(f, batch_size=self.batch_size, seq_len=self.seq_len, num_batches=self.num_batches,
                    seed=self.seed, total_records=total, max_token=self.max_token, checksums=sums,
                    padded=self.padded_batch_bytes)
            f.commit()
        except BaseException:
            f.abort()
            raise
        finally:
            self._file = None
        return self.num_batches

    def abort(self) -> None:
        """Discard the file; the final name keeps its previous content."""
        if self._file is not None:
            self._file.abort()
            self._file = None

    def __enter__(self) -> LLMBatchWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_batch_file(output_path: str | os.PathLike[str], tokens_array: Any, batch_size: int,
                     seq_len: int, seed: int, *, shuffle: bool = True) -> int:
    """Write records held in memory (or memory-mapped) as an LLMBATCH file.

    Records are shuffled with ``numpy.random.default_rng(seed).permutation(N)``, grouped
    into batches of ``batch_size``, and the remainder (``N % batch_size`` records) is dropped,
    as ``drop_last=True`` does in PyTorch's DataLoader.

    Args:
        output_path: the file to create (replaced atomically if it exists).
        tokens_array: ``[N, seq_len]`` integer tokens in ``[0, 2**32)`` (``uint32`` ideally;
            other integer dtypes are range-checked and converted).
        batch_size: records per batch, 1 to 2**31-1.
        seq_len: tokens per record, 1 to 2**31-1.
        seed: shuffle seed, 0 to 2**32-1 (recorded in the header).
        shuffle: ``False`` keeps input order.

    Returns:
        The number of batches written (``N // batch_size``).

    Raises:
        ConfigError: bad arguments, shapes, dtypes or token values.
        LimitExceededError: ``N`` of 2**32 or more, or a batch above ``MAX_BATCH_BYTES``.
        WriteError: the write failed; nothing is left under ``output_path``'s name.
    """
    llmbatch_geometry(batch_size, seq_len)
    seed = _check_seed32(seed)
    arr = tokens_array if isinstance(tokens_array, np.ndarray) else np.asarray(tokens_array)
    if arr.ndim != 2 or arr.shape[1] != seq_len:
        raise ConfigError(f"tokens_array must have shape (N, {seq_len}), got {arr.shape}", field="tokens_array")
    n = _check_records(arr.shape[0], "total_records")
    num_batches = n // batch_size
    perm = _shuffle_permutation(n, seed, shuffle)[:num_batches * batch_size]
    rows_per_group = max(1, WRITE_GROUP_BYTES // (seq_len * 4) // batch_size) * batch_size
    with LLMBatchWriter(output_path, batch_size=batch_size, seq_len=seq_len, seed=seed,
                        total_records=n) as w:
        for start in range(0, perm.size, rows_per_group):
            rows = _as_tokens_u32(arr[perm[start:start + rows_per_group]], seq_len, "tokens_array")
            w.write_batches(rows.reshape(-1, batch_size, seq_len))
    return num_batches


def write_batch_dataset(output_path: str | os.PathLike[str], tokens_iter: Iterable[Any],
                        total_records: int, batch_size: int, seq_len: int, seed: int, *,
                        shuffle: bool = True) -> int:
    """Stream records into an LLMBATCH file without holding the token data in memory.

    Produces exactly the file :func:`write_batch_file` writes for the same records and seed.
    Each record is written straight to its final place (the permutation is inverted up
    front), so memory grows with the number of records by 12 bytes each (16 at 2**32 or
    more), never with ``seq_len``. A second pass over the written file computes the
    per-batch checksums.

    Args:
        output_path: the file to create (replaced atomically if it exists).
        tokens_iter: yields records: 1-D arrays of ``seq_len`` tokens, or 2-D ``[k, seq_len]``
            chunks of records.
        total_records: exactly how many records the iterator yields.
        batch_size: records per batch.
        seq_len: tokens per record.
        seed: shuffle seed, 0 to 2**32-1.
        shuffle: ``False`` keeps input order.

    Returns:
        The number of batches written (``total_records // batch_size``).

    Raises:
        ConfigError: bad arguments, shapes or tokens, or the iterator yields more or fewer
            than ``total_records`` records.
        WriteError: the write failed; nothing is left under ``output_path``'s name.
    """
    _raw, padded = llmbatch_geometry(batch_size, seq_len)
    seed = _check_seed32(seed)
    n = _check_records(total_records, "total_records")
    num_batches = n // batch_size
    kept = num_batches * batch_size
    perm = _shuffle_permutation(n, seed, shuffle)
    # dest[j]: output slot of input record j (>= kept: dropped).
    dest = np.empty(n, dtype=np.uint32 if n < 2**32 else np.uint64)
    dest[perm] = np.arange(n, dtype=dest.dtype)
    del perm
    record_bytes = seq_len * 4
    trailer_offset = L.HEADER_SIZE + num_batches * padded
    max_token = 0
    seen = 0
    f = AtomicFile(output_path)
    try:
        f.truncate(trailer_offset)  # sparse: padding and unwritten slots read as zeros
        for item in tokens_iter:
            rows = _as_tokens_u32(item, seq_len, "tokens_iter")
            k = rows.shape[0]
            if seen + k > n:
                raise ConfigError(f"tokens_iter yielded more than total_records={n} records",
                                  field="total_records")
            for j in range(k):
                d = int(dest[seen + j])
                if d < kept:
                    b, r = divmod(d, batch_size)
                    f.pwrite(rows[j], L.HEADER_SIZE + b * padded + r * record_bytes)
                    max_token = max(max_token, max_u32(rows[j]))
            seen += k
        if seen != n:
            raise ConfigError(f"tokens_iter yielded {seen} records but total_records={n}",
                              field="total_records")
        del dest
        sums = _hash_written(f, num_batches, padded)
        _finish(f, batch_size=batch_size, seq_len=seq_len, num_batches=num_batches, seed=seed,
                total_records=n, max_token=max_token, checksums=sums, padded=padded)
        f.commit()
    except BaseException:
        f.abort()
        raise
    return num_batches


def _hash_written(f: AtomicFile, num_batches: int, padded: int) -> np.ndarray:
    """XXH3-64 of every batch slot already written to ``f`` (read back in groups)."""
    sums = np.empty(num_batches, dtype=np.uint64)
    group = max(1, WRITE_GROUP_BYTES // padded)
    buf = bytearray(group * padded)
    for start in range(0, num_batches, group):
        k = min(group, num_batches - start)
        view = memoryview(buf)[:k * padded]
        f.pread_into(view, L.HEADER_SIZE + start * padded)
        hash_slots(view, 0, padded, k, sums[start:start + k])
    return sums
