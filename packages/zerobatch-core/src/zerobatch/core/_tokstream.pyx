# TOKSTREAM windows: gather token windows that may span shards into one output buffer.
#
# Contract
#   zb_ts_windows(g, starts, count, length, out64, out32)
#     pre:  g->bases[s] points at g->cum[s+1] - g->cum[s] records of g->itemsize bytes (the
#           mapped tokens.bin of shard s); g->cum is non-decreasing with cum[0] = 0 and
#           cum[num_shards] = total; exactly one of out64 / out32 is non-NULL with room for
#           count * length values.
#     post: ZB_OK and row w of out holds the tokens at global positions
#           [starts[w], starts[w] + length), read across as many shards as the window spans
#           (shard found by binary search over cum); or
#           ZB_E_INDEX when a window falls outside [0, total) (out unspecified), or
#           ZB_E_RANGE when a token id is >= g->vocab (g->bad_pos = its global position).
#   zb_ts_boundaries(g, starts, count, length, pos64, pos32, seg_ids, cu, &nseg, &maxlen)
#     pre:  the windows were checked (zb_ts_windows's precondition); g->docs[s] holds shard
#           s's document starts (increasing, first 0, last the shard's token count).
#     post: for each window, the segments are its runs of tokens from one document (a window
#           is cut at every document start inside it, and a shard start is a document
#           start); positions (pos64 or pos32, or neither) restart at 0 at each segment
#           start, seg_ids (unless NULL) count the window's
#           segments from 0, cu receives the flattened segment starts of the whole batch
#           followed by count * length, nseg the number of segments, maxlen the longest.
#   Runs without the GIL and touches no Python object. The copy loops are in _tokstream.h
#   (vectorized, one clone per ISA).

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

from cpython.mem cimport PyMem_Free, PyMem_Malloc

from zerobatch.core._pool cimport TaskPool, zb_task
from libc.errno cimport EINTR, errno
from libc.stdlib cimport free, malloc
from posix.unistd cimport pread

from zerobatch.core._status cimport ZB_E_INDEX, ZB_E_IO, ZB_E_RANGE, ZB_E_TRUNCATED, ZB_OK

cdef extern from "_tokstream.h" nogil:
    void zb_ts_fill_segment(int64_t *p64, int32_t *p32, int32_t *seg, int64_t n, int32_t segno)
    void zb_ts_prefetch(const uint8_t *p, int64_t nbytes)
    uint32_t zb_ts_copy_u16_i64(const uint8_t *src, int64_t stride, int64_t *dst, int64_t n)
    uint32_t zb_ts_copy_u16_i32(const uint8_t *src, int64_t stride, int32_t *dst, int64_t n)
    uint32_t zb_ts_copy_u32_i64(const uint8_t *src, int64_t stride, int64_t *dst, int64_t n)
    uint32_t zb_ts_copy_u32_i32(const uint8_t *src, int64_t stride, int32_t *dst, int64_t n)

import os

import numpy as np

from zerobatch.core._checks import as_positions, check_count
from zerobatch.formats.errors import ConfigError, CorruptError, ReadError, TruncatedError


#: Windows loaded ahead of the one being copied.
cdef enum:
    PREFETCH_AHEAD = 4

_INT64 = np.dtype(np.int64)
_INT32 = np.dtype(np.int32)


cdef struct zb_ts_geometry:
    const uint8_t **bases      # mmap backend: mapped tokens.bin per shard (NULL: pread backend)
    const int *fds             # pread backend: tokens.bin descriptor per shard
    int err_errno              # ZB_E_IO: the failing call's errno
    int64_t err_shard          # ZB_E_IO / ZB_E_TRUNCATED: the shard
    const uint64_t **docs      # per shard: documents.index (D_s + 1 entries), or NULL
    const int64_t *ndocs       # per shard: D_s
    const int64_t *cum
    int64_t num_shards
    int64_t itemsize
    int64_t token_size
    uint64_t vocab
    int64_t bad_pos


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


