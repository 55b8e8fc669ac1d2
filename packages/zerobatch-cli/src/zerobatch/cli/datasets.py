"""One face over every zerobatch format for ``inspect``, ``verify``, ``head``, ``stats`` and
``bench``: :func:`open_dataset` recognises the format from the bytes (file magic) or the
folder's files, then each class describes, checks, samples and times its format through
the package's own reader.
"""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from zerobatch.formats.errors import CorruptError, NotFoundError

__all__ = ["Dataset", "open_dataset"]

Progress = Callable[[int, int], None]
#: Tokens read per piece when streaming a dataset for statistics.
PIECE = 1 << 22


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _folder_size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs
               if os.path.isfile(os.path.join(d, f)))


class Dataset(abc.ABC):
    """A dataset opened for the commands. Token formats also give :meth:`token_pieces`;
    :meth:`batch_reader` returns the batch read ``bench`` times."""

    kind = ""
    tokens = True

    def __init__(self, path: str) -> None:
        self.path = path

    @abc.abstractmethod
    def info(self) -> list[tuple[str, Any]]:
        """``(name, value)`` rows for ``inspect``."""

    @abc.abstractmethod
    def verify(self, progress: Progress | None) -> tuple[list[str], str]:
        """``(faults, summary)``: each fault names the file and the place."""

    @abc.abstractmethod
    def samples(self, n: int) -> list[np.ndarray]:
        """The first ``n`` samples."""

    def sample_name(self) -> str:
        return "record"

    @abc.abstractmethod
    def lengths(self) -> np.ndarray:
        """Tokens per document (or per record, for formats without documents)."""

    def token_pieces(self) -> Iterator[np.ndarray]:
        """The tokens in reading order, in bounded pieces (none for non-token formats)."""
        return iter(())

    @abc.abstractmethod
    def batch_reader(self, batch_size: int, seq_len: int, rng: np.random.Generator
                     ) -> tuple[Callable[[], Any], int, int]:
        """``(read, units, tokens_per_read)``: ``read()`` reads one random batch of
        ``batch_size`` samples; ``units`` how many distinct batches there are."""

    def close(self) -> None:  # noqa: B027 - a dataset with no reader of its own has nothing to release
        """Release the reader (idempotent)."""


