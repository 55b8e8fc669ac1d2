"""Write LLMCHNK (ZeroBatch v1) files: token records behind an offset table
(``docs/formats/llmchnk.md``).

:class:`LLMChunkWriter` streams records of any length in bounded memory: the tokens go to a
staging file and each record's length and XXH3-64 checksum to a second one (16 bytes per
record, flushed in blocks); :meth:`LLMChunkWriter.close` assembles the final file (header,
offset table, records, checksum trailer) under a temporary name, ``fsync`` s it and renames
it into place. Until then the final name keeps its previous content; a writer killed at any
point leaves only temporary files, removed by the next writer of that name.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from zerobatch.core import hash_slots, xxh3_64
from zerobatch.core.digest import BlockDigest
from zerobatch.core.io import AtomicFile, local_destination
from zerobatch.formats import llmchnk as C
from zerobatch.formats.errors import ConfigError, LimitExceededError

__all__ = ["LLMChunkWriter", "write_chunk_file"]

#: Records whose length and checksum are kept in memory before they go to the staging file.
INDEX_BLOCK = 1 << 16
#: Bytes copied per call when the staged records are moved into the final file.
COPY_BYTES = 8 << 20
#: Record bytes gathered in memory before one write to the staging file.
WRITE_BYTES = 4 << 20

_DTYPE_CODES = {"uint32": C.DTYPE_UINT32, "uint16": C.DTYPE_UINT16}


class LLMChunkWriter:
    """Append token records and write an LLMCHNK file atomically on :meth:`close`.

    Args:
        path: the final file.
        seq_len: the nominal record length recorded in the header (0: none). Records of
            other lengths are allowed; readers pad or cut them to the length asked at read time.
        dtype: ``"uint32"`` (default) or ``"uint16"`` (token ids below 65536).
        checksums: write the checksum trailer (default; readers verify each record on first read).

    Example::

        with LLMChunkWriter("train.chunk", seq_len=2048) as w:
            for doc in tokenized:
                w.add(doc)

    Raises:
        ConfigError: bad arguments, or a record that is not a 1-D array of integer ids in range.
        WriteError: an I/O error (the final name keeps its previous content).
    """

    def __init__(self, path: str | os.PathLike[str], *, seq_len: int = 0, dtype: str = "uint32",
                 checksums: bool = True) -> None:
        if dtype not in _DTYPE_CODES:
            raise ConfigError(f"dtype must be 'uint32' or 'uint16', got {dtype!r}", field="dtype")
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or not 0 <= seq_len < 2**32:
            raise ConfigError(f"seq_len must be an integer in [0, 2**32), got {seq_len!r}", field="seq_len")
        self.path = os.path.abspath(os.fspath(local_destination(path)))
        self.seq_len = int(seq_len)
        self.dtype = _DTYPE_CODES[dtype]
        self.np_dtype, self.itemsize = C.DTYPES[self.dtype]
        self.limit = 1 << (8 * self.itemsize)
        self.checksums = bool(checksums)
        self.num_records = 0
        self.data_bytes = 0
        self._index = np.empty((INDEX_BLOCK, 2), np.uint64)   # per record: byte length, checksum
        self._fill = 0
        self._pending = bytearray()          # record bytes not yet written to the staging file
        self._staged = 0                     # record bytes written to the staging file
        self._closed = False
        self._data = AtomicFile(f"{self.path}.records-staging")
        try:
            self._meta = AtomicFile(f"{self.path}.index-staging")
        except BaseException:
            self._data.abort()
            raise

    def _check_tokens(self, a: np.ndarray, what: str) -> None:
        if a.size:
            if a.dtype.kind not in "ui" or a.dtype == np.bool_:
                raise ConfigError(f"{what}: token ids must be integers, got {a.dtype}", path=self.path, field="tokens")
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= self.limit:
                raise ConfigError(f"{what}: token ids must lie in [0, {self.limit}), got [{lo}, {hi}]",
                                  path=self.path, field="tokens")

    def add(self, tokens: Any) -> None:
        """Append one record (a 1-D array-like of token ids; may be empty)."""
        if self._closed:
            raise ConfigError("the writer is closed", path=self.path, field="writer")
        a = np.asarray(tokens)
        if a.ndim != 1:
            raise ConfigError(f"record {self.num_records}: expected a 1-D array of token ids, got shape {a.shape}",
                              path=self.path, field="tokens")
        self._check_tokens(a, f"record {self.num_records}")
        if a.size > C.MAX_RECORD_TOKENS:
            raise LimitExceededError(f"record {self.num_records}: {a.size} tokens exceed {C.MAX_RECORD_TOKENS}",
                                     path=self.path, field="tokens")
        data = np.ascontiguousarray(a, dtype=self.np_dtype).tobytes()
        if self.num_records >= 2**40:
            raise LimitExceededError("num_records: more than 2**40 records", path=self.path, field="num_records")
        self._pending += data
        if len(self._pending) >= WRITE_BYTES:
            self._flush_data()
        self._index[self._fill] = (len(data), xxh3_64(data) if self.checksums else 0)
        self._fill += 1
        self.num_records += 1
        self.data_bytes += len(data)
        if self._fill == INDEX_BLOCK:
            self._flush_index()

    def add_many(self, records: Iterable[Any]) -> None:
        """Append every record of ``records`` (rows of a 2-D array, or any iterable of 1-D ones).

        A 2-D array is checked, converted and checksummed whole (one compiled hash over its
        rows), in groups of rows that bound the memory used.
        """
        if not (isinstance(records, np.ndarray) and records.ndim == 2):
            for r in records:
                self.add(r)
            return
        if self._closed:
            raise ConfigError("the writer is closed", path=self.path, field="writer")
        n, length = records.shape
        if length > C.MAX_RECORD_TOKENS:
            raise LimitExceededError(f"records of {length} tokens exceed {C.MAX_RECORD_TOKENS}", path=self.path,
                                     field="tokens")
        group = max(1, WRITE_BYTES // max(1, length * self.itemsize))
        for at in range(0, n, group):
            rows = np.asarray(records[at:at + group])
            self._check_tokens(rows, f"records {self.num_records}..{self.num_records + rows.shape[0] - 1}")
            data = np.ascontiguousarray(rows, dtype=self.np_dtype).tobytes()
            k, row_bytes = rows.shape[0], length * self.itemsize
            sums = hash_slots(data, 0, row_bytes, k) if self.checksums and row_bytes else np.zeros(k, np.uint64)
            if not row_bytes and self.checksums:
                sums[:] = xxh3_64(b"")
            self._pending += data
            if len(self._pending) >= WRITE_BYTES:
                self._flush_data()
            done = 0
            while done < k:
                take = min(k - done, INDEX_BLOCK - self._fill)
                self._index[self._fill:self._fill + take, 0] = row_bytes
                self._index[self._fill:self._fill + take, 1] = sums[done:done + take]
                self._fill += take
                done += take
                if self._fill == INDEX_BLOCK:
                    self._flush_index()
            self.num_records += k
            self.data_bytes += len(data)

    def _flush_data(self) -> None:
        if self._pending:
            self._data.pwrite(self._pending, self._staged)
            self._staged += len(self._pending)
            self._pending.clear()

    def _flush_index(self) -> None:
        if self._fill:
            self._meta.write(self._index[:self._fill].astype("<u8").tobytes())
            self._fill = 0

    def _index_blocks(self) -> Iterable[np.ndarray]:
        """The staged (length, checksum) rows, a block at a time."""
        self._flush_index()
        row_bytes = 16
        total = self.num_records
        at = 0
        while at < total:
            count = min(INDEX_BLOCK, total - at)
            buf = bytearray(count * row_bytes)
            self._meta.pread_into(buf, at * row_bytes)
            yield np.frombuffer(buf, "<u8").reshape(count, 2)
            at += count

    def close(self) -> None:
        """Assemble the file, ``fsync`` it and rename it into place (atomic). Idempotent."""
        if self._closed:
            return
        self._flush_data()
        out = AtomicFile(self.path)
        try:
            n = self.num_records
            header = C.LLMChunkHeader(num_records=n, seq_len=self.seq_len, dtype=self.dtype,
                                      flags=C.FLAG_CHECKSUMS if self.checksums else 0)
            head = C.pack_header(header)
            data_start = C.HEADER_SIZE + 8 * (n + 1)
            data_end = data_start + self.data_bytes
            digest = BlockDigest(C.DIGEST_BLOCK)
            out.pwrite(head, 0)
            digest.feed(head)
            # offset table
            at, pos = 0, data_start
            for block in self._index_blocks():
                ends = pos + np.cumsum(block[:, 0].astype(np.uint64), dtype=np.uint64)
                starts = np.concatenate([np.array([pos], np.uint64), ends[:-1]])
                table = starts.astype("<u8").tobytes()
                out.pwrite(table, C.HEADER_SIZE + 8 * at)
                digest.feed(table)
                pos = int(ends[-1])
                at += block.shape[0]
            last = np.array([data_end], "<u8").tobytes()
            out.pwrite(last, C.HEADER_SIZE + 8 * n)
            digest.feed(last)
            # records
            buf = bytearray(min(COPY_BYTES, max(self.data_bytes, 1)))
            done = 0
            while done < self.data_bytes:
                count = min(len(buf), self.data_bytes - done)
                view = memoryview(buf)[:count]
                self._data.pread_into(view, done)
                out.pwrite(view, data_start + done)
                done += count
            # checksum trailer
            if self.checksums:
                at = 0
                for block in self._index_blocks():
                    sums = block[:, 1].astype("<u8").tobytes()
                    out.pwrite(sums, data_end + 8 * at)
                    digest.feed(sums)
                    at += block.shape[0]
                tail = np.array([digest.digest()], "<u8").tobytes() + C.TRAILER_MAGIC
                out.pwrite(tail, data_end + 8 * n)
            out.commit()
        except BaseException:
            out.abort()
            self.abort()
            raise
        self._closed = True
        self._data.abort()
        self._meta.abort()

    def abort(self) -> None:
        """Drop everything written (the final name keeps its previous content). Idempotent."""
        self._closed = True
        self._data.abort()
        self._meta.abort()

    def __enter__(self) -> LLMChunkWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_chunk_file(path: str | os.PathLike[str], records: Iterable[Any], *, seq_len: int = 0,
                     dtype: str = "uint32", checksums: bool = True) -> int:
    """Write ``records`` (a 2-D array or an iterable of 1-D token arrays) to an LLMCHNK file;
    returns the number of records."""
    with LLMChunkWriter(path, seq_len=seq_len, dtype=dtype, checksums=checksums) as w:
        w.add_many(records)
    return w.num_records
