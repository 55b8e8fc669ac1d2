"""Feature-matrix window location and row gathers: the twin of ``_features.pyx``."""

from __future__ import annotations

from typing import Any

import numpy as np
from zerobatch.formats.errors import ConfigError, OutOfRangeError

__all__ = ["gather_rows", "locate_windows"]


# --------------------------------------------------------------------------------------------
# feature matrices


def locate_windows(cum: Any, starts: Any, stride: int, indices: Any, rows: Any,
                   keys: Any) -> tuple[np.ndarray, np.ndarray]:
    """Twin of :func:`zerobatch.core._features.locate`."""
    cum = np.asarray(cum, np.int64)
    starts = np.asarray(starts, np.int64)
    idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    if cum.size != starts.size + 1 or len(rows) < idx.size or len(keys) < idx.size:
        raise ConfigError("locate: cum needs K + 1 entries and rows / keys room for every index", field="cum")
    total = int(cum[-1])
    for g in idx.tolist():
        if not 0 <= g < total:
            raise OutOfRangeError(f"window index {g} out of range [0, {total})")
    k = np.searchsorted(cum, idx, side="right") - 1
    rows[:idx.size] = starts[k] + (idx - cum[k]) * stride
    keys[:idx.size] = k
    return np.asarray(rows[:idx.size]), np.asarray(keys[:idx.size])


def gather_rows(buffer: Any, row_bytes: int, total_rows: int, rows: Any, count: int, out: Any) -> Any:
    """Twin of :func:`zerobatch.core._features.gather_rows`."""
    rr = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
    if row_bytes <= 0 or count < 0 or total_rows < 0:
        raise ConfigError("gather_rows: row_bytes must be positive, count and total_rows not negative",
                          field="row_bytes")
    for r in rr.tolist():
        if r < 0 or r > total_rows - count:
            raise OutOfRangeError(f"rows [{r}, {r + count}) are outside the matrix's {total_rows} rows")
    src = np.frombuffer(buffer, np.uint8)
    if src.size < total_rows * row_bytes:
        raise ConfigError("gather_rows: the buffer is shorter than total_rows rows", field="buffer")
    dst = out.reshape(-1).view(np.uint8)
    if dst.size != rr.size * count * row_bytes:
        raise ConfigError(f"out must hold {rr.size} windows of {count} rows of {row_bytes} bytes", field="out")
    w = count * row_bytes
    for i, r in enumerate(rr.tolist()):
        dst[i * w:(i + 1) * w] = src[r * row_bytes:r * row_bytes + w]
    return out
