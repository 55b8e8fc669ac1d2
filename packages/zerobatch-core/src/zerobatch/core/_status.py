"""Status codes returned by the C-level kernels, and the exception each one becomes.

The numbers are declared for C in ``_status.pxd``; ``tests/core/test_status.py`` checks the two
agree. Kernels never raise: the ``def`` wrapper that called them passes the code, a message
naming the field and the values, and the file to :func:`raise_for_status`.
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

__all__ = ["STATUS_CODES", "STATUS_EXCEPTIONS", "raise_for_status"]

#: name -> code, as declared in _status.pxd.
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
}

#: code -> exception class.
STATUS_EXCEPTIONS: dict[int, type[Exception]] = {
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
}


def raise_for_status(status: int, message: str, *, path: Any = None, field: str | None = None) -> NoReturn:
    """Raise the exception that ``status`` stands for.

    Args:
        status: a non-zero code from ``_status.pxd``.
        message: the message, naming the field, expected and received values.
        path: the file at fault.
        field: the field at fault.

    Raises:
        The exception class mapped to ``status`` (``IndexError`` for an index out of range;
        ``CorruptError`` for a code this table does not know).
    """
    cls = STATUS_EXCEPTIONS.get(status)
    if cls is None:
        raise CorruptError(f"{message} (unknown status {status})", path=path, field=field)
    raise cls(message, path=path, field=field)
