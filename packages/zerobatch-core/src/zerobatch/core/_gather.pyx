# Gather: LLMBATCH batch slots -> caller buffers, with per-batch checksum verification.
#
# Contract
#   zb_convert_tokens(src, n, dst, kind)
#     pre:  src holds 4*n readable bytes of little-endian uint32 tokens; dst holds n
#           writable elements of `kind` (ZB_OUT_INT64 / ZB_OUT_INT32 / ZB_OUT_UINT32);
#           the two do not overlap.
#     post: ZB_OK and dst[i] = token i; or ZB_E_RANGE when kind is int32 and a token is
#           >= 2**31 (dst is then unspecified).
#   LLMBatchSlots methods validate indices and buffers with the GIL held, then run the
#   copies and checksums with the GIL released, so reader threads run in parallel.
#
#   pad_rows(tokens, lengths, pad_id, mask, labels, ignore_id)
#     pre:  tokens is a writable C-contiguous int64 / int32 [k, w] array whose row r holds a
#           sample's first lengths[r] tokens (0 <= lengths[r] <= w); mask (bool / uint8) and
#           labels (tokens' dtype) are optional writable C-contiguous [k, w] arrays that share
#           no memory with tokens.
#     post: tokens[r, lengths[r]:] = pad_id; mask[r, j] = j < lengths[r]; labels[r] = tokens[r]
#           with ignore_id past lengths[r]: the padded batch, its attention mask and its
#           next-token labels in one pass over the rows, GIL released.
#
# Verification: with checksums present and verify=True, a batch is checked against its
# trailer entry (XXH3-64 of its whole slot, padding included) the first time it is served;
# a bitmap remembers verified batches, so each batch is hashed once per reader.

from cpython.buffer cimport (PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE, PyBuffer_Release,
                             PyObject_GetBuffer)
from cpython.number cimport PyNumber_Index
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

from zerobatch.core._endian cimport zb_load_u64le
from zerobatch.core._hash cimport zb_xxh3_64
from zerobatch.core._layout cimport LLMBATCH_CHECKSUM_SIZE, LLMBATCH_HEADER_SIZE
from zerobatch.core._pool cimport TaskPool, zb_task
from zerobatch.core._status cimport ZB_E_CHECKSUM, ZB_E_RANGE, ZB_OK

import numpy as np

from zerobatch.core.checks import check_bitmap
from zerobatch.core.status import raise_for_status

from zerobatch.formats.errors import ConfigError, IntegrityError, OutOfRangeError

__all__ = ["LLMBatchSlots", "max_u32", "pad_rows", "widen_u32"]


cdef int zb_convert_tokens(const uint8_t *src, int64_t n, void *dst, int kind) noexcept nogil:
    if kind == ZB_OUT_INT64:
        zb_widen_u32_i64(src, n, <int64_t *>dst)
        return ZB_OK
    if kind == ZB_OUT_INT32:
        if zb_narrow_u32_i32(src, n, <int32_t *>dst):
            return ZB_E_RANGE
        return ZB_OK
    zb_copy_u32(src, n, <uint32_t *>dst)
    return ZB_OK


cdef inline const uint8_t *_slot(const zb_llmbatch_gather *g, uint64_t i) noexcept nogil:
    return g.base + LLMBATCH_HEADER_SIZE + i * g.padded


cdef inline bint _check_sum(const zb_llmbatch_gather *g, uint64_t i) noexcept nogil:
    """True when batch i is already verified or matches its checksum (then marked)."""
    if zb_bit_get(g.verified, i):
        return True
    cdef uint64_t expected = zb_load_u64le(g.trailer + i * LLMBATCH_CHECKSUM_SIZE)
    if zb_xxh3_64(_slot(g, i), g.padded) != expected:
        return False
    zb_bit_set(g.verified, i)
    return True


