# Declaration-only: the status codes every C-level kernel returns (the table is _status.h).
#
# Kernels never raise; they return one of these codes and the Python wrapper in the same .pyx
# maps it to an exception from zerobatch.formats.errors through zerobatch.core.status's one map.

cdef extern from "_status.h" nogil:
    enum:
        ZB_OK
        ZB_E_TRUNCATED
        ZB_E_MAGIC
        ZB_E_VERSION
        ZB_E_DTYPE
        ZB_E_FLAGS
        ZB_E_FIELD
        ZB_E_LIMIT
        ZB_E_OVERFLOW
        ZB_E_SIZE
        ZB_E_RESERVED
        ZB_E_CHECKSUM
        ZB_E_RANGE
        ZB_E_INDEX
        ZB_E_ARGUMENT
        ZB_E_IO
        ZB_E_CANCELLED
        ZB_E_NOMEM
        ZB_RETRY
        ZB_STALE
        ZB_NEED_TABLE
        ZB_NEED_CHUNK
