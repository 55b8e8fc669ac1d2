"""A folder of ``.npy`` token files (the seed's ``DatasetLoader`` data) as a loader source."""

from __future__ import annotations

from typing import Any

import numpy as np

from zerobatch.adapters.sources._base import (CHUNK_BYTES, Array, Source, check_dataset, check_seq_len,
                                              next_token_pair)
from zerobatch.core import xxh3_64
from zerobatch.formats.errors import CorruptError

__all__ = ["NpyTokenWindows"]


class NpyTokenWindows(Source):
    """Next-token windows of a folder of ``.npy`` token files (the seed's DatasetLoader data):
    window ``k`` of a file is its tokens ``[k*seq_len, k*seq_len + seq_len + 1)``; windows
    never cross from one file into the next. Files are memory-mapped, in sorted name order.

    Args:
        folder: the folder of 1-D ``.npy`` files (``uint16``, ``uint32``, ``int32``, ``int64``).
        seq_len: tokens per training sequence.
        next_token: hand out ``(x, y)`` (two views of one ``[B, seq_len + 1]`` buffer); else
            windows of ``seq_len`` tokens.
    """

    kind = "npy-windows"
    item_name = "windows"

    def __init__(self, folder: Any, seq_len: int, *, next_token: bool = True) -> None:
        super().__init__()
        from zerobatch.adapters.npy_folder import NpyTokenFolder
        check_dataset(folder, "NpyTokenWindows", (), expected="a folder of .npy token files")
        self.seq_len = check_seq_len(seq_len)
        self.next_token = bool(next_token)
        self.length = self.seq_len + 1 if self.next_token else self.seq_len
        self.files = NpyTokenFolder(folder, 1, self.seq_len, 0, 1, require_step=False)
        lengths = np.array(self.files.lengths, np.int64)
        counts = np.where(lengths >= self.length, (lengths - self.length) // self.seq_len + 1, 0)
        self._cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._starts = np.zeros(len(lengths), np.int64)
        self.num_items = int(self._cum[-1])
        self.fingerprint = f"{xxh3_64(repr(self.files.fingerprint()).encode()):016x}"
        self.output = next_token_pair() if self.next_token else Array("tokens")
        self._maps: list[np.ndarray] | None = None

    def geometry(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "next_token": self.next_token}

    def chunk_steps(self, items_per_step: int) -> int:
        return max(1, CHUNK_BYTES // (items_per_step * self.length * 8))

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any]:
        from zerobatch.core import locate_windows
        steps, per = items.shape
        flat = items.reshape(-1)
        rows, files = np.empty(flat.size, np.int64), np.empty(flat.size, np.int64)
        locate_windows(self._cum, self._starts, self.seq_len, flat, rows, files)
        if self._maps is None:
            self._maps = [np.load(p, mmap_mode="r", allow_pickle=False) for p in self.files.paths]
        out = self._buffer((flat.size, self.length), dtype)
        for r, (f, row) in enumerate(zip(files.tolist(), rows.tolist(), strict=True)):
            np.copyto(out[r], self._maps[f][row:row + self.length], casting="unsafe")
        if out.size and int(out.min()) < 0:
            raise CorruptError("a negative token id in a window", path=self.files.folder, field="token")
        return {"tokens": out.reshape(steps, per, self.length)}

    def __getstate__(self) -> dict[str, Any]:
        d = super().__getstate__()
        d["_maps"] = None
        return d
