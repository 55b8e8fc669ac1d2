# TOKSTREAM windows: gather token windows that may span shards into one output buffer.
#
# Contract (the C kernels and their contracts are declared in _tokstream.pxd)
#   WindowGather(bases, cum, itemsize, token_size, vocab, paths, documents, metadata_indexes)
#     an immutable descriptor of a dataset's geometry: the mapped tokens.bin of each shard
#     (bases: uint64 addresses; None when the caller reads through descriptors), cumulative
#     token counts, the record layout, the vocabulary, and optionally each shard's document
#     and metadata indexes. The caller owns and keeps alive every mapping and array it names.
#     Its methods check their arguments with the GIL held, run the kernels without it and
#     map the status through raise_for_status:
#       gather / gather_ranges / gather_with_boundaries / boundaries / metadata_ids: windows,
#         ranges, boundary outputs and metadata ids (fds=: the caller's per-shard descriptor
#         table, for a descriptor-backed read); the first three (and their async variants)
#         also write labels= (the tokens label_shift places on), set to ignore_id where a
#         second WindowGather of the same cum (mask=: a loss mask, one 0/1 per token; mask_fds=
#         its descriptors) is 0, reading the mask's records in the same GIL-free pass: its
#         unchecked blocks checked with its own BlockChecks, its values against its vocabulary,
#         an error of the mask named with the mask's file;
#       unchecked_chunks(starts, length, stops, checked): the (shard, chunk) pairs of
#         tokens.bin a batch touches that the caller's bitmaps do not mark as checked.
#     It holds no verification state, lock, descriptor or callback: those are the reader's
#     (zerobatch.readers.tokstream), which checks the chunks it is told about, then gathers.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.mem cimport PyMem_Free

from zerobatch.core._pool cimport TaskPool, zb_part_len, zb_parts_new, zb_run_parts, zb_task
from libc.errno cimport EINTR, errno
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset
from posix.unistd cimport pread

from zerobatch.core._endian cimport zb_load_u64le
from zerobatch.core._hash cimport zb_xxh3_64
from zerobatch.core._status cimport (ZB_E_ARGUMENT, ZB_E_CHECKSUM, ZB_E_FIELD, ZB_E_INDEX, ZB_E_IO, ZB_E_NOMEM,
                                     ZB_E_TRUNCATED, ZB_OK)

cdef extern from *:
    """
    /* the marks of checked blocks: relaxed atomics (the blocks' bytes never change; a mark
       only says they were compared once) */
    static inline int zb_ts_mark_get(const uint8_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
    static inline int zb_ts_mark_set(uint8_t *p) {
        uint8_t zero = 0;
        return __atomic_compare_exchange_n(p, &zero, (uint8_t)1, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
    static inline int zb_ts_mark_clear(uint8_t *p) {
        uint8_t one = 1;
        return __atomic_compare_exchange_n(p, &one, (uint8_t)0, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
    static inline int64_t zb_ts_count_get(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
    static inline void zb_ts_count_add(int64_t *p, int64_t v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
    """
    int zb_ts_mark_get(const uint8_t *p) noexcept nogil
    int zb_ts_mark_set(uint8_t *p) noexcept nogil
    int zb_ts_mark_clear(uint8_t *p) noexcept nogil
    int64_t zb_ts_count_get(const int64_t *p) noexcept nogil
    void zb_ts_count_add(int64_t *p, int64_t v) noexcept nogil

import os

import numpy as np

from zerobatch.core.checks import as_positions, check_count
from zerobatch.core.status import raise_for_status
from zerobatch.formats.errors import ConfigError, CorruptError, OutOfRangeError

__all__ = ["BlockChecks", "WindowGather", "WindowTicket", "gather_windows"]


#: Windows loaded ahead of the one being copied.
cdef enum:
    PREFETCH_AHEAD = 4

#: Buffers a ticket holds at most (out, labels, position_ids, two descriptor tables).
cdef enum:
    MAX_VIEWS = 6

_INT64 = np.dtype(np.int64)
_INT32 = np.dtype(np.int32)
_INTC = np.dtype(np.intc)


cdef inline int64_t _find_shard(const int64_t *cum, int64_t num_shards, int64_t pos) noexcept nogil:
    # the last s with cum[s] <= pos (empty shards are skipped over)
    cdef int64_t lo = 0, hi = num_shards - 1, mid
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if cum[mid] <= pos:
            lo = mid
        else:
            hi = mid - 1
    return lo


cdef int _pread_full(int fd, uint8_t *buf, int64_t n, int64_t offset, int *err) noexcept nogil:
    # read exactly n bytes at offset, retrying short reads and EINTR
    cdef int64_t got = 0
    cdef ssize_t r
    while got < n:
        r = pread(fd, buf + got, n - got, offset + got)
        if r < 0:
            if errno == EINTR:
                continue
            err[0] = errno
            return ZB_E_IO
        if r == 0:
            return ZB_E_TRUNCATED
        got += r
    return ZB_OK


cdef int _check_blocks(zb_ts_geometry *g, int64_t s, int64_t b0, int64_t b1, uint8_t *scratch) noexcept nogil:
    # every checksum block of shard s's tokens.bin under bytes [b0, b1) (b0 < b1) checked:
    # those not marked are hashed (from the mapping, or read into `scratch` through the
    # shard's descriptor) and compared with their digests, then marked
    cdef zb_ts_checks *c = g.checks
    cdef uint8_t *marks = c.maps[s]
    cdef int shift = c.shift
    cdef int64_t k, a, n, size = (g.cum[s + 1] - g.cum[s]) * g.itemsize
    cdef uint64_t got, want
    cdef const uint8_t *data
    cdef int st
    for k in range(b0 >> shift, ((b1 - 1) >> shift) + 1):
        if zb_ts_mark_get(marks + k):
            continue
        if not zb_ts_mark_get(c.lists + s):
            # the digest list itself, against the manifest's checksum of tokens.bin (once)
            got = zb_xxh3_64(c.digests[s], <uint64_t>c.nblocks[s] * 8)
            if got != c.list_hash[s]:
                g.err_shard = s
                g.bad_block = -1
                g.bad_got = got
                g.bad_want = c.list_hash[s]
                return ZB_E_CHECKSUM
            zb_ts_mark_set(c.lists + s)
        a = k << shift
        n = min(a + (<int64_t>1 << shift), size) - a
        if g.bases != NULL:
            data = g.bases[s] + a
        else:
            st = _pread_full(g.fds[s], scratch, n, a, &g.err_errno)
            if st != ZB_OK:
                g.err_shard = s
                return st
            data = scratch
        got = zb_xxh3_64(data, <uint64_t>n)
        want = zb_load_u64le(c.digests[s] + 8 * k)
        if got != want:
            g.err_shard = s
            g.bad_block = k
            g.bad_got = got
            g.bad_want = want
            return ZB_E_CHECKSUM
        if zb_ts_mark_set(marks + k):
            zb_ts_count_add(c.pending, -1)
    return ZB_OK


cdef inline void _prefetch_window(const zb_ts_geometry *g, int64_t pos, int64_t length) noexcept nogil:
    cdef int64_t s = _find_shard(g.cum, g.num_shards, pos)
    zb_ts_prefetch(g.bases[s] + (pos - g.cum[s]) * g.itemsize, min(length, g.cum[s + 1] - pos) * g.itemsize)


cdef int zb_ts_windows(zb_ts_geometry *g, const int64_t *starts, int64_t count, int64_t length,
                       int64_t *out64, int32_t *out32, int32_t *ids=NULL, zb_ts_distinct *d=NULL,
                       zb_ts_bounds *bounds=NULL, zb_ts_labels *labels=NULL) noexcept nogil:
    cdef int status = ZB_OK
    cdef uint8_t *scratch = NULL
    cdef int64_t size = max(length, 1) * g.itemsize, msize
    cdef zb_ts_checks *checks = g.checks
    cdef zb_ts_geometry *m = NULL if labels == NULL else labels.m
    cdef zb_ts_checks *mchecks = NULL if m == NULL else m.checks
    if checks != NULL and zb_ts_count_get(checks.pending) == 0:
        g.checks = NULL                 # every block checked: nothing to look up
    if mchecks != NULL and zb_ts_count_get(mchecks.pending) == 0:
        m.checks = NULL
    if g.fds != NULL:
        # pread backend: each shard piece is read whole into one buffer, then widened (and a
        # block to check, read into the same buffer before it)
        if g.checks != NULL:
            size = max(size, <int64_t>1 << g.checks.shift)
        scratch = <uint8_t *>malloc(size)
        if scratch == NULL:
            status = ZB_E_NOMEM
    if status == ZB_OK and m != NULL and m.fds != NULL:
        # the labels' stream read through descriptors too: a buffer of its own
        msize = max(length, 1) * m.itemsize
        if m.checks != NULL:
            msize = max(msize, <int64_t>1 << m.checks.shift)
        labels.scratch = <uint8_t *>malloc(msize)
        if labels.scratch == NULL:
            status = ZB_E_NOMEM
    if status == ZB_OK:
        status = _ts_windows(g, starts, count, length, out64, out32, scratch, ids, d, bounds, labels)
    g.checks = checks
    free(scratch)
    if m != NULL:
        m.checks = mchecks
        free(labels.scratch)
        labels.scratch = NULL
    return status


cdef int _labels_span(zb_ts_labels *lab, int64_t pos, int64_t n, const int64_t *tok64, const int32_t *tok32,
                      int64_t *d64, int32_t *d32) noexcept nogil:
    # d[k] = tok[k] where the stream lab.m is non-zero at global position pos + k, else
    # lab.ignore (k < n), reading the stream shard piece by shard piece as the tokens are read:
    # its unchecked blocks checked first, its values checked against its vocabulary
    cdef zb_ts_geometry *m = lab.m
    cdef int64_t isz = m.itemsize, s, take, local, k, done = 0
    cdef const uint8_t *src
    cdef uint32_t vmax
    cdef uint64_t v
    cdef int st
    s = _find_shard(m.cum, m.num_shards, pos)
    while done < n:
        while m.cum[s + 1] <= pos:
            s += 1
        take = min(m.cum[s + 1] - pos, n - done)
        local = pos - m.cum[s]
        if m.checks != NULL:
            st = _check_blocks(m, s, local * isz, (local + take) * isz, lab.scratch)
            if st != ZB_OK:
                lab.failed = 1
                return st
        if m.bases != NULL:
            src = m.bases[s] + local * isz
        else:
            st = _pread_full(m.fds[s], lab.scratch, take * isz, local * isz, &m.err_errno)
            if st != ZB_OK:
                m.err_shard = s
                lab.failed = 1
                return st
            src = lab.scratch
        if m.token_size == 2:
            if d64 != NULL:
                vmax = zb_ts_mask_u16_i64(src, isz, tok64 + done, d64 + done, take, lab.ignore)
            else:
                vmax = zb_ts_mask_u16_i32(src, isz, tok32 + done, d32 + done, take, <int32_t>lab.ignore)
        else:
            if d64 != NULL:
                vmax = zb_ts_mask_u32_i64(src, isz, tok64 + done, d64 + done, take, lab.ignore)
            else:
                vmax = zb_ts_mask_u32_i32(src, isz, tok32 + done, d32 + done, take, <int32_t>lab.ignore)
        if vmax >= m.vocab:
            for k in range(take):
                if m.token_size == 2:
                    v = (<const uint16_t *>(src + k * isz))[0]
                else:
                    v = (<const uint32_t *>(src + k * isz))[0]
                if v >= m.vocab:
                    m.bad_pos = pos + k
                    break
            m.bad_field = 0
            lab.failed = 1
            return ZB_E_FIELD
        pos += take
        done += take
    return ZB_OK


