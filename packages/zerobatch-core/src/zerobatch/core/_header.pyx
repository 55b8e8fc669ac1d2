# LLMBATCH header: parse, validate, pack.
#
# Contract
#   zb_llmbatch_parse(buf, n, file_size, h)
#     pre:  buf holds n = min(file_size, 4096) readable bytes, the start of the file.
#     post: ZB_OK and every field of h filled, the derived sizes valid and consistent with
#           file_size; or an error status with h.bad_field naming the field at fault.
#     Checks, in order: header length, magic, version, dtype, extension (header hash, then
#     ext version, flags, hash algorithm, reserved bytes) or all-zero reserved bytes,
#     batch_size / seq_len (non-zero, limits), batch bytes (limit, 64-bit overflow), batch
#     count against the real file size (division form: never a product of header fields),
#     trailer position and size, exact file size.
#     Status: ZB_E_TRUNCATED, ZB_E_MAGIC, ZB_E_VERSION, ZB_E_DTYPE, ZB_E_FLAGS, ZB_E_FIELD,
#             ZB_E_LIMIT, ZB_E_OVERFLOW, ZB_E_SIZE, ZB_E_RESERVED, ZB_E_CHECKSUM.
#   zb_llmbatch_geometry(batch_size, seq_len, raw, padded, bad_field)
#     post: ZB_OK with raw = batch_size*seq_len*4 and padded = raw rounded up to 4096;
#           ZB_E_FIELD for a zero, ZB_E_LIMIT above MAX_BATCH_SIZE / MAX_SEQ_LEN /
#           MAX_BATCH_BYTES.
#   zb_llmbatch_pack(h, out)
#     pre:  out has 4096 writable bytes; h's fields are valid.
#     post: out holds the header; with h.has_ext, the extension and its header hash.

from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

from zerobatch.core._endian cimport zb_load_u32le, zb_load_u64le, zb_store_u32le, zb_store_u64le
from zerobatch.core._hash cimport zb_xxh3_64
from zerobatch.core._layout cimport *
from zerobatch.core._status cimport *
from zerobatch.core._types cimport zb_add_u64, zb_mul_u64

from zerobatch.core._header_common import (FIELD_NAMES, check_uint, geometry_message,
                                           header_from_fields, pack_fields, parse_message)
from zerobatch.core.status import raise_for_status
from zerobatch.formats.errors import ConfigError

__all__ = ["llmbatch_geometry", "pack_llmbatch_header", "parse_llmbatch_header"]

# Index of each field name in FIELD_NAMES; h.bad_field holds one of these.
cdef enum:
    F_HEADER = 0
    F_MAGIC = 1
    F_VERSION = 2
    F_BATCH_SIZE = 3
    F_SEQ_LEN = 4
    F_NUM_BATCHES = 5
    F_DTYPE = 6
    F_SEED = 7
    F_TOTAL_RECORDS = 8
    F_RESERVED = 9
    F_EXT_VERSION = 10
    F_EXT_FLAGS = 11
    F_HASH_ALGO = 12
    F_MAX_TOKEN = 13
    F_TRAILER_OFFSET = 14
    F_TRAILER_SIZE = 15
    F_TRAILER_HASH = 16
    F_BUILD_ID = 17
    F_HEADER_HASH = 18
    F_FILE_SIZE = 19
    F_BATCH_BYTES = 20


cdef inline bint _all_zero(const uint8_t *p, uint64_t n) noexcept nogil:
    cdef uint64_t i
    cdef uint8_t acc = 0
    for i in range(n):
        acc |= p[i]
    return acc == 0


cdef int zb_llmbatch_geometry(uint64_t batch_size, uint64_t seq_len,
                              uint64_t *raw, uint64_t *padded, int *bad_field) noexcept nogil:
    cdef uint64_t tokens, nbytes
    if batch_size == 0:
        bad_field[0] = F_BATCH_SIZE
        return ZB_E_FIELD
    if seq_len == 0:
        bad_field[0] = F_SEQ_LEN
        return ZB_E_FIELD
    if batch_size > LLMBATCH_MAX_BATCH_SIZE:
        bad_field[0] = F_BATCH_SIZE
        return ZB_E_LIMIT
    if seq_len > LLMBATCH_MAX_SEQ_LEN:
        bad_field[0] = F_SEQ_LEN
        return ZB_E_LIMIT
    if zb_mul_u64(batch_size, seq_len, &tokens) or \
            zb_mul_u64(tokens, LLMBATCH_TOKEN_ITEMSIZE, &nbytes):
        bad_field[0] = F_BATCH_BYTES
        return ZB_E_OVERFLOW
    if nbytes > LLMBATCH_MAX_BATCH_BYTES:
        bad_field[0] = F_BATCH_BYTES
        return ZB_E_LIMIT
    raw[0] = nbytes
    # nbytes <= 2**34, so the round-up cannot overflow.
    padded[0] = (nbytes + LLMBATCH_ALIGNMENT - 1) // LLMBATCH_ALIGNMENT * LLMBATCH_ALIGNMENT
    return ZB_OK


