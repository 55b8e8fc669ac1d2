"""LLMCHNK on the command line: its face for ``inspect`` / ``verify`` / ``head`` / ``stats`` /
``bench`` (its ``convert`` target is :mod:`zerobatch.prepare.formats.llmchnk`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from zerobatch.cli.datasets import Dataset, Progress, human
from zerobatch.prepare.formats.llmchnk import LLMChunkDocuments

__all__ = ["LLMChunk"]


class LLMChunk(LLMChunkDocuments, Dataset):

    def info(self) -> list[tuple[str, Any]]:
        h, r = self.r.header, self.r
        size = r.geometry.file_size
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

    def batch_reader(self, batch_size: int, seq_len: int, rng: np.random.Generator
                     ) -> tuple[Callable[[], Any], int, int]:
        out = np.empty((batch_size, seq_len), np.int64)
        n = self.r.num_records

        def read() -> Any:
            return self.r.gather(rng.integers(0, n, batch_size), seq_len, out=out)
        return read, max(1, n // batch_size), batch_size * seq_len