cdef inline int _labels_window(zb_ts_labels *lab, int64_t w, int64_t pos, int64_t length, const int64_t *row64,
                               const int32_t *row32) noexcept nogil:
    # window w's labels (its row of tokens at row64 / row32): tokens [shift, length), masked
    cdef int64_t n = length - lab.shift
    cdef int64_t *d64 = NULL
    cdef int32_t *d32 = NULL
    if n <= 0:
        return ZB_OK
    if row64 != NULL:
        d64 = <int64_t *>lab.out + w * n
        row64 = row64 + lab.shift
    else:
        d32 = <int32_t *>lab.out + w * n
        row32 = row32 + lab.shift
    if lab.m == NULL:
        if d64 != NULL:
            memcpy(d64, row64, n * 8)
        else:
            memcpy(d32, row32, n * 4)
        return ZB_OK
    return _labels_span(lab, pos + lab.shift, n, row64, row32, d64, d32)


cdef int _ts_windows(zb_ts_geometry *g, const int64_t *starts, int64_t count, int64_t length,
                     int64_t *out64, int32_t *out32, uint8_t *scratch, int32_t *ids,
                     zb_ts_distinct *d, zb_ts_bounds *bounds, zb_ts_labels *labels) noexcept nogil:
    cdef int64_t total = g.cum[g.num_shards]
    cdef int st
    cdef int64_t w, pos, s, take, k, done, row
    cdef const uint8_t *src
    cdef uint64_t v, vmax
    cdef uint32_t vmax32 = 0
    cdef int64_t r
    cdef int64_t isz = g.itemsize
    # the labels' stream, when mapped, is asked for ahead as the tokens are
    cdef const zb_ts_geometry *mp = NULL
    if labels != NULL and labels.m != NULL and labels.m.bases != NULL and length > labels.shift:
        mp = labels.m
    for w in range(count):
        pos = starts[w]
        if pos < 0 or pos > total - length:
            return ZB_E_INDEX
    # random windows are memory-latency bound and the hardware prefetcher only follows a
    # window once it has started: the first PREFETCH_AHEAD windows are requested up front,
    # then each step requests the window PREFETCH_AHEAD rows on while this one is copied
    for w in range(min(count, PREFETCH_AHEAD)):
        if scratch == NULL:
            _prefetch_window(g, starts[w], length)
        if mp != NULL:
            _prefetch_window(mp, starts[w] + labels.shift, length - labels.shift)
    for w in range(count):
        if w + PREFETCH_AHEAD < count:
            if scratch == NULL:
                _prefetch_window(g, starts[w + PREFETCH_AHEAD], length)
            if mp != NULL:
                _prefetch_window(mp, starts[w + PREFETCH_AHEAD] + labels.shift, length - labels.shift)
        pos = starts[w]
        row = w * length
        done = 0
        s = _find_shard(g.cum, g.num_shards, pos)
        while done < length:
            while g.cum[s + 1] <= pos:
                s += 1
            take = g.cum[s + 1] - pos
            if take > length - done:
                take = length - done
            if g.checks != NULL:
                st = _check_blocks(g, s, (pos - g.cum[s]) * isz, (pos - g.cum[s] + take) * isz, scratch)
                if st != ZB_OK:
                    return st
            if scratch == NULL:
                src = g.bases[s] + (pos - g.cum[s]) * isz
            else:
                st = _pread_full(g.fds[s], scratch, take * isz, (pos - g.cum[s]) * isz, &g.err_errno)
                if st != ZB_OK:
                    g.err_shard = s
                    return st
                src = scratch
            if ids != NULL:
                # tokens and numbered metadata ids in one pass over the records
                r = zb_ts_meta_piece(src, <int>g.token_size, NULL if out64 == NULL else out64 + row + done,
                                     NULL if out32 == NULL else out32 + row + done, ids + row + done, take, s,
                                     g.nmeta[s], d, g.vocab, &vmax32)
                vmax = vmax32
                if r == -2:
                    return ZB_E_NOMEM
                if r >= 0:
                    g.bad_pos = pos + r
                    g.bad_field = 1
                    return ZB_E_FIELD
            elif g.token_size == 2:
                if out64 != NULL:
                    vmax = zb_ts_copy_u16_i64(src, isz, out64 + row + done, take)
                else:
                    vmax = zb_ts_copy_u16_i32(src, isz, out32 + row + done, take)
            else:
                if out64 != NULL:
                    vmax = zb_ts_copy_u32_i64(src, isz, out64 + row + done, take)
                else:
                    vmax = zb_ts_copy_u32_i32(src, isz, out32 + row + done, take)
            if vmax >= g.vocab:
                for k in range(take):
                    if g.token_size == 2:
                        v = (<const uint16_t *>(src + k * isz))[0]
                    else:
                        v = (<const uint32_t *>(src + k * isz))[0]
                    if v >= g.vocab:
                        g.bad_pos = pos + k
                        break
                g.bad_field = 0
                return ZB_E_FIELD
            pos += take
            done += take
        if labels != NULL:
            # this window's labels while its tokens are in the cache
            st = _labels_window(labels, w, starts[w], length, NULL if out64 == NULL else out64 + row,
                                NULL if out32 == NULL else out32 + row)
            if st != ZB_OK:
                return st
        if bounds != NULL:
            # this window's boundary outputs while the next windows' loads are in flight
            _bounds_window(g, bounds, w, starts[w])
    if bounds != NULL:
        bounds.cu[bounds.nseg] = <int32_t>(count * bounds.length)
    return ZB_OK


cdef inline int64_t _first_doc_after(const uint64_t *idx, int64_t nd, int64_t local) noexcept nogil:
    # index of the first document start > local (in [1, nd]); idx[0] = 0 <= local
    cdef int64_t lo = 0, hi = nd, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if <int64_t>idx[mid + 1] <= local:
            lo = mid + 1
        else:
            hi = mid
    return lo + 1


cdef inline void _fill(int64_t *p64, int32_t *p32, int32_t *seg, int64_t at, int64_t n,
                       int64_t segno) noexcept nogil:
    zb_ts_fill_segment(NULL if p64 == NULL else p64 + at, NULL if p32 == NULL else p32 + at,
                       NULL if seg == NULL else seg + at, n, <int32_t>segno)


cdef void _bounds_window(const zb_ts_geometry *g, zb_ts_bounds *b, int64_t w, int64_t pos) noexcept nogil:
    # the segments of window w, which covers [pos, pos + b.length)
    cdef int64_t length = b.length
    cdef int64_t end = pos + length, seg_start = pos, seg = 0, s, k, nxt, local
    b.cu[b.nseg] = <int32_t>(w * length)
    b.nseg += 1
    s = _find_shard(g.cum, g.num_shards, pos)
    local = pos - g.cum[s]
    k = _first_doc_after(g.docs[s], g.ndocs[s], local)
    while True:
        # the next document start after pos: in this shard, else the next non-empty shard
        if k < g.ndocs[s]:
            nxt = g.cum[s] + <int64_t>g.docs[s][k]
        else:
            nxt = g.cum[s + 1]
        if nxt >= end:
            break
        # a segment ends at nxt
        _fill(b.pos64, b.pos32, b.seg, w * length + (seg_start - pos), nxt - seg_start, seg)
        if nxt - seg_start > b.maxlen:
            b.maxlen = nxt - seg_start
        seg += 1
        seg_start = nxt
        b.cu[b.nseg] = <int32_t>(w * length + (nxt - pos))
        b.nseg += 1
        if k < g.ndocs[s]:
            k += 1
        else:
            s += 1
            while g.cum[s + 1] == g.cum[s]:
                s += 1
            k = 1
    _fill(b.pos64, b.pos32, b.seg, w * length + (seg_start - pos), end - seg_start, seg)
    if end - seg_start > b.maxlen:
        b.maxlen = end - seg_start


cdef void zb_ts_boundaries(const zb_ts_geometry *g, const int64_t *starts, int64_t count,
                           zb_ts_bounds *b) noexcept nogil:
    cdef int64_t w
    b.nseg = 0
    b.maxlen = 0
    for w in range(count):
        _bounds_window(g, b, w, starts[w])
    b.cu[b.nseg] = <int32_t>(count * b.length)


cdef int64_t zb_ts_unchecked(const zb_ts_geometry *g, const uint8_t *const *checked, int chunk_shift,
                             const int64_t *starts, const int64_t *stops, int64_t count, int64_t length,
                             int64_t *miss, int64_t cap) noexcept nogil:
    cdef int64_t total = g.cum[g.num_shards]
    cdef int64_t i, pos, end, s, b0, b1, c, k, n = 0
    cdef bint listed
    for i in range(count):
        pos = starts[i]
        end = pos + length if stops == NULL else stops[i]
        if pos < 0 or end > total or end <= pos:
            continue
        s = _find_shard(g.cum, g.num_shards, pos)
        while pos < end:
            while g.cum[s + 1] <= pos:
                s += 1
            b0 = (pos - g.cum[s]) * g.itemsize
            b1 = (min(end, g.cum[s + 1]) - g.cum[s]) * g.itemsize
            for c in range(b0 >> chunk_shift, ((b1 - 1) >> chunk_shift) + 1):
                if checked[s][c]:
                    continue
                listed = False
                for k in range(n):
                    if miss[2 * k] == s and miss[2 * k + 1] == c:
                        listed = True
                        break
                if not listed:
                    miss[2 * n] = s
                    miss[2 * n + 1] = c
                    n += 1
                    if n == cap:
                        return n
            pos = min(end, g.cum[s + 1])
    return n


