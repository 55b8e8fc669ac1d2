/* ZRECORD gather kernels: seqlocked offset-table snapshots, record checks, copies and inflate.
 *
 * Everything here runs without the GIL and touches no Python object. Status codes are those
 * of _status.pxd, plus four internal ones the Python wrapper acts on and retries
 * (ZB_RETRY, ZB_STALE, ZB_NEED_TABLE, ZB_NEED_CHUNK); they never reach a caller.
 */
#ifndef ZB_ZRECORD_H
#define ZB_ZRECORD_H

#include <stdint.h>
#include <string.h>
#include <zlib.h>

#include "_status.h"

#define ZR_HEADER 16
#define ZR_MAGIC 0x5A

/* One offset-table entry as stored (16 bytes, little-endian, unaligned in the table). */
typedef struct __attribute__((packed)) {
    uint32_t chunk;
    uint64_t offset;
    uint32_t length;
} zr_entry;

static inline uint64_t zr_ld64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t zr_ld32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t zr_ld16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* The commit file: seq at 16, flags at 12, length at 24, num_chunks at 32, epoch at 48. */
static inline uint64_t zr_seq(const uint8_t *commit) {
    return __atomic_load_n((const uint64_t *)(commit + 16), __ATOMIC_ACQUIRE);
}

/* Copy the entries of `nf` fields for `n` indices under the commit file's seqlock, each
 * checked against its CRC-32 (over the entry, its index u64 and field number u32) XOR
 * `key32` (the store key folded to 32 bits: a table of another store fails).
 * pre:  tables[k] / checks[k] map table_entries[k] entries / checks of field k (number
 *       field_nos[k]); idx has n values (negative
 *       ones count from the end); out has room for n * nf entries.
 * post: ZB_OK with out[i * nf + k] the entry of index idx[i] in field k, *length and
 *       *num_chunks the committed values they belong to; ZB_RETRY (seq odd or changed:
 *       call again), ZB_STALE (epoch differs from `epoch`, or flags set: reopen, which
 *       checks the commit file), ZB_NEED_TABLE
 *       (*bad = field), ZB_E_INDEX (*bad = position in idx), ZB_E_CHECKSUM (an entry
 *       disagrees with its check: *bad = position * nf + field). */
static int zr_snapshot(const uint8_t *commit, uint64_t epoch, const uint8_t *const *tables,
                       const uint8_t *const *checks, const uint32_t *field_nos,
                       const uint64_t *table_entries, int64_t nf, const int64_t *idx, int64_t n,
                       uint32_t key32, zr_entry *out, uint64_t *length, uint64_t *num_chunks,
                       int64_t *bad) {
    uint64_t s1 = zr_seq(commit);
    if (s1 & 1) return ZB_RETRY;
    uint32_t flags = __atomic_load_n((const uint32_t *)(commit + 12), __ATOMIC_ACQUIRE);
    uint64_t len = __atomic_load_n((const uint64_t *)(commit + 24), __ATOMIC_ACQUIRE);
    uint64_t nch = __atomic_load_n((const uint64_t *)(commit + 32), __ATOMIC_ACQUIRE);
    uint64_t ep = __atomic_load_n((const uint64_t *)(commit + 48), __ATOMIC_ACQUIRE);
    int status = ZB_OK;
    if (flags != 0 || ep != epoch) return ZB_STALE;
    for (int64_t k = 0; k < nf; k++)
        if (len > table_entries[k]) { *bad = k; status = ZB_NEED_TABLE; goto check; }
    for (int64_t i = 0; i < n; i++) {
        int64_t j = idx[i];
        if (j < 0) j += (int64_t)len;
        if (j < 0 || (uint64_t)j >= len) { *bad = i; status = ZB_E_INDEX; goto check; }
        for (int64_t k = 0; k < nf; k++) {
            uint8_t buf[28];
            uint64_t jj = (uint64_t)j;
            memcpy(buf, tables[k] + jj * 16u, 16);
            memcpy(buf + 16, &jj, 8);
            memcpy(buf + 24, &field_nos[k], 4);
            memcpy(&out[i * nf + k], buf, 16);
            if (((uint32_t)crc32(0L, buf, 28) ^ key32) != zr_ld32(checks[k] + jj * 4u)) {
                *bad = i * nf + k;
                status = ZB_E_CHECKSUM;
                goto check;
            }
        }
    }
check:
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (zr_seq(commit) != s1) return ZB_RETRY;
    *length = len;
    *num_chunks = nch;
    return status;
}

