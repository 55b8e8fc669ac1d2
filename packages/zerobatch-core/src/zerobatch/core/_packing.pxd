# C-level packing kernels: the plan of which pieces of which documents fill which row, the
# rows laid out from a plan, and the positions and labels of documents back to back. No
# Python object, no allocation (the caller owns every array, scratch included); contracts in
# _packing.pyx.

from libc.stdint cimport int32_t, int64_t, uint8_t

# Plan rows of `capacity` tokens from n documents of lengths[d], `buffer` documents at a time;
# `algorithm` 0 concat, 1 first-fit, 2 best-fit decreasing. Scratch, the caller's, read by
# first-fit and best-fit only: rem_doc, rem_len, order, bin_of, bin_room, nxt of `buffer`
# entries; count of max(capacity, buffer) + 2; tree of 2 * tree_size zeros, tree_size a power
# of two of at least capacity + 1 (best-fit) or `buffer` (first-fit); head (best-fit) of
# capacity + 1 entries, all -1. Each window leaves tree and head as it found them.
# pre:  lengths >= 0; row_ptr has room for every row + 1, the piece arrays for every piece.
# post: returns the rows; row r holds pieces [row_ptr[r], row_ptr[r + 1]), piece p tokens
#       [piece_offset[p], piece_offset[p] + piece_len[p]) of document piece_doc[p].
cdef int64_t zb_pack(const int64_t *lengths, int64_t n, int64_t capacity, int64_t buffer, int algorithm,
                     int64_t *rem_doc, int64_t *rem_len, int64_t *order, int64_t *bin_of, int64_t *bin_room,
                     int64_t *nxt, int64_t *head, int64_t *count, int64_t *tree, int64_t tree_size,
                     int64_t *row_ptr, int64_t *piece_doc, int64_t *piece_offset,
                     int64_t *piece_len) noexcept nogil

# Lay n rows of `cap` tokens out from p pieces (flat: their tokens back to back, int64 when
# `wide`, else int32; plen, prow: each piece's length and row): tokens, segment ids, positions
# (int64 when `pos_wide`), mask, labels (optional: NULL; n x (cap - 1) next-token labels, or
# with `same` n x cap labels of each token itself), cu_seqlens over rows of `seq` inputs. A
# label's value is the token's, or with `lvals` (flat's layout) the token's entry there.
# post: the cu_seqlens entries written (*longest the longest segment); -1 when the pieces do
#       not lay out as rows (an empty row or piece, a row over capacity, rows out of order).
cdef int64_t zb_pack_rows(const void *flat, bint wide, const int64_t *plen, const int64_t *prow, int64_t p,
                          int64_t n, int64_t cap, int64_t seq, int64_t pad_id, void *tokens, int32_t *seg,
                          void *pos, bint pos_wide, uint8_t *mask, void *labels, int64_t ignore_id,
                          bint mask_boundaries, int32_t *cu, int64_t *longest, const void *lvals=*,
                          bint same=*) noexcept nogil

# Positions (pos, optional: NULL) and next-token labels (optional: NULL, ignore_id at each
# document's last token) of k documents of lens[d] tokens laid back to back in `tokens`.
cdef void zb_flat_layout(const void *tokens, bint wide, const int64_t *lens, int64_t k, void *pos, bint pos_wide,
                         void *labels, int64_t ignore_id) noexcept nogil