class LLMBatch(Dataset):
    kind = "llmbatch"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        from zerobatch.readers.llmbatch import BatchFileReader

        self.r = BatchFileReader(path, verify=False)

    def info(self) -> list[tuple[str, Any]]:
        h = self.r.header
        rows: list[tuple[str, Any]] = [
            ("format", f"LLMBATCH v{h.version}" + (" + zerobatch integrity extension" if h.has_extension
                                                  else " (seed layout, no checksums)")),
            ("batch_size", h.batch_size), ("seq_len", h.seq_len), ("num_batches", h.num_batches),
            ("dtype", "uint32 (code 0)"), ("seed", h.seed),
            ("total_records", f"{h.total_records} ({h.total_records - h.num_batches * h.batch_size} dropped)"),
            ("tokens", h.num_tokens), ("raw_batch_bytes", h.raw_batch_bytes),
            ("padded_batch_bytes", f"{h.padded_batch_bytes} ({h.padded_batch_bytes - h.raw_batch_bytes} padding)"),
            ("data", f"bytes {h.data_offset}..{h.trailer_offset}"),
            ("file_size", f"{h.file_size} ({human(h.file_size)})"),
        ]
        if h.has_extension:
            rows += [
                ("checksums", f"XXH3-64 per batch, trailer at {h.trailer_offset} ({h.trailer_size} bytes)"
                 if h.has_checksums else "none"),
                ("max_token", h.max_token if h.max_token is not None else "not recorded"),
                ("int32 safe", "yes" if h.max_token is not None and h.max_token < 2**31 else "no"),
                ("build_id", h.build_id.hex() if h.build_id else ""),
            ]
        else:
            rows.append(("checksums", "none"))
        return rows

    def json_info(self) -> dict[str, Any]:
        return {"format": "LLMBATCH", "path": self.path, **self.r.header.to_dict()}

    def verify(self, progress: Progress | None) -> tuple[list[str], str]:
        report = self.r.verify(progress)
        faults = []
        if report.num_bad_batches:
            shown = ", ".join(map(str, report.bad_batches[:10]))
            faults.append(f"{report.num_bad_batches} batches do not match their checksums (first: {shown})")
        if not report.padding_ok:
            faults.append("page padding is not all zero")
        if not report.max_token_ok:
            faults.append(f"the header's max_token does not match the largest token id found ({report.max_token})")
        what = ("checksums, padding and max_token" if report.has_checksums
                else "structure and padding (no checksums in this file)")
        return faults, f"{report.num_batches} batches, {what} verified"

    def samples(self, n: int) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        for b in range(self.r.num_batches):
            for row in self.r.read_batch(b):
                if len(out) == n:
                    return out
                out.append(np.asarray(row))
        return out

    def lengths(self) -> np.ndarray:
        return np.full(self.r.num_batches * self.r.batch_size, self.r.seq_len, np.int64)

    def token_pieces(self) -> Iterator[np.ndarray]:
        step = max(1, PIECE // (self.r.batch_size * self.r.seq_len))
        for b in range(0, self.r.num_batches, step):
            yield self.r.read_batches(np.arange(b, min(self.r.num_batches, b + step)), dtype=np.int64).reshape(-1)

    def batch_reader(self, batch_size: int, seq_len: int, rng: np.random.Generator
                     ) -> tuple[Callable[[], Any], int, int]:
        out = np.empty((self.r.batch_size, self.r.seq_len), np.int64)
        n = self.r.num_batches
        order = iter(rng.permutation(n).tolist() * 1000)

        def read() -> Any:
            return self.r.read_batch_numpy(next(order), np.int64, out)
        return read, n, self.r.batch_size * self.r.seq_len

    def close(self) -> None:
        self.r.close()


class LLMChunk(Dataset):
    kind = "llmchnk"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        from zerobatch.readers.llmchnk import LLMChunkReader

        self.r = LLMChunkReader(path)

    def info(self) -> list[tuple[str, Any]]:
        h, r = self.r.header, self.r
        size = os.path.getsize(self.path)
        lengths = r.lengths()
        return [
            ("format", f"LLMCHNK v{h.version} (ZeroBatch v1: records behind an offset table)"),
            ("num_records", r.num_records), ("seq_len", f"{r.seq_len} (nominal)" if r.seq_len else "0 (none)"),
            ("dtype", str(r.dtype)), ("tokens", r.num_tokens),
            ("record_lengths", f"min {int(lengths.min()) if lengths.size else 0}, max "
                               f"{int(lengths.max()) if lengths.size else 0}, mean "
                               f"{float(lengths.mean()) if lengths.size else 0:.1f}"),
            ("checksums", "XXH3-64 per record + digest of header and table" if h.checksums else "none"),
            ("fingerprint", r.fingerprint),
            ("file_size", f"{size} ({human(size)})"),
        ]

    def verify(self, progress: Progress | None) -> tuple[list[str], str]:
        report = self.r.verify(progress)
        faults = []
        if report.bad_records:
            shown = ", ".join(map(str, report.bad_records[:10]))
            faults.append(f"{len(report.bad_records)} records do not match their checksums (first: {shown})")
        what = "checksums" if self.r.header.checksums else "structure (no checksums in this file)"
        return faults, f"{self.r.num_records} records, {what} verified"

    def samples(self, n: int) -> list[np.ndarray]:
        return [np.asarray(self.r.read_record(i)) for i in range(min(n, self.r.num_records))]

    def lengths(self) -> np.ndarray:
        return self.r.lengths()

    def token_pieces(self) -> Iterator[np.ndarray]:
        lengths = self.r.lengths()
        ends = np.cumsum(lengths)
        i = 0
        while i < lengths.size:
            j = max(i + 1, int(np.searchsorted(ends, (ends[i - 1] if i else 0) + PIECE, side="right")))
            yield np.concatenate([self.r.read_record(k) for k in range(i, min(j, lengths.size))])
            i = j

    def batch_reader(self, batch_size: int, seq_len: int, rng: np.random.Generator
                     ) -> tuple[Callable[[], Any], int, int]:
        out = np.empty((batch_size, seq_len), np.int64)
        n = self.r.num_records

        def read() -> Any:
            return self.r.gather(rng.integers(0, n, batch_size), seq_len, out=out)
        return read, max(1, n // batch_size), batch_size * seq_len

    def close(self) -> None:
        self.r.close()


class TokStream(Dataset):
    kind = "tokstream"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        from zerobatch.readers.tokstream import TokenStreamReader

        self.r = TokenStreamReader(path)

    def info(self) -> list[tuple[str, Any]]:
        m, r = self.r.manifest, self.r
        size = _folder_size(self.path)
        return [
            ("format", "TOKSTREAM v1 (sharded token stream)"),
            ("tokens", r.num_tokens), ("documents", r.num_documents), ("shards", len(m.shards)),
            ("vocab_size", m.vocab_size), ("dtype", m.token_dtype),
            ("eod_token", m.eod_token if m.eod_token is not None else "none"),
            ("metadata", "per-token metadata ids + blobs" if m.metadata else "none"),
            ("checksums", "XXH3-64 per 16 MiB chunk of every file, index files in full"),
            ("build_id", m.build_id), ("size", f"{size} ({human(size)})"),
        ]

    def verify(self, progress: Progress | None) -> tuple[list[str], str]:
        report = self.r.verify(progress)
        faults = [f"{p}: {msg}" for p, msg in report.problems]
        return faults, (f"{report.shards} shards, {report.files} files, {human(report.bytes_checked)} checked "
                        "(checksums, indexes, vocabulary)")

    def sample_name(self) -> str:
        return "document"

    def samples(self, n: int) -> list[np.ndarray]:
        return [self.r.document(i) for i in range(min(n, self.r.num_documents))]

    def lengths(self) -> np.ndarray:
        starts, stops = self.r.document_spans(np.arange(self.r.num_documents))
        return (stops - starts).astype(np.int64)

    def token_pieces(self) -> Iterator[np.ndarray]:
        for s in range(0, self.r.num_tokens, PIECE):
            yield self.r.window(s, min(PIECE, self.r.num_tokens - s))

    def batch_reader(self, batch_size: int, seq_len: int, rng: np.random.Generator
                     ) -> tuple[Callable[[], Any], int, int]:
        out = np.empty((batch_size, seq_len), np.int64)
        n = self.r.num_tokens - seq_len + 1
        if n < 1:
            raise CorruptError(f"bench: the dataset holds fewer than {seq_len} tokens", path=self.path, field="seq_len")

        def read() -> Any:
            return self.r.windows(rng.integers(0, n, batch_size), seq_len, out=out)
        return read, max(1, self.r.num_tokens // (batch_size * seq_len)), batch_size * seq_len

    def close(self) -> None:
        self.r.close()


class ZRecord(Dataset):
    kind = "zrecord"

    def __init__(self, path: str, field: str | None = None) -> None:
        super().__init__(path)
        from zerobatch.readers.zrecord import ZRecordStore

        self.r = ZRecordStore(path)
        names = self.r.keys()
        ints = [f.name for f in self.r.fields if f.dtype not in ("bytes", "bool", "f16", "f32", "f64")]
        default = "tokens" if "tokens" in names else (ints[0] if ints else names[0])
        self.field = field if field is not None else default
        if self.field not in names:
            raise NotFoundError(f"--field: no field {self.field!r} (fields: {names})", path=path, field="field")
        self.tokens = self.field in ints

    def info(self) -> list[tuple[str, Any]]:
        fields = ", ".join(f"{f.name} ({f.dtype}, "
                           f"{'shape ' + str(list(f.shape)) if f.shape is not None else 'variable'}"
                           f", {f.compress})" for f in self.r.fields)
        size = _folder_size(self.path)
        return [
            ("format", "ZRECORD (multi-field record store)"),
            ("records", len(self.r)), ("fields", fields),
            ("checksums", "XXH3-64 per record container, CRC-32 per offset entry, checked commit record"),
            ("size", f"{size} ({human(size)})"),
        ]

    def verify(self, progress: Progress | None) -> tuple[list[str], str]:
        n = len(self.r)
        step = 4096
        for s in range(0, n, step):
            self.r.gather(np.arange(s, min(n, s + step), dtype=np.int64)).release()
            if progress is not None:
                progress(min(n, s + step), n)
        return [], f"{n} records of {len(self.r.fields)} fields: every entry and record checksum verified"

    def _field_values(self, idx: np.ndarray) -> list[np.ndarray]:
        with self.r.gather(idx, [self.field]) as b:
            return [np.array(v) if v is not None else np.zeros(0) for v in b[self.field]]

    def samples(self, n: int) -> list[np.ndarray]:
        return self._field_values(np.arange(min(n, len(self.r)), dtype=np.int64))

    def lengths(self) -> np.ndarray:
        out = []
        for s in range(0, len(self.r), 4096):
            out += [v.size for v in self._field_values(np.arange(s, min(len(self.r), s + 4096), dtype=np.int64))]
        return np.array(out, np.int64)

    def token_pieces(self) -> Iterator[np.ndarray]:
        for s in range(0, len(self.r), 4096):
            vals = self._field_values(np.arange(s, min(len(self.r), s + 4096), dtype=np.int64))
            if vals:
                yield np.concatenate([v.reshape(-1) for v in vals]).astype(np.int64)

    def batch_reader(self, batch_size: int, seq_len: int, rng: np.random.Generator
                     ) -> tuple[Callable[[], Any], int, int]:
        n = len(self.r)
        if n == 0:
            raise CorruptError("bench: the store holds no records", path=self.path, field="records")
        mean = max(1, int(self.lengths()[: 4096].mean())) if self.tokens else 1

        def read() -> Any:
            self.r.gather(rng.integers(0, n, batch_size), [self.field], zero_copy=True).release()
        return read, max(1, n // batch_size), batch_size * mean

    def close(self) -> None:
        self.r.close()


class Features(Dataset):
    kind = "features"
    tokens = False

    def __init__(self, path: str) -> None:
        super().__init__(path)
        from zerobatch.readers.features import FeatureMatrix

        self.r = FeatureMatrix(path, 1)

    def info(self) -> list[tuple[str, Any]]:
        m = self.r.meta
        size = _folder_size(self.path)
        return [
            ("format", "flat feature matrix"), ("rows", m.num_rows), ("features", m.num_features),
            ("dtype", m.dtype), ("keys", len(m.keys)),
            ("normalization", "mean/std per feature" if m.mean is not None else "none"),
            ("columns", ", ".join(m.columns) if getattr(m, "columns", None) else "unnamed"),
            ("checksums", f"XXH3-64 per {human(m.block_bytes)} block + metadata_xxh3"),
            ("build_id", m.build_id), ("size", f"{size} ({human(size)})"),
        ]

    def verify(self, progress: Progress | None) -> tuple[list[str], str]:
        self.r.verify()
        return [], f"{self.r.meta.num_rows} rows x {self.r.meta.num_features}: metadata and every block verified"

    def sample_name(self) -> str:
        return "row"

    def samples(self, n: int) -> list[np.ndarray]:
        return [np.array(self.r.matrix[i]) for i in range(min(n, self.r.num_rows))]

    def lengths(self) -> np.ndarray:
        return (self.r.key_stops - self.r.key_starts).astype(np.int64)

    def batch_reader(self, batch_size: int, seq_len: int, rng: np.random.Generator
                     ) -> tuple[Callable[[], Any], int, int]:
        from zerobatch.readers.features import FeatureMatrix

        fm = FeatureMatrix(self.path, seq_len)
        total = int(fm.key_windows.sum())
        if total == 0:
            raise CorruptError(f"bench: no key has {seq_len} rows (use --seq-len)", path=self.path, field="seq_len")
        out = np.empty((batch_size, seq_len, fm.num_features), fm.meta.np_dtype)

        def read() -> Any:
            return fm.windows(rng.integers(0, total, batch_size), out=out)
        return read, max(1, total // batch_size), batch_size * seq_len

    def close(self) -> None:
        pass


def detect(path: str) -> str:
    """The format at ``path``: from the magic of a file, the files of a folder."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "manifest.json")):
            return "tokstream"
        if os.path.exists(os.path.join(path, "meta.json")) and os.path.exists(os.path.join(path, "commit.zr")):
            return "zrecord"
        if os.path.exists(os.path.join(path, "metadata.json")):
            return "features"
        raise CorruptError("format: not a zerobatch dataset folder (no manifest.json, meta.json or metadata.json)",
                           path=path, field="format")
    from zerobatch.core.io import open_regular_file, pread_exact
    from zerobatch.formats import llmbatch as L
    from zerobatch.formats import llmchnk as C

    fd, st = open_regular_file(path)
    try:
        magic = pread_exact(fd, min(8, st.st_size), 0, path=path, field="magic")
    finally:
        os.close(fd)
    if magic == L.MAGIC:
        return "llmbatch"
    if magic == C.MAGIC:
        return "llmchnk"
    raise CorruptError(f"magic: not a zerobatch file (first bytes {magic!r})", path=path, field="magic")


def open_dataset(path: str, *, field: str | None = None) -> Dataset:
    if not os.path.exists(path):
        raise NotFoundError("no such file or folder", path=path, field="path")
    kind = detect(path)
    if kind == "zrecord":
        return ZRecord(path, field)
    return {"llmbatch": LLMBatch, "llmchnk": LLMChunk, "tokstream": TokStream, "features": Features}[kind](path)


def percentiles(samples: list[float]) -> dict[str, float]:
    a = np.array(samples)
    return {"avg": float(a.mean()), "p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99))}


def time_reads(read: Callable[[], Any], count: int, warmup: int = 8) -> list[float]:
    for _ in range(warmup):
        read()
    out = []
    clock = time.perf_counter
    for _ in range(count):
        t = clock()
        read()
        out.append(clock() - t)
    return out