cdef int zb_ts_windows(zb_ts_geometry *g, const int64_t *starts, int64_t count, int64_t length,
                       int64_t *out64, int32_t *out32) noexcept nogil:
    cdef int status = ZB_OK
    cdef uint8_t *scratch = NULL
    if g.fds != NULL:
        # pread backend: each shard piece is read whole into one buffer, then widened
        scratch = <uint8_t *>malloc(max(length, 1) * g.itemsize)
        if scratch == NULL:
            g.err_errno = 12   # ENOMEM
            return ZB_E_IO
    status = _ts_windows(g, starts, count, length, out64, out32, scratch)
    free(scratch)
    return status


cdef int _ts_windows(zb_ts_geometry *g, const int64_t *starts, int64_t count, int64_t length,
                     int64_t *out64, int32_t *out32, uint8_t *scratch) noexcept nogil:
    cdef int64_t total = g.cum[g.num_shards]
    cdef int st
    cdef int64_t w, pos, s, take, k, done, row
    cdef const uint8_t *src
    cdef uint64_t v, vmax
    cdef int64_t isz = g.itemsize
    for w in range(count):
        pos = starts[w]
        if pos < 0 or pos > total - length:
            return ZB_E_INDEX
    cdef int64_t ahead, ps
    for w in range(count):
        # start loading the window PREFETCH_AHEAD rows on while this one is copied: random
        # windows are memory-latency bound, and the hardware prefetcher only follows a
        # window once it has started
        ahead = w + PREFETCH_AHEAD
        if ahead < count and scratch == NULL:
            ps = _find_shard(g.cum, g.num_shards, starts[ahead])
            zb_ts_prefetch(g.bases[ps] + (starts[ahead] - g.cum[ps]) * isz,
                           min(length, g.cum[ps + 1] - starts[ahead]) * isz)
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
            if scratch == NULL:
                src = g.bases[s] + (pos - g.cum[s]) * isz
            else:
                st = _pread_full(g.fds[s], scratch, take * isz, (pos - g.cum[s]) * isz, &g.err_errno)
                if st != ZB_OK:
                    g.err_shard = s
                    return st
                src = scratch
            if g.token_size == 2:
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
                return ZB_E_RANGE
            pos += take
            done += take
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


cdef void zb_ts_boundaries(const zb_ts_geometry *g, const int64_t *starts, int64_t count,
                           int64_t length, int64_t *pos64, int32_t *pos32, int32_t *seg_ids, int32_t *cu,
                           int64_t *nseg_out, int64_t *maxlen_out) noexcept nogil:
    cdef int64_t w, pos, end, s, k, nxt, seg_start, seg, nseg = 0, maxlen = 0, j, cut, local
    for w in range(count):
        pos = starts[w]
        end = pos + length
        seg_start = pos
        seg = 0
        cu[nseg] = <int32_t>(w * length)
        nseg += 1
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
            _fill(pos64, pos32, seg_ids, w * length + (seg_start - pos), nxt - seg_start, seg)
            if nxt - seg_start > maxlen:
                maxlen = nxt - seg_start
            seg += 1
            seg_start = nxt
            cu[nseg] = <int32_t>(w * length + (nxt - pos))
            nseg += 1
            if k < g.ndocs[s]:
                k += 1
            else:
                s += 1
                while g.cum[s + 1] == g.cum[s]:
                    s += 1
                k = 1
        _fill(pos64, pos32, seg_ids, w * length + (seg_start - pos), end - seg_start, seg)
        if end - seg_start > maxlen:
            maxlen = end - seg_start
    cu[nseg] = <int32_t>(count * length)
    nseg_out[0] = nseg
    maxlen_out[0] = maxlen


cdef struct zb_ts_job:
    zb_ts_geometry g
    const int64_t *starts
    int64_t count
    int64_t length
    int64_t *out64
    int32_t *out32