cdef int zb_llmbatch_parse(const uint8_t *buf, uint64_t n, uint64_t file_size,
                           zb_llmbatch_header *h) noexcept nogil:
    cdef int status
    cdef uint64_t available, slot, data_size, data_end, checksum_bytes
    memset(h, 0, sizeof(zb_llmbatch_header))
    h.file_size = file_size
    if n < LLMBATCH_HEADER_SIZE or file_size < LLMBATCH_HEADER_SIZE:
        h.bad_field = F_HEADER
        return ZB_E_TRUNCATED
    if memcmp(buf + LLMBATCH_OFF_MAGIC, LLMBATCH_MAGIC, 8) != 0:
        h.bad_field = F_MAGIC
        return ZB_E_MAGIC
    h.version = zb_load_u32le(buf + LLMBATCH_OFF_VERSION)
    h.batch_size = zb_load_u32le(buf + LLMBATCH_OFF_BATCH_SIZE)
    h.seq_len = zb_load_u32le(buf + LLMBATCH_OFF_SEQ_LEN)
    h.num_batches = zb_load_u64le(buf + LLMBATCH_OFF_NUM_BATCHES)
    h.dtype = zb_load_u32le(buf + LLMBATCH_OFF_DTYPE)
    h.seed = zb_load_u32le(buf + LLMBATCH_OFF_SEED)
    h.total_records = zb_load_u32le(buf + LLMBATCH_OFF_TOTAL_RECORDS)
    if h.version != LLMBATCH_VERSION:
        h.bad_field = F_VERSION
        return ZB_E_VERSION
    if h.dtype != LLMBATCH_DTYPE_UINT32:
        h.bad_field = F_DTYPE
        return ZB_E_DTYPE

    if memcmp(buf + LLMBATCH_OFF_EXT_MAGIC, LLMBATCH_EXT_MAGIC, 8) == 0:
        h.has_ext = True
        h.header_hash = zb_load_u64le(buf + LLMBATCH_OFF_HEADER_HASH)
        h.computed_header_hash = zb_xxh3_64(buf, LLMBATCH_OFF_HEADER_HASH)
        h.ext_version = zb_load_u32le(buf + LLMBATCH_OFF_EXT_VERSION)
        h.ext_flags = zb_load_u32le(buf + LLMBATCH_OFF_EXT_FLAGS)
        h.hash_algo = zb_load_u32le(buf + LLMBATCH_OFF_HASH_ALGO)
        h.max_token = zb_load_u32le(buf + LLMBATCH_OFF_MAX_TOKEN)
        h.trailer_offset = zb_load_u64le(buf + LLMBATCH_OFF_TRAILER_OFFSET)
        h.trailer_size = zb_load_u64le(buf + LLMBATCH_OFF_TRAILER_SIZE)
        h.trailer_hash = zb_load_u64le(buf + LLMBATCH_OFF_TRAILER_HASH)
        memcpy(h.build_id, buf + LLMBATCH_OFF_BUILD_ID, LLMBATCH_BUILD_ID_SIZE)
        # The hash first: a flipped bit anywhere in the header is an integrity error, whatever
        # field it lands in.
        if h.header_hash != h.computed_header_hash:
            h.bad_field = F_HEADER_HASH
            return ZB_E_CHECKSUM
        if h.ext_version != LLMBATCH_EXT_VERSION:
            h.bad_field = F_EXT_VERSION
            return ZB_E_VERSION
        if h.ext_flags & ~(<uint32_t>LLMBATCH_EXT_FLAGS_KNOWN):
            h.bad_field = F_EXT_FLAGS
            return ZB_E_FLAGS
        if h.hash_algo != LLMBATCH_HASH_ALGO_XXH3_64:
            h.bad_field = F_HASH_ALGO
            return ZB_E_VERSION
        if not _all_zero(buf + LLMBATCH_EXT_RESERVED_START,
                         LLMBATCH_OFF_HEADER_HASH - LLMBATCH_EXT_RESERVED_START):
            h.bad_field = F_RESERVED
            return ZB_E_RESERVED
        if not (h.ext_flags & LLMBATCH_EXT_FLAG_MAX_TOKEN) and h.max_token != 0:
            h.bad_field = F_MAX_TOKEN
            return ZB_E_FIELD
    else:
        if not _all_zero(buf + LLMBATCH_OFF_RESERVED,
                         LLMBATCH_HEADER_SIZE - LLMBATCH_OFF_RESERVED):
            h.bad_field = F_RESERVED
            return ZB_E_RESERVED

    status = zb_llmbatch_geometry(h.batch_size, h.seq_len, &h.raw_batch_bytes,
                                  &h.padded_batch_bytes, &h.bad_field)
    if status != ZB_OK:
        return status

    # Bytes each batch costs in this file: its slot, plus its checksum in the trailer.
    checksum_bytes = LLMBATCH_CHECKSUM_SIZE if (h.ext_flags & LLMBATCH_EXT_FLAG_BATCH_CHECKSUMS) else 0
    slot = h.padded_batch_bytes + checksum_bytes
    available = file_size - LLMBATCH_HEADER_SIZE
    # Division form: the claimed count is compared before any product is formed.
    if h.num_batches > available // slot:
        h.bad_field = F_NUM_BATCHES
        return ZB_E_TRUNCATED
    data_size = h.num_batches * h.padded_batch_bytes
    data_end = LLMBATCH_HEADER_SIZE + data_size
    h.data_end = data_end
    h.expected_file_size = data_end + h.num_batches * checksum_bytes

    if h.has_ext:
        if h.trailer_offset != data_end:
            h.bad_field = F_TRAILER_OFFSET
            return ZB_E_FIELD
        if h.trailer_size != h.num_batches * checksum_bytes:
            h.bad_field = F_TRAILER_SIZE
            return ZB_E_FIELD
        if checksum_bytes == 0 and h.trailer_hash != 0:
            h.bad_field = F_TRAILER_HASH
            return ZB_E_FIELD
    if file_size != h.expected_file_size:
        h.bad_field = F_FILE_SIZE
        return ZB_E_SIZE
    return ZB_OK


