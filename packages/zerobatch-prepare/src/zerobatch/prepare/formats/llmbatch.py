"""LLMBATCH in preparation: its ``convert --to`` target, and its files read as records."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from zerobatch.formats.errors import ConfigError
from zerobatch.prepare.formats import PIECE, Documents
from zerobatch.prepare.targets import Chunks, Target, records

__all__ = ["LLMBatchDocuments", "write"]


class LLMBatchDocuments(Documents):
    """An LLMBATCH file's rows, in stored order, each one document (of ``seq_len`` tokens)."""

    kind = "llmbatch"

    def __init__(self, path: str, field: str | None = None) -> None:
        super().__init__(path)
        from zerobatch.readers.llmbatch import BatchFileReader

        self.r = BatchFileReader(path, verify=False)

    def lengths(self) -> np.ndarray:
        return np.full(self.r.num_batches * self.r.batch_size, self.r.seq_len, np.int64)

    def token_pieces(self) -> Iterator[np.ndarray]:
        step = max(1, PIECE // (self.r.batch_size * self.r.seq_len))
        for b in range(0, self.r.num_batches, step):
            yield self.r.read_batches(np.arange(b, min(self.r.num_batches, b + step)), dtype=np.int64).reshape(-1)

    def close(self) -> None:
        self.r.close()


def write(dst: str, chunks: Chunks, target: Target) -> str:
    """``convert --to llmbatch``: the documents concatenated and cut into ``--seq-len`` records
    (the tail that does not fill one is dropped), shuffled with ``--seed`` into
    ``--batch-size`` batches."""
    from zerobatch.writers.llmbatch import write_batch_dataset

    args = target.options
    seq_len, batch_size = args.seq_len or 512, args.batch_size
    n = target.num_tokens // seq_len
    if n < batch_size:
        raise ConfigError(f"--batch-size: {target.num_tokens} tokens make {n} records of {seq_len}, fewer than "
                          f"one batch of {batch_size}", field="batch_size")
    nb = write_batch_dataset(dst, records(chunks, seq_len), n, batch_size, seq_len, args.seed, shuffle=args.shuffle)
    dropped = target.num_tokens - nb * batch_size * seq_len
    return (f"{nb} batches of {batch_size} x {seq_len} ({nb * batch_size * seq_len:,} tokens; {dropped:,} "
            f"tokens that do not fill a whole batch dropped)")
