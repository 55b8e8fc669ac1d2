/* The status codes every zerobatch kernel returns: the one table of them.
 *
 * Kernels never raise. A C function returns one of these codes; its Python wrapper (in the
 * same .pyx) passes the code, a message naming the field and the values, and the file to
 * zerobatch.core.status.raise_for_status, whose map turns it into an exception from
 * zerobatch.formats.errors. _status.pxd declares these names for Cython; status.py holds the
 * same numbers for Python (tests/core/test_status.py checks that the three agree).
 *
 * Codes from 100 up are not errors: they tell a reader to act and call again (a seqlock that
 * moved, a table or chunk to map) and never reach raise_for_status.
 */
#ifndef ZB_STATUS_H
#define ZB_STATUS_H

#define ZB_OK 0
#define ZB_E_TRUNCATED 1      /* TruncatedError: the file is shorter than it must be */
#define ZB_E_MAGIC 2          /* CorruptError: not a file of this format */
#define ZB_E_VERSION 3        /* UnsupportedVersionError: unknown version or algorithm code */
#define ZB_E_DTYPE 4          /* UnsupportedVersionError: unknown dtype code */
#define ZB_E_FLAGS 5          /* UnsupportedVersionError: unknown flag bits */
#define ZB_E_FIELD 6          /* CorruptError: a field (or a stored value) outside its allowed range */
#define ZB_E_LIMIT 7          /* LimitExceededError: a value above a named limit */
#define ZB_E_OVERFLOW 8       /* CorruptError: derived sizes overflow 64 bits */
#define ZB_E_SIZE 9           /* CorruptError: the file is longer than its layout */
#define ZB_E_RESERVED 10      /* CorruptError: reserved bytes are not zero */
#define ZB_E_CHECKSUM 11      /* IntegrityError: a checksum does not match */
#define ZB_E_RANGE 12         /* ConfigError: a value does not fit the requested output type */
#define ZB_E_INDEX 13         /* OutOfRangeError: an index outside the valid range */
#define ZB_E_ARGUMENT 14      /* ConfigError: an argument the wrapper should have refused */
#define ZB_E_IO 15            /* ReadError: a read failed at the OS level (the kernel keeps errno) */
#define ZB_E_CANCELLED 16     /* StateError: a queued task was dropped before it ran */
#define ZB_E_NOMEM 17         /* MemoryError: the kernel could not allocate its scratch memory */

#define ZB_RETRY 100          /* not an error: a seqlocked file changed while it was read; read again */
#define ZB_STALE 101          /* not an error: the files a reader mapped were replaced; reopen */
#define ZB_NEED_TABLE 102     /* not an error: a table is mapped shorter than needed; map it again */
#define ZB_NEED_CHUNK 103     /* not an error: a data file is not mapped, or mapped too short; map it */

#endif
