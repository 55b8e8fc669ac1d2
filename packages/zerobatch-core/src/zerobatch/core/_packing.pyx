# Document packing: which pieces of which documents fill which row of `capacity` tokens.
#
# Contract (the C kernels are declared in _packing.pxd)
#   zb_pack(lengths, n, capacity, buffer, algorithm, scratch..., row_ptr, piece_doc,
#           piece_offset, piece_len) -> number of rows
#     Documents are taken in the given order (the caller shuffled them), `buffer` at a time
#     (a window); each window is planned alone, so a row holds documents of one window only.
#     concat (0): every document's tokens back to back, cut into rows of exactly `capacity`
#       tokens (documents split at row ends; windows do not matter; the last row is short).
#     first-fit (1) / best-fit decreasing (2): a document longer than `capacity` gives
#       floor(L / capacity) rows of `capacity` tokens alone (its first tokens, in order), and
#       its rest (L mod capacity tokens, when any) is a piece like the whole shorter documents.
#       The window's pieces go into bins of `capacity` tokens: first-fit takes them in the
#       given order, each into the earliest open bin with room; best-fit decreasing takes
#       them longest first (ties in the given order), each into the bin with the least room
#       that still holds it. A piece that fits no open bin opens a new one.
#     Rows of a window: its documents' full rows (in document order), then its bins in the
#     order they opened, each bin's pieces in the order they went in.
#     post: row r holds pieces [row_ptr[r], row_ptr[r + 1]); piece p is tokens
#       [piece_offset[p], piece_offset[p] + piece_len[p]) of document piece_doc[p]; every
#       token of every document is in exactly one piece; every row holds 1..capacity tokens.
#     Time O(pieces x log(max(capacity, buffer))) plus O(capacity) once; no allocation.
#   zb_pack_rows(flat, pieces..., n, capacity, seq_len, outputs...) -> cu_seqlens entries
#     pre: flat holds the pieces' tokens back to back; piece_row is non-decreasing in [0, n)
#          and every row has a piece; a row's pieces hold at most `capacity` tokens.
#     post: row r of tokens holds its pieces in order, then pad_id; segment_ids the piece's
#       number in the row (-1 on padding); position_ids the token's place in its piece (0 on
#       padding); mask 1 on tokens; labels (capacity - 1 per row, when asked) the next token
#       where it is a token (of the same piece, with mask_boundaries), else ignore_id; or
#       (capacity per row: Hugging Face's layout, the model shifts) each token itself where it
#       is a token (and, with mask_boundaries, not its piece's first), else ignore_id; with
#       label values (flat's layout: e.g. ignore_id where a loss mask is off), a label is the
#       token's label value instead of the token;
#       cu_seqlens the starts, over rows of seq_len inputs flattened, of every piece starting
#       inside them and of every row's padding when it starts inside them, then n * seq_len.
#   zb_flat_layout(tokens, lengths, positions, labels): documents back to back
#     post: positions[t] = t's place in its document; labels[t] = tokens[t + 1] inside a
#       document, ignore_id at each document's last token.

from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.string cimport memcpy

import numpy as np

from zerobatch.formats.errors import ConfigError

__all__ = ["PACKING_ALGORITHMS", "flat_layout", "pack_plan", "pack_rows"]

#: The packing algorithms, by name (their codes are their places).
PACKING_ALGORITHMS = ("concat", "first-fit", "best-fit")


cdef inline void seg_add(int64_t *tree, int64_t size, int64_t leaf, int64_t delta) noexcept nogil:
    cdef int64_t i = leaf + size
    while i >= 1:
        tree[i] += delta
        i >>= 1


cdef inline int64_t seg_first_nonzero(const int64_t *tree, int64_t size, int64_t lo) noexcept nogil:
    # the smallest leaf >= lo with a nonzero count, or -1
    cdef int64_t i
    if lo >= size:
        return -1
    i = lo + size
    if tree[i] > 0:
        return lo
    while True:
        # up while i is a right child, or a left child whose right sibling is empty
        while i > 1 and ((i & 1) == 1 or tree[i + 1] == 0):
            i >>= 1
        if i <= 1:
            return -1
        i += 1
        break
    while i < size:
        i <<= 1
        if tree[i] == 0:
            i += 1
    return i - size


cdef inline void max_set(int64_t *tree, int64_t size, int64_t leaf, int64_t value) noexcept nogil:
    cdef int64_t i = leaf + size
    cdef int64_t a, b
    tree[i] = value
    i >>= 1
    while i >= 1:
        a = tree[2 * i]
        b = tree[2 * i + 1]
        tree[i] = a if a > b else b
        i >>= 1