cdef void zb_llmbatch_pack(const zb_llmbatch_header *h, uint8_t *out) noexcept nogil:
    memset(out, 0, LLMBATCH_HEADER_SIZE)
    memcpy(out + LLMBATCH_OFF_MAGIC, LLMBATCH_MAGIC, 8)
    zb_store_u32le(out + LLMBATCH_OFF_VERSION, LLMBATCH_VERSION)
    zb_store_u32le(out + LLMBATCH_OFF_BATCH_SIZE, h.batch_size)
    zb_store_u32le(out + LLMBATCH_OFF_SEQ_LEN, h.seq_len)
    zb_store_u64le(out + LLMBATCH_OFF_NUM_BATCHES, h.num_batches)
    zb_store_u32le(out + LLMBATCH_OFF_DTYPE, LLMBATCH_DTYPE_UINT32)
    zb_store_u32le(out + LLMBATCH_OFF_SEED, h.seed)
    zb_store_u32le(out + LLMBATCH_OFF_TOTAL_RECORDS, h.total_records)
    if not h.has_ext:
        return
    memcpy(out + LLMBATCH_OFF_EXT_MAGIC, LLMBATCH_EXT_MAGIC, 8)
    zb_store_u32le(out + LLMBATCH_OFF_EXT_VERSION, LLMBATCH_EXT_VERSION)
    zb_store_u32le(out + LLMBATCH_OFF_EXT_FLAGS, h.ext_flags)
    zb_store_u32le(out + LLMBATCH_OFF_HASH_ALGO, LLMBATCH_HASH_ALGO_XXH3_64)
    zb_store_u32le(out + LLMBATCH_OFF_MAX_TOKEN, h.max_token)
    zb_store_u64le(out + LLMBATCH_OFF_TRAILER_OFFSET, h.trailer_offset)
    zb_store_u64le(out + LLMBATCH_OFF_TRAILER_SIZE, h.trailer_size)
    zb_store_u64le(out + LLMBATCH_OFF_TRAILER_HASH, h.trailer_hash)
    memcpy(out + LLMBATCH_OFF_BUILD_ID, h.build_id, LLMBATCH_BUILD_ID_SIZE)
    zb_store_u64le(out + LLMBATCH_OFF_HEADER_HASH, zb_xxh3_64(out, LLMBATCH_OFF_HEADER_HASH))


# ---------------------------------------------------------------------------------------------
# Python wrappers


cdef dict _fields(const zb_llmbatch_header *h):
    cdef dict f = h[0]
    f["build_id"] = bytes(h.build_id[:LLMBATCH_BUILD_ID_SIZE])
    return f


