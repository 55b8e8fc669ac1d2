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
#   Runs without the GIL and touches no Python object.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

from zerobatch.core._status cimport ZB_E_INDEX, ZB_E_RANGE, ZB_OK

import numpy as np

from zerobatch.core._checks import as_positions, check_count
from zerobatch.formats.errors import ConfigError, CorruptError


cdef struct zb_ts_geometry:
    const uint8_t **bases
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


cdef int zb_ts_windows(zb_ts_geometry *g, const int64_t *starts, int64_t count, int64_t length,
                       int64_t *out64, int32_t *out32) noexcept nogil:
    cdef int64_t total = g.cum[g.num_shards]
    cdef int64_t w, pos, s, take, k, done, row
    cdef const uint8_t *src
    cdef uint64_t v, vmax
    cdef int64_t isz = g.itemsize
    for w in range(count):
        pos = starts[w]
        if pos < 0 or pos > total - length:
            return ZB_E_INDEX
    for w in range(count):
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
            src = g.bases[s] + (pos - g.cum[s]) * isz
            vmax = 0
            if g.token_size == 2:
                if out64 != NULL:
                    for k in range(take):
                        v = (<const uint16_t *>(src + k * isz))[0]
                        vmax = v if v > vmax else vmax
                        out64[row + done + k] = <int64_t>v
                else:
                    for k in range(take):
                        v = (<const uint16_t *>(src + k * isz))[0]
                        vmax = v if v > vmax else vmax
                        out32[row + done + k] = <int32_t>v
            else:
                if out64 != NULL:
                    for k in range(take):
                        v = (<const uint32_t *>(src + k * isz))[0]
                        vmax = v if v > vmax else vmax
                        out64[row + done + k] = <int64_t>v
                else:
                    for k in range(take):
                        v = (<const uint32_t *>(src + k * isz))[0]
                        vmax = v if v > vmax else vmax
                        out32[row + done + k] = <int32_t>v
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


def gather_windows(bases, cum, itemsize, token_size, vocab, starts, length, out, paths=None):
    """Copy token windows that may span shards into ``out`` with the GIL released.

    Args:
        bases: ``uint64`` array of the shards' mapped ``tokens.bin`` addresses (the caller
            keeps the mappings alive and read-only for the duration of the call).
        cum: ``int64`` cumulative token counts, ``len(bases) + 1`` entries from 0.
        itemsize: bytes per record (2, 4, 6 or 8); token_size: 2 or 4 (the token field
            comes first in each record).
        vocab: token ids must be below it.
        starts: integer array-like of window starts (global token positions).
        length: tokens per window.
        out: C-contiguous ``int64`` or ``int32`` array of ``len(starts) * length`` elements.
        paths: optional file name of each shard, to name in errors.

    Returns:
        ``out``.

    Raises:
        IndexError: a window outside ``[0, total)``.
        CorruptError: a token id at or above ``vocab`` (field ``token``; the message names
            the global position).
        ConfigError: inconsistent geometry or an unfit ``out``.
    """
    cdef const uint64_t[::1] b = np.ascontiguousarray(bases, dtype=np.uint64)
    cdef const int64_t[::1] c = np.ascontiguousarray(cum, dtype=np.int64)
    cdef int64_t ns = b.shape[0]
    if c.shape[0] != ns + 1 or ns < 1 or c[0] != 0:
        raise ConfigError("cum must hold len(bases) + 1 cumulative counts from 0", field="cum")
    cdef int64_t i
    for i in range(ns):
        if c[i + 1] < c[i]:
            raise ConfigError("cum must be non-decreasing", field="cum")
    if itemsize not in (2, 4, 6, 8) or token_size not in (2, 4) or token_size > itemsize:
        raise ConfigError(f"itemsize {itemsize} / token_size {token_size} is not a record layout",
                          field="itemsize")
    cdef int64_t L = check_count(length, "length")
    cdef const int64_t[::1] st = as_positions(starts, "starts")
    cdef int64_t count = st.shape[0]
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable \
            or out.dtype not in (np.int64, np.int32) or out.size != count * L:
        raise ConfigError(f"out must be a writable C-contiguous int64 or int32 array of {count * L} "
                          "elements", field="out")
    if count == 0 or L == 0:
        if count and L == 0:
            for i in range(count):
                if st[i] < 0 or st[i] > c[ns]:
                    raise IndexError(f"a window start is outside [0, {c[ns]}]")
        return out
    cdef int64_t[::1] o64
    cdef int32_t[::1] o32
    cdef int64_t *p64 = NULL
    cdef int32_t *p32 = NULL
    if out.dtype == np.int64:
        o64 = out.reshape(-1)
        p64 = &o64[0]
    else:
        if vocab > 2**31:
            raise ConfigError("out: int32 cannot hold every id of this vocabulary", field="out")
        o32 = out.reshape(-1)
        p32 = &o32[0]
    cdef const uint8_t **ptrs = <const uint8_t **>&b[0]
    cdef zb_ts_geometry g
    g.bases = ptrs
    g.cum = &c[0]
    g.num_shards = ns
    g.itemsize = itemsize
    g.token_size = token_size
    g.vocab = vocab
    g.bad_pos = -1
    cdef int status
    with nogil:
        status = zb_ts_windows(&g, &st[0], count, L, p64, p32)
    if status == ZB_E_INDEX:
        raise IndexError(f"a window of {L} tokens falls outside [0, {c[ns]})")
    if status == ZB_E_RANGE:
        shard = _find_shard(&c[0], ns, g.bad_pos)
        raise CorruptError(f"token: the id at global position {g.bad_pos} (record "
                           f"{g.bad_pos - c[shard]} of shard {shard}) is not below the vocabulary "
                           f"size {vocab}", path=None if paths is None else paths[shard], field="token")
    return out