cdef inline int64_t max_first_at_least(const int64_t *tree, int64_t size, int64_t need) noexcept nogil:
    # the leftmost leaf whose value is >= need, or -1
    cdef int64_t i = 1
    if tree[1] < need:
        return -1
    while i < size:
        i <<= 1
        if tree[i] < need:
            i += 1
    return i - size


cdef int64_t zb_pack(const int64_t *lengths, int64_t n, int64_t capacity, int64_t buffer, int algorithm,
                     int64_t *rem_doc, int64_t *rem_len, int64_t *order, int64_t *bin_of, int64_t *bin_room,
                     int64_t *nxt, int64_t *head, int64_t *count, int64_t *tree, int64_t tree_size,
                     int64_t *row_ptr, int64_t *piece_doc, int64_t *piece_offset,
                     int64_t *piece_len) noexcept nogil:
    cdef int64_t rows = 0, p = 0, fill = 0
    cdef int64_t d, off, take, w0, w1, m, i, j, t, b, nb, L, k, r, room, pos, c
    row_ptr[0] = 0
    if algorithm == 0:
        for d in range(n):
            L = lengths[d]
            off = 0
            while off < L:
                take = L - off
                if take > capacity - fill:
                    take = capacity - fill
                piece_doc[p] = d
                piece_offset[p] = off
                piece_len[p] = take
                p += 1
                off += take
                fill += take
                if fill == capacity:
                    rows += 1
                    row_ptr[rows] = p
                    fill = 0
        if fill > 0:
            rows += 1
            row_ptr[rows] = p
        return rows
    w0 = 0
    while w0 < n:
        w1 = w0 + buffer
        if w1 > n:
            w1 = n
        # the documents' full rows, then their rests as pieces
        m = 0
        for d in range(w0, w1):
            L = lengths[d]
            k = L // capacity
            for j in range(k):
                piece_doc[p] = d
                piece_offset[p] = j * capacity
                piece_len[p] = capacity
                p += 1
                rows += 1
                row_ptr[rows] = p
            if L - k * capacity > 0:
                rem_doc[m] = d
                rem_len[m] = L - k * capacity
                m += 1
        if algorithm == 2:
            # longest first, ties in document order (a counting sort: rests are < capacity)
            for r in range(capacity + 1):
                count[r] = 0
            for i in range(m):
                count[rem_len[i]] += 1
            pos = 0
            r = capacity
            while r >= 1:
                c = count[r]
                count[r] = pos
                pos += c
                r -= 1
            for i in range(m):
                order[count[rem_len[i]]] = i
                count[rem_len[i]] += 1
        else:
            for i in range(m):
                order[i] = i
        nb = 0
        for t in range(m):
            i = order[t]
            L = rem_len[i]
            if algorithm == 2:
                # bins by room: the least room that still holds L
                room = seg_first_nonzero(tree, tree_size, L)
                if room < 0:
                    b = nb
                    nb += 1
                    room = capacity
                else:
                    b = head[room]
                    head[room] = nxt[b]
                    seg_add(tree, tree_size, room, -1)
                room -= L
                bin_room[b] = room
                if room > 0:
                    nxt[b] = head[room]
                    head[room] = b
                    seg_add(tree, tree_size, room, 1)
            else:
                # bins by opening order: the first with room for L
                b = max_first_at_least(tree, tree_size, L)
                if b < 0 or b >= nb:
                    b = nb
                    nb += 1
                    room = capacity
                else:
                    room = bin_room[b]
                room -= L
                bin_room[b] = room
                max_set(tree, tree_size, b, room)
            bin_of[i] = b
        # the bins as rows, in opening order, pieces in the order they went in
        for b in range(nb + 1):
            count[b] = 0
        for i in range(m):
            count[bin_of[i] + 1] += 1
        for b in range(nb):
            count[b + 1] += count[b]
        for t in range(m):
            i = order[t]
            b = bin_of[i]
            j = p + count[b]
            count[b] += 1
            piece_doc[j] = rem_doc[i]
            piece_offset[j] = lengths[rem_doc[i]] - rem_len[i]
            piece_len[j] = rem_len[i]
        # count[b] is now the end of bin b's pieces
        for b in range(nb):
            rows += 1
            row_ptr[rows] = p + count[b]
        p += m
        # leave the scratch clean for the next window
        for b in range(nb):
            if algorithm == 2:
                if bin_room[b] > 0:
                    head[bin_room[b]] = -1
                    seg_add(tree, tree_size, bin_room[b], -1)
            else:
                max_set(tree, tree_size, b, 0)
        w0 = w1
    return rows


