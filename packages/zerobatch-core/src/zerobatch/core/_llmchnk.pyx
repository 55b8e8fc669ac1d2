# LLMCHNK: records of a mapped file -> caller batches, with per-record checksum verification.
#
# Contract (the C kernels are declared in _llmchnk.pxd)
#   ChunkRecords(buffer, num_records, itemsize, checksums, verified, path) describes a buffer
#   holding a whole LLMCHNK file whose structure the reader has already validated (header,
#   offset table monotonic from the data start to the data end with whole tokens per record,
#   trailer digest). `verified` is the reader's uint8 array of one byte per record (records
#   already checked against their trailer entry, XXH3-64 of their bytes), or None to skip the
#   checks; the kernels set a byte once its record matches (a benign race: two threads may
#   both hash a record, both then set the byte).
#   gather(indices, out, mask, pad_id) copies record indices[r] into row r of `out` (int64 or
#   int32 [k, L]): its first min(len, L) tokens, then pad_id; `mask` (uint8 or bool [k, L],
#   optional) gets 1 on the record's tokens and 0 on padding; returns the records' lengths
#   (int64 [k], in tokens, before truncation).
#   Indices and buffers are validated with the GIL held; the copies and checksums run with the
#   GIL released, so reader threads run in parallel. Errors map through raise_for_status.

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memset

from zerobatch.core._endian cimport zb_load_u64le
from zerobatch.core._gather cimport zb_narrow_u32_i32, zb_widen_u32_i64
from zerobatch.core._hash cimport zb_xxh3_64
from zerobatch.core._status cimport ZB_E_CHECKSUM, ZB_E_INDEX, ZB_E_RANGE, ZB_OK

import numpy as np

from zerobatch.core.status import raise_for_status
from zerobatch.formats.errors import ConfigError

__all__ = ["ChunkRecords"]


cdef inline uint64_t _offset(const zb_chnk_file *f, int64_t i) noexcept nogil:
    return zb_load_u64le(f.base + f.table + 8 * i)


cdef int zb_chnk_check(const zb_chnk_file *f, int64_t i) noexcept nogil:
    cdef uint64_t a, b
    if f.verified == NULL or f.sums < 0 or f.verified[i]:
        return ZB_OK
    a = _offset(f, i)
    b = _offset(f, i + 1)
    if zb_xxh3_64(f.base + a, b - a) != zb_load_u64le(f.base + f.sums + 8 * i):
        return ZB_E_CHECKSUM
    f.verified[i] = 1
    return ZB_OK


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