cdef int zb_ts_spans(const zb_ts_geometry *g, const int64_t *cum_docs, const int64_t *idx, int64_t count,
                     int64_t *starts, int64_t *stops, int64_t *bad) noexcept nogil:
    # the global token span of each document idx[i] (documents numbered across shards)
    cdef int64_t i, d, s, local, a, b
    cdef int64_t total = cum_docs[g.num_shards]
    for i in range(count):
        d = idx[i]
        if d < 0 or d >= total:
            bad[0] = i
            return ZB_E_INDEX
        s = _find_shard(cum_docs, g.num_shards, d)     # shards without documents skipped over
        local = d - cum_docs[s]
        a = <int64_t>g.docs[s][local]
        b = <int64_t>g.docs[s][local + 1]
        if a < 0 or b < a or b > g.cum[s + 1] - g.cum[s]:
            bad[0] = i
            return ZB_E_FIELD
        starts[i] = g.cum[s] + a
        stops[i] = g.cum[s] + b
    return ZB_OK


cdef struct zb_ts_job:
    zb_ts_geometry g
    const int64_t *starts
    int64_t count
    int64_t length
    int64_t *out64
    int32_t *out32
    bint has_labels             # labels: lab (lab.m points at mg when masked)
    zb_ts_labels lab
    zb_ts_geometry mg


cdef inline void _job_labels(zb_ts_job *j, const zb_ts_labels *lab, int64_t first) noexcept nogil:
    # job j's labels: the windows of `lab` from window `first` on (its own copy of the stream's
    # geometry, whose error fields it may set)
    j.has_labels = lab != NULL
    if lab == NULL:
        return
    j.lab = lab[0]
    j.lab.scratch = NULL
    j.lab.failed = 0
    if j.out64 != NULL:
        j.lab.out = <int64_t *>lab.out + first * (j.length - lab.shift)
    else:
        j.lab.out = <int32_t *>lab.out + first * (j.length - lab.shift)
    if lab.m != NULL:
        j.mg = lab.m[0]
        j.lab.m = &j.mg


cdef int _ts_job_run(void *arg) noexcept nogil:
    cdef zb_ts_job *j = <zb_ts_job *>arg
    return zb_ts_windows(&j.g, j.starts, j.count, j.length, j.out64, j.out32, NULL, NULL, NULL,
                         &j.lab if j.has_labels else NULL)


cdef int _ts_ticket_run(void *arg) noexcept nogil:
    cdef zb_ts_job *j = <zb_ts_job *>arg
    if j.count == 0:
        return ZB_OK
    return _ts_job_run(arg)


cdef struct zb_ts_ranges:
    const int64_t *a            # the ranges [a[i], b[i]), checked to lie in the stream
    const int64_t *b
    int64_t count
    int64_t *out64              # their tokens back to back (one of the two)
    int32_t *out32
    int64_t *pos64              # optional: each token's place in its range
    int32_t *pos32
    void *labels                # optional (out's width): the token `shift` places on in the
    int64_t ignore              #   same range (ignore past its end), ignore where the stream
    int64_t shift               #   m is 0 (m NULL: no stream)
    zb_ts_geometry *m
    int failed                  # set on failure: the error fields are m's
    int64_t cur                 # set on failure: the length of the range being read


cdef int zb_ts_ranges_run(zb_ts_geometry *g, zb_ts_ranges *r) noexcept nogil:
    # the ranges back to back, each one's positions and labels written right after its tokens
    # (still in the cache)
    cdef int64_t i, j, n, at = 0
    cdef int st
    cdef bint wide = r.out64 != NULL
    cdef zb_ts_labels lab
    memset(&lab, 0, sizeof(lab))
    lab.m = r.m
    lab.shift = r.shift
    lab.ignore = r.ignore
    for i in range(r.count):
        n = r.b[i] - r.a[i]
        if n <= 0:
            continue
        r.cur = n
        if r.labels != NULL:
            if wide:
                lab.out = <int64_t *>r.labels + at
            else:
                lab.out = <int32_t *>r.labels + at
        st = zb_ts_windows(g, &r.a[i], 1, n, NULL if r.out64 == NULL else r.out64 + at,
                           NULL if r.out32 == NULL else r.out32 + at, NULL, NULL, NULL,
                           &lab if r.labels != NULL else NULL)
        if st != ZB_OK:
            r.failed = lab.failed
            return st
        if r.pos64 != NULL:
            for j in range(n):
                r.pos64[at + j] = j
        elif r.pos32 != NULL:
            for j in range(n):
                r.pos32[at + j] = <int32_t>j
        if r.labels != NULL and r.shift == 1:
            # the range's last token: no next token in it
            if wide:
                (<int64_t *>r.labels)[at + n - 1] = r.ignore
            else:
                (<int32_t *>r.labels)[at + n - 1] = <int32_t>r.ignore
        at += n
    return ZB_OK


cdef struct zb_ts_ranges_job:
    zb_ts_geometry g
    zb_ts_ranges r
    zb_ts_geometry mg           # the labels' stream (r.m points here when masked)


cdef int _ts_ranges_task(void *arg) noexcept nogil:
    cdef zb_ts_ranges_job *j = <zb_ts_ranges_job *>arg
    return zb_ts_ranges_run(&j.g, &j.r)


#: Fewest windows, and fewest tokens, worth handing to another thread: waking a pool worker
#: costs about as much as copying 64 Ki random-window tokens here, so a smaller batch runs on
#: the calling thread alone. asv: bench_tokstream.WindowsThreads (one thread against two, on a
#: batch below the threshold and one above it).
MIN_WINDOWS_PER_PART = 4
MIN_TOKENS_PER_PART = 1 << 16


cdef inline void _copy_errors(zb_ts_geometry *to, const zb_ts_geometry *frm) noexcept nogil:
    to.bad_pos = frm.bad_pos
    to.bad_field = frm.bad_field
    to.err_errno = frm.err_errno
    to.err_shard = frm.err_shard
    to.bad_block = frm.bad_block
    to.bad_got = frm.bad_got
    to.bad_want = frm.bad_want


cdef int _run_split(TaskPool pool, zb_ts_geometry *g, const int64_t *starts, int64_t count,
                    int64_t length, int64_t *out64, int32_t *out32, int64_t parts,
                    zb_ts_labels *lab=NULL) except -2:
    """Split the windows in `parts` runs and run them as one batch on `pool` (zb_run_parts).
    Returns the first non-OK status (the last run's, then the others' in order, an index
    error first), with its error fields copied into g (or, for an error of the labels'
    stream, into lab.m, with lab.failed set)."""
    cdef zb_ts_job *jobs
    cdef zb_task *tasks = zb_parts_new(parts, sizeof(zb_ts_job), <void **>&jobs)
    cdef int64_t p, first = 0, n, q
    cdef int status = ZB_OK
    try:
        for p in range(parts):
            n = zb_part_len(count, parts, p)
            jobs[p].g = g[0]
            jobs[p].starts = starts + first
            jobs[p].count = n
            jobs[p].length = length
            jobs[p].out64 = NULL if out64 == NULL else out64 + first * length
            jobs[p].out32 = NULL if out32 == NULL else out32 + first * length
            _job_labels(&jobs[p], lab, first)
            tasks[p].fn = _ts_job_run
            tasks[p].arg = &jobs[p]
            first += n
        zb_run_parts(pool, tasks, parts)
        q = -1
        if tasks[parts - 1].status != ZB_OK:
            status = tasks[parts - 1].status
            q = parts - 1
        for p in range(parts - 1):
            if tasks[p].status != ZB_OK and (status == ZB_OK or tasks[p].status == ZB_E_INDEX):
                status = tasks[p].status
                q = p
        if q >= 0:
            _copy_errors(g, &jobs[q].g)
            if jobs[q].has_labels and jobs[q].lab.failed:
                lab.failed = 1
                _copy_errors(lab.m, &jobs[q].mg)
    finally:
        PyMem_Free(tasks)
    return status