def parse_llmbatch_header(buf, file_size, *, path=None):
    """Parse and validate an LLMBATCH header against the file's real size.

    Args:
        buf: the first ``min(file_size, 4096)`` bytes of the file (any buffer).
        file_size: the file's size in bytes, from ``fstat``.
        path: the file's name, for error messages.

    Returns:
        A :class:`zerobatch.formats.llmbatch.LLMBatchHeader`.

    Raises:
        TruncatedError: the file is shorter than its header or than the batches it claims.
        CorruptError: bad magic, a zero or inconsistent field, non-zero reserved bytes, or
            bytes after the last batch.
        IntegrityError: the header checksum does not match.
        UnsupportedVersionError: unknown version, dtype, extension version, flag or hash.
        LimitExceededError: a batch larger than ``MAX_BATCH_BYTES`` or dimensions above 2**31-1.
    """
    cdef const uint8_t[::1] view = memoryview(buf).cast("B") if len(buf) else b"\0"
    cdef uint64_t n = len(buf)
    cdef zb_llmbatch_header h
    if isinstance(file_size, bool) or file_size < 0:
        raise ConfigError(f"file_size must be an integer >= 0, got {file_size!r}", field="file_size")
    cdef uint64_t fsize = file_size
    cdef int status
    if n > LLMBATCH_HEADER_SIZE:
        n = LLMBATCH_HEADER_SIZE
    with nogil:
        status = zb_llmbatch_parse(&view[0], n, fsize, &h)
    fields = _fields(&h)
    if status != ZB_OK:
        raise_for_status(status, parse_message(status, fields), path=path,
                         field=FIELD_NAMES[h.bad_field])
    return header_from_fields(fields)


def llmbatch_geometry(batch_size, seq_len):
    """Bytes of one batch and of its page-aligned slot.

    Args:
        batch_size: samples per batch, 1 to 2**31-1.
        seq_len: tokens per sample, 1 to 2**31-1.

    Returns:
        ``(raw_batch_bytes, padded_batch_bytes)``.

    Raises:
        ConfigError: a dimension is 0, negative or not an integer.
        LimitExceededError: a dimension above 2**31-1, or a batch above ``MAX_BATCH_BYTES``.
    """
    bs = check_uint(batch_size, "batch_size", 2**32 - 1)
    sl = check_uint(seq_len, "seq_len", 2**32 - 1)
    cdef uint64_t raw = 0, padded = 0
    cdef int bad_field = 0
    cdef int status = zb_llmbatch_geometry(bs, sl, &raw, &padded, &bad_field)
    if status == ZB_E_FIELD:
        raise ConfigError(geometry_message(status, FIELD_NAMES[bad_field], bs, sl),
                          field=FIELD_NAMES[bad_field])
    if status != ZB_OK:
        raise_for_status(ZB_E_LIMIT, geometry_message(status, FIELD_NAMES[bad_field], bs, sl),
                         field=FIELD_NAMES[bad_field])
    return raw, padded


def pack_llmbatch_header(*, batch_size, seq_len, num_batches, seed, total_records,
                         extension=True, checksums=True, max_token=None, trailer_hash=0,
                         build_id=None):
    """Pack a 4096-byte LLMBATCH header.

    Args:
        batch_size: samples per batch.
        seq_len: tokens per sample.
        num_batches: batches in the file.
        seed: the writer's shuffle seed, 0 to 2**32-1.
        total_records: source records before batching, 0 to 2**32-1.
        extension: write the zerobatch integrity extension (``False`` writes exactly the
            seed's header: fields then zeros).
        checksums: the file carries a trailer of per-batch XXH3-64 checksums.
        max_token: the largest token id in the file, or ``None`` when unknown.
        trailer_hash: XXH3-64 of the trailer (with ``checksums``).
        build_id: 16 bytes identifying this build (zeros when ``None``).

    Returns:
        4096 bytes.

    Raises:
        ConfigError: a field outside its range.
        LimitExceededError: a batch above ``MAX_BATCH_BYTES``.
    """
    cdef zb_llmbatch_header h
    memset(&h, 0, sizeof(h))
    fields = pack_fields(batch_size=batch_size, seq_len=seq_len, num_batches=num_batches,
                         seed=seed, total_records=total_records, extension=extension,
                         checksums=checksums, max_token=max_token, trailer_hash=trailer_hash,
                         build_id=build_id)
    h.batch_size = fields["batch_size"]
    h.seq_len = fields["seq_len"]
    h.num_batches = fields["num_batches"]
    h.seed = fields["seed"]
    h.total_records = fields["total_records"]
    h.has_ext = fields["has_ext"]
    h.ext_flags = fields["ext_flags"]
    h.max_token = fields["max_token"]
    h.trailer_offset = fields["trailer_offset"]
    h.trailer_size = fields["trailer_size"]
    h.trailer_hash = fields["trailer_hash"]
    cdef bytes bid = fields["build_id"]
    memcpy(h.build_id, <const char *>bid, LLMBATCH_BUILD_ID_SIZE)
    out = bytearray(LLMBATCH_HEADER_SIZE)
    cdef uint8_t[::1] dst = out
    zb_llmbatch_pack(&h, &dst[0])
    return bytes(out)