def _pow2(n):
    size = 1
    while size < n:
        size <<= 1
    return size


def pack_plan(lengths, capacity, buffer=1024, algorithm="best-fit"):
    """Plan rows of ``capacity`` tokens filled with documents (see the contract above).

    Args:
        lengths: tokens of each document, in the order to pack them (shuffle first).
        capacity: tokens per row (``seq_len + 1`` for next-token pairs).
        buffer: documents planned together (the look-ahead of first-fit and best-fit).
        algorithm: ``"best-fit"`` (decreasing), ``"first-fit"`` or ``"concat"``.

    Returns:
        ``(row_ptr, piece_doc, piece_offset, piece_len)``, ``int64`` arrays: row ``r`` holds
        pieces ``row_ptr[r]:row_ptr[r + 1]``; piece ``p`` is tokens
        ``[piece_offset[p], piece_offset[p] + piece_len[p])`` of document ``piece_doc[p]``.

    Raises:
        ConfigError: a negative length, or an argument out of range.
    """
    if algorithm not in PACKING_ALGORITHMS:
        raise ConfigError(f"algorithm must be one of {PACKING_ALGORITHMS}, got {algorithm!r}", field="algorithm")
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or not 1 <= capacity <= 1 << 40:
        raise ConfigError(f"capacity must be a positive integer, got {capacity!r}", field="capacity")
    if isinstance(buffer, bool) or not isinstance(buffer, (int, np.integer)) or buffer < 1:
        raise ConfigError(f"buffer must be a positive integer, got {buffer!r}", field="buffer")
    cdef int code = PACKING_ALGORITHMS.index(algorithm)
    cdef int64_t[::1] lens = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
    cdef int64_t n = lens.shape[0]
    cdef int64_t cap = int(capacity)
    cdef int64_t buf = min(int(buffer), max(n, 1))
    arr = np.asarray(lens)
    if n and int(arr.min()) < 0:
        raise ConfigError("lengths: a document has a negative length", field="lengths")
    total = int(arr.sum()) if n else 0
    if code == 0:
        pieces = n + total // cap + 1
        rows_max = total // cap + 1
    else:
        full = int((arr // cap).sum()) if n else 0
        pieces = n + full
        rows_max = pieces
    cdef int64_t[::1] row_ptr = np.empty(rows_max + 1, np.int64)
    cdef int64_t[::1] piece_doc = np.empty(max(pieces, 1), np.int64)
    cdef int64_t[::1] piece_offset = np.empty(max(pieces, 1), np.int64)
    cdef int64_t[::1] piece_len = np.empty(max(pieces, 1), np.int64)
    scratch_n = buf if code else 1
    cdef int64_t[::1] rem_doc = np.empty(scratch_n, np.int64)
    cdef int64_t[::1] rem_len = np.empty(scratch_n, np.int64)
    cdef int64_t[::1] order = np.empty(scratch_n, np.int64)
    cdef int64_t[::1] bin_of = np.empty(scratch_n, np.int64)
    cdef int64_t[::1] bin_room = np.empty(scratch_n, np.int64)
    cdef int64_t[::1] nxt = np.empty(scratch_n, np.int64)
    cdef int64_t[::1] head = np.full(cap + 1 if code == 2 else 1, -1, np.int64)
    cdef int64_t[::1] count = np.empty(max(cap, buf) + 2 if code else 1, np.int64)
    cdef int64_t tree_size = _pow2(cap + 1) if code == 2 else (_pow2(buf) if code == 1 else 1)
    cdef int64_t[::1] tree = np.zeros(2 * tree_size, np.int64)
    cdef int64_t rows
    with nogil:
        rows = zb_pack(&lens[0] if n else NULL, n, cap, buf, code, &rem_doc[0], &rem_len[0], &order[0],
                       &bin_of[0], &bin_room[0], &nxt[0], &head[0], &count[0], &tree[0], tree_size,
                       &row_ptr[0], &piece_doc[0], &piece_offset[0], &piece_len[0])
    used = int(np.asarray(row_ptr)[rows]) if rows else 0
    return (np.asarray(row_ptr)[:rows + 1].copy(), np.asarray(piece_doc)[:used].copy(),
            np.asarray(piece_offset)[:used].copy(), np.asarray(piece_len)[:used].copy())


cdef inline void put(void *base, bint wide, int64_t i, int64_t v) noexcept nogil:
    if wide:
        (<int64_t *>base)[i] = v
    else:
        (<int32_t *>base)[i] = <int32_t>v


cdef inline int64_t get(const void *base, bint wide, int64_t i) noexcept nogil:
    if wide:
        return (<const int64_t *>base)[i]
    return (<const int32_t *>base)[i]


cdef int64_t zb_pack_rows(const void *flat, bint wide, const int64_t *plen, const int64_t *prow, int64_t p,
                          int64_t n, int64_t cap, int64_t seq, int64_t pad_id, void *tokens, int32_t *seg,
                          void *pos, bint pos_wide, uint8_t *mask, void *labels, int64_t ignore_id,
                          bint mask_boundaries, int32_t *cu, int64_t *longest, const void *lvals=NULL,
                          bint same=False) noexcept nogil:
    cdef int64_t q = 0, f = 0, r, c, k, j, at, ncu = 0, best = 0, f0, lw
    cdef const void *src
    for r in range(n):
        c = 0
        k = 0
        at = r * cap
        f0 = f                            # the row's first token in flat (its tokens are consecutive there)
        while q < p and prow[q] == r:
            if plen[q] < 1 or c + plen[q] > cap:
                return -1
            if c < seq:
                cu[ncu] = <int32_t>(r * seq + c)
                ncu += 1
            for j in range(plen[q]):
                put(tokens, wide, at + c, get(flat, wide, f))
                seg[at + c] = <int32_t>k
                put(pos, pos_wide, at + c, j)
                mask[at + c] = 1
                c += 1
                f += 1
            k += 1
            q += 1
        if k == 0:
            return -1                     # an empty row, or pieces out of row order
        if c < seq:
            cu[ncu] = <int32_t>(r * seq + c)
            ncu += 1
        while c < cap:
            put(tokens, wide, at + c, pad_id)
            seg[at + c] = -1
            put(pos, pos_wide, at + c, 0)
            mask[at + c] = 0
            c += 1
        if labels != NULL:
            # label values: the row's tokens, or its run of lvals (token c is flat[f0 + c])
            if lvals == NULL:
                src = tokens
                lw = at
            else:
                src = lvals
                lw = f0
            if same:
                for c in range(cap):
                    if mask[at + c] and not (mask_boundaries and (c == 0 or seg[at + c] != seg[at + c - 1])):
                        put(labels, wide, at + c, get(src, wide, lw + c))
                    else:
                        put(labels, wide, at + c, ignore_id)
            else:
                for c in range(cap - 1):
                    if mask[at + c + 1] and (not mask_boundaries or seg[at + c + 1] == seg[at + c]):
                        put(labels, wide, r * (cap - 1) + c, get(src, wide, lw + c + 1))
                    else:
                        put(labels, wide, r * (cap - 1) + c, ignore_id)
    if q != p:
        return -1                         # pieces of rows beyond n, or out of order
    cu[ncu] = <int32_t>(n * seq)
    ncu += 1
    for j in range(1, ncu):
        if cu[j] - cu[j - 1] > best:
            best = cu[j] - cu[j - 1]
    longest[0] = best
    return ncu


def _c_array(a, dtypes, ndim, name):
    if not isinstance(a, np.ndarray) or a.dtype not in dtypes or a.ndim != ndim or not a.flags.c_contiguous \
            or not a.flags.writeable:
        raise ConfigError(f"pack_rows: {name} must be a writable C-contiguous {ndim}-D array of "
                          f"{' or '.join(str(np.dtype(d)) for d in dtypes)}", field=name)


def pack_rows(flat, piece_len, piece_row, int64_t seq_len, tokens, segment_ids, position_ids, mask, labels=None,
              cu_seqlens=None, int64_t pad_id=0, int64_t ignore_id=-100, bint mask_boundaries=True,
              label_values=None):
    """Lay packed rows out in one pass, GIL released (see the contract above).

    Args:
        flat: the pieces' tokens back to back (``int64`` or ``int32``, the dtype of ``tokens``).
        piece_len, piece_row: each piece's length and row (rows non-decreasing, each row
            holding a piece and at most ``tokens.shape[1]`` tokens).
        seq_len: input tokens per row (``cu_seqlens`` covers them).
        tokens: ``[n, capacity]`` output; ``segment_ids`` ``int32 [n, capacity]``;
            ``position_ids`` ``int64`` / ``int32 [n, capacity]``; ``mask`` ``bool [n, capacity]``;
            ``labels`` ``None``, ``[n, capacity - 1]`` (next-token labels) or ``[n, capacity]``
            (Hugging Face's layout: each token's own label) of ``tokens``' dtype.
        cu_seqlens: ``int32`` output of at least ``pieces + n + 1`` entries (default: made).
        label_values: ``None`` (a label is its token) or the label value of every token of
            ``flat``, laid out as ``flat`` (e.g. the tokens with ``ignore_id`` where a loss
            mask is off: :meth:`TokenStreamReader.ranges` with ``label_shift=0``).

    Returns:
        ``(cu_seqlens[:count], max_seqlen)``.

    Raises:
        ConfigError: an unfit array or a plan the rows cannot hold.
    """
    _c_array(tokens, (np.int64, np.int32), 2, "tokens")
    n, cap = tokens.shape
    _c_array(segment_ids, (np.int32,), 2, "segment_ids")
    _c_array(position_ids, (np.int64, np.int32), 2, "position_ids")
    _c_array(mask, (np.bool_, np.uint8), 2, "mask")
    for name, a in (("segment_ids", segment_ids), ("position_ids", position_ids), ("mask", mask)):
        if a.shape != (n, cap):
            raise ConfigError(f"pack_rows: {name} is {a.shape}, not {(n, cap)}", field=name)
    cdef bint same = False
    if labels is not None:
        _c_array(labels, (tokens.dtype,), 2, "labels")
        same = labels.shape == (n, cap)
        if labels.shape != (n, cap - 1) and not same:
            raise ConfigError(f"pack_rows: labels is {labels.shape}, not {(n, cap - 1)} or {(n, cap)}", field="labels")
    f = np.ascontiguousarray(flat, dtype=tokens.dtype).reshape(-1)
    lv = None
    if label_values is not None:
        lv = np.ascontiguousarray(label_values, dtype=tokens.dtype).reshape(-1)
        if lv.size != f.size:
            raise ConfigError(f"pack_rows: label_values holds {lv.size} values, flat {f.size}", field="label_values")
    cdef const int64_t[::1] plen = np.ascontiguousarray(piece_len, dtype=np.int64).reshape(-1)
    cdef const int64_t[::1] prow = np.ascontiguousarray(piece_row, dtype=np.int64).reshape(-1)
    cdef int64_t p = plen.shape[0]
    if prow.shape[0] != p:
        raise ConfigError("pack_rows: piece_len and piece_row differ in length", field="piece_row")
    lens = np.asarray(plen)
    if (p == 0) != (n == 0) or int(lens.sum()) != f.size:
        raise ConfigError(f"pack_rows: flat holds {f.size} tokens, the pieces {int(lens.sum())}", field="flat")
    if not 0 <= seq_len <= cap or n * seq_len >= 2 ** 31:
        raise ConfigError(f"pack_rows: seq_len {seq_len} does not fit rows of {cap} (or int32 cu_seqlens)",
                          field="seq_len")
    if tokens.dtype == np.int32 and not (-2**31 <= pad_id < 2**31 and -2**31 <= ignore_id < 2**31):
        raise ConfigError("pack_rows: pad_id or ignore_id does not fit int32", field="pad_id")
    if cu_seqlens is None:
        cu_seqlens = np.empty(p + n + 1, np.int32)
    _c_array(cu_seqlens, (np.int32,), 1, "cu_seqlens")
    if cu_seqlens.size < p + n + 1:
        raise ConfigError(f"pack_rows: cu_seqlens holds {cu_seqlens.size}, needs {p + n + 1}", field="cu_seqlens")
    cdef bint wide = tokens.dtype == np.int64
    cdef bint pos_wide = position_ids.dtype == np.int64
    cdef Py_ssize_t flat_addr = f.ctypes.data, tok_addr = tokens.ctypes.data, pos_addr = position_ids.ctypes.data
    cdef Py_ssize_t seg_addr = segment_ids.ctypes.data, mask_addr = mask.ctypes.data, cu_addr = cu_seqlens.ctypes.data
    cdef Py_ssize_t lab_addr = 0 if labels is None else labels.ctypes.data
    cdef Py_ssize_t lv_addr = 0 if lv is None or labels is None else lv.ctypes.data
    cdef int64_t count = 0, longest = 0
    cdef int64_t nn = n, cc = cap
    with nogil:
        count = zb_pack_rows(<const void *>flat_addr, wide, &plen[0] if p else NULL, &prow[0] if p else NULL, p,
                             nn, cc, seq_len, pad_id, <void *>tok_addr, <int32_t *>seg_addr, <void *>pos_addr,
                             pos_wide, <uint8_t *>mask_addr, <void *>lab_addr, ignore_id, mask_boundaries,
                             <int32_t *>cu_addr, &longest, <const void *>lv_addr, same)
    if count < 0:
        raise ConfigError("pack_rows: the pieces do not lay out as rows (a row empty or over capacity, rows out "
                          "of order, or an empty piece)", field="piece_row")
    return cu_seqlens[:count], int(longest)


cdef void zb_flat_layout(const void *tokens, bint wide, const int64_t *lens, int64_t k, void *pos, bint pos_wide,
                         void *labels, int64_t ignore_id) noexcept nogil:
    cdef int64_t d, j, t = 0, n, total = 0
    cdef int64_t *p64
    cdef int32_t *p32
    if pos != NULL:
        # one typed loop per document (vectorized): 0, 1, ... n - 1
        p64 = <int64_t *>pos if pos_wide else NULL
        p32 = NULL if pos_wide else <int32_t *>pos
        for d in range(k):
            n = lens[d]
            if p64 != NULL:
                for j in range(n):
                    p64[t + j] = j
            else:
                for j in range(n):
                    p32[t + j] = <int32_t>j
            t += n
    if labels != NULL:
        # the tokens shifted by one (one copy), then the ignore id at every document's end
        for d in range(k):
            total += lens[d]
        if total > 1:
            memcpy(labels, <const char *>tokens + (8 if wide else 4), (total - 1) * (8 if wide else 4))
        t = 0
        for d in range(k):
            t += lens[d]
            if lens[d] > 0:
                put(labels, wide, t - 1, ignore_id)


def flat_layout(tokens, lengths, position_ids, labels=None, int64_t ignore_id=-100):
    """Positions and next-token labels of documents laid back to back (see the contract),
    GIL released.

    Args:
        tokens: the documents' tokens, ``int64`` or ``int32``, 1-D.
        lengths: each document's tokens (they add up to ``tokens.size``).
        position_ids: ``None`` or an ``int64`` / ``int32`` output of ``tokens``' size.
        labels: ``None`` or an output of ``tokens``' size and dtype.

    Returns:
        ``position_ids``.

    Raises:
        ConfigError: an unfit array, or lengths that do not add up.
    """
    if not isinstance(tokens, np.ndarray) or tokens.dtype not in (np.int64, np.int32) or tokens.ndim != 1 \
            or not tokens.flags.c_contiguous:
        raise ConfigError("flat_layout: tokens must be a C-contiguous 1-D int64 or int32 array", field="tokens")
    if position_ids is not None:
        _c_array(position_ids, (np.int64, np.int32), 1, "position_ids")
        if position_ids.size != tokens.size:
            raise ConfigError(f"flat_layout: position_ids holds {position_ids.size}, not {tokens.size}",
                              field="position_ids")
    if labels is not None:
        _c_array(labels, (tokens.dtype,), 1, "labels")
        if labels.size != tokens.size:
            raise ConfigError(f"flat_layout: labels holds {labels.size}, not {tokens.size}", field="labels")
    if tokens.dtype == np.int32 and not -2**31 <= ignore_id < 2**31:
        raise ConfigError("flat_layout: ignore_id does not fit int32", field="ignore_id")
    cdef const int64_t[::1] lens = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
    cdef int64_t k = lens.shape[0]
    arr = np.asarray(lens)
    if (k and int(arr.min()) < 0) or int(arr.sum()) != tokens.size:
        raise ConfigError(f"flat_layout: lengths add up to {int(arr.sum())}, not the {tokens.size} tokens",
                          field="lengths")
    cdef bint wide = tokens.dtype == np.int64
    cdef bint pos_wide = position_ids is not None and position_ids.dtype == np.int64
    cdef Py_ssize_t tok_addr = tokens.ctypes.data, pos_addr = 0 if position_ids is None else position_ids.ctypes.data
    cdef Py_ssize_t lab_addr = 0 if labels is None else labels.ctypes.data
    with nogil:
        zb_flat_layout(<const void *>tok_addr, wide, &lens[0] if k else NULL, k, <void *>pos_addr, pos_wide,
                       <void *>lab_addr, ignore_id)
    return position_ids
