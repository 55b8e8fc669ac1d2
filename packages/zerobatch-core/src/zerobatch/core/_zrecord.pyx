# ZRECORD gathers: records of a multi-field store, resolved, checked, copied or inflated.
#
# Contract
#   RecordGather(commit, epoch)
#     commit: a buffer over the store's commit.zr (read-only mapping, >= 64 bytes);
#     epoch: the rebalance epoch of the tables this reader mapped.
#   set_table(k, table, check) / set_chunk(c, mapping)
#     register field k's mapped offset table and check file / chunk c's mapping (kept alive
#     here, and by every view a caller made of it, so no view ever dangles).
#   snapshot(indices, fields) -> (entries [n, len(fields)] ENTRY_DTYPE, length, num_chunks)
#     the entries under the seqlock of commit.zr: all from one committed state, each
#     checked against its CRC-32. Returns the internal codes (RETRY / STALE / NEED_TABLE)
#     and a damaged entry ("bad_entry", field, index) as tuples for the wrapper to act on;
#     raises IndexError for an index outside [-length, length).
#   check(entries_col, num_chunks, field_no, codec, fixed_len, max_len, verify, out, pool)
#     per record: the chunk exists, the entry lies inside it, the container's magic,
#     checksum (verify), codec, field number and lengths agree; then copies (raw) or
#     inflates (flate) into out when out is given (fixed_len * n bytes, or variable records
#     at out_offsets). Returns (payload_offsets u64[n], lens i64[n]: -1 absent) or a
#     ("need_chunk", c) tuple.
#   inflate(entries_col, payload, lens, out, out_offsets, pool)  the fill of variable flate
#     records after check sized them.
#   All loops run with the GIL released, split over `pool` when the batch is large.

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memset

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.ref cimport Py_INCREF, PyObject
cimport numpy as cnp

from zerobatch.core._hash cimport zb_xxh3_64
from zerobatch.core._pool cimport TaskPool, zb_task

import numpy as np

from zerobatch.core._status import raise_for_status
from zerobatch.formats.errors import OutOfRangeError

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    # The array constructor Cython's numpy.pxd leaves out; it steals the reference to descr.
    object PyArray_NewFromDescr(void *subtype, cnp.dtype descr, int nd, cnp.npy_intp *dims,
                                cnp.npy_intp *strides, void *data, int flags, PyObject *obj)
from zerobatch.formats.zrecord import ENTRY_DTYPE

__all__ = ["RecordGather", "buffer_views", "zrecord_status_error"]

cdef extern from "_zrecord.h" nogil:
    int ZR_OK, ZR_RETRY, ZR_STALE, ZR_NEED_TABLE, ZR_NEED_CHUNK, ZR_E_INDEX, ZR_E_CHECKSUM
    ctypedef struct zr_entry:
        uint32_t chunk
        uint64_t offset
        uint32_t length
    ctypedef struct zr_chunkmap:
        const uint8_t *const *base
        const uint64_t *size
        uint64_t mapped
        uint64_t committed
    ctypedef struct zr_job:
        const zr_chunkmap *cm
        const zr_entry *entries
        int64_t stride
        int64_t count
        uint32_t field_no
        uint32_t codec
        int verify
        uint64_t fixed_len
        uint64_t max_len
        uint64_t itemsize
        uint64_t (*hash)(const uint8_t *, uint64_t) noexcept nogil
        uint64_t *payload
        int64_t *lens
        uint8_t *out
        const uint64_t *out_off
        int fill_only
        int status
        int64_t bad
        uint64_t need_chunk
    int zr_snapshot(const uint8_t *commit, uint64_t epoch, const uint8_t *const *tables,
                    const uint8_t *const *checks, const uint32_t *field_nos,
                    const uint64_t *table_entries, int64_t nf, const int64_t *idx, int64_t n,
                    zr_entry *out, uint64_t *length, uint64_t *num_chunks, int64_t *bad)
    int zr_job_run(zr_job *j)
    void zr_publish_chunk(const uint8_t **base_slot, uint64_t *size_slot, const uint8_t *base,
                          uint64_t size)

#: Fewest bytes of records worth handing to another thread (waking a worker costs about
#: as much as checking and copying this much).
MIN_BYTES_PER_PART = 1 << 17


