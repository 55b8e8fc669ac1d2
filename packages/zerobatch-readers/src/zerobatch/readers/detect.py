"""Which zerobatch format a path holds: a file by its magic bytes, a folder by its files
(through the format registry, :mod:`zerobatch.formats.registry`)."""

from __future__ import annotations

import os

from zerobatch.core.io import open_regular_file, pread_exact
from zerobatch.formats.errors import CorruptError, NotFoundError
from zerobatch.formats.registry import Format, formats, identify

__all__ = ["MAGIC_BYTES", "detect", "find"]

#: Bytes read from the start of a file to recognise it.
MAGIC_BYTES = 16


def find(path: str | os.PathLike[str]) -> Format | None:
    """The format at ``path``, or ``None`` when it is none (or cannot be read)."""
    try:
        return detect(path)
    except (OSError, ValueError):
        return None


def detect(path: str | os.PathLike[str]) -> Format:
    """The format at ``path``: from the magic of a file, the files of a folder.

    Raises:
        NotFoundError: nothing at ``path``.
        CorruptError: not a zerobatch file or dataset folder.
        FormatError, ReadError: a path that is not a regular file or folder, or unreadable.
    """
    p = os.fspath(path)
    if os.path.isdir(p):
        fmt = identify(folder_files=set(os.listdir(p)))
        if fmt is None:
            names = ", ".join(dict.fromkeys(m for f in formats() for m in f.markers))
            raise CorruptError(f"format: not a zerobatch dataset folder (none of {names})", path=p,
                               field="format")
        return fmt
    if not os.path.lexists(p):
        raise NotFoundError("no such file or folder", path=p, field="path")
    fd, st = open_regular_file(p)
    try:
        head = pread_exact(fd, min(MAGIC_BYTES, st.st_size), 0, path=p, field="magic")
    finally:
        os.close(fd)
    fmt = identify(head=head)
    if fmt is None:
        raise CorruptError(f"magic: not a zerobatch file (first bytes {head[:8]!r})", path=p, field="magic")
    return fmt
