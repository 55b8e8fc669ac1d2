"""ZRECORD on the command line: its face for ``inspect`` / ``verify`` / ``head`` / ``stats`` /
``bench``, and its ``convert`` target."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from zerobatch.cli.convert import Chunks, Target, build_folder, documents
from zerobatch.cli.datasets import Dataset, Progress, folder_size, human
from zerobatch.formats.errors import ConfigError, CorruptError, NotFoundError

__all__ = ["ZRecord", "write"]


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
        remote = self.r.remote
        size = None if remote else folder_size(self.path)    # a store at a URL is never listed
        rows: list[tuple[str, Any]] = [
            ("format", "ZRECORD (multi-field record store)" + (" at a URL (read-only)" if remote else "")),
            ("records", len(self.r)), ("fields", fields),
            ("checksums", "XXH3-64 per record container, CRC-32 per offset entry, checked commit record"),
        ]
        if size is not None:
            rows.append(("size", f"{size} ({human(size)})"))
        return rows

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

    def print_value_stats(self, path: str, *, top: int, plot: str | None, as_json: bool = False) -> int:
        """Refused: ``stats`` counts the token ids of an integer field.

        Raises:
            ConfigError: the field chosen holds no integers.
        """
        dtype = next(f.dtype for f in self.r.fields if f.name == self.field)
        ints = [f.name for f in self.r.fields if f.dtype not in ("bytes", "bool", "f16", "f32", "f64")]
        raise ConfigError(f"stats: field {self.field!r} holds {dtype} values, not token ids; choose an integer "
                          f"field with --field (integer fields: {ints or 'none'})", path=self.path, field="field")

    def close(self) -> None:
        self.r.close()


def write(dst: str, chunks: Chunks, target: Target) -> str:
    """``convert --to zrecord``: one record per document, field ``tokens`` (built under a
    temporary name and renamed into place)."""
    from zerobatch.writers.zrecord import ZRecordWriter

    args = target.options

    def build(folder: str) -> str:
        spec = [{"name": "tokens", "dtype": "u16" if target.dtype == "uint16" else "u32", "shape": None,
                 "compress": args.compress}]
        if target.rows is not None:
            spec.append({"name": "row", "dtype": "i64", "shape": [], "compress": "raw"})
        w = ZRecordWriter(folder, spec, num_writers=max(1, min(args.workers, 8)))
        np_dt = np.uint16 if target.dtype == "uint16" else np.uint32
        docs = (np.ascontiguousarray(d, dtype=np_dt) for d in documents(chunks))
        if target.rows is not None:
            rows = target.rows()
            docs = ({"tokens": d, "row": np.int64(next(rows))} for d in docs)  # type: ignore[assignment]
        try:
            n = len(w.extend(docs))
        except BaseException:
            w.close(commit=False)
            raise
        w.close()
        return f"{n:,} records (field tokens, {target.dtype}, {args.compress})"
    return f"{build_folder(dst, build, overwrite=target.options.overwrite)}, {target.num_tokens:,} tokens"