cdef int _ts_job_run(void *arg) noexcept nogil:
    cdef zb_ts_job *j = <zb_ts_job *>arg
    return zb_ts_windows(&j.g, j.starts, j.count, j.length, j.out64, j.out32)


#: Fewest windows worth handing to another thread.
MIN_WINDOWS_PER_PART = 4


cdef int _run_split(TaskPool pool, zb_ts_geometry *g, const int64_t *starts, int64_t count,
                    int64_t length, int64_t *out64, int32_t *out32, int64_t parts) except -2:
    """Split the windows in `parts` runs: all but the last queued on `pool`, the last run here,
    then wait for the others (helping with them if no worker has started). Returns the first
    non-OK status (g.bad_pos set for ZB_E_RANGE)."""
    cdef zb_ts_job *jobs = <zb_ts_job *>PyMem_Malloc(parts * sizeof(zb_ts_job))
    cdef zb_task *tasks = <zb_task *>PyMem_Malloc(parts * sizeof(zb_task))
    if jobs == NULL or tasks == NULL:
        PyMem_Free(jobs)
        PyMem_Free(tasks)
        raise MemoryError()
    cdef int64_t p, first = 0, n, submitted = 0
    cdef int status = ZB_OK, st
    try:
        for p in range(parts):
            n = count // parts + (1 if p < count % parts else 0)
            jobs[p].g = g[0]
            jobs[p].starts = starts + first
            jobs[p].count = n
            jobs[p].length = length
            jobs[p].out64 = NULL if out64 == NULL else out64 + first * length
            jobs[p].out32 = NULL if out32 == NULL else out32 + first * length
            tasks[p].fn = _ts_job_run
            tasks[p].arg = &jobs[p]
            first += n
        for p in range(parts - 1):
            pool.submit(&tasks[p])
            submitted += 1
        with nogil:
            st = _ts_job_run(&jobs[parts - 1])
        if st != ZB_OK:
            status = st
            g.bad_pos = jobs[parts - 1].g.bad_pos
        for p in range(submitted):
            pool.wait(&tasks[p])
            if tasks[p].status != ZB_OK and (status == ZB_OK or tasks[p].status == ZB_E_INDEX):
                status = tasks[p].status
                g.bad_pos = jobs[p].g.bad_pos
    finally:
        for p in range(submitted):
            pool.wait(&tasks[p])
        PyMem_Free(jobs)
        PyMem_Free(tasks)
    return status


