"""LLMBATCH batch gathers, token widening and padded rows: the twin of ``_gather.pyx``."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
from zerobatch.core._twins.hash import _r64, xxh3_64
from zerobatch.core.checks import check_bitmap
from zerobatch.formats import llmbatch as L
from zerobatch.formats.errors import ConfigError, IntegrityError, OutOfRangeError

__all__ = ["LLMBatchSlots", "max_u32", "pad_rows", "widen_u32"]


# --------------------------------------------------------------------------------------------
# Gather


def _tokens(src: Any) -> np.ndarray:
    b = memoryview(src).cast("B")
    if len(b) % 4:
        raise ConfigError(f"src holds {len(b)} bytes, not a multiple of 4", field="src")
    return np.frombuffer(b, dtype="<u4")


def _out_array(out: Any, elements: int, what: str) -> np.ndarray:
    arr = np.asarray(out)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ConfigError(f"{what}: out must be a writable C-contiguous buffer", field="out")
    if arr.dtype not in (np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint32)):
        raise ConfigError(f"{what}: out must hold int64, int32 or uint32 elements, got {arr.dtype}", field="out")
    if arr.size != elements:
        raise ConfigError(f"{what}: out holds {arr.size} elements, expected {elements}", field="out")
    return arr.reshape(-1)


def _convert(tokens: np.ndarray, flat: np.ndarray) -> bool:
    """flat[:] = tokens; False when flat is int32 and a token is 2**31 or more."""
    if flat.dtype == np.int32 and tokens.size and int(tokens.max()) >= 2**31:
        return False
    flat[...] = tokens.astype(flat.dtype, copy=False) if flat.dtype != np.int32 else tokens.view(np.int32)
    return True


def widen_u32(src: Any, out: Any) -> Any:
    """Convert little-endian ``uint32`` tokens into a preallocated output."""
    t = _tokens(src)
    flat = _out_array(out, t.size, "widen_u32")
    if not _convert(t, flat):
        raise ConfigError("widen_u32: a token is 2**31 or more and does not fit in int32", field="out")
    return out


def max_u32(src: Any) -> int:
    """Largest little-endian ``uint32`` in a buffer (0 for an empty one)."""
    t = _tokens(src)
    return int(t.max()) if t.size else 0


def _rows_fit(a: Any, shape: tuple[int, ...], dtypes: tuple[Any, ...]) -> bool:
    return (isinstance(a, np.ndarray) and a.shape == shape and a.flags.c_contiguous and a.flags.writeable
            and a.dtype in tuple(np.dtype(d) for d in dtypes))


def pad_rows(tokens: Any, lengths: Any, pad_id: int = 0, mask: Any = None, labels: Any = None,
             ignore_id: int = -100, label_values: Any = None) -> Any:
    """Padding after each row's first ``lengths[r]`` tokens, the mask and the labels."""
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 2 or not _rows_fit(tokens, tokens.shape,
                                                                                (np.int64, np.int32)):
        raise ConfigError("pad_rows: tokens must be a writable C-contiguous int64 or int32 array [k, w]",
                          field="tokens")
    k, w = tokens.shape
    lens = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
    if lens.size != k:
        raise ConfigError(f"pad_rows: lengths holds {lens.size} values for {k} rows", field="lengths")
    if tokens.dtype == np.int32 and not (-2**31 <= pad_id < 2**31 and -2**31 <= ignore_id < 2**31):
        raise ConfigError(f"pad_rows: pad_id {pad_id} or ignore_id {ignore_id} does not fit in int32",
                          field="pad_id")
    if mask is not None and not _rows_fit(mask, tokens.shape, (np.bool_, np.uint8)):
        raise ConfigError(f"pad_rows: mask must be a writable C-contiguous bool or uint8 array of shape "
                          f"{tokens.shape}", field="mask")
    if labels is not None and not _rows_fit(labels, tokens.shape, (tokens.dtype,)):
        raise ConfigError(f"pad_rows: labels must be a writable C-contiguous {tokens.dtype} array of shape "
                          f"{tokens.shape}", field="labels")
    for name, other in (("mask", mask), ("labels", labels)):
        if other is not None and np.may_share_memory(tokens, other):
            raise ConfigError(f"pad_rows: {name} shares memory with tokens", field=name)
    if label_values is not None:
        if labels is None or not isinstance(label_values, np.ndarray) or label_values.dtype != tokens.dtype \
                or label_values.shape != tokens.shape or not label_values.flags.c_contiguous:
            raise ConfigError(f"pad_rows: label_values must be a C-contiguous {tokens.dtype} array of shape "
                              f"{tokens.shape}, with labels", field="label_values")
        if label_values.ctypes.data != labels.ctypes.data and np.may_share_memory(labels, label_values):
            raise ConfigError("pad_rows: label_values overlaps labels", field="label_values")
    bad = np.flatnonzero((lens < 0) | (lens > w))
    if bad.size:
        r = int(bad[0])
        raise ConfigError(f"pad_rows: lengths[{r}] = {lens[r]} is outside [0, {w}]", field="lengths")
    inside = np.arange(w)[None, :] < lens[:, None]
    np.putmask(tokens, ~inside, pad_id)
    if mask is not None:
        mask[...] = inside
    if labels is not None:
        labels[...] = np.where(inside, tokens if label_values is None else label_values, ignore_id)
    return tokens