cdef class BlockChecks:
    """Which checksum blocks of every shard's ``tokens.bin`` were checked against their
    digests, and the digests to check them against: the record a reader keeps, and that a
    :class:`WindowGather` built with ``checks=`` reads and writes from its kernels (each block
    a read touches hashed and compared the first time, GIL released, before its tokens are
    copied; no lock: a block's byte is flipped atomically, and its bytes never change).

    Args:
        block_counts: checksum blocks of each shard's ``tokens.bin``.
        block_bytes: bytes per block (a power of two).

    Attributes:
        lock: a ``threading.Condition`` for callers that fetch blocks themselves (a dataset at
            a URL): under it they list what is unchecked, :meth:`claim` what they will fetch
            (another thread's claimed blocks are waited for, never fetched twice), and after
            the fetch :meth:`mark_pairs`, :meth:`release` and ``notify_all``.
    """

    cdef object _maps, _map_ptrs, _digests, _digest_ptrs, _list_hash, _lists, _nblocks, _pending
    cdef object _claims, _claim_ptrs
    cdef readonly int64_t block_bytes
    cdef readonly int64_t num_shards
    cdef public object lock
    cdef zb_ts_checks c
    cdef int64_t _missing

    def __cinit__(self, block_counts, int64_t block_bytes=1 << 24):
        import threading
        if block_bytes < 1 or block_bytes & (block_bytes - 1):
            raise ConfigError("block_bytes must be a power of two", field="block_bytes")
        counts = [check_count(n, "block_counts") for n in block_counts]
        self.num_shards = len(counts)
        self.block_bytes = block_bytes
        self._maps = [np.zeros(max(n, 1), np.uint8) for n in counts]
        self._map_ptrs = np.array([m.ctypes.data for m in self._maps], dtype=np.uint64)
        self._nblocks = np.array(counts, dtype=np.int64)
        self._digests = [None] * len(counts)
        self._digest_ptrs = np.zeros(len(counts), dtype=np.uint64)
        self._list_hash = np.zeros(len(counts), dtype=np.uint64)
        self._lists = np.zeros(len(counts), dtype=np.uint8)
        self._pending = np.array([sum(counts)], dtype=np.int64)
        self._missing = len(counts)
        self._claims = [np.zeros(max(n, 1), np.uint8) for n in counts]
        self._claim_ptrs = np.array([m.ctypes.data for m in self._claims], dtype=np.uint64)
        self.lock = threading.Condition()
        memset(&self.c, 0, sizeof(self.c))
        cdef uint64_t[::1] mp = self._map_ptrs
        cdef uint64_t[::1] dp = self._digest_ptrs
        cdef uint64_t[::1] lh = self._list_hash
        cdef uint8_t[::1] ls = self._lists
        cdef int64_t[::1] nb = self._nblocks
        cdef int64_t[::1] pe = self._pending
        if len(counts):
            self.c.maps = <uint8_t **>&mp[0]
            self.c.digests = <const uint8_t **>&dp[0]
            self.c.list_hash = &lh[0]
            self.c.lists = &ls[0]
            self.c.nblocks = &nb[0]
        self.c.pending = &pe[0]
        self.c.shift = (<int64_t>block_bytes).bit_length() - 1

    def set_digests(self, int64_t shard, digests, list_hash):
        """The block digests of shard ``shard``'s ``tokens.bin`` (a ``<u8`` array of one
        digest per block, kept alive here; typically a view of the mapped ``checksums.bin``)
        and the XXH3-64 they must hash to (the manifest's checksum of ``tokens.bin``), checked
        before the first block of the shard is."""
        if not 0 <= shard < self.num_shards:
            raise ConfigError(f"shard must be in [0, {self.num_shards}), got {shard}", field="shard")
        arr = np.asarray(digests)
        if arr.dtype != np.dtype("<u8") or arr.ndim != 1 or not arr.flags.c_contiguous \
                or arr.shape[0] != self._nblocks[shard]:
            raise ConfigError(f"digests must be a C-contiguous <u8 array of {self._nblocks[shard]} digests",
                              field="digests")
        if self._digests[shard] is None:
            self._missing -= 1
        self._digests[shard] = arr
        self._digest_ptrs[shard] = arr.ctypes.data if arr.shape[0] else 0
        self._list_hash[shard] = check_count(list_hash, "list_hash", maximum=2**64 - 1)
        self._lists[shard] = 0

    @property
    def ready(self) -> bool:
        """Whether every shard's digests are known (a gather can check any block)."""
        return self._missing == 0

    @property
    def pending(self) -> int:
        """Blocks not checked yet, over every shard."""
        return zb_ts_count_get(self.c.pending)

    @property
    def addresses(self):
        """``uint64`` addresses of the per-shard bitmaps (one byte per block, non-zero when
        checked), for :meth:`WindowGather.unchecked_chunks`."""
        return self._map_ptrs

    def checked(self, int64_t shard, int64_t block) -> bool:
        """Whether block ``block`` of shard ``shard`` was checked."""
        self._block_range(shard, block, 1)
        return bool(zb_ts_mark_get(self.c.maps[shard] + block))

    cdef int _block_range(self, int64_t shard, int64_t first, int64_t count) except -1:
        if not 0 <= shard < self.num_shards:
            raise ConfigError(f"shard must be in [0, {self.num_shards}), got {shard}", field="shard")
        if first < 0 or count < 0 or first + count > self._nblocks[shard]:
            raise ConfigError(f"blocks [{first}, {first + count}) are not blocks of shard {shard} "
                              f"({self._nblocks[shard]})", field="block")
        return 0

    def mark(self, int64_t shard, int64_t first, int64_t count=1) -> int:
        """Blocks ``[first, first + count)`` of ``shard`` checked (by the caller); returns how
        many were not marked before."""
        self._block_range(shard, first, count)
        cdef int64_t k, n = 0
        cdef uint8_t *m = self.c.maps[shard]
        for k in range(first, first + count):
            if zb_ts_mark_set(m + k):
                n += 1
        zb_ts_count_add(self.c.pending, -n)
        return n

    def mark_shard(self, int64_t shard) -> int:
        """Every block of ``shard`` checked (after a full verify); returns how many were
        not marked before."""
        return self.mark(shard, 0, self._nblocks[shard] if shard < self.num_shards else 0)

    cdef const int64_t[:, ::1] _pairs(self, pairs) except *:
        cdef const int64_t[:, ::1] p = np.ascontiguousarray(pairs, dtype=np.int64).reshape(-1, 2)
        cdef Py_ssize_t i
        for i in range(p.shape[0]):
            if not 0 <= p[i, 0] < self.num_shards or not 0 <= p[i, 1] < self._nblocks[p[i, 0]]:
                raise ConfigError(f"block {p[i, 1]} of shard {p[i, 0]} is not a block of the dataset", field="block")
        return p

    def claim(self, pairs):
        """Claim the ``(shard, block)`` pairs for a fetch by this caller: a ``bool`` array,
        true for each pair claimed now (not checked, and not claimed by anyone else)."""
        cdef const int64_t[:, ::1] p = self._pairs(pairs)
        out = np.zeros(p.shape[0], dtype=np.bool_)
        cdef uint8_t[::1] got = out.view(np.uint8)
        cdef const uint64_t[::1] claims = self._claim_ptrs
        cdef Py_ssize_t i
        for i in range(p.shape[0]):
            if not zb_ts_mark_get(self.c.maps[p[i, 0]] + p[i, 1]) and \
                    zb_ts_mark_set(<uint8_t *>claims[p[i, 0]] + p[i, 1]):
                got[i] = 1
        return out

    def release(self, pairs) -> None:
        """Give up the claims of the ``(shard, block)`` pairs (after the fetch, or its failure)."""
        cdef const int64_t[:, ::1] p = self._pairs(pairs)
        cdef const uint64_t[::1] claims = self._claim_ptrs
        cdef Py_ssize_t i
        for i in range(p.shape[0]):
            zb_ts_mark_clear(<uint8_t *>claims[p[i, 0]] + p[i, 1])

    def mark_pairs(self, pairs) -> int:
        """The ``(shard, block)`` pairs checked (by the caller); returns how many were not marked."""
        cdef const int64_t[:, ::1] p = self._pairs(pairs)
        cdef Py_ssize_t i
        cdef int64_t n = 0
        for i in range(p.shape[0]):
            if zb_ts_mark_set(self.c.maps[p[i, 0]] + p[i, 1]):
                n += 1
        zb_ts_count_add(self.c.pending, -n)
        return n

    def reset(self, int64_t shard) -> None:
        """Every block of ``shard`` unchecked again (a remote copy let go)."""
        self._block_range(shard, 0, self._nblocks[shard] if 0 <= shard < self.num_shards else 0)
        cdef int64_t k, n = 0
        cdef uint8_t *m = self.c.maps[shard]
        for k in range(self._nblocks[shard]):
            if zb_ts_mark_clear(m + k):
                n += 1
        zb_ts_count_add(self.c.pending, n)


