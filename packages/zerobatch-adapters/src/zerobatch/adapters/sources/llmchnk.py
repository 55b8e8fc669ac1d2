"""LLMCHNK as a loader source: one record per row, padded or cut to a length chosen at read time."""

from __future__ import annotations

from typing import Any

import numpy as np

from zerobatch.adapters.sources._base import (CHUNK_BYTES, Access, Array, Source, check_dataset, check_pad_id,
                                              check_seq_len, open_reader)

__all__ = ["LLMChunkSource"]


class LLMChunkSource(Source):
    """The records of an LLMCHNK file, one per row, padded or cut to ``seq_len`` tokens (the
    batch size is chosen at read time).

    Args:
        path: the file or an open :class:`~zerobatch.readers.llmchnk.LLMChunkReader`.
        seq_len: tokens per row (default: the header's nominal length).
        pad_id: the id written after a short record.
        mask: hand out ``{"input_ids", "attention_mask"}`` (True on record tokens) instead of
            the token array alone.
        verify: check each record's checksum the first time it is read.
    """

    kind = "llmchnk"
    item_name = "records"

    def __init__(self, path: Any, seq_len: int | None = None, *, pad_id: int = 0, mask: bool = False,
                 verify: bool = True) -> None:
        super().__init__()
        from zerobatch.readers.llmchnk import LLMChunkReader
        check_dataset(path, "LLMChunkSource", ("llmchnk",))
        self.reader = open_reader(path, LLMChunkReader, verify=verify)
        width = self.reader.seq_len if seq_len is None else seq_len
        self.seq_len = check_seq_len(width)
        self.pad_id = check_pad_id(pad_id)
        self.mask = bool(mask)
        self.output = {"input_ids": Array("tokens"), "attention_mask": Array("mask")} if self.mask else Array("tokens")
        self.num_items = self.reader.num_records
        self.fingerprint = self.reader.fingerprint


    @property
    def access(self) -> Access:
        return self.reader.access
    def chunk_steps(self, items_per_step: int) -> int:
        return max(1, CHUNK_BYTES // (items_per_step * self.seq_len * 8))

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any]:
        steps, per = items.shape
        out = self._buffer((steps * per, self.seq_len), dtype)
        # the compiled gather writes the mask with the rows when given one
        mask = self._buffer((steps * per, self.seq_len), np.dtype(np.bool_)) if self.mask else None
        self.reader.read_into(items, out, mask=mask, pad_id=self.pad_id)
        result = {"tokens": out.reshape(steps, per, self.seq_len)}
        if mask is not None:
            result["mask"] = mask.reshape(steps, per, self.seq_len)
        return result

    def close(self) -> None:
        self.reader.close()

