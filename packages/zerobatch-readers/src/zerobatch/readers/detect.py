"""Which zerobatch format a path holds: a file by its magic bytes, a folder by its files
(through the format registry, :mod:`zerobatch.formats.registry`)."""

from __future__ import annotations

import os

from zerobatch.core.io import open_regular_file, pread_exact
from zerobatch.core.remote import is_url, local_path, open_store, redact, split_url
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
    if is_url(p) and not p.lower().startswith("file://"):
        return _detect_url(p)
    p = local_path(p)
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


def _detect_url(url: str) -> Format:
    """:func:`detect` for a URL: a folder format by a HEAD of each marker file, else a file
    format by the object's first bytes (credentials from the environment)."""
    root, key = split_url(url)
    store = open_store(root)
    for fmt in formats():
        if fmt.layout == "folder" and fmt.markers and all(
                store.head(f"{key}/{m}" if key else m) is not None for m in fmt.markers):
            return fmt
    size = store.head(key) if key else None
    if size is None:
        raise NotFoundError("no dataset at this URL (no object, and no dataset manifest under it)", path=redact(url),
                            field="path")
    head = bytes(store.get_range(key, 0, min(MAGIC_BYTES, size))) if size else b""
    fmt = identify(head=head)
    if fmt is None:
        raise CorruptError(f"magic: not a zerobatch file (first bytes {head[:8]!r})", path=redact(url), field="magic")
    return fmt
