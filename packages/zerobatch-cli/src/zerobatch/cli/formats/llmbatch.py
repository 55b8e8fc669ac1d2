"""LLMBATCH on the command line: its face for ``inspect`` / ``verify`` / ``head`` / ``stats`` /
``bench`` (its ``convert`` target is :mod:`zerobatch.prepare.formats.llmbatch`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from zerobatch.cli.datasets import Dataset, Progress, human
from zerobatch.prepare.formats.llmbatch import LLMBatchDocuments

__all__ = ["LLMBatch"]


class LLMBatch(LLMBatchDocuments, Dataset):
    stored_batches = True

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

    def batch_reader(self, batch_size: int, seq_len: int, rng: np.random.Generator
                     ) -> tuple[Callable[[], Any], int, int]:
        out = np.empty((self.r.batch_size, self.r.seq_len), np.int64)
        n = self.r.num_batches
        order = iter(rng.permutation(n).tolist() * 1000)

        def read() -> Any:
            return self.r.read_batch_numpy(next(order), np.int64, out)
        return read, n, self.r.batch_size * self.r.seq_len
