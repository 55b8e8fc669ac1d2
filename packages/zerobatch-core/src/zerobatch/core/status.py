"""Status codes returned by the C-level kernels, and the exception each one becomes: the one
map from a kernel's result to an error (public: a reader that drives a kernel directly maps
its codes here, ``STATUS.ZB_RETRY`` and the other signals included).

The numbers are defined for C in ``_status.h`` (declared for Cython in ``_status.pxd``);
``tests/core/test_status.py`` checks that this table holds the same. Kernels never raise: the
``def`` wrapper that called them passes the code, a message naming the field and the values,
and the file to :func:`raise_for_status`. Codes of 100 and above are signals to the caller
(read again, map a file), never errors.
"""

from __future__ import annotations

from typing import Any, NoReturn

from zerobatch.formats.errors import (
    ConfigError,
    CorruptError,
    IntegrityError,
    LimitExceededError,
    OutOfRangeError,
    ReadError,
    StateError,
    TruncatedError,
    UnsupportedVersionError,
)

__all__ = ["STATUS", "STATUS_CODES", "STATUS_EXCEPTIONS", "raise_for_status"]

#: name -> code, as defined in _status.h.
STATUS_CODES = {
    "ZB_OK": 0,
    "ZB_E_TRUNCATED": 1,
    "ZB_E_MAGIC": 2,
    "ZB_E_VERSION": 3,
    "ZB_E_DTYPE": 4,
    "ZB_E_FLAGS": 5,
    "ZB_E_FIELD": 6,
    "ZB_E_LIMIT": 7,
    "ZB_E_OVERFLOW": 8,
    "ZB_E_SIZE": 9,
    "ZB_E_RESERVED": 10,
    "ZB_E_CHECKSUM": 11,
    "ZB_E_RANGE": 12,
    "ZB_E_INDEX": 13,
    "ZB_E_ARGUMENT": 14,
    "ZB_E_IO": 15,
    "ZB_E_CANCELLED": 16,
    "ZB_E_NOMEM": 17,
    "ZB_RETRY": 100,
    "ZB_STALE": 101,
    "ZB_NEED_TABLE": 102,
    "ZB_NEED_CHUNK": 103,
}


class STATUS:
    """The codes by name, for Python callers (``STATUS.ZB_E_CHECKSUM``...)."""


for _name, _code in STATUS_CODES.items():
    setattr(STATUS, _name, _code)

#: code -> exception class (every error code; not ZB_OK or the signals of 100 and above).
STATUS_EXCEPTIONS: dict[int, type[BaseException]] = {
    1: TruncatedError,
    2: CorruptError,
    3: UnsupportedVersionError,
    4: UnsupportedVersionError,
    5: UnsupportedVersionError,
    6: CorruptError,
    7: LimitExceededError,
    8: CorruptError,
    9: CorruptError,
    10: CorruptError,
    11: IntegrityError,
    12: ConfigError,
    13: OutOfRangeError,
    14: ConfigError,
    15: ReadError,
    16: StateError,
    17: MemoryError,
}


def raise_for_status(status: int, message: str, *, path: Any = None, field: str | None = None,
                     errno: int | None = None) -> NoReturn:
    """Raise the exception that ``status`` stands for.

    Args:
        status: a non-zero error code from ``_status.h``.
        message: the message, naming the field, expected and received values.
        path: the file at fault.
        field: the field at fault.
        errno: the OS error of a failed read (``ZB_E_IO``).

    Raises:
        The exception class mapped to ``status`` (``CorruptError`` naming the code for a code
        this table does not map, a signal included: a kernel bug, never a silent success).
    """
    cls = STATUS_EXCEPTIONS.get(status)
    if cls is None:
        raise CorruptError(f"{message} (unknown status {status})", path=path, field=field)
    if cls is MemoryError:
        raise MemoryError(message)
    if cls is ReadError:
        raise ReadError(message, errno=errno, path=path, field=field)
    raise cls(message, path=path, field=field)
