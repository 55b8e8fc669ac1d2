# LLMCHNK: records of a mapped file -> caller batches, with per-record checksum verification.
#
# Contract
#   ChunkRecords(buffer, num_records, itemsize, verify, path) wraps a buffer holding a whole
#   LLMCHNK file whose structure the reader has already validated (header, offset table
#   monotonic from the data start to the data end with whole tokens per record, trailer
#   digest). gather(indices, out, mask, pad_id) copies record indices[r] into row r of `out`
#   (int64 or int32 [k, L]): its first min(len, L) tokens, then pad_id; `mask` (uint8 or
#   bool [k, L], optional) gets 1 on the record's tokens and 0 on padding; returns the
#   records' lengths (int64 [k], in tokens, before truncation).
#   Indices and buffers are validated with the GIL held; the copies and checksums run with
#   the GIL released, so reader threads run in parallel.
#
# Verification: with checksums and verify=True, a record is checked against its trailer
# entry (XXH3-64 of its bytes) the first time it is served; a bitmap remembers verified
# records (a benign race: two threads may both hash a record, both then set the bit).

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memset

from zerobatch.core._endian cimport zb_load_u64le
from zerobatch.core._gather cimport zb_narrow_u32_i32, zb_widen_u32_i64
from zerobatch.core._hash cimport zb_xxh3_64
from zerobatch.core._status cimport ZB_E_CHECKSUM, ZB_E_INDEX, ZB_E_RANGE, ZB_OK

import numpy as np

from zerobatch.formats.errors import ConfigError, IntegrityError, OutOfRangeError

__all__ = ["ChunkRecords"]

cdef inline int _copy_record(const uint8_t *src, int64_t length, int itemsize, int64_t width,
                             void *row, bint wide, int64_t pad) noexcept nogil:
    """Copy min(length, width) tokens to row (int64 when `wide`, else int32), pad the rest."""
    cdef int64_t m = length if length < width else width
    cdef int64_t j
    cdef uint16_t t16
    cdef int64_t *r64 = <int64_t *>row
    cdef int32_t *r32 = <int32_t *>row
    if itemsize == 4:
        if wide:
            zb_widen_u32_i64(src, m, r64)
        elif zb_narrow_u32_i32(src, m, r32):
            return ZB_E_RANGE
    else:
        for j in range(m):
            t16 = <uint16_t>src[2 * j] | (<uint16_t>src[2 * j + 1] << 8)
            if wide:
                r64[j] = t16
            else:
                r32[j] = t16
    if wide:
        for j in range(m, width):
            r64[j] = pad
    else:
        for j in range(m, width):
            r32[j] = <int32_t>pad
    return ZB_OK