cdef int zb_llmbatch_gather_run(void *arg) noexcept nogil:
    cdef zb_llmbatch_gather *g = <zb_llmbatch_gather *>arg
    cdef int64_t j
    cdef int status
    for j in range(g.count):
        if g.verify and not _check_sum(g, g.items[j]):
            g.bad = g.items[j]
            return ZB_E_CHECKSUM
        if g.out == NULL:
            # a check alone (zero-copy views follow): with int32 views, every id below 2**31,
            # scanned once per batch while its bytes are still in the cache from the hash
            if g.kind == ZB_OUT_INT32 and not zb_bit_get(g.int32_ok, g.items[j]):
                if zb_max_u32(_slot(g, g.items[j]), g.tokens) >= <uint32_t>0x80000000u:
                    g.bad = g.items[j]
                    return ZB_E_RANGE
                zb_bit_set(g.int32_ok, g.items[j])
            continue
        status = zb_convert_tokens(_slot(g, g.items[j]), g.tokens,
                                   g.out + j * g.tokens * g.itemsize, g.kind)
        if status != ZB_OK:
            g.bad = g.items[j]
            return status
    return ZB_OK


cdef int _buffer_kind(const Py_buffer *view) noexcept:
    """The zb_out_kind of an acquired buffer, or 0 when it is not int64/int32/uint32."""
    cdef const char *f = view.format
    if f == NULL:
        return 0
    if f[0] == b'@' or f[0] == b'=' or f[0] == b'<':
        f += 1
    elif f[0] == b'>' or f[0] == b'!':
        return 0
    if f[0] == 0 or f[1] != 0:
        return 0
    cdef char c = f[0]
    if c == b'b' or c == b'h' or c == b'i' or c == b'l' or c == b'q' or c == b'n':
        if view.itemsize == 8:
            return ZB_OUT_INT64
        if view.itemsize == 4:
            return ZB_OUT_INT32
    elif c == b'B' or c == b'H' or c == b'I' or c == b'L' or c == b'Q' or c == b'N':
        if view.itemsize == 4:
            return ZB_OUT_UINT32
    return 0