class _Ticket:
    """A gather queued on the pool twin's threads (as a Python call)."""

    def __init__(self, call: Any) -> None:
        self.call = call

    def wait(self) -> Any:
        if self.call.done() and getattr(self.call, "_cancelled", False):
            raise ConfigError("wait: this gather was cancelled", field="ticket")
        return self.call.wait()

    def cancel(self) -> bool:
        return bool(self.call.cancel())


class _Bits:
    """A caller's bitmap, read and set bit by bit (as the kernel's zb_bit_get / zb_bit_set)."""

    __slots__ = ("bits",)

    def __init__(self, bits: np.ndarray) -> None:
        self.bits = bits

    def __getitem__(self, i: int) -> bool:
        return bool((int(self.bits[i >> 3]) >> (i & 7)) & 1)

    def __setitem__(self, i: int, value: bool) -> None:
        if value:
            self.bits[i >> 3] |= np.uint8(1 << (i & 7))


class LLMBatchSlots:
    """Twin of the compiled ``LLMBatchSlots``: access to the batch slots of a mapped file."""

    def __init__(self, buffer: Any, header: L.LLMBatchHeader, *, verify: bool = True, verified: Any = None,
                 int32_ok: Any = None, path: Any = None) -> None:
        self._data = np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8)
        if self._data.size != header.file_size:
            raise ConfigError(f"LLMBatchSlots: buffer holds {self._data.size} bytes, header "
                              f"describes {header.file_size}", field="buffer", path=path)
        self.path = path
        self.num_batches = header.num_batches
        self.batch_size = header.batch_size
        self.seq_len = header.seq_len
        self.tokens_per_batch = header.batch_size * header.seq_len
        self.raw_batch_bytes = header.raw_batch_bytes
        self.padded_batch_bytes = header.padded_batch_bytes
        self.has_checksums = header.has_checksums
        self.verify = bool(verify and header.has_checksums)
        self.int32_safe = False   # never trust max_token for a narrowing: scan each batch once
        self._trailer = header.trailer_offset
        nbytes = max((self.num_batches + 7) // 8, 1)
        self._verified = _Bits(check_bitmap(verified, nbytes, "verified"))
        self._int32_ok = _Bits(check_bitmap(int32_ok, nbytes, "int32_ok"))
        shape = (header.num_batches, header.batch_size, header.seq_len)
        strides = (header.padded_batch_bytes, header.seq_len * 4, 4)
        if header.num_batches:
            self._u32_views = np.ndarray(shape, "<u4", buffer=buffer, offset=L.HEADER_SIZE, strides=strides)
            self._i32_views = np.ndarray(shape, "<i4", buffer=buffer, offset=L.HEADER_SIZE, strides=strides)
        else:
            self._u32_views = np.zeros(shape, "<u4")
            self._i32_views = np.zeros(shape, "<i4")
        self._u32_views.flags.writeable = False

    def view_uint32(self, i: Any) -> np.ndarray:
        return self._u32_views[self.check(i)]

    def view_int32(self, i: Any) -> np.ndarray:
        return self._i32_views[self.check_int32(i)]

    def new_int64(self, i: Any) -> np.ndarray:
        return self.read_into(i, np.empty((self.batch_size, self.seq_len), np.int64))

    def gather_async(self, pool: Any, indices: Any, out: Any) -> _Ticket:
        idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        for j in idx:
            if j < 0 or j >= self.num_batches:
                raise OutOfRangeError(f"batch index {j} out of range [0, {self.num_batches})", path=self.path, field="index")
        _out_array(out, idx.size * self.tokens_per_batch, "gather")
        return _Ticket(pool.call(lambda: self.gather(idx, out)))

    def check_async(self, pool: Any, indices: Any, int32: bool = False) -> _Ticket:
        idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        for j in idx:
            if j < 0 or j >= self.num_batches:
                raise OutOfRangeError(f"batch index {j} out of range [0, {self.num_batches})", path=self.path,
                                      field="index")

        def run() -> None:
            for j in idx.tolist():
                if int32:
                    self.check_int32(j)
                else:
                    self.check(j)
        return _Ticket(pool.call(run))

    @property
    def int32_views(self) -> np.ndarray:
        return self._i32_views

    def _index(self, i: Any) -> int:
        j = operator.index(i)
        if j < 0 or j >= self.num_batches:
            raise OutOfRangeError(f"batch index {j} out of range [0, {self.num_batches})", path=self.path, field="index")
        return int(j)

    def _slot(self, i: int) -> np.ndarray:
        start = L.HEADER_SIZE + i * self.padded_batch_bytes
        return self._data[start:start + self.padded_batch_bytes]

    def _expected(self, i: int) -> int:
        return _r64(self._data[self._trailer + 8 * i:self._trailer + 8 * i + 8].tobytes(), 0)

    def _verify(self, i: int) -> None:
        if not self.verify or self._verified[i]:
            return
        got = xxh3_64(self._slot(i))
        if got != self._expected(i):
            raise IntegrityError(
                f"batch_checksum: batch {i} does not match its checksum (stored "
                f"0x{self._expected(i):016x}, computed 0x{got:016x})",
                path=self.path, field="batch_checksum")
        self._verified[i] = True

    def check(self, i: Any) -> int:
        idx = self._index(i)
        self._verify(idx)
        return idx

    def is_verified(self, i: Any) -> bool:
        return bool(self._verified[self._index(i)])

    def check_int32(self, i: Any) -> int:
        idx = self.check(i)
        if self.int32_safe or self._int32_ok[idx]:
            return idx
        m = max_u32(self._slot(idx)[:self.raw_batch_bytes])
        if m >= 2**31:
            raise ConfigError(f"batch {idx} holds token id {m}, which does not fit in int32; "
                              f"read it as int64", path=self.path, field="dtype")
        self._int32_ok[idx] = True
        return idx

    def _copy(self, idx: int, flat: np.ndarray) -> None:
        if not _convert(_tokens(self._slot(idx)[:self.raw_batch_bytes]), flat):
            raise ConfigError(f"batch {idx} holds a token id of 2**31 or more, which does not "
                              f"fit in int32; read it as int64", path=self.path, field="dtype")

    def read_into(self, i: Any, out: Any) -> Any:
        idx = self._index(i)
        flat = _out_array(out, self.tokens_per_batch, "read_into")
        self._verify(idx)
        self._copy(idx, flat)
        return out

    def gather(self, indices: Any, out: Any) -> Any:
        idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        for j in idx:
            if j < 0 or j >= self.num_batches:
                raise OutOfRangeError(f"batch index {j} out of range [0, {self.num_batches})", path=self.path, field="index")
        flat = _out_array(out, idx.size * self.tokens_per_batch, "gather")
        t = self.tokens_per_batch
        for k, j in enumerate(idx):
            self._verify(int(j))
            self._copy(int(j), flat[k * t:(k + 1) * t])
        return out

    def _check_range(self, start: int, stop: int, what: str) -> None:
        if start < 0 or start > stop or stop > self.num_batches:
            raise ConfigError(f"{what}: [{start}, {stop}) is not inside [0, {self.num_batches})",
                              field="stop", path=self.path)

    def verify_range(self, start: int, stop: int) -> list[int]:
        self._check_range(start, stop, "verify_range")
        bad = []
        if not self.has_checksums:
            return bad
        for i in range(start, stop):
            if xxh3_64(self._slot(i)) != self._expected(i):
                bad.append(i)
            else:
                self._verified[i] = True
        return bad

    def padding_is_zero(self, start: int, stop: int) -> bool:
        self._check_range(start, stop, "padding_is_zero")
        return not any(self._slot(i)[self.raw_batch_bytes:].any() for i in range(start, stop))

    def max_token(self, start: int, stop: int) -> int:
        self._check_range(start, stop, "max_token")
        return max((max_u32(self._slot(i)[:self.raw_batch_bytes]) for i in range(start, stop)), default=0)
