# C-level TOKSTREAM kernels: token windows that may span shards, their document boundaries
# and metadata ids. No Python object, no callback, no state but the caller's; status codes
# from _status.h. The vectorized copy loops are in _tokstream.h (one clone per ISA).

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

cdef extern from "_tokstream.h" nogil:
    void zb_ts_fill_segment(int64_t *p64, int32_t *p32, int32_t *seg, int64_t n, int32_t segno)
    void zb_ts_prefetch(const uint8_t *p, int64_t nbytes)
    uint32_t zb_ts_copy_u16_i64(const uint8_t *src, int64_t stride, int64_t *dst, int64_t n)
    uint32_t zb_ts_copy_u16_i32(const uint8_t *src, int64_t stride, int32_t *dst, int64_t n)
    uint32_t zb_ts_copy_u32_i64(const uint8_t *src, int64_t stride, int64_t *dst, int64_t n)
    uint32_t zb_ts_copy_u32_i32(const uint8_t *src, int64_t stride, int32_t *dst, int64_t n)
    uint32_t zb_ts_mask_u16_i64(const uint8_t *src, int64_t stride, const int64_t *tok, int64_t *dst, int64_t n,
                                int64_t ignore)
    uint32_t zb_ts_mask_u16_i32(const uint8_t *src, int64_t stride, const int32_t *tok, int32_t *dst, int64_t n,
                                int32_t ignore)
    uint32_t zb_ts_mask_u32_i64(const uint8_t *src, int64_t stride, const int64_t *tok, int64_t *dst, int64_t n,
                                int64_t ignore)
    uint32_t zb_ts_mask_u32_i32(const uint8_t *src, int64_t stride, const int32_t *tok, int32_t *dst, int64_t n,
                                int32_t ignore)
    # The distinct (shard, metadata id) pairs of a batch, in order of first appearance.
    ctypedef struct zb_ts_distinct:
        int64_t n
        int64_t *shard
        uint32_t *mid
        uint32_t *raw
    int zb_ts_distinct_init(zb_ts_distinct *d)
    void zb_ts_distinct_free(zb_ts_distinct *d)
    int zb_ts_meta_simd
    int zb_ts_meta_simd_available()
    int64_t zb_ts_meta_piece(const uint8_t *src, int token_size, int64_t *dst64, int32_t *dst32, int32_t *ids,
                             int64_t n, int64_t shard, int64_t nmeta, zb_ts_distinct *d, uint64_t vocab,
                             uint32_t *vmax)

# Which checksum blocks of every shard's tokens.bin were checked, and what to check them
# against (a BlockChecks object owns the arrays). The kernels mark a block after its bytes
# hash to its digest (an atomic 0 -> 1 of its byte; only the thread that flips it counts it
# off `pending`), and a shard's digest list is itself checked once against the manifest's
# checksum of tokens.bin before its first digest is used. Data files are never rewritten, so
# a block checked once by any thread stays checked for every thread.
cdef struct zb_ts_checks:
    uint8_t **maps              # per shard: one byte per block, non-zero once checked
    const uint8_t **digests     # per shard: the block digests of tokens.bin (little-endian u64)
    const uint64_t *list_hash   # per shard: XXH3-64 the digest list must hash to (the manifest's)
    uint8_t *lists              # per shard: non-zero once its digest list matched list_hash
    const int64_t *nblocks      # per shard: blocks of tokens.bin (digests in its list)
    int64_t *pending            # blocks not yet checked, over every shard
    int shift                   # log2 of the block size

# Where a dataset's tokens are: one descriptor per call (the caller's arrays; nothing here is
# owned or changed by the kernels but the error fields and, with `checks`, its marks).
cdef struct zb_ts_geometry:
    const uint8_t **bases       # mmap: the mapped tokens.bin of each shard (NULL: read through fds)
    const int *fds              # pread: the tokens.bin descriptor of each shard
    const int64_t *cum          # cumulative token counts, num_shards + 1 entries from 0
    int64_t num_shards
    int64_t itemsize            # bytes per record (2, 4, 6 or 8)
    int64_t token_size          # bytes of the token field (2 or 4), first in each record
    uint64_t vocab              # token ids must be below it
    const uint64_t **docs       # per shard: documents.index (D_s + 1 entries), or NULL
    const int64_t *ndocs        # per shard: D_s
    const int64_t *nmeta        # per shard: metadata blobs (ids must be below), or NULL
    zb_ts_checks *checks        # check each block a read touches on its first read, or NULL
    # set on failure
    int64_t bad_pos             # ZB_E_FIELD: the global position of the bad token or metadata id
    int bad_field               # ZB_E_FIELD: 0 a token id >= vocab, 1 a metadata id >= nmeta
    int err_errno               # ZB_E_IO: the failing call's errno
    int64_t err_shard           # ZB_E_IO / ZB_E_TRUNCATED / ZB_E_CHECKSUM: the shard
    int64_t bad_block           # ZB_E_CHECKSUM: the block (-1: the shard's digest list)
    uint64_t bad_got            # ZB_E_CHECKSUM: the digest computed
    uint64_t bad_want           # ZB_E_CHECKSUM: the digest expected