cdef class WindowGather:
    """Gathers token windows across the shards of one dataset, GIL released.

    The geometry is checked once here; each :meth:`gather` only checks its windows and
    output buffer.

    Args:
        bases: ``uint64`` array of the shards' mapped ``tokens.bin`` addresses (the owner
            keeps the mappings alive and unchanged while this object is used).
        cum: ``int64`` cumulative token counts, ``len(bases) + 1`` entries from 0.
        itemsize: bytes per record (2, 4, 6 or 8); token_size: 2 or 4 (the token field
            comes first in each record).
        vocab: token ids must be below it.
        paths: optional file name of each shard, named in errors.
        documents: optional per-shard ``uint64`` document indexes (``D_s + 1`` entries:
            document starts, then the shard's token count), for :meth:`boundaries`.
        fds: optional per-shard descriptors of ``tokens.bin``: windows are then read with
            ``pread`` (each piece checked for its full length) instead of from ``bases``.

    Raises:
        ConfigError: inconsistent geometry.
    """

    cdef object _bases, _cum, paths, _docs, _doc_ptrs, _ndocs, _fds
    cdef const int[::1] fv
    cdef const uint64_t[::1] b
    cdef const int64_t[::1] c
    cdef const uint64_t[::1] dp
    cdef const int64_t[::1] nd
    cdef zb_ts_geometry g
    cdef readonly int64_t total

    def __cinit__(self, bases, cum, itemsize, token_size, vocab, paths=None, documents=None, fds=None):
        self._bases = np.ascontiguousarray(bases, dtype=np.uint64)
        self._cum = np.ascontiguousarray(cum, dtype=np.int64)
        self.b = self._bases
        self.c = self._cum
        cdef int64_t ns = self.b.shape[0]
        if self.c.shape[0] != ns + 1 or ns < 1 or self.c[0] != 0:
            raise ConfigError("cum must hold len(bases) + 1 cumulative counts from 0", field="cum")
        cdef int64_t i
        for i in range(ns):
            if self.c[i + 1] < self.c[i]:
                raise ConfigError("cum must be non-decreasing", field="cum")
        if itemsize not in (2, 4, 6, 8) or token_size not in (2, 4) or token_size > itemsize:
            raise ConfigError(f"itemsize {itemsize} / token_size {token_size} is not a record layout",
                              field="itemsize")
        if not 1 <= vocab <= 2**32:
            raise ConfigError(f"vocab {vocab} is not in [1, 2**32]", field="vocab")
        self.paths = paths
        self.g.bases = <const uint8_t **>&self.b[0]
        self.g.cum = &self.c[0]
        self.g.num_shards = ns
        self.g.itemsize = itemsize
        self.g.token_size = token_size
        self.g.vocab = vocab
        self.total = self.c[ns]
        self.g.fds = NULL
        if fds is not None:
            if len(fds) != ns:
                raise ConfigError("fds: one descriptor per shard", field="fds")
            self._fds = np.ascontiguousarray(fds, dtype=np.intc)
            self.fv = self._fds
            self.g.fds = &self.fv[0]
        self.g.docs = NULL
        self.g.ndocs = NULL
        if documents is not None:
            if len(documents) != ns:
                raise ConfigError("documents: one index per shard", field="documents")
            self._docs = [np.ascontiguousarray(d, dtype=np.uint64) for d in documents]
            for i in range(ns):
                d = self._docs[i]
                if d.ndim != 1 or d.shape[0] < 1 or d[0] != 0 \
                        or <int64_t>d[d.shape[0] - 1] != self.c[i + 1] - self.c[i]:
                    raise ConfigError(f"documents[{i}]: must start at 0 and end at the shard's token count",
                                      field="documents")
            self._doc_ptrs = np.array([d.ctypes.data for d in self._docs], dtype=np.uint64)
            self._ndocs = np.array([d.shape[0] - 1 for d in self._docs], dtype=np.int64)
            self.dp = self._doc_ptrs
            self.nd = self._ndocs
            self.g.docs = <const uint64_t **>&self.dp[0]
            self.g.ndocs = &self.nd[0]

    def gather(self, starts, length, out, TaskPool pool=None):
        """Copy the windows ``[starts[w], starts[w] + length)`` into the rows of ``out``.

        Args:
            starts: integer array-like of global token positions.
            length: tokens per window.
            out: C-contiguous ``int64`` or ``int32`` array of ``len(starts) * length`` elements.
            pool: a :class:`~zerobatch.core.TaskPool`: the windows are split over its workers
                and the calling thread (each part runs without the GIL).

        Returns:
            ``out``.

        Raises:
            IndexError: a window outside ``[0, total)``.
            CorruptError: a token id at or above ``vocab`` (field ``token``, naming the
                shard's file when ``paths`` was given).
            ConfigError: an unfit ``out`` or non-integer starts.
        """
        cdef int64_t L = length if type(length) is int and length >= 0 else check_count(length, "length")
        cdef const int64_t[::1] st = _starts(starts)
        cdef int64_t count = st.shape[0], i
        cdef int64_t *p64 = NULL
        cdef int32_t *p32 = NULL
        _out_pointers(out, count * L, self.g.vocab, &p64, &p32)
        if count == 0 or L == 0:
            for i in range(count):
                if st[i] < 0 or st[i] > self.total:
                    raise IndexError(f"a window start is outside [0, {self.total}]")
            return out
        cdef zb_ts_geometry g = self.g
        cdef int status
        cdef int64_t parts = 1
        if pool is not None:
            parts = min(pool.num_threads + 1, count // MIN_WINDOWS_PER_PART)
        if parts > 1:
            status = _run_split(pool, &g, &st[0], count, L, p64, p32, parts)
        else:
            with nogil:
                status = zb_ts_windows(&g, &st[0], count, L, p64, p32)
        self._raise_status(status, &g, L)
        return out

    def gather_ranges(self, starts, stops, out):
        """Copy the token ranges ``[starts[i], stops[i])`` back to back into the flat ``out``.

        Args:
            starts, stops: integer array-likes of global token positions, ``starts <= stops``.
            out: C-contiguous ``int64`` or ``int32`` array of ``sum(stops - starts)`` elements.

        Returns:
            ``out``.

        Raises:
            IndexError: a range outside ``[0, total)`` or reversed.
            CorruptError, ReadError, TruncatedError: as :meth:`gather`.
            ConfigError: an unfit ``out``.
        """
        cdef const int64_t[::1] a = as_positions(starts, "starts")
        cdef const int64_t[::1] b = as_positions(stops, "stops")
        cdef int64_t count = a.shape[0], i, total = 0
        if b.shape[0] != count:
            raise ConfigError("stops: one per start", field="stops")
        for i in range(count):
            if a[i] < 0 or b[i] < a[i] or b[i] > self.total:
                raise IndexError(f"range [{a[i]}, {b[i]}) is not within [0, {self.total})")
            total += b[i] - a[i]
        cdef int64_t *p64 = NULL
        cdef int32_t *p32 = NULL
        _out_pointers(out, total, self.g.vocab, &p64, &p32)
        if total == 0:
            return out
        cdef zb_ts_geometry g = self.g
        cdef int status = ZB_OK
        cdef int64_t at = 0, cur = 0
        with nogil:
            for i in range(count):
                cur = b[i] - a[i]
                if cur > 0:
                    status = zb_ts_windows(&g, &a[i], 1, b[i] - a[i], NULL if p64 == NULL else p64 + at,
                                           NULL if p32 == NULL else p32 + at)
                    if status != ZB_OK:
                        break
                    at += b[i] - a[i]
        self._raise_status(status, &g, cur)
        return out

    cdef int _raise_status(self, int status, zb_ts_geometry *g, int64_t L) except -1:
        if status == ZB_OK:
            return 0
        if status == ZB_E_INDEX:
            raise IndexError(f"a window of {L} tokens falls outside [0, {self.total})")
        if status == ZB_E_IO or status == ZB_E_TRUNCATED:
            where = None if self.paths is None else self.paths[g.err_shard]
            if status == ZB_E_TRUNCATED:
                raise TruncatedError(f"tokens.bin: shard {g.err_shard} ended before its last record (the "
                                     "file shrank after open)", path=where, field="tokens.bin")
            raise ReadError(f"tokens.bin: read failed: {os.strerror(g.err_errno)}", errno=g.err_errno,
                            path=where, field="tokens.bin")
        shard = _find_shard(g.cum, g.num_shards, g.bad_pos)
        raise CorruptError(f"token: the id at global position {g.bad_pos} (record "
                           f"{g.bad_pos - self.c[shard]} of shard {shard}) is not below the "
                           f"vocabulary size {g.vocab}",
                           path=None if self.paths is None else self.paths[shard], field="token")

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
            position_dtype: ``int64`` (default) or ``int32`` when no buffer is given.
            segments: also fill segment ids (``False`` skips them: the outputs are
                store-bandwidth bound, and ``cu_seqlens`` carries the same information).

        Returns:
            ``(position_ids, segment_ids, cu_seqlens, max_seqlen)``: positions restarting at
            0 at each segment start; ``int32`` segment numbers within each window (``None``
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
        cdef int64_t count = st.shape[0], i
        if count * L >= 2**31:
            raise ConfigError(f"boundaries: {count} x {L} tokens do not fit int32 cu_seqlens", field="length")
        for i in range(count):
            if st[i] < 0 or st[i] > self.total - L:
                raise IndexError(f"a window of {L} tokens falls outside [0, {self.total})")
        pdt = position_ids.dtype if isinstance(position_ids, np.ndarray) else np.dtype(position_dtype)
        if pdt is not _INT64 and pdt is not _INT32:
            raise ConfigError(f"position_ids must be int64 or int32, got {pdt}", field="position_ids")
        pos_ids = _buffer(position_ids, (count, L), pdt, "position_ids")
        seg_ids = _buffer(segment_ids, (count, L), _INT32, "segment_ids") if segments else None
        cu = _buffer(cu_seqlens, (count * L + 1,), _INT32, "cu_seqlens")
        cdef int64_t nseg = 0, maxlen = 0
        if count == 0:
            cu[0] = 0
            return pos_ids, seg_ids, cu[:1], 0
        cdef int64_t[::1] p64v
        cdef int32_t[::1] p32v
        cdef int32_t[::1] sv
        cdef int64_t *p64 = NULL
        cdef int32_t *p32 = NULL
        cdef int32_t *sp = NULL
        if pdt is _INT64:
            p64v = pos_ids.reshape(-1)
            p64 = &p64v[0]
        else:
            p32v = pos_ids.reshape(-1)
            p32 = &p32v[0]
        if seg_ids is not None:
            sv = seg_ids.reshape(-1)
            sp = &sv[0]
        cdef int32_t[::1] cv = cu
        with nogil:
            zb_ts_boundaries(&self.g, &st[0], count, L, p64, p32, sp, &cv[0], &nseg, &maxlen)
        return pos_ids, seg_ids, cu[:nseg + 1], int(maxlen)


cdef int _out_pointers(object out, int64_t n, uint64_t vocab, int64_t **p64, int32_t **p32) except -1:
    # check a caller's output buffer and point p64 or p32 at its data (left NULL when empty);
    # the caller holds `out` for as long as the pointer is used
    if type(out) is not np.ndarray or not out.flags.c_contiguous or not out.flags.writeable \
            or (out.dtype is not _INT64 and out.dtype is not _INT32) or out.size != n:
        raise ConfigError(f"out must be a writable C-contiguous int64 or int32 array of {n} elements",
                          field="out")
    if out.dtype is _INT32 and vocab > 2**31:
        raise ConfigError("out: int32 cannot hold every id of this vocabulary", field="out")
    if n == 0:
        return 0
    cdef int64_t[::1] o64
    cdef int32_t[::1] o32
    if out.dtype is _INT64:
        o64 = out.reshape(-1)
        p64[0] = &o64[0]
    else:
        o32 = out.reshape(-1)
        p32[0] = &o32[0]
    return 0


cdef inline object _starts(object starts):
    # window starts as a flat int64 array: the common case (already one) costs no conversion
    if type(starts) is np.ndarray and starts.dtype is _INT64 and starts.ndim == 1 \
            and starts.flags.c_contiguous:
        return starts
    return as_positions(starts, "starts")


def _buffer(buf, shape, dtype, name):
    # a caller's buffer of exactly this shape and dtype, or a new array
    if buf is None:
        return np.empty(shape, dtype=dtype)
    if type(buf) is not np.ndarray or buf.dtype is not dtype or buf.shape != shape \
            or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise ConfigError(f"{name} must be a writable C-contiguous {dtype} array of shape {shape}", field=name)
    return buf


def gather_windows(bases, cum, itemsize, token_size, vocab, starts, length, out, paths=None):
    """One-shot :class:`WindowGather` (``WindowGather(...).gather(starts, length, out)``)."""
    return WindowGather(bases, cum, itemsize, token_size, vocab, paths).gather(starts, length, out)
