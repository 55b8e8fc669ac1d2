# Declaration-only: the status codes every C-level kernel returns.
#
# Kernels never raise; they return one of these codes and the Python wrapper in the same
# .pyx maps it to an exception from zerobatch.formats.errors (see _status.py, which holds
# the same numbers; a test checks that the two agree).

cdef enum zb_status:
    ZB_OK = 0
    ZB_E_TRUNCATED = 1      # TruncatedError: the file is shorter than it must be
    ZB_E_MAGIC = 2          # CorruptError: not a file of this format
    ZB_E_VERSION = 3        # UnsupportedVersionError: unknown version or algorithm code
    ZB_E_DTYPE = 4          # UnsupportedVersionError: unknown dtype code
    ZB_E_FLAGS = 5          # UnsupportedVersionError: unknown flag bits
    ZB_E_FIELD = 6          # CorruptError: a field outside its allowed range
    ZB_E_LIMIT = 7          # LimitExceededError: a value above a named limit
    ZB_E_OVERFLOW = 8       # CorruptError: derived sizes overflow 64 bits
    ZB_E_SIZE = 9           # CorruptError: the file is longer than its layout
    ZB_E_RESERVED = 10      # CorruptError: reserved bytes are not zero
    ZB_E_CHECKSUM = 11      # IntegrityError: a checksum does not match
    ZB_E_RANGE = 12         # ConfigError: a value does not fit the requested output type
    ZB_E_INDEX = 13         # IndexError: an index outside the valid range
    ZB_E_ARGUMENT = 14      # ConfigError: an argument the wrapper should have refused
    ZB_E_IO = 15            # ReadError: a read failed at the OS level (the kernel keeps errno)
    ZB_E_CANCELLED = 16     # StateError: a queued task was dropped before it ran
