"""The format registry: every zerobatch format as one record, found without a shared table.

Each format module ``zerobatch.formats.<fmt>`` declares ``FORMAT = Format(...)``: its name,
how it is recognised (a file's magic bytes, or the files a folder holds), whether it is a
file or a folder, its specification page, and the dotted names of the parts that implement
it in the higher packages (reader, writer, kernel module, loader sources, the command line's
face, its documents and conversion target for preparation), and what its conversion target
can do (URLs, source rows, document fields, a loss-mask stream, distributed parts). The names
are strings, resolved only when asked for (:meth:`Format.resolve`), so this package imports
nothing above it.

Everything that serves every format iterates the registry instead of naming formats: the
command line's detection, ``--to`` choices and ``inspect`` / ``verify`` / ``head`` / ``stats``
/ ``bench``; conversion (``zerobatch.prepare``); the loaders'
:func:`~zerobatch.adapters.sources.open_source`. A new format is its own files (this module's
record in its format module, its reader, writer, source, command-line face, preparation part,
spec page and tests) and no edit to a shared one
(``docs/adding-a-format.md``). A format from another distribution registers with
:func:`register`.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import sys
import threading
from typing import Any

from zerobatch.formats.errors import ConfigError

__all__ = ["Format", "formats", "get", "identify", "register"]


@dataclasses.dataclass(frozen=True)
class Format:
    """One format (see the module documentation).

    Attributes:
        name: its name on the command line and in states (``"llmbatch"``).
        title: how documents spell it (``"LLMBATCH"``).
        summary: one line: what it is for.
        layout: ``"file"`` or ``"folder"``.
        magic: a file format's first bytes.
        markers: a folder format's files that must all be present.
        spec: its specification page, relative to the repository (``docs/formats/...``).
        reader, writer, kernel: dotted names (``"module:attribute"`` or a module) of its
            reader class, writer (class or function) and compiled kernel module.
        sources: its loader sources (``"zerobatch.adapters.sources.<fmt>:<Class>"``).
        default_source: the source a path alone opens (``Loader("train.batch")``), if any.
        cli: its command-line face (a ``zerobatch.cli.datasets.Dataset`` subclass).
        documents: its datasets read as documents of tokens, what a conversion from one
            reads (a ``zerobatch.prepare.formats.Documents`` subclass), if they hold tokens.
        convert: its ``zerobatch convert --to`` target (``write(dst, chunks, target)``, in
            ``zerobatch.prepare.formats.<fmt>``), if it can be written from documents of tokens.

    What its ``convert`` target can do beyond writing documents (each field says it for the
    target, so that preparation asks the record instead of naming formats):

    Attributes:
        convert_stream: the target cuts records from the documents' concatenation, so it
            also takes a token stream whose document boundaries are unknown (a nanoGPT
            ``.bin`` without ``--eod-id``); a target that stores documents (the default)
            refuses such a stream rather than store made-up documents.
        url_check: it is written to URLs (``s3://bucket/dataset``...): the dotted name of the
            check its destination gets before any work (``check(url, overwrite) -> bool``,
            True when a dataset is there to replace); a target without one writes local paths.
        row_ids: it keeps each document's source row (``convert --row-ids``).
        doc_metadata: it keeps fields of each document (``convert --metadata-fields``).
        streams: the streams of each document it writes, ``tokens`` first; ``loss_mask``
            (one 0/1 per token) takes a chat conversion (``convert --chat``).
        task_parts: distributed tasks (``convert --task I --tasks N``) write it as finished
            parts that ``zerobatch commit`` assembles.
        publish: how a dataset of it, built locally, goes to a URL: the dotted name of
            ``publish(local, url, *, storage_options=None, overwrite=False)``, whose order is
            the format's (its data first, what makes it visible last: a manifest, a commit
            file, or one object uploaded whole), so readers see the old dataset or the new one.
    """

    name: str
    title: str
    summary: str
    layout: str
    magic: bytes | None = None
    markers: tuple[str, ...] = ()
    spec: str = ""
    reader: str | None = None
    writer: str | None = None
    kernel: str | None = None
    sources: tuple[str, ...] = ()
    default_source: str | None = None
    cli: str | None = None
    documents: str | None = None
    convert: str | None = None
    convert_stream: bool = False
    url_check: str | None = None
    row_ids: bool = False
    doc_metadata: bool = False
    streams: tuple[str, ...] = ("tokens",)
    task_parts: bool = False
    publish: str | None = None

    def __post_init__(self) -> None:
        if self.layout not in ("file", "folder"):
            raise ConfigError(f"layout must be 'file' or 'folder', got {self.layout!r}", field="layout")
        if self.layout == "file" and not self.magic:
            raise ConfigError(f"format {self.name!r}: a file format needs its magic bytes", field="magic")
        if self.layout == "folder" and not self.markers:
            raise ConfigError(f"format {self.name!r}: a folder format needs its marker files", field="markers")

    def resolve(self, attr: str) -> Any:
        """The object a dotted name of this record names, imported now.

        Raises:
            ConfigError: the record names nothing for ``attr``.
        """
        target = getattr(self, attr)
        if not target:
            raise ConfigError(f"format {self.name!r} has no {attr}", field=attr)
        module, _, name = target.partition(":")
        mod = importlib.import_module(module)
        return getattr(mod, name) if name else mod


_lock = threading.Lock()
_registered: dict[str, Format] = {}
_discovered = False


def _discover() -> None:
    """Every ``FORMAT`` of the ``zerobatch.formats`` modules, once."""
    global _discovered
    if _discovered:
        return
    package = sys.modules[__name__.rpartition(".")[0]]   # zerobatch.formats, imported before us
    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_") or info.name in ("errors", "registry", "strict_json"):
            continue
        fmt = getattr(importlib.import_module(f"zerobatch.formats.{info.name}"), "FORMAT", None)
        if isinstance(fmt, Format):
            found[fmt.name] = fmt
    with _lock:
        for name, fmt in found.items():
            _registered.setdefault(name, fmt)
        _discovered = True


def register(fmt: Format) -> Format:
    """Add a format (from another distribution); returns it.

    Raises:
        ConfigError: another format has that name, or the same magic or markers.
    """
    if not isinstance(fmt, Format):
        raise ConfigError(f"register: expected a Format, got {type(fmt).__name__}", field="format")
    _discover()
    with _lock:
        for other in _registered.values():
            if other.name == fmt.name and other is not fmt:
                raise ConfigError(f"format {fmt.name!r} is registered already", field="name")
            if fmt.magic and other.magic == fmt.magic and other is not fmt:
                raise ConfigError(f"format {fmt.name!r}: {other.name!r} has the same magic", field="magic")
            if fmt.markers and set(other.markers) == set(fmt.markers) and other is not fmt:
                raise ConfigError(f"format {fmt.name!r}: {other.name!r} has the same markers", field="markers")
        _registered[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Remove a format added with :func:`register` (tests)."""
    with _lock:
        _registered.pop(name, None)


def formats() -> list[Format]:
    """Every format: files first, then folders, each in name order."""
    _discover()
    with _lock:
        return sorted(_registered.values(), key=lambda f: (f.layout != "file", f.name))


def get(name: str) -> Format:
    """The format called ``name``.

    Raises:
        ConfigError: no such format (naming the ones there are).
    """
    for fmt in formats():
        if fmt.name == name:
            return fmt
    raise ConfigError(f"format must be one of {[f.name for f in formats()]}, got {name!r}", field="format")


def identify(*, folder_files: set[str] | None = None, head: bytes | None = None) -> Format | None:
    """The format of a folder holding ``folder_files``, or of a file starting with ``head``
    (``None``: none matches). A folder matches the format with the most markers it holds all
    of (a folder with ``meta.json`` and ``commit.zr`` is ZRECORD, even if it held a
    ``metadata.json`` too)."""
    best: Format | None = None
    for fmt in formats():
        if folder_files is not None and fmt.layout == "folder":
            if set(fmt.markers) <= folder_files and (best is None or len(fmt.markers) > len(best.markers)):
                best = fmt
        elif head is not None and fmt.layout == "file" and fmt.magic and head.startswith(fmt.magic):
            return fmt
    return best
