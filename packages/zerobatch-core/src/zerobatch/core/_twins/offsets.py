"""Batch offsets and block-shuffle positions: the twin of ``_offsets.pyx``."""

from __future__ import annotations

from typing import Any

import numpy as np
from zerobatch.formats import llmbatch as L
from zerobatch.formats.errors import ConfigError, OutOfRangeError

__all__ = ["block_shuffle_items", "first_unordered", "llmbatch_batch_offsets"]


# --------------------------------------------------------------------------------------------
# Offsets and orders


def llmbatch_batch_offsets(indices: Any, padded_batch_bytes: int, num_batches: int, out: np.ndarray | None = None) -> np.ndarray:
    """Byte offsets of LLMBATCH batches: ``4096 + i * padded_batch_bytes``."""
    if padded_batch_bytes < 1 or num_batches < 0 or L.HEADER_SIZE + num_batches * padded_batch_bytes > 2**63 - 1:
        raise ConfigError(f"padded_batch_bytes {padded_batch_bytes} x num_batches {num_batches} "
                          f"is not a valid geometry", field="num_batches")
    idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    if out is None:
        out = np.empty(idx.size, dtype=np.int64)
    if out.shape != idx.shape:
        raise ConfigError(f"out holds {out.size} offsets, expected {idx.size}", field="out")
    if idx.size and (idx.min() < 0 or idx.max() >= num_batches):
        raise OutOfRangeError(f"a batch index is outside [0, {num_batches})")
    out[...] = L.HEADER_SIZE + idx * padded_batch_bytes
    return out


def block_shuffle_items(block_perm: Any, block_size: int, n: int, positions: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Items at the given epoch positions of a block-shuffle order (see the compiled twin)."""
    if block_size < 1 or n < 0:
        raise ConfigError(f"block_size must be >= 1 and n >= 0, got block_size={block_size}, n={n}",
                          field="block_size")
    nblocks = -(-n // block_size)
    perm = np.ascontiguousarray(block_perm, dtype=np.int64).reshape(-1)
    if perm.size != nblocks:
        raise ConfigError(f"block_perm holds {perm.size} blocks, expected {nblocks}", field="block_perm")
    if perm.size and (perm.min() < 0 or perm.max() >= nblocks):
        raise ConfigError(f"block_perm names a block outside [0, {nblocks})", field="block_perm")
    pos = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
    if out is None:
        out = np.empty(pos.size, dtype=np.int64)
    if out.shape != pos.shape:
        raise ConfigError(f"out holds {out.size} items, expected {pos.size}", field="out")
    if pos.size and (pos.min() < 0 or pos.max() >= n):
        raise OutOfRangeError(f"an epoch position is outside [0, {n})")
    # The whole order, spelled out: concatenate the blocks in permuted order.
    order = np.concatenate([np.arange(b * block_size, min((b + 1) * block_size, n)) for b in perm]) \
        if nblocks else np.empty(0, dtype=np.int64)
    out[...] = order[pos]
    return out


def first_unordered(values: Any, strict: bool = True) -> int:
    """The first index whose entry does not increase from the one before it, or -1 (see the
    compiled twin)."""
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.dtype != np.uint64:
        raise ConfigError(f"values must be a 1-D uint64 array, got {arr.dtype} of shape {arr.shape}", field="values")
    if arr.size < 2:
        return -1
    bad = (arr[1:] <= arr[:-1]) if strict else (arr[1:] < arr[:-1])
    return int(np.argmax(bad)) + 1 if bad.any() else -1
