# Document packing: which pieces of which documents fill which row of `capacity` tokens.
#
# Contract
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

from libc.stdint cimport int64_t

import numpy as np

from zerobatch.formats.errors import ConfigError

__all__ = ["PACKING_ALGORITHMS", "pack_plan"]

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