cdef int _acquire_out(object out, Py_buffer *view, int64_t elements, str what) except -1:
    """Acquire `out` as a writable C-contiguous int64/int32/uint32 buffer of `elements` items."""
    if PyObject_GetBuffer(out, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0:
        return -1
    cdef int kind = _buffer_kind(view)
    if kind == 0:
        fmt = view.format
        PyBuffer_Release(view)
        raise ConfigError(f"{what}: out must hold int64, int32 or uint32 elements, got format "
                          f"{fmt!r}", field="out")
    if view.len != elements * view.itemsize:
        n = view.len // view.itemsize
        PyBuffer_Release(view)
        raise ConfigError(f"{what}: out holds {n} elements, expected {elements}", field="out")
    return kind


def widen_u32(src, out):
    """Convert little-endian ``uint32`` tokens into a preallocated output, GIL released.

    Args:
        src: a buffer of ``4 * n`` bytes (a NumPy ``uint32`` array, an mmap slice...).
        out: a writable C-contiguous ``int64``, ``int32`` or ``uint32`` buffer of ``n`` elements.

    Returns:
        ``out``.

    Raises:
        ConfigError: sizes differ, ``out`` has another dtype or is read-only, or ``out`` is
            ``int32`` and a token is 2**31 or more.
    """
    cdef const uint8_t[::1] s = memoryview(src).cast("B")
    if s.shape[0] % 4:
        raise ConfigError(f"widen_u32: src holds {s.shape[0]} bytes, not a multiple of 4",
                          field="src")
    cdef int64_t n = s.shape[0] // 4
    cdef Py_buffer view
    cdef int kind = _acquire_out(out, &view, n, "widen_u32")
    cdef int status = ZB_OK
    try:
        if n:
            with nogil:
                status = zb_convert_tokens(&s[0], n, view.buf, kind)
    finally:
        PyBuffer_Release(&view)
    if status == ZB_E_RANGE:
        raise ConfigError("widen_u32: a token is 2**31 or more and does not fit in int32",
                          field="out")
    return out


def max_u32(src) -> int:
    """Largest little-endian ``uint32`` in a buffer (0 for an empty one), GIL released."""
    cdef const uint8_t[::1] s = memoryview(src).cast("B")
    if s.shape[0] % 4:
        raise ConfigError(f"max_u32: src holds {s.shape[0]} bytes, not a multiple of 4",
                          field="src")
    cdef int64_t n = s.shape[0] // 4
    cdef uint32_t m = 0
    if n:
        with nogil:
            m = zb_max_u32(&s[0], n)
    return m


cdef bint _rows_array(object a, tuple shape, bint allow_int32, bint allow_mask) except -1:
    """True when `a` is a writable C-contiguous ndarray of `shape` holding int64 (or int32 /
    bool / uint8 when allowed); False otherwise."""
    if not isinstance(a, np.ndarray) or a.shape != shape or not a.flags.c_contiguous or not a.flags.writeable:
        return False
    if allow_mask:
        return a.dtype == np.bool_ or a.dtype == np.uint8
    return a.dtype == np.int64 or (allow_int32 and a.dtype == np.int32)


def pad_rows(tokens, lengths, int64_t pad_id=0, mask=None, labels=None, int64_t ignore_id=-100, label_values=None):
    """Finish a padded batch in one pass: padding after each row's tokens, the attention mask
    and the next-token labels (see the module comment), GIL released.

    Args:
        tokens: a writable C-contiguous ``int64`` or ``int32`` array ``[k, w]``; row ``r`` holds
            its sample's first ``lengths[r]`` tokens (what follows is overwritten).
        lengths: ``k`` integers in ``[0, w]``.
        pad_id: written after each row's tokens.
        mask: ``None`` or a writable C-contiguous ``bool`` / ``uint8`` array ``[k, w]``.
        labels: ``None`` or a writable C-contiguous array ``[k, w]`` of ``tokens``' dtype.
        ignore_id: written into ``labels`` after each row's tokens.
        label_values: ``None`` (each row's labels are its tokens) or an array of ``labels``'
            shape and dtype whose first ``lengths[r]`` values of each row are its labels (e.g.
            the tokens with ``ignore_id`` where a loss mask is off); it may be ``labels``
            itself, which then only gets its padding written.

    Returns:
        ``tokens``.

    Raises:
        ConfigError: an unfit array, a length outside ``[0, w]``, arrays that overlap, or an
            ``int32`` batch and a ``pad_id`` / ``ignore_id`` that does not fit.
    """
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 2 \
            or not _rows_array(tokens, tokens.shape, True, False):
        raise ConfigError("pad_rows: tokens must be a writable C-contiguous int64 or int32 array [k, w]",
                          field="tokens")
    shape = tokens.shape
    cdef int64_t k = shape[0], w = shape[1]
    cdef bint wide = tokens.dtype == np.int64
    cdef const int64_t[::1] lens = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
    if lens.shape[0] != k:
        raise ConfigError(f"pad_rows: lengths holds {lens.shape[0]} values for {k} rows", field="lengths")
    if not wide and not (-2**31 <= pad_id < 2**31 and -2**31 <= ignore_id < 2**31):
        raise ConfigError(f"pad_rows: pad_id {pad_id} or ignore_id {ignore_id} does not fit in int32",
                          field="pad_id")
    cdef bint has_mask = mask is not None, has_labels = labels is not None
    if has_mask and not _rows_array(mask, shape, False, True):
        raise ConfigError(f"pad_rows: mask must be a writable C-contiguous bool or uint8 array of shape {shape}",
                          field="mask")
    if has_labels and (not _rows_array(labels, shape, True, False) or labels.dtype != tokens.dtype):
        raise ConfigError(f"pad_rows: labels must be a writable C-contiguous {tokens.dtype} array of shape {shape}",
                          field="labels")
    for name, other in (("mask", mask), ("labels", labels)):
        if other is not None and np.may_share_memory(tokens, other):
            raise ConfigError(f"pad_rows: {name} shares memory with tokens", field=name)
    cdef bint in_place = False
    if label_values is not None:
        if not has_labels or not isinstance(label_values, np.ndarray) or label_values.dtype != tokens.dtype \
                or label_values.shape != shape or not label_values.flags.c_contiguous:
            raise ConfigError(f"pad_rows: label_values must be a C-contiguous {tokens.dtype} array of shape {shape}, "
                              "with labels", field="label_values")
        in_place = label_values.ctypes.data == labels.ctypes.data
        if not in_place and np.may_share_memory(labels, label_values):
            raise ConfigError("pad_rows: label_values overlaps labels", field="label_values")
    cdef int64_t r, j, n
    for r in range(k):
        if lens[r] < 0 or lens[r] > w:
            raise ConfigError(f"pad_rows: lengths[{r}] = {lens[r]} is outside [0, {w}]", field="lengths")
    if k == 0 or w == 0:
        return tokens
    cdef int64_t[:, ::1] t64, l64
    cdef int32_t[:, ::1] t32, l32
    cdef const int64_t[:, ::1] v64
    cdef const int32_t[:, ::1] v32
    cdef bint copy_values = label_values is not None and not in_place
    cdef uint8_t[:, ::1] m
    if wide:
        t64 = tokens
        if has_labels:
            l64 = labels
            v64 = label_values if copy_values else tokens
    else:
        t32 = tokens
        if has_labels:
            l32 = labels
            v32 = label_values if copy_values else tokens
    if has_mask:
        m = mask.view(np.uint8)
    with nogil:
        for r in range(k):
            n = lens[r]
            if wide:
                for j in range(n, w):
                    t64[r, j] = pad_id
                if has_labels:
                    if n and not in_place:
                        memcpy(&l64[r, 0], &v64[r, 0], n * 8)
                    for j in range(n, w):
                        l64[r, j] = ignore_id
            else:
                for j in range(n, w):
                    t32[r, j] = <int32_t>pad_id
                if has_labels:
                    if n and not in_place:
                        memcpy(&l32[r, 0], &v32[r, 0], n * 4)
                    for j in range(n, w):
                        l32[r, j] = <int32_t>ignore_id
            if has_mask:
                if n:
                    memset(&m[r, 0], 1, n)
                if n < w:
                    memset(&m[r, n], 0, w - n)
    return tokens


cdef class LLMBatchSlots:
    """Compiled access to the batch slots of one mapped LLMBATCH file.

    Holds the mapping's buffer and the validated geometry; every method validates its
    arguments with the GIL held, then copies and verifies with the GIL released. What was
    checked is recorded in bitmaps the caller owns (a reader passes its own; a caller that
    passes none gets fresh ones).

    Args:
        buffer: the whole file, mapped (any buffer of ``header.file_size`` bytes).
        header: the file's validated :class:`~zerobatch.formats.llmbatch.LLMBatchHeader`.
        verify: check each batch against its checksum the first time it is served.
        verified: the caller's ``uint8`` bitmap of ``ceil(num_batches / 8)`` bytes of batches
            checked against their checksums (set here as batches are checked).
        int32_ok: the caller's bitmap of batches known to hold no id of 2**31 or more.
        path: the file's name, for error messages.
    """

    cdef const uint8_t[::1] _data
    cdef uint8_t[::1] _verified
    cdef uint8_t[::1] _int32_ok
    cdef zb_llmbatch_gather _g      # the gather template: geometry, trailer, bitmaps
    cdef readonly uint64_t num_batches
    cdef readonly uint64_t batch_size
    cdef readonly uint64_t seq_len
    cdef readonly uint64_t tokens_per_batch
    cdef readonly uint64_t raw_batch_bytes
    cdef readonly uint64_t padded_batch_bytes
    cdef readonly bint verify
    cdef readonly bint has_checksums
    cdef readonly bint int32_safe
    cdef readonly object path
    cdef object _u32_views       # [num_batches, batch_size, seq_len] read-only uint32 view
    cdef object _i32_views       # the same pages as writable int32 (zero-copy int32 reads)
    cdef object _empty           # numpy.empty
    cdef object _batch_shape     # (batch_size, seq_len)
    cdef object _int64

    def __cinit__(self, buffer, header, *, bint verify=True, verified=None, int32_ok=None, path=None):
        cdef const uint8_t[::1] data = memoryview(buffer).cast("B")
        if <uint64_t>data.shape[0] != <uint64_t>header.file_size:
            raise ConfigError(f"LLMBatchSlots: buffer holds {data.shape[0]} bytes, header "
                              f"describes {header.file_size}", field="buffer", path=path)
        self._data = data
        self.path = path
        self.num_batches = header.num_batches
        self.batch_size = header.batch_size
        self.seq_len = header.seq_len
        self.tokens_per_batch = header.batch_size * header.seq_len
        self.raw_batch_bytes = header.raw_batch_bytes
        self.padded_batch_bytes = header.padded_batch_bytes
        self.has_checksums = header.has_checksums
        self.verify = verify and header.has_checksums
        nbytes = max((header.num_batches + 7) // 8, 1)
        self._verified = check_bitmap(verified, nbytes, "verified")
        self._int32_ok = check_bitmap(int32_ok, nbytes, "int32_ok")
        # the header's max_token is never trusted for a narrowing (a crafted header could claim
        # a small one): each batch viewed as int32 is scanned once, as every int32 copy is
        self.int32_safe = False
        cdef uint64_t trailer_offset = header.trailer_offset
        self._g.base = &data[0]
        self._g.padded = self.padded_batch_bytes
        self._g.tokens = self.tokens_per_batch
        self._g.trailer = self._g.base + trailer_offset if header.has_checksums else NULL
        self._g.verified = &self._verified[0]
        self._g.int32_ok = &self._int32_ok[0]
        self._g.verify = self.verify
        self._g.items = NULL
        self._g.count = 0
        self._g.out = NULL
        self._g.kind = 0
        self._g.itemsize = 0
        self._g.bad = -1
        self._empty = np.empty
        self._int64 = np.dtype(np.int64)
        self._batch_shape = (header.batch_size, header.seq_len)
        strides = (header.padded_batch_bytes, header.seq_len * 4, 4)
        shape = (header.num_batches, header.batch_size, header.seq_len)
        if header.num_batches:
            self._u32_views = np.ndarray(shape, dtype="<u4", buffer=buffer, offset=LLMBATCH_HEADER_SIZE,
                                         strides=strides)
            self._i32_views = np.ndarray(shape, dtype="<i4", buffer=buffer, offset=LLMBATCH_HEADER_SIZE,
                                         strides=strides)
        else:
            self._u32_views = np.zeros(shape, dtype="<u4")
            self._i32_views = np.zeros(shape, dtype="<i4")
        self._u32_views.flags.writeable = False

    def view_uint32(self, i):
        """Batch ``i`` as a read-only ``uint32`` view of the mapped file (checked, verified)."""
        return self._u32_views[self.check(i)]

    def view_int32(self, i):
        """Batch ``i`` as an ``int32`` view of the mapped file, no copy (checked, verified,
        every token below 2**31); writable when the mapping is (copy-on-write pages)."""
        return self._i32_views[self.check_int32(i)]

    def new_int64(self, i):
        """Batch ``i`` converted into a new ``int64`` array ``[batch_size, seq_len]``."""
        return self._read_into(i, self._empty(self._batch_shape, self._int64))

    cdef inline uint64_t _index(self, object i) except? 0xFFFFFFFFFFFFFFFF:
        cdef object j = i if type(i) is int else PyNumber_Index(i)
        if j < 0 or j >= self.num_batches:
            raise OutOfRangeError(f"batch index {j} out of range [0, {self.num_batches})", path=self.path, field="index")
        return <uint64_t>j

    cdef int _raise(self, int status, int64_t bad) except -1:
        cdef uint64_t expected, got
        if status == ZB_E_CHECKSUM:
            expected = zb_load_u64le(self._g.trailer + bad * LLMBATCH_CHECKSUM_SIZE)
            got = zb_xxh3_64(_slot(&self._g, bad), self._g.padded)
            raise_for_status(status, f"batch_checksum: batch {bad} does not match its checksum "
                             f"(stored 0x{expected:016x}, computed 0x{got:016x})", path=self.path,
                             field="batch_checksum")
        if status == ZB_E_RANGE:
            raise_for_status(status, f"batch {bad} holds a token id of 2**31 or more, which does not "
                             f"fit in int32; read it as int64", path=self.path, field="dtype")
        if status != ZB_OK:
            raise_for_status(status, f"a gather of batch {bad} failed", path=self.path, field="batch")
        return 0

    cpdef uint64_t check(self, object i) except? 0xFFFFFFFFFFFFFFFF:
        """Validate index ``i`` (an integer in ``[0, num_batches)``), verify that batch's
        checksum if it has not been verified yet, and return the index.

        Raises:
            IndexError: ``i`` is outside ``[0, num_batches)``.
            IntegrityError: the batch does not match its checksum.
        """
        cdef uint64_t idx = self._index(i)
        cdef bint ok
        if self.verify and not zb_bit_get(self._g.verified, idx):
            with nogil:
                ok = _check_sum(&self._g, idx)
            if not ok:
                self._raise(ZB_E_CHECKSUM, idx)
        return idx

    def is_verified(self, i) -> bool:
        """Whether batch ``i`` has been checked against its checksum by this reader."""
        return bool(zb_bit_get(self._g.verified, self._index(i)))

    cpdef uint64_t check_int32(self, object i) except? 0xFFFFFFFFFFFFFFFF:
        """:meth:`check`, then make sure every token of batch ``i`` fits in ``int32``.

        Scans the batch once (remembered per batch; the header's ``max_token`` is not trusted).

        Raises:
            ConfigError: a token of the batch is 2**31 or more.
        """
        cdef uint64_t idx = self.check(i)
        cdef uint32_t m
        if self.int32_safe or zb_bit_get(&self._int32_ok[0], idx):
            return idx
        with nogil:
            m = zb_max_u32(_slot(&self._g, idx), self.tokens_per_batch)
        if m >= 2**31:
            raise ConfigError(f"batch {idx} holds token id {m}, which does not fit in int32; "
                              f"read it as int64", path=self.path, field="dtype")
        zb_bit_set(&self._int32_ok[0], idx)
        return idx

    cdef object _read_into(self, object i, object out):
        cdef int64_t idx = self._index(i)
        cdef Py_buffer view
        cdef zb_llmbatch_gather g = self._g
        g.kind = _acquire_out(out, &view, self.tokens_per_batch, "read_into")
        g.itemsize = view.itemsize
        g.out = <char *>view.buf
        g.items = &idx
        g.count = 1
        self._run(&g, &view)
        return out

    cdef int _run(self, zb_llmbatch_gather *g, Py_buffer *view) except -1:
        """Run a prepared gather with the GIL released, release `view`, map the status."""
        cdef int status
        with nogil:
            status = zb_llmbatch_gather_run(g)
        PyBuffer_Release(view)
        if status != ZB_OK:
            self._raise(status, g.bad)
        return 0

    def read_into(self, i, out):
        """Copy batch ``i`` into ``out``, converting tokens to ``out``'s element type.

        Args:
            i: batch index in ``[0, num_batches)``.
            out: writable C-contiguous ``int64``, ``int32`` or ``uint32`` buffer of
                ``batch_size * seq_len`` elements.

        Returns:
            ``out``.

        Raises:
            IndexError: ``i`` out of range.
            IntegrityError: the batch does not match its checksum.
            ConfigError: ``out`` does not fit, or is ``int32`` and a token is 2**31 or more.
        """
        return self._read_into(i, out)

    cdef int _check_indices(self, const int64_t[::1] idx) except -1:
        cdef Py_ssize_t j
        for j in range(idx.shape[0]):
            if idx[j] < 0 or <uint64_t>idx[j] >= self.num_batches:
                raise OutOfRangeError(f"batch index {idx[j]} out of range [0, {self.num_batches})",
                                      path=self.path, field="index")
        return 0

    cdef GatherTicket _queue(self, GatherTicket t, TaskPool pool, object out):
        # queue the prepared gather t.g on pool; the ticket keeps everything it points into
        t.slots = self
        t.out = out
        t.pool = pool
        t.task.fn = zb_llmbatch_gather_run
        t.task.arg = &t.g
        pool.submit(&t.task)
        t.submitted = True
        return t

    cdef int _prepare(self, zb_llmbatch_gather *g, const int64_t[::1] idx, object out,
                      Py_buffer *view) except -1:
        cdef Py_ssize_t k = idx.shape[0]
        self._check_indices(idx)
        g[0] = self._g
        g.kind = _acquire_out(out, view, k * self.tokens_per_batch, "gather")
        g.itemsize = view.itemsize
        g.out = <char *>view.buf
        g.items = &idx[0] if k else NULL
        g.count = k
        return 0

    def gather(self, indices, out):
        """Copy the batches at ``indices`` into ``out[k]``, in order, GIL released.

        Args:
            indices: integer array-like of batch indices (each in ``[0, num_batches)``).
            out: writable C-contiguous ``int64``, ``int32`` or ``uint32`` buffer of
                ``len(indices) * batch_size * seq_len`` elements (e.g. shape
                ``[k, batch_size, seq_len]``).

        Returns:
            ``out``.

        Raises:
            IndexError: an index out of range (nothing is copied).
            IntegrityError: a batch does not match its checksum.
            ConfigError: ``out`` does not fit, or is ``int32`` and a token is 2**31 or more.
        """
        cdef const int64_t[::1] idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        cdef zb_llmbatch_gather g
        cdef Py_buffer view
        self._prepare(&g, idx, out, &view)
        self._run(&g, &view)
        return out

    def gather_async(self, TaskPool pool, indices, out):
        """Queue a :meth:`gather` on ``pool``'s worker threads; returns a :class:`GatherTicket`.

        Indices and ``out`` are validated now (``IndexError`` / ``ConfigError`` are raised
        here); checksum and int32 range errors are raised by :meth:`GatherTicket.wait`.
        """
        cdef GatherTicket t = GatherTicket.__new__(GatherTicket)
        t.idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        self._prepare(&t.g, t.idx, out, &t.view)
        t.has_view = True
        return self._queue(t, pool, out)

    def check_async(self, TaskPool pool, indices, bint int32=False):
        """Check the batches at ``indices`` (their checksums, and with ``int32`` that every id
        fits ``int32``) as one task queued on ``pool``, GIL released; each batch is checked
        once per reader (the bitmaps remember it). For zero-copy views, made while the task
        runs and handed out once it succeeded. Returns a :class:`GatherTicket` whose
        ``wait()`` returns ``None``.

        Raises:
            IndexError: an index out of range (now).
            IntegrityError, ConfigError: from ``wait()``, as :meth:`check` / :meth:`check_int32`.
        """
        cdef GatherTicket t = GatherTicket.__new__(GatherTicket)
        t.idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        cdef Py_ssize_t k = t.idx.shape[0]
        self._check_indices(t.idx)
        t.g = self._g
        t.g.out = NULL
        t.g.kind = ZB_OUT_INT32 if int32 and not self.int32_safe else 0
        t.g.items = &t.idx[0] if k else NULL
        t.g.count = k
        return self._queue(t, pool, None)

    @property
    def int32_views(self):
        """Every batch as ``int32`` ``[num_batches, batch_size, seq_len]`` views of the mapped
        file (unchecked: check a batch with :meth:`check_int32` or :meth:`check_async` before
        handing it out)."""
        return self._i32_views

    def verify_range(self, start, stop):
        """Check batches ``[start, stop)`` against their checksums, GIL released.

        Returns:
            A list of the indices whose checksum does not match (empty when all match, or
            when the file has no checksums).
        """
        cdef uint64_t a = start, b = stop, i
        if a > b or b > self.num_batches:
            raise ConfigError(f"verify_range: [{start}, {stop}) is not inside "
                              f"[0, {self.num_batches})", field="stop", path=self.path)
        bad = []
        if not self.has_checksums:
            return bad
        cdef int64_t first_bad
        while a < b:
            first_bad = -1
            with nogil:
                i = a
                while i < b:
                    if zb_xxh3_64(_slot(&self._g, i), self._g.padded) != \
                            zb_load_u64le(self._g.trailer + i * LLMBATCH_CHECKSUM_SIZE):
                        first_bad = i
                        break
                    zb_bit_set(self._g.verified, i)
                    i += 1
            if first_bad < 0:
                break
            bad.append(first_bad)
            a = first_bad + 1
        return bad

    def padding_is_zero(self, start, stop) -> bool:
        """Whether the zero padding after each batch in ``[start, stop)`` is all zeros."""
        cdef uint64_t a = start, b = stop, i, k
        cdef uint64_t pad = self.padded_batch_bytes - self.raw_batch_bytes
        cdef const uint8_t *p
        cdef uint8_t acc = 0
        if a > b or b > self.num_batches:
            raise ConfigError(f"padding_is_zero: [{start}, {stop}) is not inside "
                              f"[0, {self.num_batches})", field="stop", path=self.path)
        if pad == 0:
            return True
        with nogil:
            for i in range(a, b):
                p = _slot(&self._g, i) + self.raw_batch_bytes
                for k in range(pad):
                    acc |= p[k]
        return acc == 0

    def max_token(self, start, stop) -> int:
        """Largest token id in batches ``[start, stop)`` (0 for an empty range), GIL released."""
        cdef uint64_t a = start, b = stop, i
        cdef uint32_t m = 0, v
        if a > b or b > self.num_batches:
            raise ConfigError(f"max_token: [{start}, {stop}) is not inside "
                              f"[0, {self.num_batches})", field="stop", path=self.path)
        with nogil:
            for i in range(a, b):
                v = zb_max_u32(_slot(&self._g, i), self.tokens_per_batch)
                m = v if v > m else m
        return m


cdef class GatherTicket:
    """A gather queued on a :class:`TaskPool`; :meth:`wait` returns its output.

    Holds the slots, the indices and the output alive until the gather has run.
    """

    cdef zb_task task
    cdef zb_llmbatch_gather g
    cdef Py_buffer view
    cdef bint has_view
    cdef bint submitted
    cdef bint finished
    cdef bint cancelled
    cdef const int64_t[::1] idx
    cdef LLMBatchSlots slots
    cdef TaskPool pool
    cdef object out

    def wait(self):
        """Block (GIL released) until the gather has run; return ``out``.

        Raises:
            IntegrityError: a batch does not match its checksum.
            ConfigError: an ``int32`` output and a token of 2**31 or more.
        """
        if self.cancelled:
            raise ConfigError("wait: this gather was cancelled", field="ticket")
        if not self.finished:
            self.pool.wait(&self.task)
            self.finished = True
            if self.has_view:
                PyBuffer_Release(&self.view)
                self.has_view = False
        if self.task.status != ZB_OK:
            self.slots._raise(self.task.status, self.g.bad)
        return self.out

    def cancel(self):
        """Drop the gather if no worker has started it; else wait for it. Never raises.

        Returns:
            ``True`` when it was dropped (``out`` was not written).
        """
        cdef bint dropped = False
        if not self.finished:
            dropped = self.pool.cancel(&self.task)
            self.finished = True
            self.cancelled = dropped
            if self.has_view:
                PyBuffer_Release(&self.view)
                self.has_view = False
        return dropped

    def __dealloc__(self):
        # The task points into this object: never free it while a worker may run it.
        if self.submitted and not self.finished:
            self.pool.wait(&self.task)
        if self.has_view:
            PyBuffer_Release(&self.view)
