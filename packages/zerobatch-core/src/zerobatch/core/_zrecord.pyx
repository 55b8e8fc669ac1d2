# distutils: libraries = z
# ZRECORD kernels: records of a multi-field store, resolved, checked, copied or inflated.
#
# Contract (the C kernels and their contracts are declared in _zrecord.pxd)
#   snapshot_entries(commit, epoch, tables, checks, table_entries, field_nos, indices, out,
#                    key32=0) -> (status, length, num_chunks, bad)
#     commit: a buffer over the store's commit.zr (>= 64 bytes); tables / checks: uint64
#     addresses of field k's mapped offset table and check file, table_entries: the entries
#     both cover (all three indexed by field number, owned by the caller, which keeps the
#     mappings alive); out: a C-contiguous ENTRY_DTYPE array (n, len(field_nos)). Runs
#     zr_snapshot without the GIL and returns its status: ZB_OK, the signals ZB_RETRY /
#     ZB_STALE / ZB_NEED_TABLE, or the errors ZB_E_INDEX / ZB_E_CHECKSUM (with `bad`), for
#     the caller to act on or raise through raise_for_status.
#   check_records(entries, chunk_base, chunk_size, committed, field_no, codec, fixed_len,
#                 max_len, itemsize, verify, out=None, pool=None, threads=1, key=0, first=0)
#     -> (status, bad, need_chunk, payload, lens)
#     key: the store key XORed into every record checksum; first: the first live chunk.
#     chunk_base / chunk_size: the caller's uint64 arrays of mapped chunk addresses and sizes
#     (0: not mapped; published with publish_chunk). Per record the checks of zr_job_run,
#     then a copy (raw) or inflate (flate) into `out` (fixed_len * n bytes) when given.
#   inflate_records(entries, chunk_base, chunk_size, payload, lens, out, out_offsets, pool,
#                   threads) -> (status, bad): the fill of variable flate records after
#     check_records sized them.
#   publish_chunk(chunk_base, chunk_size, c, address, size): chunk c's mapping, base first.
#   record_views(chunk_base, chunk_size, owners, chunks, payload, lens, dtype, shape) /
#   buffer_views(buf, offsets, lens, dtype, shape): read-only arrays over mapped records /
#     a buffer, each kept alive by its owner.
#   All loops run with the GIL released, split over `pool` when the batch is large. The
#   functions hold no state: the tables, the chunk registry and the retry policy are the
#   reader's (zerobatch.readers.zrecord).

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memset

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.ref cimport Py_INCREF, PyObject
cimport numpy as cnp

from zerobatch.core._hash cimport zb_xxh3_64
from zerobatch.core._pool cimport TaskPool, zb_part_len, zb_parts_new, zb_run_parts, zb_task
from zerobatch.core._status cimport ZB_E_ARGUMENT, ZB_OK

import numpy as np

from zerobatch.core.status import raise_for_status
from zerobatch.formats.errors import ConfigError
from zerobatch.formats.zrecord import ENTRY_DTYPE

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    # The array constructor Cython's numpy.pxd leaves out; it steals the reference to descr.
    object PyArray_NewFromDescr(void *subtype, cnp.dtype descr, int nd, cnp.npy_intp *dims,
                                cnp.npy_intp *strides, void *data, int flags, PyObject *obj)

__all__ = ["buffer_views", "check_records", "inflate_records", "publish_chunk", "record_views",
           "snapshot_entries", "zrecord_status_error"]

#: Fewest bytes of records worth handing to another thread (waking a worker costs about
#: as much as checking and copying this much).
MIN_BYTES_PER_PART = 1 << 17


cdef int _task_fn(void *arg) noexcept nogil:
    return zr_job_run(<zr_job *>arg)