# The document-boundary outputs of a batch, filled window by window.
cdef struct zb_ts_bounds:
    int64_t length              # tokens per window they cover (at most the window's length)
    int64_t *pos64
    int32_t *pos32
    int32_t *seg
    int32_t *cu
    int64_t nseg
    int64_t maxlen

# The labels of a batch of windows, written right after each window's tokens: window w's
# labels are its tokens [shift, length) (count x (length - shift) values of the tokens'
# width, at `out`), set to `ignore` where the 0/1 stream `m` is 0 at their positions. `m` is
# the geometry of a second dataset of the same cum (a loss mask: a value per token), read in
# the same pass: its checksum blocks checked as the tokens' are, its values checked against
# its vocabulary; NULL for labels that copy the tokens.
cdef struct zb_ts_labels:
    zb_ts_geometry *m
    void *out
    int64_t shift               # 0 or 1 (the next token)
    int64_t ignore
    uint8_t *scratch            # the stream's pread buffer (set by zb_ts_windows)
    int failed                  # set on failure: the error fields are m's, not the tokens'

# Copy the windows [starts[w], starts[w] + length) into out64 or out32 (count * length values;
# one of them non-NULL, or both NULL with `ids` to number metadata only), reading across as
# many shards as a window spans.
# pre:  the geometry is consistent (the wrapper checked it); with `ids` (count * length
#       int32) and `d`, each token's metadata id is numbered in the same pass: the index of
#       its (shard, id) among d's distinct pairs in order of first appearance, -1 for none;
#       with `bounds`, each window's boundary outputs are written right after its tokens;
#       with `labels`, each window's labels (zb_ts_labels) right after its tokens (out64 or
#       out32 non-NULL).
#       With g.checks, every checksum block under a piece not yet marked is hashed and
#       compared with its digest before the piece is copied (and marked when it matches).
# post: ZB_OK; ZB_E_INDEX (a window outside [0, total): out unspecified); ZB_E_FIELD (bad_pos,
#       bad_field); ZB_E_IO (err_errno, err_shard) or ZB_E_TRUNCATED (err_shard) from a
#       pread; ZB_E_CHECKSUM (err_shard, bad_block, bad_got, bad_want: the block stays
#       unmarked); ZB_E_NOMEM. An error of the labels' stream sets labels.failed and the
#       error fields of labels.m instead of g's.
cdef int zb_ts_windows(zb_ts_geometry *g, const int64_t *starts, int64_t count, int64_t length,
                       int64_t *out64, int32_t *out32, int32_t *ids=*, zb_ts_distinct *d=*,
                       zb_ts_bounds *bounds=*, zb_ts_labels *labels=*) noexcept nogil

# The document boundaries inside windows whose range was checked: each window is cut at every
# document start inside it (a shard start is a document start); positions restart at 0 at
# each segment, segment ids count a window's segments from 0, cu receives the flattened
# segment starts followed by count * length.
cdef void zb_ts_boundaries(const zb_ts_geometry *g, const int64_t *starts, int64_t count,
                           zb_ts_bounds *b) noexcept nogil

# The (shard, chunk) pairs of tokens.bin that the ranges [starts[i], stops[i]) (stops NULL:
# [starts[i], starts[i] + length)) touch and checked[shard] does not mark (byte chunk of
# 2**chunk_shift), at most cap, as miss[2k], miss[2k + 1], each listed once. Ranges outside
# [0, total) are skipped (the gather that follows refuses them). Returns the count.
cdef int64_t zb_ts_unchecked(const zb_ts_geometry *g, const uint8_t *const *checked, int chunk_shift,
                             const int64_t *starts, const int64_t *stops, int64_t count, int64_t length,
                             int64_t *miss, int64_t cap) noexcept nogil
