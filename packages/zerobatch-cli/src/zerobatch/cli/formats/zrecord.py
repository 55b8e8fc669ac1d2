"""ZRECORD on the command line: its face for ``inspect`` / ``verify`` / ``head`` / ``stats`` /
``bench`` (its ``convert`` target is :mod:`zerobatch.prepare.formats.zrecord`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from zerobatch.cli.datasets import Dataset, Progress, folder_size, human
from zerobatch.formats.errors import ConfigError, CorruptError
from zerobatch.prepare.formats.zrecord import ZRecordDocuments

__all__ = ["ZRecord"]


class ZRecord(ZRecordDocuments, Dataset):

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

    def samples(self, n: int) -> list[np.ndarray]:
        return self._field_values(np.arange(min(n, len(self.r)), dtype=np.int64))

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