def snapshot_entries(commit, uint64_t epoch, tables, checks, table_entries, field_nos, indices, out,
                     uint32_t key32=0):
    """See the module comment. Returns ``(status, length, num_chunks, bad)``."""
    cdef const uint8_t[::1] cv = np.frombuffer(commit, dtype=np.uint8)
    if cv.shape[0] < 64:
        raise ConfigError("commit: fewer than 64 bytes", field="commit")
    cdef const uint64_t[::1] taddr = np.ascontiguousarray(tables, dtype=np.uint64)
    cdef const uint64_t[::1] caddr = np.ascontiguousarray(checks, dtype=np.uint64)
    cdef const uint64_t[::1] tent = np.ascontiguousarray(table_entries, dtype=np.uint64)
    cdef const int64_t[::1] fno = np.ascontiguousarray(field_nos, dtype=np.int64)
    cdef const int64_t[::1] idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    cdef int64_t n = idx.shape[0], nf = fno.shape[0], k, bad = 0
    if not isinstance(out, np.ndarray) or out.dtype != ENTRY_DTYPE or out.shape != (n, nf) \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise ConfigError(f"out must be a writable C-contiguous ENTRY_DTYPE array of shape ({n}, {nf})", field="out")
    cdef uint8_t[::1] raw = out.reshape(-1).view(np.uint8) if n and nf else np.empty(16, np.uint8)
    cdef uint64_t length = 0, nchunks = 0
    cdef int status
    # the selected fields' pointers and sizes, copied with the GIL held: the caller may
    # replace a table (with a larger one) while this runs
    cdef const uint8_t **tabs = <const uint8_t **>PyMem_Malloc((nf + 1) * sizeof(uint8_t *))
    cdef const uint8_t **chks = <const uint8_t **>PyMem_Malloc((nf + 1) * sizeof(uint8_t *))
    cdef uint32_t *fnos = <uint32_t *>PyMem_Malloc((nf + 1) * sizeof(uint32_t))
    cdef uint64_t *tents = <uint64_t *>PyMem_Malloc((nf + 1) * sizeof(uint64_t))
    try:
        if tabs == NULL or chks == NULL or fnos == NULL or tents == NULL:
            raise MemoryError()
        for k in range(nf):
            if fno[k] < 0 or fno[k] >= taddr.shape[0] or fno[k] >= caddr.shape[0] or fno[k] >= tent.shape[0] \
                    or fno[k] > 65535:
                raise ConfigError(f"field number {fno[k]} has no table", field="field_nos")
            tabs[k] = <const uint8_t *><size_t>taddr[fno[k]]
            chks[k] = <const uint8_t *><size_t>caddr[fno[k]]
            fnos[k] = <uint32_t>fno[k]
            tents[k] = tent[fno[k]] if tabs[k] != NULL and chks[k] != NULL else 0
        with nogil:
            status = zr_snapshot(&cv[0], epoch, tabs, chks, fnos, tents, nf, &idx[0] if n else NULL,
                                 n if nf else 0, key32, <zr_entry *>&raw[0], &length, &nchunks, &bad)
    finally:
        PyMem_Free(tabs)
        PyMem_Free(chks)
        PyMem_Free(fnos)
        PyMem_Free(tents)
    return status, int(length), int(nchunks), int(bad)


def check_records(entries, chunk_base, chunk_size, uint64_t committed, uint32_t field_no, uint32_t codec,
                  uint64_t fixed_len, uint64_t max_len, uint64_t itemsize, bint verify, out=None,
                  TaskPool pool=None, int64_t threads=1, uint64_t key=0, uint64_t first=0):
    """See the module comment. Returns ``(status, bad, need_chunk, payload, lens)``."""
    n = len(entries)
    payload = np.zeros(n, np.uint64)
    lens = np.zeros(n, np.int64)
    status, bad, need = _run(entries, chunk_base, chunk_size, committed, field_no, codec, fixed_len, max_len,
                             itemsize, verify, out, None, payload, lens, False, pool, threads, key, first)
    return status, bad, need, payload, lens


def inflate_records(entries, chunk_base, chunk_size, payload, lens, out, out_offsets, TaskPool pool=None,
                    int64_t threads=1):
    """See the module comment. Returns ``(status, bad)``."""
    status, bad, _ = _run(entries, chunk_base, chunk_size, len(chunk_base), 0, 1, 0, 0, 1, False, out,
                          out_offsets, payload, lens, True, pool, threads, 0, 0)
    return status, bad


