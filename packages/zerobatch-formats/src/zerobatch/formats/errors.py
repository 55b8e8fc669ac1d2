"""The one exception hierarchy of zerobatch.

Every error a zerobatch package raises on purpose comes from here, so callers can catch
``ZerobatchError`` for everything, or a precise subclass. Format errors also derive from
``ValueError`` (and write errors from ``OSError``) so code written against the standard
exceptions keeps working.

Every error carries the file (``path``) and the field or parameter (``field``) at fault when
they are known; ``str(error)`` starts with the file name, so a message read in a log names
both::

    dataset.batch: num_batches: header claims 8 batches (32768 bytes) but the file holds 5

Messages are written in words stable enough for ``pytest.raises(..., match=...)``.
"""

from __future__ import annotations

import os
import re
from typing import Any

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
    "scrub",
]

# a URL: ``scheme://`` and what follows up to a space or a quote; also ``scheme:/`` (a URL
# that went through os.path.abspath or pathlib, which fold ``//``)
_URL = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*:/{1,2})([^\s'\"]*)")


def _scrub_url(m: re.Match[str]) -> str:
    scheme, rest = m.group(1), m.group(2)
    # user information ends at the last '@' whose text before it holds a ':' (user:secret)
    # or no '/' (a token): a secret may itself hold '@', '/', '?' or '#'; a '@' deeper in a
    # path (``s3://bucket/a@b``) is part of an object's name and stays
    at = rest.rfind("@")
    while at >= 0:
        info = rest[:at]
        if ":" in info or "/" not in info:
            rest = "***@" + rest[at + 1:]
            break
        at = rest.rfind("@", 0, at)
    q = rest.find("?")           # a query string: a signed URL's signature, a SAS token
    if q >= 0:
        rest = rest[:q] + "?***"
    return scheme + rest


def scrub(text: str) -> str:
    """``text`` with the user information of any URL in it (``s3://KEY:SECRET@bucket``,
    ``http://user:pa/ss@host``) and its query string (a signature, a SAS token) replaced by
    ``***``: no error message carries a credential written into a URL, whatever raised it."""
    if ":/" not in text or ("@" not in text and "?" not in text):
        return text
    return _URL.sub(_scrub_url, text)


def _fspath(path: Any) -> str | None:
    if path is None:
        return None
    try:
        return scrub(os.fsdecode(os.fspath(path)))
    except TypeError:
        return scrub(str(path))


class ZerobatchError(Exception):
    """Base class of every error zerobatch raises on purpose.

    Args:
        message: what went wrong, naming the field, the expected and the received value.
        path: the file or folder at fault, if any.
        field: the header field, table, parameter or state key at fault, if any.
    """

    def __init__(self, message: str, *, path: Any = None, field: str | None = None) -> None:
        message = scrub(message)
        super().__init__(message)
        self.message = message
        self.path = _fspath(path)
        self.field = field

    def __str__(self) -> str:
        if self.path:
            return f"{self.path}: {self.message}"
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep path and field across pickling (errors cross process boundaries in workers).
        return (_rebuild, (type(self), self.message, self.path, self.field))


def _rebuild(cls: type[ZerobatchError], message: str, path: str | None, field: str | None) -> ZerobatchError:
    return cls(message, path=path, field=field)


class FormatError(ZerobatchError, ValueError):
    """A file or folder does not follow its format's specification."""


class TruncatedError(FormatError):
    """A file is shorter than its header or tables say it must be."""


class CorruptError(FormatError):
    """A file holds values its format forbids (bad magic, impossible offsets, junk bytes)."""


class IntegrityError(CorruptError):
    """A checksum does not match the bytes it covers, or files from different builds are mixed."""


class UnsupportedVersionError(FormatError):
    """A file declares a format version, flag or type code this release does not know."""


class LimitExceededError(FormatError):
    """A value is larger than the named limit zerobatch accepts (see ``zerobatch.formats``)."""


class ConfigError(ZerobatchError, ValueError):
    """An argument passed by the caller is out of range or of the wrong type."""


class OutOfRangeError(ZerobatchError, IndexError):
    """An index or position outside its valid range (a batch index, a sampler step, a window).

    Also an ``IndexError``, so ``except IndexError`` and the sequence protocol keep working.
    """


class StateError(ZerobatchError, ValueError):
    """A saved loader or sampler state does not fit the loader it is loaded into."""


class WriteError(ZerobatchError, OSError):
    """Writing, flushing, syncing or renaming a file failed.

    The previous state of the file is intact and nothing partial is left under the final name.

    Args:
        message: what failed.
        errno: the ``errno`` reported by the failing call (``None`` for a logical failure).
        path: the file being written.
        operation: the call that failed (``"write"``, ``"fsync"``, ``"rename"``...).
    """

    def __init__(
        self,
        message: str,
        *,
        errno: int | None = None,
        path: Any = None,
        field: str | None = None,
        operation: str | None = None,
    ) -> None:
        ZerobatchError.__init__(self, message, path=path, field=field)
        # OSError's attributes, set by hand so OSError's constructor cannot remap the class.
        self.errno = errno
        self.strerror = os.strerror(errno) if errno is not None else message
        self.filename = self.path
        self.operation = operation

    def __str__(self) -> str:
        return ZerobatchError.__str__(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_write, (self.message, self.errno, self.path, self.field, self.operation))


def _rebuild_write(
    message: str, errno: int | None, path: str | None, field: str | None, operation: str | None
) -> WriteError:
    return WriteError(message, errno=errno, path=path, field=field, operation=operation)


class NotFoundError(ZerobatchError, FileNotFoundError):
    """A file to read does not exist (or is a dangling symlink)."""


class ReadError(ZerobatchError, OSError):
    """Opening or reading a file failed at the operating-system level (keeps ``errno``).

    Args:
        message: what failed.
        errno: the ``errno`` of the failing call.
        path: the file.
        field: the field or table being read.
    """

    def __init__(
        self, message: str, *, errno: int | None = None, path: Any = None, field: str | None = None
    ) -> None:
        ZerobatchError.__init__(self, message, path=path, field=field)
        self.errno = errno
        self.strerror = os.strerror(errno) if errno is not None else message
        self.filename = self.path

    def __str__(self) -> str:
        return ZerobatchError.__str__(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_read, (self.message, self.errno, self.path, self.field))


def _rebuild_read(message: str, errno: int | None, path: str | None, field: str | None) -> ReadError:
    return ReadError(message, errno=errno, path=path, field=field)
