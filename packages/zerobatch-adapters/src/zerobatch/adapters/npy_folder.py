"""The npy-folder token stream of the seed's ``DatasetLoader`` (NumPy only).

A folder of ``.npy`` files, each a 1-D array of token ids (``uint16``, ``uint32``, ``int32``
or ``int64``), read in sorted name order as one stream per file. With batch ``B``, sequence
length ``T`` and ``W`` processes, a step takes ``B*T*W + 1`` tokens of the current file at
``offset``: rank ``r`` reads ``[offset + r*B*T, offset + (r+1)*B*T + 1)`` (``x`` is the first
``B*T`` of them, ``y`` the last ``B*T``), then ``offset`` advances by ``B*T*W``. A file serves
every step that fits in it; after its last one the stream moves to the next file, and after
the last file back to the first.

Where the seed's code contradicts its text, this follows the text (documented in
``docs/loader.md``):

- a step that fits exactly at the end of a file is read (the seed's ``>=`` skips it);
- a file too short for one step is skipped (the seed returns the same batch forever, or fails
  later with a reshape error); a folder where no file holds one step is refused at once;
- files are memory-mapped, not loaded whole; only ``.npy`` files are taken.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from zerobatch.core.checks import check_count
from zerobatch.formats.errors import ConfigError, CorruptError, FormatError, NotFoundError, StateError

__all__ = ["NPY_STATE_VERSION", "NpyTokenFolder"]

NPY_STATE_VERSION = 1
TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.int32), np.dtype(np.int64))


class NpyTokenFolder:
    """The token files of ``folder`` and this rank's position in them (see the module docs).

    Raises:
        NotFoundError: no folder, or no ``.npy`` file in it.
        FormatError: a file that is not a 1-D array of one of :data:`TOKEN_DTYPES` (the
            error names the file).
        ConfigError: bad sizes, or no file long enough for one step.
    """

    def __init__(self, folder: str | os.PathLike[str], batch: int, seq_len: int, rank: int, world_size: int, *,
                 require_step: bool = True) -> None:
        self.folder = os.fspath(folder)
        self.batch = check_count(batch, "batch", minimum=1, maximum=1 << 30)
        self.seq_len = check_count(seq_len, "seq_len", minimum=1, maximum=1 << 30)
        self.world_size = check_count(world_size, "num_processes", minimum=1, maximum=1 << 20)
        self.rank = check_count(rank, "process_rank", maximum=self.world_size - 1)
        if not os.path.isdir(self.folder):
            raise NotFoundError(f"dataset_dir: {self.folder} is not a folder", path=self.folder, field="dataset_dir")
        names = sorted(n for n in os.listdir(self.folder) if n.endswith(".npy"))
        if not names:
            raise NotFoundError("dataset_dir: the folder holds no .npy file", path=self.folder, field="dataset_dir")
        self.paths = [os.path.join(self.folder, n) for n in names]
        self.lengths = [self._length(p) for p in self.paths]
        self.per_rank = self.batch * self.seq_len
        self.stride = self.per_rank * self.world_size
        if require_step and not any(self._fits(f, 0) for f in range(len(self.paths))):
            raise ConfigError(
                f"dataset_dir: no file holds one step of {self.stride + 1} tokens (batch {self.batch} x seq_len "
                f"{self.seq_len} x {self.world_size} processes + 1); the longest has {max(self.lengths)}",
                path=self.folder, field="dataset_dir")
        self.file_idx = 0
        self.offset = 0
        self._data: np.ndarray | None = None
        if require_step:
            self._skip_short()

    @staticmethod
    def _length(path: str) -> int:
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise FormatError(f"not a readable .npy file: {exc}", path=path, field="header") from None
        if not isinstance(arr, np.ndarray) or arr.ndim != 1:
            raise FormatError(f"expected a 1-D array of token ids, got shape {getattr(arr, 'shape', None)}",
                              path=path, field="shape")
        if arr.dtype.newbyteorder("=") not in TOKEN_DTYPES:
            raise FormatError(f"dtype {arr.dtype}: token ids must be uint16, uint32, int32 or int64",
                              path=path, field="dtype")
        return int(arr.shape[0])

    def _fits(self, f: int, offset: int) -> bool:
        return offset + self.stride + 1 <= self.lengths[f]

    def _skip_short(self) -> None:
        """Move to the first file from ``file_idx`` on (wrapping) that holds a step at ``offset``."""
        for _ in range(len(self.paths) + 1):
            if self._fits(self.file_idx, self.offset):
                return
            self.file_idx = (self.file_idx + 1) % len(self.paths)
            self.offset = 0
            self._data = None

    def _file(self) -> np.ndarray:
        if self._data is None:
            self._data = np.load(self.paths[self.file_idx], mmap_mode="r", allow_pickle=False)
        return self._data

    def next_tokens(self, out: np.ndarray | None = None) -> np.ndarray:
        """This rank's ``B*T + 1`` tokens of the current step as ``int64`` (into ``out``), and
        advance.

        Raises:
            CorruptError: a negative id in a signed file.
        """
        data = self._file()
        start = self.offset + self.rank * self.per_rank
        piece = data[start:start + self.per_rank + 1]
        if out is None:
            out = np.empty(self.per_rank + 1, np.int64)
        np.copyto(out, piece, casting="unsafe")
        if data.dtype.kind == "i" and out.size and int(out.min()) < 0:
            raise CorruptError(f"a negative token id in tokens [{start}, {start + out.size})",
                               path=self.paths[self.file_idx], field="token")
        self.offset += self.stride
        self._skip_short()
        return out

    # -- state ------------------------------------------------------------------------------

    def fingerprint(self) -> list[list[Any]]:
        return [[os.path.basename(p), n] for p, n in zip(self.paths, self.lengths, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        """The position of the next step (JSON-able; the same on every rank)."""
        return {"zerobatch_npy_folder": NPY_STATE_VERSION, "file": os.path.basename(self.paths[self.file_idx]),
                "file_idx": self.file_idx, "offset": self.offset, "files": self.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``'s position (any batch, seq_len or number of processes: the
        position is a token offset in a file).

        Raises:
            StateError: another version, other files (names or lengths), a position out of range.
        """
        if not isinstance(state, dict) or state.get("zerobatch_npy_folder") != NPY_STATE_VERSION:
            raise StateError("zerobatch_npy_folder: not a DatasetLoader state of this version",
                             field="zerobatch_npy_folder")
        if state.get("files") != self.fingerprint():
            raise StateError("files: the state was saved over other .npy files (names or lengths differ)",
                             path=self.folder, field="files")
        f, off = state.get("file_idx"), state.get("offset")
        for name, v, hi in (("file_idx", f, len(self.paths) - 1), ("offset", off, None)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (hi is not None and v > hi):
                raise StateError(f"{name}: out of range: {v!r}", field=name)
        if off > self.lengths[f]:
            raise StateError(f"offset: {off} is beyond the file's {self.lengths[f]} tokens", field="offset")
        self.file_idx, self.offset, self._data = f, off, None
        self._skip_short()

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_data"] = None
        return d