cdef tuple _run(entries, chunk_base, chunk_size, uint64_t committed, uint32_t field_no, uint32_t codec,
                uint64_t fixed_len, uint64_t max_len, uint64_t itemsize, bint verify, out, out_offsets,
                payload, lens, bint fill_only, TaskPool pool, int64_t threads, uint64_t key, uint64_t first_chunk):
    cdef const uint8_t[::1] ent_raw = np.ascontiguousarray(entries).view(np.uint8).reshape(-1)
    cdef int64_t n = ent_raw.shape[0] // 16
    cdef const uint64_t[::1] bases = chunk_base
    cdef const uint64_t[::1] sizes = chunk_size
    cdef uint64_t[::1] pay = payload
    cdef int64_t[::1] ln = lens
    cdef uint8_t[::1] outv
    cdef const uint64_t[::1] offv
    cdef uint8_t *outp = NULL
    cdef const uint64_t *offp = NULL
    cdef zr_chunkmap cm
    cdef int64_t i, parts, first, cnt, p
    cdef uint64_t total = 0
    if bases.shape[0] != sizes.shape[0]:
        raise ConfigError("chunk_base and chunk_size must have one entry per chunk", field="chunk_size")
    if n == 0:
        return ZB_OK, 0, 0
    if out is not None:
        outv = out.reshape(-1).view(np.uint8) if isinstance(out, np.ndarray) else out
        outp = &outv[0] if outv.shape[0] else NULL
        if fixed_len and <uint64_t>outv.shape[0] < fixed_len * <uint64_t>n:
            raise ConfigError("out is too small for the records", field="out")
    if out_offsets is not None:
        offv = out_offsets
        offp = &offv[0]
    cdef const zr_entry *ents = <const zr_entry *>&ent_raw[0]
    # The work to split: bytes read (checked), plus bytes inflated, which cost several times
    # more per byte than a hash or a copy.
    for i in range(n):
        total += ents[i].length
        if fill_only and ln[i] > 0:
            total += 4 * <uint64_t>ln[i]
    if codec == 1 and fixed_len and outp != NULL:
        total += 4 * fixed_len * <uint64_t>n
    cm.base = <const uint8_t *const *>&bases[0] if bases.shape[0] else NULL
    cm.size = &sizes[0] if sizes.shape[0] else NULL
    cm.mapped = bases.shape[0]
    cm.committed = committed
    cm.first = first_chunk
    parts = 1
    if pool is not None and threads > 1:
        parts = min(threads, max(1, <int64_t>(total // MIN_BYTES_PER_PART)), n)
    cdef zr_job *jobs
    cdef zb_task *tasks = zb_parts_new(parts, sizeof(zr_job), <void **>&jobs)
    try:
        first = 0
        for p in range(parts):
            cnt = zb_part_len(n, parts, p)
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
            jobs[p].key = key
            jobs[p].payload = &pay[first]
            jobs[p].lens = &ln[first]
            jobs[p].fill_only = fill_only
            if outp != NULL:
                jobs[p].out = outp + (first * fixed_len if fixed_len else 0)
                jobs[p].out_off = offp + first if offp != NULL else NULL
            tasks[p].fn = _task_fn
            tasks[p].arg = &jobs[p]
            first += cnt
        zb_run_parts(pool, tasks, parts)
        first = 0
        for p in range(parts):
            if jobs[p].status != ZB_OK:
                return jobs[p].status, first + jobs[p].bad, jobs[p].need_chunk
            first += jobs[p].count
    finally:
        PyMem_Free(tasks)
    return ZB_OK, 0, 0


def publish_chunk(chunk_base, chunk_size, uint64_t c, size_t address, uint64_t size):
    """Publish chunk ``c``'s mapping into the caller's arrays (base first, then size; release
    stores), so a kernel running on another thread sees a base that covers the size."""
    cdef uint64_t[::1] bases = chunk_base
    cdef uint64_t[::1] sizes = chunk_size
    if c >= <uint64_t>bases.shape[0] or bases.shape[0] != sizes.shape[0]:
        raise ConfigError(f"chunk {c} is beyond the chunk arrays", field="chunk")
    zr_publish_chunk(<const uint8_t **>&bases[c], &sizes[c], <const uint8_t *>address, size)


def record_views(chunk_base, chunk_size, owners, chunks, payload, lens, dtype, shape=None):
    """Read-only arrays over mapped records: record i is ``lens[i]`` bytes at chunk
    ``chunks[i]``, offset ``payload[i]``, viewed as ``dtype`` (reshaped to ``shape``); None
    where ``lens[i] < 0``. Each array's base is ``owners[chunk]`` (the chunk's mapping)."""
    cdef const uint64_t[::1] bases = chunk_base
    cdef const uint64_t[::1] sizes = chunk_size
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
        if c >= <uint32_t>bases.shape[0] or bases[c] == 0 or pay[i] + <uint64_t>ln[i] > sizes[c]:
            raise_for_status(ZB_E_ARGUMENT, f"record {i} lies outside the mapped chunks", field="chunk")
        out[i] = _view(<char *><size_t>bases[c] + pay[i], ln[i], dtype, shape, owners[c])
    return out


def zrecord_status_error(int status, str message, path=None, field=None):
    """Raise the exception of ``status`` (:func:`zerobatch.core.status.raise_for_status`)."""
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
        raise ConfigError("buf must be C-contiguous", field="buf")
    for i in range(n):
        if ln[i] < 0:
            continue
        if off[i] + <uint64_t>ln[i] > size:
            raise ConfigError(f"record {i} lies outside the buffer", field="offsets")
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