cdef int zb_chnk_gather(const zb_chnk_file *f, const int64_t *idx, int64_t k, int64_t width, void *rows,
                        bint wide, int64_t pad, uint8_t *mask, int64_t *lengths, int64_t *bad) noexcept nogil:
    cdef int64_t r, i, length, lim
    cdef int64_t row_bytes = width * (8 if wide else 4)
    cdef int status
    cdef uint64_t a
    for r in range(k):
        i = idx[r]
        status = zb_chnk_check(f, i)
        if status != ZB_OK:
            bad[0] = i
            return status
        a = _offset(f, i)
        length = <int64_t>((_offset(f, i + 1) - a) // f.itemsize)
        lengths[r] = length
        status = _copy_record(f.base + a, length, f.itemsize, width, <uint8_t *>rows + r * row_bytes, wide, pad)
        if status != ZB_OK:
            bad[0] = i
            return status
        if mask != NULL:
            lim = length if length < width else width
            if lim:
                memset(mask + r * width, 1, lim)
            if width > lim:
                memset(mask + r * width + lim, 0, width - lim)
    return ZB_OK


cdef class ChunkRecords:
    """The records of a validated LLMCHNK file (see the module comment).

    Args:
        buffer: the whole file (a mapping); kept alive by this object.
        num_records: ``N``.
        itemsize: 4 (uint32 tokens) or 2 (uint16).
        checksums: the file carries record checksums.
        verified: the reader's ``uint8`` array of ``N`` bytes marking records checked against
            their checksums (checked on first use and marked here), or ``None``: no checks.
        path: the file, for error messages.
    """

    cdef Py_buffer _view
    cdef bint _has_view
    cdef zb_chnk_file _file
    cdef object _verified
    cdef int64_t _size
    cdef readonly int64_t num_records
    cdef readonly int itemsize
    cdef readonly bint checksums
    cdef readonly object path

    def __cinit__(self):
        self._has_view = False

    def __init__(self, buffer, int64_t num_records, int itemsize, bint checksums, verified=None, path=None):
        if itemsize != 2 and itemsize != 4:
            raise ConfigError(f"itemsize must be 2 or 4, got {itemsize}", path=path, field="dtype")
        PyObject_GetBuffer(buffer, &self._view, PyBUF_C_CONTIGUOUS)
        self._has_view = True
        self._size = self._view.len
        self.num_records = num_records
        self.itemsize = itemsize
        self.checksums = checksums
        self.path = path
        memset(&self._file, 0, sizeof(self._file))
        self._file.base = <const uint8_t *>self._view.buf
        self._file.num_records = num_records
        self._file.itemsize = itemsize
        self._file.table = 32
        self._file.sums = self._size - 16 - 8 * num_records if checksums else -1
        if self._file.table + 8 * (num_records + 1) > self._size:
            raise ConfigError("the buffer is shorter than the offset table", path=path, field="num_records")
        cdef uint8_t[::1] bits
        if verified is not None and checksums:
            if not isinstance(verified, np.ndarray) or verified.dtype != np.uint8 or verified.size < num_records \
                    or not verified.flags.c_contiguous or not verified.flags.writeable:
                raise ConfigError(f"verified must be a writable uint8 array of {num_records} bytes", field="verified")
            self._verified = verified
            if num_records:
                bits = verified
                self._file.verified = &bits[0]

    def __dealloc__(self):
        if self._has_view:
            PyBuffer_Release(&self._view)
            self._has_view = False

    cdef int _raise(self, int status, int64_t bad) except -1:
        cdef uint64_t a, b
        if status == ZB_E_CHECKSUM:
            a = _offset(&self._file, bad)
            b = _offset(&self._file, bad + 1)
            raise_for_status(status, f"record_checksum: record {bad} does not match its checksum (stored "
                             f"0x{zb_load_u64le(self._file.base + self._file.sums + 8 * bad):016x}, computed "
                             f"0x{zb_xxh3_64(self._file.base + a, b - a):016x})", path=self.path,
                             field="record_checksum")
        if status == ZB_E_RANGE:
            raise_for_status(status, f"record {bad} holds a token id of 2**31 or more, which does not fit in int32; "
                             "read it as int64", path=self.path, field="dtype")
        raise_for_status(status, f"record index {bad} out of range [0, {self.num_records})", path=self.path,
                         field="index")

    def span(self, int64_t i):
        """``(byte offset, length in tokens)`` of record ``i``, checked against its checksum.

        Raises:
            OutOfRangeError: ``i`` out of range. IntegrityError: a checksum mismatch.
        """
        if i < 0 or i >= self.num_records:
            self._raise(ZB_E_INDEX, i)
        cdef int status
        with nogil:
            status = zb_chnk_check(&self._file, i)
        if status != ZB_OK:
            self._raise(status, i)
        a = _offset(&self._file, i)
        return int(a), int((_offset(&self._file, i + 1) - a) // self.itemsize)

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
            o[r] = <int64_t>((_offset(&self._file, i + 1) - _offset(&self._file, i)) // self.itemsize)
        return out

    def check(self, int64_t start, int64_t stop):
        """The records in ``[start, stop)`` that do not match their checksums (every record is
        hashed; the matching ones are marked in ``verified``)."""
        if start < 0 or stop > self.num_records or start > stop:
            raise ConfigError(f"check: [{start}, {stop}) is not inside [0, {self.num_records})", field="stop")
        cdef zb_chnk_file f = self._file
        cdef uint8_t[::1] fresh = np.zeros(max(self.num_records, 1), np.uint8)
        f.verified = &fresh[0]        # every record hashed, whatever was checked before
        bad = []
        cdef int64_t i
        cdef int status
        if self._file.sums < 0:
            return bad
        for i in range(start, stop):
            with nogil:
                status = zb_chnk_check(&f, i)
            if status != ZB_OK:
                bad.append(i)
            elif self._file.verified != NULL:
                self._file.verified[i] = 1
        return bad

    def gather(self, indices, out, mask=None, int64_t pad_id=0):
        """Copy the records at ``indices`` into the rows of ``out`` (see the module comment);
        returns their lengths (``int64``, before truncation).

        Raises:
            OutOfRangeError: an index out of range (nothing is copied). IntegrityError: a
            record does not match its checksum. ConfigError: unfit ``out`` / ``mask``, or
            ``int32`` output and a token of 2**31 or more.
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
        cdef uint8_t *mask_ptr = NULL
        if mask is not None:
            if not isinstance(mask, np.ndarray) or mask.shape != out.shape or mask.dtype not in (np.uint8, np.bool_) \
                    or not mask.flags.c_contiguous or not mask.flags.writeable:
                raise ConfigError(f"mask must be a writable C-contiguous bool or uint8 array of shape {out.shape}",
                                  field="mask")
            m = mask.view(np.uint8)
            if k and width:
                mask_ptr = &m[0, 0]
        cdef int64_t r, bad = -1
        for r in range(k):
            if idx[r] < 0 or idx[r] >= self.num_records:
                self._raise(ZB_E_INDEX, idx[r])
        lengths = np.empty(k, np.int64)
        cdef int64_t[::1] lens = lengths
        cdef Py_buffer ob
        PyObject_GetBuffer(out, &ob, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        cdef int status = ZB_OK
        try:
            if k:
                with nogil:
                    status = zb_chnk_gather(&self._file, &idx[0], k, width, ob.buf, wide, pad_id, mask_ptr,
                                            &lens[0], &bad)
        finally:
            PyBuffer_Release(&ob)
        if status != ZB_OK:
            self._raise(status, bad)
        return lengths