cdef int _task_fn(void *arg) noexcept nogil:
    return zr_job_run(<zr_job *>arg)


cdef class RecordGather:
    """The compiled side of a ZRECORD reader: see the contract at the top of _zrecord.pyx."""

    cdef const uint8_t *_commit
    cdef object _commit_obj
    cdef readonly uint64_t epoch
    cdef const uint8_t **_tables
    cdef const uint8_t **_checks
    cdef uint64_t *_table_entries
    cdef int64_t _num_tables
    cdef list _table_objs
    cdef const uint8_t **_chunk_base
    cdef uint64_t *_chunk_size
    cdef uint64_t _chunk_cap
    cdef list _chunk_objs
    cdef list _old_arrays      # addresses of outgrown pointer arrays: a kernel may still read them
    cdef list _keep            # replaced mappings: a kernel may still read them

    def __cinit__(self, commit, uint64_t epoch):
        cdef const uint8_t[::1] mv = np.frombuffer(commit, dtype=np.uint8)
        if mv.shape[0] < 64:
            raise ValueError("commit: fewer than 64 bytes")
        self._commit = &mv[0]
        self._commit_obj = commit
        self.epoch = epoch
        self._table_objs = []
        self._chunk_objs = []
        self._old_arrays = []
        self._keep = []

    def __dealloc__(self):
        cdef size_t addr
        if self._old_arrays is not None:
            for addr in self._old_arrays:
                free(<void *>addr)
        free(self._tables)
        free(self._checks)
        free(self._table_entries)
        free(self._chunk_base)
        free(self._chunk_size)

    def set_table(self, int64_t k, table, check):
        """Register field k's offset table (16-byte entries) and its check file (a CRC-32
        per entry); the entries usable are those both cover."""
        cdef const uint8_t[::1] mv = np.frombuffer(table, dtype=np.uint8)
        cdef const uint8_t[::1] cv = np.frombuffer(check, dtype=np.uint8)
        cdef int64_t n
        if k < 0 or k > 65535:
            raise ValueError("field number out of range")
        # The pointer arrays are only read with the GIL held (snapshot copies them), so they
        # may be reallocated here; the mappings they point at are kept alive (see _keep).
        if k >= self._num_tables:
            n = k + 1
            self._tables = <const uint8_t **>realloc(self._tables, n * sizeof(uint8_t *))
            self._checks = <const uint8_t **>realloc(self._checks, n * sizeof(uint8_t *))
            self._table_entries = <uint64_t *>realloc(self._table_entries, n * sizeof(uint64_t))
            if self._tables == NULL or self._checks == NULL or self._table_entries == NULL:
                raise MemoryError()
            while self._num_tables < n:
                self._tables[self._num_tables] = NULL
                self._checks[self._num_tables] = NULL
                self._table_entries[self._num_tables] = 0
                self._table_objs.append(None)
                self._num_tables += 1
        if self._table_objs[k] is not None:
            self._keep.append(self._table_objs[k])   # a snapshot running now may read it
        self._table_objs[k] = (table, check)
        self._tables[k] = &mv[0] if mv.shape[0] else NULL
        self._checks[k] = &cv[0] if cv.shape[0] else NULL
        self._table_entries[k] = min(mv.shape[0] // 16, cv.shape[0] // 4)

    def set_chunk(self, uint64_t c, mapping):
        """Register chunk c's mapping (None unmaps it here; live views keep theirs)."""
        # Kernels read these arrays without the GIL while this runs on another thread: an
        # outgrown array is kept (freed with this object), a replaced mapping is kept alive,
        # and an entry is published base first, then size (zr_publish_chunk).
        cdef const uint8_t[::1] mv
        cdef uint64_t cap
        cdef const uint8_t **nb
        cdef uint64_t *ns
        if c >= self._chunk_cap:
            cap = max(c + 1, self._chunk_cap * 2, 16)
            nb = <const uint8_t **>malloc(cap * sizeof(uint8_t *))
            ns = <uint64_t *>malloc(cap * sizeof(uint64_t))
            if nb == NULL or ns == NULL:
                free(nb)
                free(ns)
                raise MemoryError()
            memset(nb, 0, cap * sizeof(uint8_t *))
            memset(ns, 0, cap * sizeof(uint64_t))
            if self._chunk_cap:
                memcpy(nb, self._chunk_base, self._chunk_cap * sizeof(uint8_t *))
                memcpy(ns, self._chunk_size, self._chunk_cap * sizeof(uint64_t))
            if self._chunk_base != NULL:
                self._old_arrays.append(<size_t>self._chunk_base)
                self._old_arrays.append(<size_t>self._chunk_size)
            self._chunk_base = nb
            self._chunk_size = ns
            self._chunk_objs.extend([None] * (cap - self._chunk_cap))
            self._chunk_cap = cap
        if self._chunk_objs[c] is not None:
            self._keep.append(self._chunk_objs[c])
        if mapping is None or len(mapping) == 0:
            zr_publish_chunk(&self._chunk_base[c], &self._chunk_size[c], NULL, 0)
            self._chunk_objs[c] = None
            return
        mv = np.frombuffer(mapping, dtype=np.uint8)
        self._chunk_objs[c] = mapping
        zr_publish_chunk(&self._chunk_base[c], &self._chunk_size[c], &mv[0], mv.shape[0])

    def chunk_array(self, uint64_t c):
        """A uint8 array over chunk c's mapping (views of records keep the mapping alive)."""
        return np.frombuffer(self._chunk_objs[c], np.uint8)

    def views(self, chunks, payload, lens, dtype, shape=None):
        """Read-only arrays over the mapped records: record i is ``lens[i]`` bytes at chunk
        ``chunks[i]``, offset ``payload[i]``, viewed as ``dtype`` (reshaped to ``shape``);
        None where ``lens[i] < 0``. Each array's base is the chunk's mapping."""
        cdef const uint32_t[::1] ch = np.ascontiguousarray(chunks, dtype=np.uint32)
        cdef const uint64_t[::1] pay = payload
        cdef const int64_t[::1] ln = lens
        cdef int64_t i, n = ln.shape[0]
        cdef list out = [None] * n
        cdef uint32_t c
        for i in range(n):
            if ln[i] < 0:
                continue
            c = ch[i]
            if c >= self._chunk_cap or self._chunk_base[c] == NULL or \
                    pay[i] + <uint64_t>ln[i] > self._chunk_size[c]:
                raise ValueError("a record outside the mapped chunks")
            out[i] = _view(<char *>self._chunk_base[c] + pay[i], ln[i], dtype, shape, self._chunk_objs[c])
        return out

    def snapshot(self, indices, fields):
        """Entries [n, len(fields)] of one committed state, or a (code, detail) tuple."""
        cdef const int64_t[::1] idx = np.ascontiguousarray(indices, dtype=np.int64)
        cdef const int64_t[::1] fno = np.ascontiguousarray(fields, dtype=np.int64)
        cdef int64_t n = idx.shape[0], nf = fno.shape[0], k, bad = 0
        cdef uint64_t length = 0, nchunks = 0
        cdef int status
        entries = np.empty((n, nf), dtype=ENTRY_DTYPE)
        cdef uint8_t[::1] raw = entries.reshape(-1).view(np.uint8) if n and nf else np.empty(16, np.uint8)
        cdef const uint8_t **tabs = <const uint8_t **>PyMem_Malloc((nf + 1) * sizeof(uint8_t *))
        cdef const uint8_t **chks = <const uint8_t **>PyMem_Malloc((nf + 1) * sizeof(uint8_t *))
        cdef uint32_t *fnos = <uint32_t *>PyMem_Malloc((nf + 1) * sizeof(uint32_t))
        cdef uint64_t *tents = <uint64_t *>PyMem_Malloc((nf + 1) * sizeof(uint64_t))
        try:
            if tabs == NULL or chks == NULL or fnos == NULL or tents == NULL:
                raise MemoryError()
            for k in range(nf):
                if fno[k] < 0 or fno[k] >= self._num_tables:
                    raise ValueError(f"field number {fno[k]} has no table")
                tabs[k] = self._tables[fno[k]]
                chks[k] = self._checks[fno[k]]
                fnos[k] = <uint32_t>fno[k]
                tents[k] = self._table_entries[fno[k]]
            with nogil:
                status = zr_snapshot(self._commit, self.epoch, tabs, chks, fnos, tents, nf,
                                     &idx[0] if n else NULL, n if nf else 0, <zr_entry *>&raw[0],
                                     &length, &nchunks, &bad)
        finally:
            PyMem_Free(tabs)
            PyMem_Free(chks)
            PyMem_Free(fnos)
            PyMem_Free(tents)
        if status == ZR_RETRY:
            return ("retry", 0)
        if status == ZR_STALE:
            return ("stale", 0)
        if status == ZR_NEED_TABLE:
            return ("need_table", int(fno[bad]))
        if status == ZR_E_CHECKSUM:
            return ("bad_entry", int(fno[bad % nf]), int(idx[bad // nf]))
        if status == ZR_E_INDEX:
            raise OutOfRangeError(f"index {int(idx[bad])} is out of range for a store of {length} records")
        return entries, int(length), int(nchunks)

    def check(self, entries_col, uint64_t num_chunks, uint32_t field_no, uint32_t codec,
              uint64_t fixed_len, uint64_t max_len, bint verify, out=None, TaskPool pool=None,
              int64_t threads=1, uint64_t itemsize=1):
        """Check one field's records (a logical length must be a multiple of ``itemsize``);
        copy or inflate fixed-shape ones into ``out``."""
        return self._run(entries_col, num_chunks, field_no, codec, fixed_len, max_len, verify, out,
                         None, None, None, pool, threads, itemsize)

    def inflate(self, entries_col, uint32_t field_no, payload, lens, out, out_offsets,
                TaskPool pool=None, int64_t threads=1):
        """Inflate checked variable-length flate records into ``out`` at ``out_offsets``."""
        return self._run(entries_col, 0, field_no, 1, 0, 0, False, out, out_offsets, payload, lens,
                         pool, threads, 1)

    cdef object _run(self, entries_col, uint64_t num_chunks, uint32_t field_no, uint32_t codec,
                     uint64_t fixed_len, uint64_t max_len, bint verify, out, out_offsets, payload_in,
                     lens_in, TaskPool pool, int64_t threads, uint64_t itemsize):
        cdef const uint8_t[::1] ent_raw = np.ascontiguousarray(entries_col).view(np.uint8).reshape(-1)
        cdef int64_t n = ent_raw.shape[0] // 16
        cdef bint fill_only = payload_in is not None
        payload = np.zeros(n, np.uint64) if not fill_only else payload_in
        lens = np.zeros(n, np.int64) if not fill_only else lens_in
        cdef uint64_t[::1] pay = payload
        cdef int64_t[::1] ln = lens
        cdef uint8_t[::1] outv
        cdef const uint64_t[::1] offv
        cdef uint8_t *outp = NULL
        cdef const uint64_t *offp = NULL
        cdef zr_chunkmap cm
        cdef int64_t i, parts, first, cnt, p, submitted = 0
        cdef uint64_t total = 0
        cdef int status = ZR_OK
        if n == 0:
            return payload, lens
        if out is not None:
            outv = out.reshape(-1).view(np.uint8) if isinstance(out, np.ndarray) else out
            outp = &outv[0] if outv.shape[0] else NULL
            if fixed_len and <uint64_t>outv.shape[0] < fixed_len * <uint64_t>n:
                raise ValueError("out is too small")
        if out_offsets is not None:
            offv = out_offsets
            offp = &offv[0]
        cdef const zr_entry *ents = <const zr_entry *>&ent_raw[0]
        # The work to split: bytes read (checked), plus bytes inflated, which cost several
        # times more per byte than a hash or a copy.
        for i in range(n):
            total += ents[i].length
            if fill_only and ln[i] > 0:
                total += 4 * <uint64_t>ln[i]
        if codec == 1 and fixed_len and outp != NULL:
            total += 4 * fixed_len * <uint64_t>n
        cm.base = self._chunk_base
        cm.size = self._chunk_size
        cm.mapped = self._chunk_cap
        cm.committed = num_chunks if not fill_only else self._chunk_cap
        parts = 1
        if pool is not None and threads > 1:
            parts = min(threads, max(1, <int64_t>(total // MIN_BYTES_PER_PART)), n)
        cdef zr_job *jobs = <zr_job *>PyMem_Malloc(parts * sizeof(zr_job))
        cdef zb_task *tasks = <zb_task *>PyMem_Malloc(parts * sizeof(zb_task))
        if jobs == NULL or tasks == NULL:
            PyMem_Free(jobs)
            PyMem_Free(tasks)
            raise MemoryError()
        try:
            first = 0
            for p in range(parts):
                cnt = n // parts + (1 if p < n % parts else 0)
                memset(&jobs[p], 0, sizeof(zr_job))
                jobs[p].cm = &cm
                jobs[p].entries = ents + first
                jobs[p].stride = 1
                jobs[p].count = cnt
                jobs[p].field_no = field_no
                jobs[p].codec = codec
                jobs[p].verify = verify
                jobs[p].fixed_len = fixed_len
                jobs[p].max_len = max_len
                jobs[p].itemsize = itemsize
                jobs[p].hash = zb_xxh3_64
                jobs[p].payload = &pay[first]
                jobs[p].lens = &ln[first]
                jobs[p].fill_only = fill_only
                if outp != NULL:
                    jobs[p].out = outp + (first * fixed_len if fixed_len else 0)
                    jobs[p].out_off = offp + first if offp != NULL else NULL
                tasks[p].fn = _task_fn
                tasks[p].arg = &jobs[p]
                first += cnt
            for p in range(parts - 1):
                pool.submit(&tasks[p])
                submitted += 1
            with nogil:
                zr_job_run(&jobs[parts - 1])
            for p in range(submitted):
                pool.wait(&tasks[p])
            submitted = 0
            first = 0
            for p in range(parts):
                if jobs[p].status != ZR_OK:
                    return _failure(jobs[p].status, first + jobs[p].bad, jobs[p].need_chunk,
                                    ents[first + jobs[p].bad])
                first += jobs[p].count
        finally:
            for p in range(submitted):
                pool.wait(&tasks[p])
            PyMem_Free(jobs)
            PyMem_Free(tasks)
        return payload, lens


cdef object _failure(int status, int64_t pos, uint64_t need, const zr_entry e):
    if status == ZR_NEED_CHUNK:
        return ("need_chunk", int(need), int(pos))
    return ("error", status, int(pos), (int(e.chunk), int(e.offset), int(e.length)))


def zrecord_status_error(int status, str message, path=None, field=None):
    """Raise the exception of a failure tuple's status (for the Python wrapper)."""
    raise_for_status(status, message, path=path, field=field)


def buffer_views(cnp.ndarray buf, offsets, lens, dtype, shape=None):
    """Arrays over ``buf`` (C-contiguous bytes): record i is ``lens[i]`` bytes at
    ``offsets[i]``, viewed as ``dtype`` (reshaped to ``shape``); None where ``lens[i] < 0``."""
    cdef const uint64_t[::1] off = offsets
    cdef const int64_t[::1] ln = lens
    cdef int64_t i, n = ln.shape[0]
    cdef list out = [None] * n
    cdef char *base = <char *>cnp.PyArray_DATA(buf)
    cdef uint64_t size = <uint64_t>cnp.PyArray_NBYTES(buf)
    if not cnp.PyArray_IS_C_CONTIGUOUS(buf):
        raise ValueError("buf must be C-contiguous")
    for i in range(n):
        if ln[i] < 0:
            continue
        if off[i] + <uint64_t>ln[i] > size:
            raise ValueError("a record outside the buffer")
        out[i] = _view(base + off[i], ln[i], dtype, shape, buf)
    return out


cdef object _view(char *data, int64_t nbytes, object dtype, object shape, object owner):
    """A read-only array of ``dtype`` over ``nbytes`` at ``data``, kept alive by ``owner``."""
    cdef cnp.dtype descr = <cnp.dtype>dtype
    cdef cnp.npy_intp dims[8]
    cdef int nd = 1, k
    cdef int64_t item = descr.itemsize
    if shape is None:
        dims[0] = nbytes // item
    else:
        nd = len(shape)
        for k in range(nd):
            dims[k] = shape[k]
    Py_INCREF(descr)   # PyArray_NewFromDescr steals it
    arr = PyArray_NewFromDescr(<void *>np.ndarray, descr, nd, dims, NULL, data,
                               cnp.NPY_ARRAY_C_CONTIGUOUS | cnp.NPY_ARRAY_ALIGNED, NULL)
    Py_INCREF(owner)   # PyArray_SetBaseObject steals it
    cnp.PyArray_SetBaseObject(<cnp.ndarray>arr, owner)
    return arr
