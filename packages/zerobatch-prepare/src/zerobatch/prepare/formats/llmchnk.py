"""LLMCHNK in preparation: its ``convert --to`` target, and its files read as records."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from zerobatch.prepare.formats import PIECE, Documents
from zerobatch.prepare.sources import documents
from zerobatch.prepare.targets import Chunks, Target

__all__ = ["LLMChunkDocuments", "write"]


class LLMChunkDocuments(Documents):
    """An LLMCHNK file's records, in order, each one document."""

    kind = "llmchnk"

    def __init__(self, path: str, field: str | None = None) -> None:
        super().__init__(path)
        from zerobatch.readers.llmchnk import LLMChunkReader

        self.r = LLMChunkReader(path)

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

    def close(self) -> None:
        self.r.close()


def write(dst: str, chunks: Chunks, target: Target) -> str:
    """``convert --to llmchnk``: one record per document (a document longer than
    ``--seq-len``, when given, is cut into records of that length)."""
    from zerobatch.writers.llmchnk import LLMChunkWriter

    seq_len = target.options.seq_len or 0
    n = 0
    with LLMChunkWriter(dst, seq_len=seq_len, dtype=target.dtype) as w:
        for doc in documents(chunks):
            if seq_len and doc.size > seq_len:
                for s in range(0, doc.size, seq_len):
                    w.add(doc[s:s + seq_len])
                    n += 1
            else:
                w.add(doc)
                n += 1
    return f"{n:,} records, {target.num_tokens:,} tokens ({target.dtype})"
