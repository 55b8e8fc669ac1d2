"""Read LLMCHNK (ZeroBatch v1) files: validated, memory-mapped, zero-copy records and batch
gathers of any size chosen at read time (``docs/formats/llmchnk.md``)."""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zerobatch.core import ChunkRecords, flat_layout, xxh3_64
from zerobatch.core.checks import check_count
from zerobatch.core.digest import block_digest
from zerobatch.core.io import open_regular_file, pread_exact
from zerobatch.formats import llmchnk as C
from zerobatch.formats.errors import ConfigError, CorruptError, IntegrityError, OutOfRangeError, ReadError, StateError
from zerobatch.readers.base import Access, BatchReader, OpensOnFirstUse
from zerobatch.readers.remote import RemoteItems
from zerobatch.readers.remote import runs as _runs

__all__ = ["LLMChunkReader", "RecordDocuments", "VerifyReport"]


@dataclass
class VerifyReport:
    """The result of :meth:`LLMChunkReader.verify`."""

    path: str
    records_checked: int = 0
    bad_records: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad_records


class LLMChunkReader(RemoteItems, OpensOnFirstUse, BatchReader):
    """Zero-copy, validated access to the records of an LLMCHNK file.

    On open the header, the offset table (from the data start to the data end, never
    decreasing, a whole number of tokens per record) and the trailer digest are checked; with
    ``verify`` each record is checked against its checksum the first time it is read.

    Args:
        path: the file, or its URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``file://``;
            ``docs/object-storage.md``).
        verify: check record checksums on first read (files with checksums; a file at a URL
            is always checked).
        storage_options, cache_dir, cache_limit, fetch_threads: a URL's store configuration,
            local cache folder, its byte limit and requests in flight (as for
            :class:`~zerobatch.readers.tokstream.TokenStreamReader`).

    A file at a URL costs three requests to open (its size, header, then its offset table and
    checksums); each record is fetched by exact byte range the first time a read (or
    :meth:`prefetch`) needs it, neighbouring records in one request, checked against its
    checksum and kept in a sparse local copy in the cache folder.

    Raises:
        NotFoundError, ReadError: the file is missing or cannot be opened or mapped.
        FormatError: any fault of structure (``TruncatedError``, ``CorruptError``,
            ``IntegrityError``, ``UnsupportedVersionError``, ``LimitExceededError``), naming
            the file and the field.

    Example::

        reader = LLMChunkReader("train.chunk")
        rec = reader.read_record(7)                 # uint32 view of the mapped file
        x, mask = reader.gather([3, 1, 4], 2048)    # int64 (3, 2048), padded rows masked
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True,
                 storage_options: dict[str, Any] | None = None, cache_dir: str | os.PathLike[str] | None = None,
                 cache_limit: int | None = None, fetch_threads: int | None = None) -> None:
        self._locate(path, storage_options, cache_dir, cache_limit, fetch_threads)
        self.verify_records = bool(verify) or self._remote is not None
        self._open()

    def _fetch_layout(self) -> str:
        """A file at a URL: its header, offset table and checksums fetched, its sparse local
        copy made (or found) in the cache; returns the copy's path (checked as a local file)."""
        from zerobatch.readers.remote import RemoteFile
        r = self._remote
        if r is None:
            raise StateError("the file is not read from a URL", path=self.path, field="path")
        size = r.size("")
        head = bytes(r.store.get_range(r.name, 0, min(size, C.HEADER_SIZE)))
        header = C.parse_header(head, path=self.path)
        geo = C.geometry(header, size, path=self.path)
        if not header.checksums:
            raise ConfigError("checksums: the file has no record checksums, and every byte read from a URL is "
                              "checked: rewrite it with checksums, or read a local copy", path=self.path,
                              field="checksums")
        table, tail = r.store.get_ranges(r.name, [len(head), geo.checksums_offset], [geo.data_start, size])
        folder = r.cache.folder("llmchnk", bytes(tail[-16:-8]).hex())
        old = self.__dict__.get("_copy")
        if old is not None:
            old.close()
        self._copy = RemoteFile(r, r.name, os.path.join(folder, "file.chunk"), size,
                                [(0, head), (len(head), table), (geo.checksums_offset, tail)])
        return self._copy.path

    def _open(self) -> None:
        if self._remote is None:
            self._copy = None
        # a reader unpickled in a worker has no _copy until this open: reads check for one
        # only after touching the reader (which opens it), never before
        local = self.path if self._remote is None else self._fetch_layout()
        fd, st = open_regular_file(local)
        try:
            size = st.st_size
            head = pread_exact(fd, min(size, C.HEADER_SIZE), 0, path=self.path, field="header")
            header = C.parse_header(head, path=self.path)
            geo = C.geometry(header, size, path=self.path)
            try:
                self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            except OSError as exc:
                raise ReadError(f"file: cannot map: {exc.strerror}", errno=exc.errno, path=self.path,
                                field="file") from exc
        finally:
            os.close(fd)
        self.header, self.geometry = header, geo
        n = header.num_records
        table = np.frombuffer(self._mm, "<u8", n + 1, C.HEADER_SIZE)
        self._check_table(table, header, geo)
        if header.checksums:
            if self._mm[size - 8:size] != C.TRAILER_MAGIC:
                raise CorruptError(f"trailer_magic: expected {C.TRAILER_MAGIC!r} at the end of the file",
                                   path=self.path, field="trailer_magic")
            stored = int.from_bytes(self._mm[size - 16:size - 8], "little")
            view = memoryview(self._mm)
            got = block_digest([view[:geo.data_start], view[geo.checksums_offset:geo.digest_offset]],
                               C.DIGEST_BLOCK)
            view.release()
            if got != stored:
                raise IntegrityError(f"table_digest: the header, offset table and checksums do not match their "
                                     f"digest (stored 0x{stored:016x}, computed 0x{got:016x})",
                                     path=self.path, field="table_digest")
            self.fingerprint = f"{stored:016x}"
        else:
            view = memoryview(self._mm)
            self.fingerprint = f"nosum:{size}:{xxh3_64(view[:geo.data_start]):016x}"
            view.release()
        self._table = table
        self._dtype = np.dtype(header.np_dtype)
        # the records checked against their checksums: this reader's (the kernel marks them)
        self._verified = np.zeros(n, np.uint8) if self.verify_records and header.checksums else None
        self._records = ChunkRecords(self._mm, n, header.itemsize, header.checksums, self._verified, self.path)
        self.closed = False
        if self._copy is not None:
            records = self._records

            def spans(units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
                return table[units].astype(np.int64), table[units + 1].astype(np.int64)

            def check(units: list[int]) -> list[int]:
                bad: list[int] = []
                for a, b in _runs(units):
                    bad += records.check(a, b)
                return bad
            self._copy.units(n, spans, check)

    def _check_table(self, table: np.ndarray, h: C.LLMChunkHeader, geo: C.Geometry) -> None:
        if int(table[0]) != geo.data_start:
            raise CorruptError(f"offsets: the first record must start at {geo.data_start} (after the table), "
                               f"the table says {int(table[0])}", path=self.path, field="offsets")
        if int(table[-1]) != geo.data_end:
            raise CorruptError(f"offsets: the records must end at {geo.data_end} (before the trailer), the table "
                               f"says {int(table[-1])}", path=self.path, field="offsets")
        if table.size > 1:
            back = np.flatnonzero(table[1:] < table[:-1])
            if back.size:
                i = int(back[0])
                raise CorruptError(f"offsets: record {i} ends before it starts ({int(table[i + 1])} < "
                                   f"{int(table[i])})", path=self.path, field="offsets")
            sizes = table[1:] - table[:-1]
            odd = np.flatnonzero(sizes % h.itemsize)
            if odd.size:
                i = int(odd[0])
                raise CorruptError(f"offsets: record {i} has {int(sizes[i])} bytes, not a whole number of "
                                   f"{h.itemsize}-byte tokens", path=self.path, field="offsets")
            if int(sizes.max()) // h.itemsize > C.MAX_RECORD_TOKENS:
                i = int(np.argmax(sizes))
                raise CorruptError(f"offsets: record {i} is longer than {C.MAX_RECORD_TOKENS} tokens",
                                   path=self.path, field="offsets")

    # ---------------------------------------------------------------------------------------

    @property
    def num_records(self) -> int:
        return self.header.num_records

    @property
    def seq_len(self) -> int:
        """The nominal record length from the header (0: none)."""
        return self.header.seq_len

    @property
    def dtype(self) -> np.dtype:
        """The stored token type (``uint32`` or ``uint16``, little-endian)."""
        return self._dtype

    @property
    def num_tokens(self) -> int:
        return (self.geometry.data_end - self.geometry.data_start) // self.header.itemsize

    def __len__(self) -> int:
        return self.num_records

    def _ready(self) -> None:
        if self.closed:
            raise StateError("the reader is closed", path=self.path, field="reader")

    def documents(self) -> RecordDocuments:
        """The file's records as :class:`~zerobatch.readers.base.Documents` (what packing reads)."""
        return RecordDocuments(self)

    def lengths(self, indices: Any = None) -> np.ndarray:
        """Tokens per record at ``indices`` (default: all records), ``int64``."""
        self._ready()
        if indices is None:
            return ((self._table[1:] - self._table[:-1]) // self.header.itemsize).astype(np.int64)
        return self._records.lengths(indices)

    def read_record(self, i: int) -> np.ndarray:
        """Record ``i``: a read-only view of the mapped file (``uint32`` / ``uint16``), no copy.

        Raises:
            IndexError: ``i`` out of range. IntegrityError: a checksum mismatch.
        """
        self._ready()
        i = int(i)
        if i < 0:
            i += self.num_records
        if self._copy is not None:
            self._copy.ensure(i)
        offset, length = self._records.span(i)
        return np.frombuffer(self._mm, self._dtype, length, offset)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.read_record(i)

    def __iter__(self) -> Iterator[np.ndarray]:
        n = self.num_records
        for i in range(n):
            if self._copy is not None and i % 64 == 0:       # a URL: the next records fetched ahead
                self.prefetch(np.arange(i + 64, min(n, i + 128)) if i else np.arange(0, min(n, 128)))
            yield self.read_record(i)

    def gather(self, indices: Any, seq_len: int | None = None, *, out: np.ndarray | None = None,
               dtype: Any = np.int64, pad_id: int = 0, mask: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray | None]:
        """The records at ``indices`` as rows of one ``[len(indices), seq_len]`` array, in one
        compiled call (GIL released): each row holds its record's first ``seq_len`` tokens,
        then ``pad_id``.

        Args:
            indices: record indices (any order, repeats allowed).
            seq_len: row length (default: ``out``'s, else the header's).
            out: a preallocated C-contiguous ``int64`` / ``int32`` buffer to fill.
            dtype: ``int64`` or ``int32`` when ``out`` is not given.
            pad_id: the id written after a short record.
            mask: a preallocated bool buffer for the mask.

        Returns:
            ``(tokens, mask)``: ``mask`` is a bool array (True on record tokens) when a row was
            padded or a ``mask`` buffer was given, else ``None``.

        Raises:
            IndexError, IntegrityError, ConfigError: a bad index, a checksum mismatch, an
            unfit buffer or an id that does not fit ``int32``.
        """
        self._ready()
        idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        if out is None:
            width = self.seq_len if seq_len is None else check_count(seq_len, "seq_len", maximum=C.MAX_RECORD_TOKENS)
            if seq_len is None and width == 0:
                raise ConfigError("seq_len: the file has no nominal record length; give one", path=self.path,
                                  field="seq_len")
            dt = np.dtype(dtype)
            if dt not in (np.int64, np.int32):
                raise ConfigError(f"dtype must be int64 or int32, got {dt}", field="dtype")
            out = np.empty((idx.size, width), dt)
        elif seq_len is not None and out.ndim == 2 and out.shape[1] != seq_len:
            raise ConfigError(f"out has rows of {out.shape[1]} tokens, seq_len is {seq_len}", field="out")
        if self._copy is not None:
            self._copy.ensure(idx)
        lengths = self._records.gather(idx, out, mask, pad_id)
        if mask is not None:
            return out, mask
        width = out.shape[1]
        if lengths.size and int(lengths.min()) < width:
            return out, np.arange(width)[None, :] < lengths[:, None]
        return out, None

    def read_into(self, items: Any, out: np.ndarray, *, mask: np.ndarray | None = None, pad_id: int = 0
                  ) -> np.ndarray:
        """The batch read sources call: records ``items`` into the rows of ``out`` (int64 or
        int32 ``[k, width]``: each record's first ``width`` tokens, then ``pad_id``), ``mask``
        (bool or uint8, optional) set on record tokens, in one compiled call (GIL released);
        each record checked against its checksum the first time.

        Returns:
            The records' lengths (``int64``, before cutting).

        Raises:
            OutOfRangeError, IntegrityError, ConfigError: as :meth:`gather`.
        """
        self._ready()
        idx = np.ascontiguousarray(items, dtype=np.int64).reshape(-1)
        if self._copy is not None:
            self._copy.ensure(idx)
        return self._records.gather(idx, out, mask, pad_id)

    def verify(self, progress: Callable[[int, int], None] | None = None, *, chunk: int = 4096) -> VerifyReport:
        """Check every record against its checksum (the structure was checked on open)."""
        self._ready()
        report = VerifyReport(self.path)
        if not self.header.checksums:
            return report
        n = self.num_records
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            if self._copy is not None:      # fetched (and checked) first; what stays bad is reported
                with contextlib.suppress(IntegrityError):
                    self._copy.ensure(np.arange(start, stop))
            report.bad_records.extend(self._records.check(start, stop))
            report.records_checked += stop - start
            if progress is not None:
                progress(stop, n)
        return report

    def close(self) -> None:
        """Release the mapping (arrays returned by :meth:`read_record` keep their pages until
        they are dropped). Idempotent."""
        if self.__dict__.pop("_unpickled", None) is not None:
            return      # unpickled, never opened: nothing to release
        if self.closed:
            return
        self.closed = True
        if self._copy is not None:
            self._copy.close()
        self._records = None  # type: ignore[assignment]
        self._table = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass   # views handed out are still alive: the mapping goes with the last of them

    def __enter__(self) -> LLMChunkReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = {"path": self.path, "verify": self.verify_records, "fingerprint": self.fingerprint}
        if self._remote is not None:
            state.update(path=self._url, remote=self._remote.options)
        return state

    def _unpickled_attributes(self, state: dict[str, Any]) -> dict[str, Any]:
        if state.get("remote") is not None:
            from zerobatch.readers.remote import RemoteOptions
            remote = RemoteOptions(state["path"], **state["remote"])
            return {"path": remote.url, "_url": state["path"], "_remote": remote,
                    "verify_records": state["verify"]}
        return {"path": state["path"], "verify_records": state["verify"], "_remote": None}

    def _reopen(self, state: dict[str, Any]) -> None:
        self._open()
        if self.fingerprint != state["fingerprint"]:
            raise IntegrityError(f"fingerprint: the file changed since this reader was pickled (was "
                                 f"{state['fingerprint']}, now {self.fingerprint})", path=self.path,
                                 field="fingerprint")

    def __repr__(self) -> str:
        return f"LLMChunkReader({self.path!r}, num_records={self.num_records}, seq_len={self.seq_len})"


class RecordDocuments:
    """The records of an LLMCHNK file as :class:`~zerobatch.readers.base.Documents` (what
    packing reads): document spans and flat reads of ``[start, stop)`` token ranges, over
    token positions counted across the records in order. Each read goes through
    :meth:`LLMChunkReader.read_record`, so every record is checked against its checksum the
    first time it is read (and fetched by byte range from a URL).

    Args:
        reader: an open :class:`LLMChunkReader` (:meth:`LLMChunkReader.documents`).
    """

    def __init__(self, reader: LLMChunkReader) -> None:
        self.records = reader
        self._index()

    def _index(self) -> None:
        lengths = self.records.lengths()
        self.record_start = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=self.record_start[1:])

    def __getstate__(self) -> dict[str, Any]:
        return {"records": self.records}          # the index is recomputed: 8 bytes a record

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.records = d["records"]
        self._index()

    @property
    def path(self) -> str:
        return self.records.path

    @property
    def build_id(self) -> str:
        return f"llmchnk:{self.records.fingerprint}"

    @property
    def access(self) -> Access:
        """The file's access, without queued compiled reads (records are read one by one)."""
        return dataclasses.replace(self.records.access, tasks=False)

    @property
    def num_documents(self) -> int:
        return self.records.num_records

    def document_spans(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        return self.record_start[idx], self.record_start[idx + 1]

    def _records_of(self, starts: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.record_start, starts, side="right") - 1

    @property
    def num_tokens(self) -> int:
        return int(self.record_start[-1])

    def documents_at(self, positions: Any) -> np.ndarray:
        """The record holding each token position (provenance; see
        :meth:`TokenStreamReader.documents_at <zerobatch.readers.tokstream.TokenStreamReader.documents_at>`).

        Raises:
            IndexError: a position outside ``[0, num_tokens)``.
        """
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.num_tokens):
            raise OutOfRangeError(f"a token position is outside [0, {self.num_tokens})", path=self.path,
                                  field="positions")
        return self._records_of(pos)

    def windows_metadata(self, starts: Any, length: int) -> None:
        """An LLMCHNK file keeps no per-document metadata."""
        return None

    def window(self, start: int, length: int, *, dtype: Any = np.int64) -> np.ndarray:
        """Tokens ``[start, start + length)`` across the records."""
        first, last = self._records_of(np.asarray([start, start + length - 1], np.int64)).tolist()
        bounds = np.clip(self.record_start[first:last + 2], start, start + length)
        return self.ranges(bounds[:-1], bounds[1:], dtype=dtype)

    def ranges(self, starts: Any, stops: Any, *, dtype: Any = np.int64, out: np.ndarray | None = None,
               position_ids: np.ndarray | None = None, labels: np.ndarray | None = None,
               ignore_id: int = -100) -> np.ndarray:
        """Tokens ``[starts[k], stops[k])`` back to back (into ``out`` when given; each range
        lies in one record), and their positions and next-token labels when given (one
        compiled pass, as a TOKSTREAM reader's ``ranges``)."""
        starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
        dt = np.dtype(dtype) if out is None else out.dtype
        recs = self._records_of(starts)
        if out is None:
            out = np.empty(int((stops - starts).sum()), dt)
        at = 0
        for r, a, b in zip(recs.tolist(), starts.tolist(), stops.tolist(), strict=True):
            base = int(self.record_start[r])
            part = self.records.read_record(r)[a - base:b - base]
            if dt == np.int32 and part.dtype == np.uint32 and part.size and int(part.max()) >= 1 << 31:
                raise ConfigError("a token id does not fit int32 (read int64)", path=self.path, field="dtype")
            out[at:at + part.size] = part
            at += part.size
        if position_ids is not None or labels is not None:
            flat_layout(out, stops - starts, position_ids, labels, ignore_id)     # GIL released
        return out

    def prefetch(self, starts: Any = None, length: int | None = None, stops: Any = None, *,
                 documents: Any = None) -> None:
        """Read-ahead hint: the records under the ranges starting at ``starts`` (or the
        records ``documents``) fetched in the background from a URL."""
        recs = documents if documents is not None else self._records_of(np.asarray(starts, np.int64))
        self.records.prefetch(np.unique(np.asarray(recs, np.int64)))

    def close(self) -> None:
        self.records.close()