/* Where the chunks are mapped. base[c] NULL: not mapped. */
typedef struct {
    const uint8_t *const *base;
    const uint64_t *size;
    uint64_t mapped;      /* entries of base / size */
    uint64_t committed;   /* chunks that exist in the committed state */
    uint64_t first;       /* the first live chunk: those below were retired by a rebalance */
} zr_chunkmap;

/* A chunk's mapping is published base first, then size (both release); a kernel loads the
 * size first, then the base (both acquire). A mapping is only ever replaced by a larger one
 * of the same file and the old one stays mapped while the gather object lives, so whatever
 * pair a kernel sees, the base covers the size. */
static inline void zr_publish_chunk(const uint8_t **base_slot, uint64_t *size_slot,
                                    const uint8_t *base, uint64_t size) {
    __atomic_store_n(base_slot, base, __ATOMIC_RELEASE);
    __atomic_store_n(size_slot, size, __ATOMIC_RELEASE);
}

/* One task: check (and copy or inflate) `count` records of one field. */
typedef struct {
    const zr_chunkmap *cm;
    const zr_entry *entries;   /* entry of record i at entries[i * stride] */
    int64_t stride;
    int64_t count;
    uint32_t field_no;
    uint32_t codec;            /* 0 raw, 1 flate */
    int verify;
    uint64_t fixed_len;        /* bytes of a fixed-shape record, 0 variable */
    uint64_t max_len;          /* largest logical length accepted */
    uint64_t itemsize;         /* a logical length must be a multiple of it */
    uint64_t (*hash)(const uint8_t *, uint64_t);
    uint64_t key;              /* the store key, XORed into every record's checksum */
    /* outputs of the check */
    uint64_t *payload;         /* chunk offset of the payload, per record */
    int64_t *lens;             /* logical length, -1 for an absent record */
    /* the fill: out + i * fixed_len (fixed) or out + out_off[i] (variable), NULL: no fill */
    uint8_t *out;
    const uint64_t *out_off;
    int fill_only;             /* the check ran already: only inflate */
    /* result */
    int status;
    int64_t bad;               /* position of the failing record */
    uint64_t need_chunk;
} zr_job;

/* Inflate the raw deflate stream src[0, n) into dst, which must receive exactly m bytes, the
 * stream ending exactly at src + n. `slack` spare bytes of room after the m (a record of
 * logical length 0 passes a 1-byte scratch with m = 0, slack = 1) let a stream that holds
 * more than it declares be told apart from one that ends. */
static int zr_inflate(z_stream *zs, int *zs_ready, const uint8_t *src, uint64_t n, uint8_t *dst,
                      uint64_t m, uint32_t slack) {
    if (!*zs_ready) {
        memset(zs, 0, sizeof(*zs));
        if (inflateInit2(zs, -15) != Z_OK) return ZB_E_NOMEM;
        *zs_ready = 1;
    } else if (inflateReset(zs) != Z_OK) {
        return ZB_E_IO;
    }
    zs->next_in = (Bytef *)src;
    zs->avail_in = (uInt)n;
    zs->next_out = dst;
    zs->avail_out = (uInt)m + slack;
    int r = inflate(zs, Z_FINISH);
    if (r != Z_STREAM_END || zs->avail_out != slack || zs->avail_in != 0) return ZB_E_FIELD;
    return ZB_OK;
}

/* The most bytes a raw deflate stream of `stored` bytes can inflate to (deflate's largest
 * ratio is 1032:1): a record declaring more is damage, refused before any allocation. */
static inline uint64_t zr_inflate_bound(uint64_t stored) { return stored * 1032u + 1024u; }