cdef class WindowGather:
    """The geometry of one dataset's tokens for the window kernels (see the module comment).

    The geometry is checked once here; each call only checks its windows, its output buffers
    and, for a descriptor-backed read, the descriptor table it is given.

    Args:
        bases: ``uint64`` array of the shards' mapped ``tokens.bin`` addresses, or ``None``
            when every read passes ``fds`` (the owner keeps the mappings alive and unchanged
            while this object is used).
        cum: ``int64`` cumulative token counts, ``num_shards + 1`` entries from 0.
        itemsize: bytes per record (2, 4, 6 or 8); token_size: 2 or 4 (the token field
            comes first in each record).
        vocab: token ids must be below it.
        paths: optional file name of each shard's ``tokens.bin``, named in errors.
        documents: optional per-shard ``uint64`` document indexes (``D_s + 1`` entries:
            document starts, then the shard's token count), for :meth:`boundaries`.
        metadata_indexes: optional per-shard ``uint64`` metadata indexes, for
            :meth:`metadata_ids`.
        num_shards: with ``bases=None``, the number of shards (else ``len(bases)``).
        checks: a :class:`BlockChecks` with every shard's digests: each read checks the
            checksum blocks of ``tokens.bin`` it touches that were not checked before (in
            the same GIL-free pass that copies them), raising ``IntegrityError`` for a block
            that does not match its digest.

    Raises:
        ConfigError: inconsistent geometry.
    """

    cdef object _bases, _cum, _docs, _doc_ptrs, _doc_counts, _meta_counts, _meta_indexes, _meta_index_ptrs
    cdef object _cum_docs, _mask_ok
    cdef const int64_t[::1] _cum_docs_view
    cdef readonly object paths
    cdef readonly BlockChecks checks
    cdef const uint64_t[::1] _base_view
    cdef const int64_t[::1] _cum_view
    cdef const uint64_t[::1] _doc_ptr_view
    cdef const int64_t[::1] _doc_count_view
    cdef const int64_t[::1] _meta_count_view
    cdef const uint64_t[::1] _meta_index_ptr_view
    cdef zb_ts_geometry g
    cdef readonly int64_t total
    cdef readonly int64_t num_shards

    def __cinit__(self, bases, cum, itemsize, token_size, vocab, paths=None, documents=None,
                  metadata_indexes=None, num_shards=None, BlockChecks checks=None):
        self._cum = np.ascontiguousarray(cum, dtype=np.int64)
        self._cum_view = self._cum
        cdef int64_t ns = self._cum_view.shape[0] - 1
        memset(&self.g, 0, sizeof(self.g))
        if bases is not None:
            self._bases = np.ascontiguousarray(bases, dtype=np.uint64)
            self._base_view = self._bases
            if self._base_view.shape[0] != ns:
                raise ConfigError("cum must hold len(bases) + 1 cumulative counts from 0", field="cum")
        elif num_shards is None or num_shards != ns:
            raise ConfigError("without bases, num_shards must be len(cum) - 1", field="num_shards")
        if ns < 1 or self._cum_view[0] != 0:
            raise ConfigError("cum must hold num_shards + 1 cumulative counts from 0", field="cum")
        cdef int64_t i
        for i in range(ns):
            if self._cum_view[i + 1] < self._cum_view[i]:
                raise ConfigError("cum must be non-decreasing", field="cum")
        if itemsize not in (2, 4, 6, 8) or token_size not in (2, 4) or token_size > itemsize:
            raise ConfigError(f"itemsize {itemsize} / token_size {token_size} is not a record layout",
                              field="itemsize")
        if not 1 <= vocab <= 2**32:
            raise ConfigError(f"vocab {vocab} is not in [1, 2**32]", field="vocab")
        self.paths = paths
        self.g.bases = <const uint8_t **>&self._base_view[0] if bases is not None else NULL
        self.g.cum = &self._cum_view[0]
        self.g.num_shards = ns
        self.g.itemsize = itemsize
        self.g.token_size = token_size
        self.g.vocab = vocab
        self.total = self._cum_view[ns]
        self.num_shards = ns
        if checks is not None:
            if checks.num_shards != ns or not checks.ready:
                raise ConfigError("checks: a BlockChecks with the digests of every shard", field="checks")
            self.checks = checks
            self.g.checks = &checks.c
        if metadata_indexes is not None:
            if itemsize == token_size:
                raise ConfigError("metadata_indexes: the records hold no metadata id", field="metadata_indexes")
            if len(metadata_indexes) != ns:
                raise ConfigError("metadata_indexes: one index per shard", field="metadata_indexes")
            self._meta_indexes = [np.ascontiguousarray(x, dtype=np.uint64) for x in metadata_indexes]
            for i in range(ns):
                x = self._meta_indexes[i]
                if x.ndim != 1 or x.shape[0] < 1 or x[0] != 0:
                    raise ConfigError(f"metadata_indexes[{i}]: must start at 0", field="metadata_indexes")
            self._meta_counts = np.array([x.shape[0] - 1 for x in self._meta_indexes], dtype=np.int64)
            self._meta_index_ptrs = np.array([x.ctypes.data for x in self._meta_indexes], dtype=np.uint64)
            self._meta_count_view = self._meta_counts
            self._meta_index_ptr_view = self._meta_index_ptrs
            self.g.nmeta = &self._meta_count_view[0]
        if documents is not None:
            if len(documents) != ns:
                raise ConfigError("documents: one index per shard", field="documents")
            self._docs = [np.ascontiguousarray(d, dtype=np.uint64) for d in documents]
            for i in range(ns):
                d = self._docs[i]
                if d.ndim != 1 or d.shape[0] < 1 or d[0] != 0 \
                        or <int64_t>d[d.shape[0] - 1] != self._cum_view[i + 1] - self._cum_view[i]:
                    raise ConfigError(f"documents[{i}]: must start at 0 and end at the shard's token count",
                                      field="documents")
            self._doc_ptrs = np.array([d.ctypes.data for d in self._docs], dtype=np.uint64)
            self._doc_counts = np.array([d.shape[0] - 1 for d in self._docs], dtype=np.int64)
            self._doc_ptr_view = self._doc_ptrs
            self._doc_count_view = self._doc_counts
            self._cum_docs = np.concatenate([[0], np.cumsum(self._doc_counts)]).astype(np.int64)
            self._cum_docs_view = self._cum_docs
            self.g.docs = <const uint64_t **>&self._doc_ptr_view[0]
            self.g.ndocs = &self._doc_count_view[0]

    cdef int _geometry(self, zb_ts_geometry *g, object fds, Py_buffer *view) except -1:
        """This call's geometry: the descriptor table when given (held in `view`, released
        by the caller when this returns 1)."""
        g[0] = self.g
        if fds is None:
            if g.bases == NULL:
                raise ConfigError("fds: this dataset is read through descriptors; pass the table", field="fds")
            return 0
        _acquire(fds, view, _INTC, self.num_shards, -1, "fds")
        g.fds = <const int *>view.buf
        g.bases = NULL
        return 1

    cdef int _labels(self, zb_ts_labels *lab, zb_ts_geometry *mg, object labels, object mask, object mask_fds,
                     Py_buffer *views, int *nviews, bint wide, int64_t n, int64_t shift,
                     int64_t ignore_id) except -1:
        """A read's labels: `labels` (n values of the tokens' width) held in views[nviews],
        and with `mask` its geometry in `mg` (its descriptor table held after it); the caller
        releases views[:nviews]."""
        memset(lab, 0, sizeof(lab[0]))
        if labels is None:
            if mask is not None:
                raise ConfigError("mask: it masks labels; pass labels too", field="labels")
            return 0
        if shift != 0 and shift != 1:
            raise ConfigError(f"label_shift must be 0 or 1, got {shift}", field="label_shift")
        if n < 0:
            raise ConfigError(f"label_shift {shift}: the windows are shorter than it", field="label_shift")
        if not wide and not -2**31 <= ignore_id < 2**31:
            raise ConfigError("ignore_id does not fit int32 labels", field="ignore_id")
        lab.out = _acquire(labels, &views[nviews[0]], _INT64 if wide else _INT32, n, -1, "labels")
        nviews[0] += 1
        lab.shift = shift
        lab.ignore = ignore_id
        if mask is None:
            return 0
        if type(mask) is not WindowGather:
            raise ConfigError("mask: a WindowGather of the labels' stream", field="mask")
        cdef WindowGather m = <WindowGather>mask
        if m is not self._mask_ok:
            if m.num_shards != self.num_shards or not np.array_equal(m._cum, self._cum):
                raise ConfigError("mask: the stream's shards do not hold the tokens' counts (a stream of another "
                                  "dataset)", field="mask")
            self._mask_ok = m
        if mask_fds is None and m.g.bases == NULL:
            raise ConfigError("mask_fds: the labels' stream is read through descriptors; pass its table",
                              field="mask_fds")
        if m._geometry(mg, mask_fds, &views[nviews[0]]):
            nviews[0] += 1
        lab.m = mg
        return 0

    def unchecked_chunks(self, starts, length=None, stops=None, checked=None, int64_t chunk_bytes=1 << 24,
                         int64_t cap=256):
        """The (shard, chunk) pairs of ``tokens.bin`` that the windows ``[starts[i], starts[i] +
        length)`` (or the ranges ``[starts[i], stops[i])``) touch and that ``checked`` does not
        mark: ``int64 (k, 2)``, each pair once, at most ``cap``.

        Args:
            checked: ``uint64`` addresses of the caller's per-shard ``uint8`` bitmaps, one
                byte per chunk of ``chunk_bytes`` (a power of two), non-zero when checked.
        """
        if checked is None:
            raise ConfigError("checked: the bitmaps' addresses are needed", field="checked")
        cdef const uint64_t[::1] maps = np.ascontiguousarray(checked, dtype=np.uint64)
        if maps.shape[0] != self.num_shards:
            raise ConfigError("checked: one bitmap per shard", field="checked")
        if chunk_bytes < 1 or chunk_bytes & (chunk_bytes - 1):
            raise ConfigError("chunk_bytes must be a power of two", field="chunk_bytes")
        cdef int shift = (<int64_t>chunk_bytes).bit_length() - 1
        cdef const int64_t[::1] st = _starts(starts)
        cdef const int64_t[::1] sp
        cdef const int64_t *stop_ptr = NULL
        cdef int64_t count = st.shape[0], L = 0, n = 0
        if stops is not None:
            sp = _starts(stops)
            if sp.shape[0] != count:
                raise ConfigError("stops: one per start", field="stops")
            stop_ptr = &sp[0] if count else NULL
        else:
            L = check_count(length, "length")
        out = np.empty((max(cap, 1), 2), np.int64)
        cdef int64_t[:, ::1] miss = out
        if count:
            with nogil:
                n = zb_ts_unchecked(&self.g, <const uint8_t *const *>&maps[0], shift, &st[0], stop_ptr, count, L,
                                    &miss[0, 0], cap)
        return out[:n]

    def gather(self, starts, length, out, TaskPool pool=None, fds=None, *, labels=None, mask=None, mask_fds=None,
               int64_t label_shift=1, int64_t ignore_id=-100):
        """Copy the windows ``[starts[w], starts[w] + length)`` into the rows of ``out`` (and,
        optionally, their labels in the same pass).

        Args:
            starts: integer array-like of global token positions.
            length: tokens per window.
            out: C-contiguous ``int64`` or ``int32`` array of ``len(starts) * length`` elements.
            pool: a :class:`~zerobatch.core.TaskPool`: the windows are split over its workers
                and the calling thread (each part runs without the GIL).
            fds: the caller's ``intc`` table of each shard's ``tokens.bin`` descriptor (read
                with ``pread``; every descriptor a window needs must be open).
            labels: optional output of ``out``'s dtype, ``len(starts) * (length - label_shift)``
                elements: window ``w``'s tokens ``[label_shift, length)`` (``label_shift=1``:
                the next-token targets ``w[1:]``), ``ignore_id`` where ``mask`` is 0.
            mask: the :class:`WindowGather` of a stream of one value per token over the same
                shards (a loss mask: 0 turns a label off), read in the same pass as the
                tokens: its blocks read for the first time checked against their digests
                (with its ``checks``), its values against its vocabulary.
            mask_fds: ``mask``'s descriptor table, when it is read through descriptors.

        Returns:
            ``out``.

        Raises:
            OutOfRangeError: a window outside ``[0, total)``.
            CorruptError: a token id at or above ``vocab`` (field ``token``, naming the
                shard's file when ``paths`` was given); a mask value at or above the mask's
                vocabulary (naming the mask's file).
            IntegrityError: a block of the tokens or of the mask that does not match its digest.
            ReadError, TruncatedError: a ``pread`` failed or came short.
            ConfigError: an unfit ``out`` or ``labels``, a mask of other shards, or
                non-integer starts.
        """
        cdef int64_t L = length if type(length) is int and length >= 0 else check_count(length, "length")
        cdef const int64_t[::1] st = _starts(starts)
        cdef int64_t count = st.shape[0], i
        cdef int64_t *p64 = NULL
        cdef int32_t *p32 = NULL
        cdef Py_buffer view, fview
        cdef Py_buffer lviews[2]
        cdef int nl = 0
        cdef zb_ts_geometry g, mg
        cdef zb_ts_labels lab
        cdef zb_ts_labels *labp = NULL
        cdef bint held = self._geometry(&g, fds, &fview)
        cdef void *data
        try:
            data = _acquire_out(out, &view, count * L, self.g.vocab, count * L, -1)
        except BaseException:
            if held:
                PyBuffer_Release(&fview)
            raise
        cdef int status = ZB_OK
        cdef int64_t parts = 1
        try:
            if labels is not None or mask is not None:
                self._labels(&lab, &mg, labels, mask, mask_fds, lviews, &nl, view.itemsize == 8,
                             count * (L - label_shift), label_shift, ignore_id)
                labp = &lab
            if count == 0 or L == 0:
                for i in range(count):
                    if st[i] < 0 or st[i] > self.total:
                        raise OutOfRangeError(f"a window start is outside [0, {self.total}]", field="starts")
                return out
            if view.itemsize == 8:
                p64 = <int64_t *>data
            else:
                p32 = <int32_t *>data
            if pool is not None:
                parts = min(pool.num_threads + 1, count // MIN_WINDOWS_PER_PART, count * L // MIN_TOKENS_PER_PART)
            if parts > 1:
                status = _run_split(pool, &g, &st[0], count, L, p64, p32, parts, labp)
            else:
                with nogil:
                    status = zb_ts_windows(&g, &st[0], count, L, p64, p32, NULL, NULL, NULL, labp)
        finally:
            PyBuffer_Release(&view)
            if held:
                PyBuffer_Release(&fview)
            while nl > 0:
                nl -= 1
                PyBuffer_Release(&lviews[nl])
        if status != ZB_OK and labp != NULL and lab.failed:
            (<WindowGather>mask)._raise_status(status, &mg, L)
        self._raise_status(status, &g, L)
        return out

    @property
    def num_documents(self):
        """Documents over every shard (0 without document indexes)."""
        return 0 if self._cum_docs is None else self._cum_docs_view[self.num_shards]

    def document_spans(self, indices, starts=None, stops=None):
        """``(starts, stops)``: the global token span of each document ``indices[i]``
        (documents numbered across shards in order), from the shards' document indexes, GIL
        released.

        Args:
            indices: integer array-like of document numbers.
            starts, stops: optional ``int64`` outputs of ``len(indices)`` elements.

        Raises:
            OutOfRangeError: an index outside ``[0, num_documents)``.
            CorruptError: a document index entry outside its shard (field ``documents.index``).
            ConfigError: no document indexes were given; an unfit output.
        """
        if self.g.docs == NULL:
            raise ConfigError("document_spans: this gatherer has no document indexes", field="documents")
        cdef const int64_t[::1] idx = _starts(indices)
        cdef int64_t count = idx.shape[0], bad = 0, i, sh, local
        a = np.empty(count, _INT64) if starts is None else starts
        b = np.empty(count, _INT64) if stops is None else stops
        cdef Py_buffer av, bv
        cdef int64_t *pa = <int64_t *>_acquire(a, &av, _INT64, count, -1, "starts")
        cdef int64_t *pb
        try:
            pb = <int64_t *>_acquire(b, &bv, _INT64, count, -1, "stops")
        except BaseException:
            PyBuffer_Release(&av)
            raise
        cdef int status = ZB_OK
        try:
            if count:
                with nogil:
                    status = zb_ts_spans(&self.g, &self._cum_docs_view[0], &idx[0], count, pa, pb, &bad)
        finally:
            PyBuffer_Release(&av)
            PyBuffer_Release(&bv)
        if status == ZB_E_INDEX:
            raise OutOfRangeError(f"a document index is outside [0, {self.num_documents}): {idx[bad]}",
                                  field="indices")
        if status != ZB_OK:
            i = idx[bad]
            sh = _find_shard(&self._cum_docs_view[0], self.num_shards, i)
            local = i - self._cum_docs_view[sh]
            raise CorruptError(f"documents.index[{local}:{local + 2}]: document {local} of shard {sh} is not a span "
                               f"of its {self._cum_view[sh + 1] - self._cum_view[sh]} tokens", field="documents.index",
                               path=None if self.paths is None else
                               os.path.join(os.path.dirname(self.paths[sh]), "documents.index"))
        return a, b

    def gather_async(self, TaskPool pool, starts, length, out, *, labels=None, mask=None, int64_t label_shift=1,
                     int64_t ignore_id=-100):
        """:meth:`gather` queued on ``pool`` as one compiled task (mapped files only; with
        ``labels`` and ``mask``, the mask's too); returns a :class:`WindowTicket` whose
        ``wait()`` returns ``out``.

        The arguments are checked now (``ConfigError``); a window outside the stream, a token
        id at or above the vocabulary or a block that does not match its checksum is raised by
        ``wait()``.
        """
        if self.g.bases == NULL:
            raise ConfigError("gather_async: this dataset is read through descriptors", field="fds")
        cdef int64_t L = length if type(length) is int and length >= 0 else check_count(length, "length")
        cdef WindowTicket t = WindowTicket.__new__(WindowTicket)
        cdef const int64_t[::1] st = _starts(starts)
        t.keep = st
        cdef int64_t count = st.shape[0]
        cdef void *data = _acquire_out(out, &t.views[0], count * L, self.g.vocab, count * L, -1)
        t.nviews = 1
        t.gather = self
        t.pool = pool
        t.out = out
        t.job.g = self.g
        t.job.starts = &st[0] if count else NULL
        t.job.count = count
        t.job.length = L
        t.job.out64 = <int64_t *>data if t.views[0].itemsize == 8 else NULL
        t.job.out32 = <int32_t *>data if t.views[0].itemsize == 4 else NULL
        t.job.has_labels = False
        if labels is not None or mask is not None:
            self._labels(&t.job.lab, &t.job.mg, labels, mask, None, t.views, &t.nviews, t.views[0].itemsize == 8,
                         count * (L - label_shift), label_shift, ignore_id)
            t.job.has_labels = True
            if mask is not None:
                t.job.lab.m = &t.job.mg
                t.mask = <WindowGather>mask
        if count == 0 or L == 0:
            t.job.count = 0
        t.task.fn = _ts_ticket_run
        t.task.arg = &t.job
        pool.submit(&t.task)
        t.submitted = True
        return t

    def metadata_ids(self, starts, length, ids=None, out=None, fds=None):
        """The per-token metadata of a batch of windows, deduplicated over the batch, GIL released.

        With ``out`` the windows' tokens are copied as well, in the same pass over the
        records (as :meth:`gather` would, on the calling thread).

        Args:
            starts: integer array-like of global token positions.
            length: tokens per window.
            ids: optional caller buffer, C-contiguous ``int32 (len(starts), length)``.
            out: optional token output (as for :meth:`gather`).
            fds: as for :meth:`gather`.

        Returns:
            ``(ids, table)``: ``ids[w, k]`` numbers the distinct metadata of token
            ``starts[w] + k`` (-1: none), in order of first appearance; ``table`` is
            ``int64 (distinct, 4)``: per distinct metadata its shard, its shard-local id, and
            the ``[start, stop)`` bytes of its blob in that shard's ``metadata.bin`` (from
            the shard's metadata index, each checked to be a range of the file).

        Raises:
            ConfigError: built without ``metadata_indexes``; an unfit ``ids`` or ``out``.
            OutOfRangeError: a window outside ``[0, total)``.
            CorruptError: a metadata id not below its shard's count (field ``metadata_id``);
                index entries that are not a range of ``metadata.bin`` (field
                ``metadata.index``); with ``out``, a token id at or above ``vocab`` (field
                ``token``).
            ReadError, TruncatedError: as :meth:`gather`.
        """
        if self.g.nmeta == NULL:
            raise ConfigError("metadata_ids: this gatherer has no metadata indexes", field="metadata_indexes")
        cdef int64_t L = length if type(length) is int and length >= 0 else check_count(length, "length")
        cdef const int64_t[::1] st = _starts(starts)
        cdef int64_t count = st.shape[0]
        tokens = out
        out = np.empty((count, L), _INT32) if ids is None else ids
        cdef Py_buffer view, tview, fview
        cdef int64_t *p64 = NULL
        cdef int32_t *p32 = NULL
        cdef int32_t *p
        cdef void *tp
        cdef bint have_t = False, have_v = False, held = False
        cdef zb_ts_distinct d
        memset(&d, 0, sizeof(d))
        cdef zb_ts_geometry g
        cdef int status = ZB_OK
        cdef int64_t i
        try:
            held = self._geometry(&g, fds, &fview)
            if tokens is not None:
                tp = _acquire_out(tokens, &tview, count * L, self.g.vocab, count * L, -1)
                have_t = True
                if tview.itemsize == 8:
                    p64 = <int64_t *>tp
                else:
                    p32 = <int32_t *>tp
            p = <int32_t *>_acquire(out, &view, _INT32, count, L, "ids")
            have_v = True
            if zb_ts_distinct_init(&d) != 0:
                raise MemoryError()
            d.raw = <uint32_t *>malloc(max(L, 1) * sizeof(uint32_t))
            if d.raw == NULL:
                raise MemoryError()
            if count and L:
                with nogil:
                    status = zb_ts_windows(&g, &st[0], count, L, p64, p32, p, &d)
            else:
                for i in range(count):
                    if st[i] < 0 or st[i] > self.total:
                        raise OutOfRangeError(f"a window start is outside [0, {self.total}]", field="starts")
            self._raise_status(status, &g, L)
            table = np.empty((d.n, 4), np.int64)
            if d.n:
                self._blob_table(&d, table)
        finally:
            if have_v:
                PyBuffer_Release(&view)
            if have_t:
                PyBuffer_Release(&tview)
            if held:
                PyBuffer_Release(&fview)
            zb_ts_distinct_free(&d)
        return out, table

    cdef int _blob_table(self, zb_ts_distinct *d, object table) except -1:
        # rows (shard, id, start, stop) of the distinct metadata, the blob range checked
        cdef Py_buffer view
        cdef int64_t *t = <int64_t *>_acquire(table, &view, _INT64, d.n, 4, "table")
        cdef int64_t i, s
        cdef uint32_t m
        cdef const uint64_t *idx
        cdef uint64_t a, b
        try:
            for i in range(d.n):
                s = d.shard[i]
                m = d.mid[i]
                idx = <const uint64_t *>self._meta_index_ptr_view[s]
                a = idx[m]
                b = idx[m + 1]
                if a > b or b > idx[self._meta_count_view[s]]:
                    raise CorruptError(f"metadata.index[{m}:{m + 2}]: [{a}, {b}) is not a range of metadata.bin's "
                                       f"{idx[self._meta_count_view[s]]} bytes", field="metadata.index",
                                       path=None if self.paths is None else
                                       os.path.join(os.path.dirname(self.paths[s]), "metadata.index"))
                t[4 * i] = s
                t[4 * i + 1] = m
                t[4 * i + 2] = <int64_t>a
                t[4 * i + 3] = <int64_t>b
        finally:
            PyBuffer_Release(&view)
        return 0

    def gather_ranges(self, starts, stops, out, fds=None, position_ids=None, labels=None, int64_t ignore_id=-100, *,
                      mask=None, mask_fds=None, int64_t label_shift=1):
        """Copy the token ranges ``[starts[i], stops[i])`` back to back into the flat ``out``
        (and, optionally, each token's place in its range and the next-token labels, in the
        same pass).

        Args:
            starts, stops: integer array-likes of global token positions, ``starts <= stops``.
            out: C-contiguous ``int64`` or ``int32`` array of ``sum(stops - starts)`` elements.
            fds: as for :meth:`gather`.
            position_ids: optional ``int64`` / ``int32`` output of ``out``'s size: 0, 1, ...
                restarting at each range.
            labels: optional output of ``out``'s size and dtype: the token ``label_shift``
                places on in the same range (1, the default: the next token, ``ignore_id`` at
                each range's last token; 0: the token itself), ``ignore_id`` where ``mask``
                is 0.
            mask, mask_fds: the labels' stream, as for :meth:`gather`.

        Returns:
            ``out``.

        Raises:
            OutOfRangeError: a range outside ``[0, total)`` or reversed.
            CorruptError, ReadError, TruncatedError, IntegrityError: as :meth:`gather`.
            ConfigError: an unfit output.
        """
        cdef WindowTicket t = self._ranges_job(starts, stops, out, fds, position_ids, labels, ignore_id, mask,
                                               mask_fds, label_shift)
        cdef int status
        try:
            with nogil:
                status = zb_ts_ranges_run(&t.rjob.g, &t.rjob.r)
        finally:
            t.finished = True
            t._release()
        if status != ZB_OK:
            if t.rjob.r.failed:
                t.mask._raise_status(status, &t.rjob.mg, t.rjob.r.cur)
            self._raise_status(status, &t.rjob.g, t.rjob.r.cur)
        return out

    def gather_ranges_async(self, TaskPool pool, starts, stops, out, position_ids=None, labels=None,
                            int64_t ignore_id=-100, *, mask=None, int64_t label_shift=1):
        """:meth:`gather_ranges` queued on ``pool`` as one compiled task (mapped files only;
        with ``mask``, the mask's too); returns a :class:`WindowTicket` whose ``wait()``
        returns ``out``. The arguments are checked now; the errors of the read itself are
        raised by ``wait()``."""
        if self.g.bases == NULL:
            raise ConfigError("gather_ranges_async: this dataset is read through descriptors", field="fds")
        cdef WindowTicket t = self._ranges_job(starts, stops, out, None, position_ids, labels, ignore_id, mask, None,
                                               label_shift)
        t.pool = pool
        t.task.fn = _ts_ranges_task
        t.task.arg = &t.rjob
        pool.submit(&t.task)
        t.submitted = True
        return t

    cdef WindowTicket _ranges_job(self, starts, stops, out, fds, position_ids, labels, int64_t ignore_id,
                                  mask=None, mask_fds=None, int64_t label_shift=1):
        # a ticket holding a checked ranges job (its buffers acquired; released by the ticket)
        cdef WindowTicket t = WindowTicket.__new__(WindowTicket)
        cdef const int64_t[::1] a = as_positions(starts, "starts")
        cdef const int64_t[::1] b = as_positions(stops, "stops")
        cdef int64_t count = a.shape[0], i, total = 0
        if b.shape[0] != count:
            raise ConfigError("stops: one per start", field="stops")
        for i in range(count):
            if a[i] < 0 or b[i] < a[i] or b[i] > self.total:
                raise OutOfRangeError(f"range [{a[i]}, {b[i]}) is not within [0, {self.total})", field="starts")
            total += b[i] - a[i]
        t.is_ranges = True
        t.gather = self
        t.out = out
        t.keep = (a, b, fds, mask_fds)
        memset(&t.rjob, 0, sizeof(t.rjob))
        cdef Py_buffer fview
        cdef bint held = self._geometry(&t.rjob.g, fds, &fview)
        if held:
            t.views[t.nviews] = fview
            t.nviews += 1
        cdef void *data = _acquire_out(out, &t.views[t.nviews], total, self.g.vocab, total, -1)
        t.nviews += 1
        cdef bint wide = t.views[t.nviews - 1].itemsize == 8
        t.rjob.r.a = &a[0] if count else NULL
        t.rjob.r.b = &b[0] if count else NULL
        t.rjob.r.count = count
        t.rjob.r.out64 = <int64_t *>data if wide else NULL
        t.rjob.r.out32 = NULL if wide else <int32_t *>data
        t.rjob.r.ignore = ignore_id
        cdef void *p
        if position_ids is not None:
            pdt = position_ids.dtype if type(position_ids) is np.ndarray else None
            p = _acquire(position_ids, &t.views[t.nviews], _INT64 if pdt == _INT64 else _INT32, total, -1,
                         "position_ids")
            t.nviews += 1
            if pdt == _INT64:
                t.rjob.r.pos64 = <int64_t *>p
            else:
                t.rjob.r.pos32 = <int32_t *>p
        cdef zb_ts_labels lab
        if labels is not None or mask is not None:
            self._labels(&lab, &t.rjob.mg, labels, mask, mask_fds, t.views, &t.nviews, wide, total, label_shift,
                         ignore_id)
            t.rjob.r.labels = lab.out
            t.rjob.r.shift = label_shift
            if mask is not None:
                t.rjob.r.m = &t.rjob.mg
                t.mask = <WindowGather>mask
        return t

    cdef int _raise_status(self, int status, zb_ts_geometry *g, int64_t L) except -1:
        """Map a kernel's status through the one table, with the place named."""
        cdef int64_t shard
        if status == ZB_OK:
            return 0
        if status == ZB_E_INDEX:
            raise_for_status(status, f"a window of {L} tokens falls outside [0, {self.total})", field="starts")
        if status == ZB_E_NOMEM:
            raise_for_status(status, "out of memory for a window gather")
        if status == ZB_E_CHECKSUM:
            where = None if self.paths is None else self.paths[g.err_shard]
            if g.bad_block < 0:
                raise_for_status(status, f"checksums.bin: the chunk digests of tokens.bin hash to {g.bad_got:016x}, "
                                 f"the manifest records {g.bad_want:016x}", field="tokens.bin.xxh3",
                                 path=None if where is None else os.path.join(os.path.dirname(where), "checksums.bin"))
            a = g.bad_block * self.checks.block_bytes
            b = min(a + self.checks.block_bytes, (self._cum_view[g.err_shard + 1] - self._cum_view[g.err_shard])
                    * self.g.itemsize)
            raise_for_status(status, f"tokens.bin: block {g.bad_block} (bytes [{a}, {b})) does not match its "
                             f"checksum ({g.bad_got:016x}, expected {g.bad_want:016x})", path=where, field="xxh3")
        if status == ZB_E_IO or status == ZB_E_TRUNCATED:
            where = None if self.paths is None else self.paths[g.err_shard]
            if status == ZB_E_TRUNCATED:
                raise_for_status(status, f"tokens.bin: shard {g.err_shard} ended before its last record (the file "
                                 "shrank after open)", path=where, field="tokens.bin")
            raise_for_status(status, f"tokens.bin: read failed: {os.strerror(g.err_errno)}", path=where,
                             field="tokens.bin", errno=g.err_errno)
        if status == ZB_E_FIELD:
            shard = _find_shard(g.cum, g.num_shards, g.bad_pos)
            where = None if self.paths is None else self.paths[shard]
            if g.bad_field == 1:
                raise_for_status(status, f"metadata_id: the id at global position {g.bad_pos} (record "
                                 f"{g.bad_pos - self._cum_view[shard]} of shard {shard}) is not below the shard's "
                                 f"{self._meta_count_view[shard]} metadata blobs", path=where, field="metadata_id")
            raise_for_status(status, f"token: the id at global position {g.bad_pos} (record "
                             f"{g.bad_pos - self._cum_view[shard]} of shard {shard}) is not below the "
                             f"vocabulary size {g.vocab}", path=where, field="token")
        raise_for_status(status, "a window gather failed", field="starts")

    def boundaries(self, starts, length, position_ids=None, segment_ids=None, cu_seqlens=None, *,
                   position_dtype=np.int64, segments=True):
        """Document boundaries inside a batch of windows, computed without the GIL.

        A window is cut into segments at every document start inside it (the first segment
        starts at the window's start; a shard start is a document start).

        Args:
            starts: integer array-like of global token positions.
            length: tokens per window.
            position_ids, segment_ids, cu_seqlens: optional caller buffers (C-contiguous
                ``(B, L)`` ``int64`` or ``int32``; ``int32 (B, L)``; ``int32 (B * L + 1,)``),
                reused from batch to batch instead of allocating.
            position_dtype: ``int64`` (default) or ``int32`` when no buffer is given; ``None``
                for no position ids (``cu_seqlens`` and ``max_seqlen`` alone are what
                variable-length attention kernels take; positions follow from them).
            segments: also fill segment ids (``False`` skips them: the outputs are
                store-bandwidth bound, and ``cu_seqlens`` carries the same information).

        Returns:
            ``(position_ids, segment_ids, cu_seqlens, max_seqlen)``: positions restarting at
            0 at each segment start (``None`` with ``position_dtype=None``); ``int32`` segment numbers within each window (``None``
            without ``segments``); ``int32`` cumulative segment starts over the flattened
            batch, ending with ``B * L`` (as variable-length attention kernels take them);
            the longest segment.

        Raises:
            IndexError: a window outside ``[0, total)``.
            ConfigError: no document indexes were given, an unfit buffer, or ``B * L`` does
                not fit in int32.
        """
        if self.g.docs == NULL:
            raise ConfigError("boundaries: this gatherer has no document indexes", field="documents")
        cdef int64_t L = length if type(length) is int and length >= 1 else \
            check_count(length, "length", minimum=1)
        cdef const int64_t[::1] st = _starts(starts)
        cdef int64_t count = st.shape[0]
        return self._bounded(st, count, L, L, None, position_ids, segment_ids, cu_seqlens, position_dtype,
                             segments, None)[1:]

    def gather_with_boundaries(self, starts, length, out, bounds_length=None, position_ids=None,
                               segment_ids=None, cu_seqlens=None, *, position_dtype=np.int64, segments=True,
                               fds=None, labels=None, mask=None, mask_fds=None, int64_t label_shift=1,
                               int64_t ignore_id=-100):
        """:meth:`gather` and :meth:`boundaries` in one pass on the calling thread: each
        window's boundary outputs (and labels) are computed right after its tokens are
        copied, while the next windows' loads are in flight.

        Args:
            starts, length, out: as for :meth:`gather`.
            bounds_length: tokens per window the boundaries cover (default ``length - 1``:
                the inputs of next-token pairs; at most ``length``).
            position_ids, segment_ids, cu_seqlens, position_dtype, segments: as for
                :meth:`boundaries`, shaped by ``bounds_length``.
            labels, mask, mask_fds, label_shift, ignore_id: as for :meth:`gather`.

        Returns:
            ``(out, position_ids, segment_ids, cu_seqlens, max_seqlen)``.

        Raises:
            As :meth:`gather` and :meth:`boundaries`.
        """
        if self.g.docs == NULL:
            raise ConfigError("boundaries: this gatherer has no document indexes", field="documents")
        cdef int64_t L = length if type(length) is int and length >= 1 else \
            check_count(length, "length", minimum=1)
        cdef int64_t BL = L - 1 if bounds_length is None else check_count(bounds_length, "bounds_length")
        if BL < 1 or BL > L:
            raise ConfigError(f"bounds_length must be in [1, {L}], got {BL}", field="bounds_length")
        cdef const int64_t[::1] st = _starts(starts)
        cdef int64_t count = st.shape[0]
        return self._bounded(st, count, L, BL, out, position_ids, segment_ids, cu_seqlens, position_dtype,
                             segments, fds, labels, mask, mask_fds, label_shift, ignore_id)

    cdef object _bounded(self, const int64_t[::1] st, int64_t count, int64_t L, int64_t BL, object out,
                         object position_ids, object segment_ids, object cu_seqlens, object position_dtype,
                         bint segments, object fds, object labels=None, object mask=None, object mask_fds=None,
                         int64_t label_shift=1, int64_t ignore_id=-100):
        # boundaries over BL tokens of each window, and with `out` the windows' L tokens too
        cdef int64_t i
        if count * BL >= 2**31:
            raise ConfigError(f"boundaries: {count} x {BL} tokens do not fit int32 cu_seqlens", field="length")
        for i in range(count):
            if st[i] < 0 or st[i] > self.total - L:
                raise OutOfRangeError(f"a window of {L} tokens falls outside [0, {self.total})", field="starts")
        pdt = None
        if type(position_ids) is np.ndarray:
            pdt = position_ids.dtype
        elif position_dtype is not None:
            pdt = position_dtype if type(position_dtype) is np.dtype else np.dtype(position_dtype)
        elif position_ids is not None:
            raise ConfigError("position_ids must be a NumPy array", field="position_ids")
        if pdt is not None and pdt == _INT64:
            pdt = _INT64
        elif pdt is not None and pdt == _INT32:
            pdt = _INT32
        if pdt is not None and pdt is not _INT64 and pdt is not _INT32:
            raise ConfigError(f"position_ids must be int64 or int32, got {pdt}", field="position_ids")
        pos_ids = None
        if pdt is not None:
            pos_ids = np.empty((count, BL), pdt) if position_ids is None else position_ids
        seg_ids = None
        if segments:
            seg_ids = np.empty((count, BL), _INT32) if segment_ids is None else segment_ids
        cu = np.empty(count * BL + 1, _INT32) if cu_seqlens is None else cu_seqlens
        cdef zb_ts_bounds b
        memset(&b, 0, sizeof(b))
        b.length = BL
        cdef Py_buffer pv, sv, cv, tv, fview
        cdef bint have_p = False, have_s = False, have_c = False, have_t = False, held = False
        cdef void *pp
        cdef void *tp
        cdef int64_t *t64 = NULL
        cdef int32_t *t32 = NULL
        cdef zb_ts_geometry g = self.g
        cdef zb_ts_geometry mg
        cdef zb_ts_labels lab
        cdef zb_ts_labels *labp = NULL
        cdef Py_buffer lviews[2]
        cdef int nl = 0
        cdef int status = ZB_OK
        try:
            if out is not None:
                held = self._geometry(&g, fds, &fview)
            if pos_ids is not None:
                pp = _acquire(pos_ids, &pv, pdt, count, BL, "position_ids")
                have_p = True
                if pv.itemsize == 8:
                    b.pos64 = <int64_t *>pp
                else:
                    b.pos32 = <int32_t *>pp
            if seg_ids is not None:
                b.seg = <int32_t *>_acquire(seg_ids, &sv, _INT32, count, BL, "segment_ids")
                have_s = True
            b.cu = <int32_t *>_acquire(cu, &cv, _INT32, count * BL + 1, -1, "cu_seqlens")
            have_c = True
            if out is not None:
                tp = _acquire_out(out, &tv, count * L, self.g.vocab, count * L, -1)
                have_t = True
                if tv.itemsize == 8:
                    t64 = <int64_t *>tp
                else:
                    t32 = <int32_t *>tp
                if labels is not None or mask is not None:
                    self._labels(&lab, &mg, labels, mask, mask_fds, lviews, &nl, tv.itemsize == 8,
                                 count * (L - label_shift), label_shift, ignore_id)
                    labp = &lab
            if count == 0:
                b.cu[0] = 0
            elif out is None:
                with nogil:
                    zb_ts_boundaries(&g, &st[0], count, &b)
            else:
                with nogil:
                    status = zb_ts_windows(&g, &st[0], count, L, t64, t32, NULL, NULL, &b, labp)
        finally:
            while nl > 0:
                nl -= 1
                PyBuffer_Release(&lviews[nl])
            if have_p:
                PyBuffer_Release(&pv)
            if have_s:
                PyBuffer_Release(&sv)
            if have_c:
                PyBuffer_Release(&cv)
            if have_t:
                PyBuffer_Release(&tv)
            if held:
                PyBuffer_Release(&fview)
        if status != ZB_OK and labp != NULL and lab.failed:
            (<WindowGather>mask)._raise_status(status, &mg, L)
        self._raise_status(status, &g, L)
        return out, pos_ids, seg_ids, cu[:b.nseg + 1], b.maxlen


cdef class WindowTicket:
    """A window or range gather queued on a :class:`~zerobatch.core.TaskPool` as one compiled
    task (no Python and no GIL from start to finish: the checks of unchecked blocks, the
    positions and labels of ranges, and the labels' stream, included); :meth:`wait` returns
    its output. Holds the gatherers, the positions and every buffer alive until the task has
    run."""

    cdef zb_task task
    cdef zb_ts_job job
    cdef zb_ts_ranges_job rjob
    cdef bint is_ranges
    # out, labels, position_ids, and (a synchronous read) two descriptor tables
    cdef Py_buffer views[MAX_VIEWS]
    cdef int nviews
    cdef bint submitted, finished, cancelled
    cdef object keep
    cdef WindowGather gather
    cdef WindowGather mask
    cdef TaskPool pool
    cdef object out

    def wait(self):
        """Block (GIL released) until the gather has run; return ``out``.

        Raises:
            IntegrityError, CorruptError, OutOfRangeError, ReadError: as the gather.
        """
        if self.cancelled:
            raise ConfigError("wait: this gather was cancelled", field="ticket")
        if not self.finished:
            self.pool.wait(&self.task)
            self.finished = True
            self._release()
        if self.task.status != ZB_OK:
            if self.is_ranges:
                if self.rjob.r.failed:
                    self.mask._raise_status(self.task.status, &self.rjob.mg, self.rjob.r.cur)
                self.gather._raise_status(self.task.status, &self.rjob.g, self.rjob.r.cur)
            if self.job.has_labels and self.job.lab.failed:
                self.mask._raise_status(self.task.status, &self.job.mg, self.job.length)
            self.gather._raise_status(self.task.status, &self.job.g, self.job.length)
        return self.out

    def cancel(self, wait=True):
        """Drop the gather if no worker has started it; else wait for it. Never raises.

        Returns:
            ``True`` when it was dropped (``out`` was not written).
        """
        cdef bint dropped = False
        if not self.finished:
            dropped = self.pool.cancel(&self.task)
            self.finished = True
            self.cancelled = dropped
            self._release()
        return dropped

    cdef void _release(self):
        while self.nviews > 0:
            self.nviews -= 1
            PyBuffer_Release(&self.views[self.nviews])

    def __dealloc__(self):
        # the task points into this object: never free it while a worker may run it
        if self.submitted and not self.finished:
            self.pool.wait(&self.task)
        self._release()


cdef void *_acquire(object buf, Py_buffer *view, object dtype, int64_t rows, int64_t cols,
                   str name) except NULL:
    # hold a caller's output array through the buffer protocol (no memoryview objects: this
    # is per batch, and the checks cost less than a microsecond): a writable C-contiguous
    # ndarray of `dtype` holding rows * cols elements, shaped (rows, cols) when cols >= 0.
    # The caller releases `view` (PyBuffer_Release) once the pointer is no longer used.
    cdef int64_t n = rows if cols < 0 else rows * cols
    # equality, not identity: an unpickled dtype is equal to the canonical one but another object
    cdef bint ok = type(buf) is np.ndarray and (<object>buf).dtype == dtype
    if ok:
        try:
            PyObject_GetBuffer(buf, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
        except (BufferError, ValueError):
            ok = False
    if ok:
        if view.len != n * view.itemsize or (cols >= 0 and (view.ndim != 2 or view.shape[0] != rows
                                                             or view.shape[1] != cols)):
            PyBuffer_Release(view)
            ok = False
    if not ok:
        shape = f"{n} elements" if cols < 0 else f"shape ({rows}, {cols})"
        raise ConfigError(f"{name} must be a writable C-contiguous {np.dtype(dtype)} array of {shape}",
                          field=name)
    return view.buf


cdef void *_acquire_out(object out, Py_buffer *view, int64_t n, uint64_t vocab, int64_t rows,
                        int64_t cols) except NULL:
    # the token output of gather / gather_ranges: int64, or int32 when the vocabulary fits
    dtype = _INT32 if type(out) is np.ndarray and out.dtype == _INT32 else _INT64
    if dtype is _INT32 and vocab > 2**31:
        raise ConfigError("out: int32 cannot hold every id of this vocabulary", field="out")
    if type(out) is np.ndarray and (<object>out).size != n:
        raise ConfigError(f"out must be a writable C-contiguous int64 or int32 array of {n} elements",
                          field="out")
    return _acquire(out, view, dtype, n, -1, "out")


cdef inline object _starts(object starts):
    # window starts as a flat int64 array: the common case (already one) costs no conversion
    if type(starts) is np.ndarray and starts.dtype is _INT64 and starts.ndim == 1 \
            and starts.flags.c_contiguous:
        return starts
    return as_positions(starts, "starts")


def _meta_path(simd=None):
    """The metadata numbering path: ``"avx512"`` or ``"portable"``; ``simd=False`` forces the
    portable one, ``True`` restores the CPU's choice (for tests: both must agree)."""
    global zb_ts_meta_simd
    if simd is not None:
        zb_ts_meta_simd = -1 if simd else 0
    if zb_ts_meta_simd < 0:
        zb_ts_meta_simd = zb_ts_meta_simd_available()
    return "avx512" if zb_ts_meta_simd > 0 else "portable"


def gather_windows(bases, cum, itemsize, token_size, vocab, starts, length, out, paths=None):
    """One-shot :class:`WindowGather` (``WindowGather(...).gather(starts, length, out)``)."""
    return WindowGather(bases, cum, itemsize, token_size, vocab, paths).gather(starts, length, out)