cdef class ChunkRecords:
    """The records of a validated LLMCHNK file (see the module comment).

    Args:
        buffer: the whole file (a mapping); kept alive by this object.
        num_records: ``N``.
        itemsize: 4 (uint32 tokens) or 2 (uint16).
        checksums: the file carries record checksums.
        verify: check each record against its checksum the first time it is served.
        path: the file, for error messages.
    """

    cdef Py_buffer _view
    cdef bint _has_view
    cdef const uint8_t *_base
    cdef int64_t _size
    cdef readonly int64_t num_records
    cdef readonly int itemsize
    cdef readonly bint checksums
    cdef readonly bint verify
    cdef readonly object path
    cdef uint8_t[::1] _verified
    cdef int64_t _table
    cdef int64_t _sums

    def __cinit__(self):
        self._has_view = False

    def __init__(self, buffer, int64_t num_records, int itemsize, bint checksums, bint verify, path=None):
        if itemsize != 2 and itemsize != 4:
            raise ConfigError(f"itemsize must be 2 or 4, got {itemsize}", path=path, field="dtype")
        PyObject_GetBuffer(buffer, &self._view, PyBUF_C_CONTIGUOUS)
        self._has_view = True
        self._base = <const uint8_t *>self._view.buf
        self._size = self._view.len
        self.num_records = num_records
        self.itemsize = itemsize
        self.checksums = checksums
        self.verify = verify and checksums
        self.path = path
        self._table = 32
        if self._table + 8 * (num_records + 1) > self._size:
            raise ConfigError("the buffer is shorter than the offset table", path=path, field="num_records")
        self._verified = np.zeros(num_records if self.verify else 0, np.uint8)
        self._sums = 0
        if checksums:
            self._sums = self._size - 16 - 8 * num_records

    def __dealloc__(self):
        if self._has_view:
            PyBuffer_Release(&self._view)
            self._has_view = False

    cdef inline uint64_t _offset(self, int64_t i) noexcept nogil:
        return zb_load_u64le(self._base + self._table + 8 * i)

    cdef int _check(self, int64_t i) noexcept nogil:
        cdef uint64_t a, b
        if not self.verify or self._verified[i]:
            return ZB_OK
        a = self._offset(i)
        b = self._offset(i + 1)
        if zb_xxh3_64(self._base + a, b - a) != zb_load_u64le(self._base + self._sums + 8 * i):
            return ZB_E_CHECKSUM
        self._verified[i] = 1
        return ZB_OK

    cdef int _raise(self, int status, int64_t bad) except -1:
        cdef uint64_t a, b
        if status == ZB_E_CHECKSUM:
            a = self._offset(bad)
            b = self._offset(bad + 1)
            raise IntegrityError(
                f"record_checksum: record {bad} does not match its checksum (stored "
                f"0x{zb_load_u64le(self._base + self._sums + 8 * bad):016x}, computed "
                f"0x{zb_xxh3_64(self._base + a, b - a):016x})", path=self.path, field="record_checksum")
        if status == ZB_E_RANGE:
            raise ConfigError(f"record {bad} holds a token id of 2**31 or more, which does not fit in int32; "
                              "read it as int64", path=self.path, field="dtype")
        if status == ZB_E_INDEX:
            raise OutOfRangeError(f"record index {bad} out of range [0, {self.num_records})", path=self.path, field="index")
        return 0

    def span(self, int64_t i):
        """``(byte offset, length in tokens)`` of record ``i``, checked against its checksum.

        Raises:
            IndexError: ``i`` out of range. IntegrityError: a checksum mismatch.
        """
        if i < 0 or i >= self.num_records:
            raise OutOfRangeError(f"record index {i} out of range [0, {self.num_records})", path=self.path, field="index")
        cdef int status
        with nogil:
            status = self._check(i)
        if status != ZB_OK:
            self._raise(status, i)
        a = self._offset(i)
        return int(a), int((self._offset(i + 1) - a) // self.itemsize)

    def lengths(self, indices):
        """Tokens of each record at ``indices`` (``int64``)."""
        cdef const int64_t[::1] idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        out = np.empty(idx.shape[0], np.int64)
        cdef int64_t[::1] o = out
        cdef int64_t r, i
        for r in range(idx.shape[0]):
            i = idx[r]
            if i < 0 or i >= self.num_records:
                self._raise(ZB_E_INDEX, i)
            o[r] = <int64_t>((self._offset(i + 1) - self._offset(i)) // self.itemsize)
        return out

    def is_verified(self, int64_t i):
        return bool(self.verify and 0 <= i < self.num_records and self._verified[i])

    def gather(self, indices, out, mask=None, int64_t pad_id=0):
        """Copy the records at ``indices`` into the rows of ``out`` (see the module comment);
        returns their lengths (``int64``, before truncation).

        Raises:
            IndexError: an index out of range (nothing is copied). IntegrityError: a record
            does not match its checksum. ConfigError: unfit ``out`` / ``mask``, or ``int32``
            output and a token of 2**31 or more.
        """
        cdef const int64_t[::1] idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        cdef int64_t k = idx.shape[0]
        if not isinstance(out, np.ndarray) or out.ndim != 2 or out.shape[0] != k \
                or out.dtype not in (np.int64, np.int32) or not out.flags.c_contiguous or not out.flags.writeable:
            raise ConfigError(f"out must be a writable C-contiguous int64 or int32 array of {k} rows", field="out")
        cdef int64_t width = out.shape[1]
        cdef bint wide = out.dtype == np.int64
        if not wide and not -2**31 <= pad_id < 2**31:
            raise ConfigError(f"pad_id {pad_id} does not fit in int32", field="pad_id")
        cdef uint8_t[:, ::1] m
        cdef bint has_mask = mask is not None
        if has_mask:
            if not isinstance(mask, np.ndarray) or mask.shape != out.shape or mask.dtype not in (np.uint8, np.bool_) \
                    or not mask.flags.c_contiguous or not mask.flags.writeable:
                raise ConfigError(f"mask must be a writable C-contiguous bool or uint8 array of shape {out.shape}",
                                  field="mask")
            m = mask.view(np.uint8)
        cdef int64_t r, i, length, lim, bad = -1
        for r in range(k):
            i = idx[r]
            if i < 0 or i >= self.num_records:
                self._raise(ZB_E_INDEX, i)
        lengths = np.empty(k, np.int64)
        cdef int64_t[::1] lens = lengths
        cdef Py_buffer ob
        PyObject_GetBuffer(out, &ob, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        cdef uint8_t *rows = <uint8_t *>ob.buf
        cdef int64_t row_bytes = width * (8 if wide else 4)
        cdef int status = ZB_OK
        cdef uint64_t a
        try:
            with nogil:
                for r in range(k):
                    i = idx[r]
                    status = self._check(i)
                    if status != ZB_OK:
                        bad = i
                        break
                    a = self._offset(i)
                    length = <int64_t>((self._offset(i + 1) - a) // self.itemsize)
                    lens[r] = length
                    status = _copy_record(self._base + a, length, self.itemsize, width,
                                          rows + r * row_bytes, wide, pad_id)
                    if status != ZB_OK:
                        bad = i
                        break
                    if has_mask:
                        lim = length if length < width else width
                        if lim:
                            memset(&m[r, 0], 1, lim)
                        if width > lim:
                            memset(&m[r, lim], 0, width - lim)
        finally:
            PyBuffer_Release(&ob)
        if status != ZB_OK:
            self._raise(status, bad)
        return lengths