static int zr_job_run(zr_job *j) {
    const zr_chunkmap *cm = j->cm;
    z_stream zs;
    int zs_ready = 0;
    int status = ZB_OK;
    for (int64_t i = 0; i < j->count; i++) {
        const zr_entry *e = &j->entries[i * j->stride];
        uint8_t *dst = NULL;
        if (j->out != NULL)
            dst = j->fixed_len ? j->out + (uint64_t)i * j->fixed_len : j->out + j->out_off[i];
        if (j->fill_only) {
            if (j->lens[i] <= 0 || j->codec == 0) continue;
            const uint8_t *p = __atomic_load_n(&cm->base[e->chunk], __ATOMIC_ACQUIRE) + j->payload[i];
            status = zr_inflate(&zs, &zs_ready, p, e->length - ZR_HEADER, dst, (uint64_t)j->lens[i], 0);
            if (status != ZB_OK) { j->bad = i; break; }
            continue;
        }
        if (e->length == 0) {
            j->lens[i] = -1;
            j->payload[i] = 0;
            if (dst != NULL && j->fixed_len) memset(dst, 0, j->fixed_len);
            continue;
        }
        if ((uint64_t)e->chunk >= cm->committed || (uint64_t)e->chunk < cm->first) {
            status = ZB_E_FIELD; j->bad = i; break;
        }
        if ((uint64_t)e->chunk >= cm->mapped) {
            status = ZB_NEED_CHUNK; j->need_chunk = e->chunk; j->bad = i; break;
        }
        uint64_t csize = __atomic_load_n(&cm->size[e->chunk], __ATOMIC_ACQUIRE);
        const uint8_t *cbase = __atomic_load_n(&cm->base[e->chunk], __ATOMIC_ACQUIRE);
        if (cbase == NULL) { status = ZB_NEED_CHUNK; j->need_chunk = e->chunk; j->bad = i; break; }
        if (e->length < ZR_HEADER || (e->offset & 15u) != 0) { status = ZB_E_FIELD; j->bad = i; break; }
        if (e->offset > UINT64_MAX - e->length) { status = ZB_E_OVERFLOW; j->bad = i; break; }
        if (e->offset + e->length > csize) {
            status = ZB_NEED_CHUNK; j->need_chunk = e->chunk; j->bad = i; break;
        }
        const uint8_t *h = cbase + e->offset;
        uint64_t stored = (uint64_t)e->length - ZR_HEADER;
        uint32_t logical = zr_ld32(h + 8);
        if (h[13] != ZR_MAGIC) { status = ZB_E_MAGIC; j->bad = i; break; }
        if (j->verify && (j->hash(h + 8, (uint64_t)e->length - 8) ^ j->key) != zr_ld64(h)) {
            status = ZB_E_CHECKSUM; j->bad = i; break;
        }
        if (h[12] != j->codec || zr_ld16(h + 14) != j->field_no) { status = ZB_E_FIELD; j->bad = i; break; }
        if (j->codec == 0 && logical != stored) { status = ZB_E_FIELD; j->bad = i; break; }
        if (j->fixed_len && logical != j->fixed_len) { status = ZB_E_FIELD; j->bad = i; break; }
        if (logical > j->max_len) { status = ZB_E_LIMIT; j->bad = i; break; }
        if (j->codec == 1 && logical > zr_inflate_bound(stored)) { status = ZB_E_FIELD; j->bad = i; break; }
        if (j->codec == 1 && logical == 0) {
            uint8_t scratch[1];   /* an empty record's stream must inflate to nothing, and end */
            status = zr_inflate(&zs, &zs_ready, h + ZR_HEADER, stored, scratch, 0, 1);
            if (status != ZB_OK) { j->bad = i; break; }
        }
        if (j->itemsize > 1 && logical % j->itemsize) { status = ZB_E_FIELD; j->bad = i; break; }
        j->lens[i] = logical;
        j->payload[i] = e->offset + ZR_HEADER;
        if (dst == NULL) continue;
        if (j->codec == 0) {
            memcpy(dst, h + ZR_HEADER, logical);
        } else {
            status = zr_inflate(&zs, &zs_ready, h + ZR_HEADER, stored, dst, logical, 0);
            if (status != ZB_OK) { j->bad = i; break; }
        }
    }
    if (zs_ready) inflateEnd(&zs);
    j->status = status;
    return status;
}

#endif
