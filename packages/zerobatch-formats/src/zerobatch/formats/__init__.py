"""zerobatch.formats: the specification of every zerobatch file format, in pure Python.

One module per format (constants, header and manifest types, layout limits), the exception
hierarchy in :mod:`zerobatch.formats.errors` and the strict JSON parser every small document
goes through (:mod:`zerobatch.formats.strict_json`). Nothing here reads or writes files.
"""

from zerobatch.formats import errors, llmbatch
from zerobatch.formats._version import __version__
from zerobatch.formats.errors import (
    ConfigError,
    CorruptError,
    FormatError,
    IntegrityError,
    LimitExceededError,
    NotFoundError,
    OutOfRangeError,
    ReadError,
    StateError,
    TruncatedError,
    UnsupportedVersionError,
    WriteError,
    ZerobatchError,
)

__all__ = [
    "ConfigError",
    "CorruptError",
    "FormatError",
    "IntegrityError",
    "LimitExceededError",
    "NotFoundError",
    "OutOfRangeError",
    "ReadError",
    "StateError",
    "TruncatedError",
    "UnsupportedVersionError",
    "WriteError",
    "ZerobatchError",
    "__version__",
    "errors",
    "llmbatch",
]
