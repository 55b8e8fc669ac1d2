# C-level ZRECORD kernels (implemented in _zrecord.h): seqlocked entry snapshots, record checks,
# copies and inflate. No Python object, no allocation the caller does not own, no callback;
# status codes from _status.h.

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

cdef extern from "_zrecord.h" nogil:
    ctypedef struct zr_entry:
        uint32_t chunk
        uint64_t offset
        uint32_t length

    # Where the chunks are mapped: base[c] NULL when chunk c is not mapped; `mapped` entries;
    # `committed` chunks exist in the committed state. A chunk is published base first, then
    # size (release); kernels load size, then base (acquire).
    ctypedef struct zr_chunkmap:
        const uint8_t *const *base
        const uint64_t *size
        uint64_t mapped
        uint64_t committed
        uint64_t first

    # One task: check (and copy or inflate) `count` records of one field.
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
        uint64_t key
        uint64_t *payload
        int64_t *lens
        uint8_t *out
        const uint64_t *out_off
        int fill_only
        int status
        int64_t bad
        uint64_t need_chunk

    # The entries of `nf` fields for `n` indices, all of one committed state (the commit
    # file's seqlock), each checked against its CRC-32 XOR key32 (the folded store key).
    # pre:  tables[k] / checks[k] hold table_entries[k] entries / checks of field number
    #       field_nos[k]; out has room for n * nf entries.
    # post: ZB_OK (out filled, *length and *num_chunks the state's); ZB_RETRY (a writer was
    #       committing: call again); ZB_STALE (another epoch, or flags: reopen); ZB_NEED_TABLE
    #       (*bad = the field whose table is too short); ZB_E_INDEX (*bad = position in idx);
    #       ZB_E_CHECKSUM (*bad = position * nf + field of the entry that fails its check).
    int zr_snapshot(const uint8_t *commit, uint64_t epoch, const uint8_t *const *tables,
                    const uint8_t *const *checks, const uint32_t *field_nos,
                    const uint64_t *table_entries, int64_t nf, const int64_t *idx, int64_t n,
                    uint32_t key32, zr_entry *out, uint64_t *length, uint64_t *num_chunks, int64_t *bad)

    # Check `j.count` records: the chunk is live (in [first, committed)) and holds the entry,
    # the container's magic, checksum XOR j.key (verify), codec, field number and lengths (a
    # flate record declares at most 1032x its stored bytes, and one of length 0 must hold an
    # empty stream ending exactly); copy or inflate into j.out.
    # post: ZB_OK (payload offsets and logical lengths set, -1 for an absent record);
    #       ZB_NEED_CHUNK (j.need_chunk not mapped or mapped too short: map it, call again);
    #       ZB_E_FIELD / ZB_E_MAGIC / ZB_E_CHECKSUM / ZB_E_LIMIT / ZB_E_OVERFLOW with
    #       j.bad the record at fault; ZB_E_NOMEM / ZB_E_IO (inflate could not start).
    int zr_job_run(zr_job *j)

    # Publish chunk c's mapping (base, then size; release stores).
    void zr_publish_chunk(const uint8_t **base_slot, uint64_t *size_slot, const uint8_t *base,
                          uint64_t size)
