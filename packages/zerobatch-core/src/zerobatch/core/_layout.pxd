# Declaration-only: the LLMBATCH byte layout for the compiled kernels.
#
# zerobatch.formats.llmbatch is the single source of truth; these are the same numbers as
# C constants so kernels compile them in. tests/core/test_layout.py keeps the two equal.

from libc.stdint cimport uint64_t

cdef enum:
    LLMBATCH_HEADER_SIZE = 4096
    LLMBATCH_ALIGNMENT = 4096
    LLMBATCH_VERSION = 1
    LLMBATCH_DTYPE_UINT32 = 0
    LLMBATCH_TOKEN_ITEMSIZE = 4
    LLMBATCH_CHECKSUM_SIZE = 8

    # seed fields
    LLMBATCH_OFF_MAGIC = 0
    LLMBATCH_OFF_VERSION = 8
    LLMBATCH_OFF_BATCH_SIZE = 12
    LLMBATCH_OFF_SEQ_LEN = 16
    LLMBATCH_OFF_NUM_BATCHES = 20
    LLMBATCH_OFF_DTYPE = 28
    LLMBATCH_OFF_SEED = 32
    LLMBATCH_OFF_TOTAL_RECORDS = 36
    LLMBATCH_OFF_RESERVED = 40

    # zerobatch integrity extension
    LLMBATCH_OFF_EXT_MAGIC = 40
    LLMBATCH_OFF_EXT_VERSION = 48
    LLMBATCH_OFF_EXT_FLAGS = 52
    LLMBATCH_OFF_HASH_ALGO = 56
    LLMBATCH_OFF_MAX_TOKEN = 60
    LLMBATCH_OFF_TRAILER_OFFSET = 64
    LLMBATCH_OFF_TRAILER_SIZE = 72
    LLMBATCH_OFF_TRAILER_HASH = 80
    LLMBATCH_OFF_BUILD_ID = 88
    LLMBATCH_BUILD_ID_SIZE = 16
    LLMBATCH_EXT_RESERVED_START = 104
    LLMBATCH_OFF_HEADER_HASH = 4088

    LLMBATCH_EXT_VERSION = 1
    LLMBATCH_EXT_FLAG_BATCH_CHECKSUMS = 1
    LLMBATCH_EXT_FLAG_MAX_TOKEN = 2
    LLMBATCH_EXT_FLAGS_KNOWN = 3
    LLMBATCH_HASH_ALGO_XXH3_64 = 1

    LLMBATCH_MAX_BATCH_SIZE = 2147483647
    LLMBATCH_MAX_SEQ_LEN = 2147483647

cdef extern from *:
    """
    __attribute__((unused)) static const char LLMBATCH_MAGIC[8] = {'L','L','M','B','A','T','C','H'};
    __attribute__((unused)) static const char LLMBATCH_EXT_MAGIC[8] = {'Z','B','A','T','C','H','X','1'};
    #define LLMBATCH_MAX_BATCH_BYTES ((uint64_t)1 << 34)
    """
    const char LLMBATCH_MAGIC[8]
    const char LLMBATCH_EXT_MAGIC[8]
    uint64_t LLMBATCH_MAX_BATCH_BYTES
