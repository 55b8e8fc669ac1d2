"""ZRECORD in preparation: its ``convert --to`` target, and a store's token field read as
documents."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from zerobatch.formats.errors import NotFoundError
from zerobatch.prepare.formats import Documents
from zerobatch.prepare.sources import documents
from zerobatch.prepare.targets import Chunks, Target, build_folder

__all__ = ["ZRecordDocuments", "write"]

#: Records gathered per read when streaming a field.
STEP = 4096


class ZRecordDocuments(Documents):
    """A ZRECORD store's records, in order, each one document: the values of its token field
    (``field``; default ``tokens``, else its first integer field, else its first field)."""

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

    def _field_values(self, idx: np.ndarray) -> list[np.ndarray]:
        with self.r.gather(idx, [self.field]) as b:
            return [np.array(v) if v is not None else np.zeros(0) for v in b[self.field]]

    def lengths(self) -> np.ndarray:
        out = []
        for s in range(0, len(self.r), STEP):
            out += [v.size for v in self._field_values(np.arange(s, min(len(self.r), s + STEP), dtype=np.int64))]
        return np.array(out, np.int64)

    def token_pieces(self) -> Iterator[np.ndarray]:
        for s in range(0, len(self.r), STEP):
            vals = self._field_values(np.arange(s, min(len(self.r), s + STEP), dtype=np.int64))
            if vals:
                yield np.concatenate([v.reshape(-1) for v in vals]).astype(np.int64)

    def close(self) -> None:
        self.r.close()


def write(dst: str, chunks: Chunks, target: Target) -> str:
    """``convert --to zrecord``: one record per document, field ``tokens`` (built under a
    temporary name and renamed into place)."""
    from zerobatch.formats.zrecord import FieldSpec
    from zerobatch.writers.zrecord import ZRecordWriter

    args = target.options

    def build(folder: str) -> str:
        spec = [FieldSpec("tokens", "u16" if target.dtype == "uint16" else "u32", None, args.compress)]
        if target.rows is not None:
            spec.append(FieldSpec("row", "i64", (), "raw"))
        w = ZRecordWriter(folder, spec, num_writers=max(1, min(args.workers, 8)))
        np_dt = np.uint16 if target.dtype == "uint16" else np.uint32
        docs = (np.ascontiguousarray(d, dtype=np_dt) for d in documents(chunks))
        records: Iterator[np.ndarray | dict[str, np.ndarray | np.int64]] = docs
        if target.rows is not None:
            records = _with_rows(docs, target.rows())
        try:
            n = len(w.extend(records))
        except BaseException:
            w.close(commit=False)
            raise
        w.close()
        return f"{n:,} records (field tokens, {target.dtype}, {args.compress})"
    return f"{build_folder(dst, build, overwrite=target.options.overwrite)}, {target.num_tokens:,} tokens"


def _with_rows(docs: Iterator[np.ndarray], rows: Iterator[int]) -> Iterator[dict[str, np.ndarray | np.int64]]:
    """Each document as a record of two fields: its tokens and the source row it came from."""
    for d in docs:
        yield {"tokens": d, "row": np.int64(next(rows))}
