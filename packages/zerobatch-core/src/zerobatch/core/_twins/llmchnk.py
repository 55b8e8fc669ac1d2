"""LLMCHNK record gathers: the twin of ``_llmchnk.pyx``."""

from __future__ import annotations

from typing import Any

import numpy as np
from zerobatch.core._twins.hash import xxh3_64
from zerobatch.formats.errors import ConfigError, IntegrityError, OutOfRangeError

__all__ = ["ChunkRecords"]


# --------------------------------------------------------------------------------------------
# LLMCHNK records


class ChunkRecords:
    """Twin of :class:`zerobatch.core._llmchnk.ChunkRecords` (NumPy, same checks and errors)."""

    def __init__(self, buffer: Any, num_records: int, itemsize: int, checksums: bool, verified: Any = None,
                 path: Any = None) -> None:
        if itemsize not in (2, 4):
            raise ConfigError(f"itemsize must be 2 or 4, got {itemsize}", path=path, field="dtype")
        self._buf = np.frombuffer(buffer, np.uint8)
        self.num_records = int(num_records)
        self.itemsize = itemsize
        self.checksums = bool(checksums)
        self.path = path
        if 32 + 8 * (self.num_records + 1) > self._buf.size:
            raise ConfigError("the buffer is shorter than the offset table", path=path, field="num_records")
        self._table = self._buf[32:32 + 8 * (self.num_records + 1)].view("<u8")
        self._sums = self._buf[self._buf.size - 16 - 8 * self.num_records:self._buf.size - 16].view("<u8") \
            if checksums else None
        self._verified = None
        if verified is not None and checksums:
            if not isinstance(verified, np.ndarray) or verified.dtype != np.uint8 or verified.size < self.num_records \
                    or not verified.flags.c_contiguous or not verified.flags.writeable:
                raise ConfigError(f"verified must be a writable uint8 array of {self.num_records} bytes",
                                  field="verified")
            self._verified = verified

    def _index(self, i: int) -> int:
        if not 0 <= i < self.num_records:
            raise OutOfRangeError(f"record index {i} out of range [0, {self.num_records})", path=self.path, field="index")
        return i

    def _check(self, i: int, verified: Any = None) -> None:
        verified = self._verified if verified is None else verified
        if verified is None or verified[i]:
            return
        a, b = int(self._table[i]), int(self._table[i + 1])
        got, stored = xxh3_64(self._buf[a:b].tobytes()), int(self._sums[i])  # type: ignore[index]
        if got != stored:
            raise IntegrityError(f"record_checksum: record {i} does not match its checksum (stored "
                                 f"0x{stored:016x}, computed 0x{got:016x})", path=self.path, field="record_checksum")
        verified[i] = 1

    def span(self, i: int) -> tuple[int, int]:
        self._check(self._index(int(i)))
        a = int(self._table[i])
        return a, (int(self._table[i + 1]) - a) // self.itemsize

    def lengths(self, indices: Any) -> np.ndarray:
        idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        for i in idx.tolist():
            self._index(i)
        return ((self._table[idx + 1] - self._table[idx]) // self.itemsize).astype(np.int64)

    def check(self, start: int, stop: int) -> list[int]:
        if start < 0 or stop > self.num_records or start > stop:
            raise ConfigError(f"check: [{start}, {stop}) is not inside [0, {self.num_records})", field="stop")
        bad = []
        if self._sums is None:
            return bad
        fresh = np.zeros(max(self.num_records, 1), np.uint8)
        for i in range(start, stop):
            try:
                self._check(i, fresh)
            except IntegrityError:
                bad.append(i)
                continue
            if self._verified is not None:
                self._verified[i] = 1
        return bad

    def gather(self, indices: Any, out: Any, mask: Any = None, pad_id: int = 0) -> np.ndarray:
        idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        k = idx.size
        if not isinstance(out, np.ndarray) or out.ndim != 2 or out.shape[0] != k \
                or out.dtype not in (np.int64, np.int32) or not out.flags.c_contiguous or not out.flags.writeable:
            raise ConfigError(f"out must be a writable C-contiguous int64 or int32 array of {k} rows", field="out")
        wide = out.dtype == np.int64
        if not wide and not -2**31 <= pad_id < 2**31:
            raise ConfigError(f"pad_id {pad_id} does not fit in int32", field="pad_id")
        if mask is not None and (not isinstance(mask, np.ndarray) or mask.shape != out.shape
                                 or mask.dtype not in (np.uint8, np.bool_) or not mask.flags.c_contiguous
                                 or not mask.flags.writeable):
            raise ConfigError(f"mask must be a writable C-contiguous bool or uint8 array of shape {out.shape}",
                              field="mask")
        for i in idx.tolist():
            self._index(i)
        width = out.shape[1]
        dt = "<u4" if self.itemsize == 4 else "<u2"
        lengths = np.empty(k, np.int64)
        for r, i in enumerate(idx.tolist()):
            self._check(i)
            a, b = int(self._table[i]), int(self._table[i + 1])
            tokens = self._buf[a:b].view(dt)
            lengths[r] = tokens.size
            m = min(tokens.size, width)
            if not wide and m and int(tokens[:m].max()) >= 2**31:
                raise ConfigError(f"record {i} holds a token id of 2**31 or more, which does not fit in int32; "
                                  "read it as int64", path=self.path, field="dtype")
            out[r, :m] = tokens[:m]
            out[r, m:] = pad_id
            if mask is not None:
                mask[r, :m] = 1
                mask[r, m:] = 0
        return lengths
