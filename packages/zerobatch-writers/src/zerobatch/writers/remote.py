"""Publish a finished TOKSTREAM dataset folder to object storage (a URL), so that a reader
sees the old dataset or the new one, never a part of the new one.

The order makes it so: every shard's objects first (data and index files, then its
``shard.json``), in parallel and each object whole (obstore uploads large files in parts and
completes them in one step); then ``manifest.json``, the one object a reader opens first, put
in one request (S3 and the other stores replace an object atomically); then the objects of the
previous dataset that the new manifest no longer names, and those a killed upload left. A
reader that opened the old manifest keeps reading the old shards until they are removed
(then a ``NotFoundError``, never wrong tokens: every block is checked against the digests the
manifest it opened names).

A killed upload leaves shard objects without a manifest naming them: nothing a reader takes
for a dataset (with no earlier manifest), or the old dataset intact. A rerun uploads again,
skips the shards already there (same name, same build id, same sizes) and removes what the
killed run left.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from zerobatch.core.io import read_document
from zerobatch.core.pool import run_io
from zerobatch.core.remote import ObjectStore, open_store, split_url
from zerobatch.formats import tokstream as T
from zerobatch.formats.errors import ConfigError, FormatError, NotFoundError

__all__ = ["UPLOAD_THREADS", "check_remote_destination", "check_remote_file", "check_remote_zrecord", "publish",
           "publish_file", "publish_folder", "publish_tokstream", "publish_zrecord", "unique_shard_prefix"]

#: Shard uploads in flight.
UPLOAD_THREADS = 8
#: Shard names zerobatch's writers make: ``shard-NNNNN`` (a new dataset) and those of
#: :func:`unique_shard_prefix` (one replacing a dataset); what a rerun may remove when no
#: manifest names them (a killed upload's, or those of a dataset replaced by one whose
#: cleanup a kill cut short).
_OWN_SHARD = re.compile(r"^shard-([0-9a-f]{8}-)?\d{5,}$")


def unique_shard_prefix() -> str:
    """A shard-name prefix no earlier upload used (``shard-<8 hex>-``): the shards of a new
    dataset never overwrite the objects of the one readers see now."""
    return f"shard-{os.urandom(4).hex()}-"


def publish_tokstream(folder: str | os.PathLike[str], url: str, *, storage_options: dict[str, Any] | None = None,
                      overwrite: bool = False, log: Callable[[str], None] | None = None) -> T.DatasetManifest:
    """Upload the finished dataset at ``folder`` to ``url`` (see the module documentation).

    A chat dataset's loss mask (``folder/loss_mask``, named by the manifest) goes with it:
    both datasets' shards first, then the mask's ``manifest.json``, then the dataset's, in two
    consecutive requests (a reader that opens the mask between them is refused, never served
    a mask of other tokens). A dataset that replaces a chat dataset without a mask of its own
    removes the old mask.

    Args:
        folder: a local TOKSTREAM dataset folder (with ``manifest.json``).
        url: where it goes (``s3://bucket/prefix``...).
        storage_options: the store's configuration (as for the readers).
        overwrite: replace a dataset already at ``url``.
        log: called with a line per step.

    Returns:
        The manifest published.

    Raises:
        ConfigError: a dataset is at ``url`` and not ``overwrite``; or one of the new shards
            has the name of an old one with other contents (write with unique names:
            :func:`unique_shard_prefix`).
        NotFoundError, FormatError: ``folder`` is not a finished dataset.
        WriteError: an upload failed after the retry budget.
    """
    folder = os.path.abspath(os.fspath(folder))
    main = _Publication(folder, url, storage_options, overwrite)
    mask = None
    if main.manifest.loss_mask is not None:
        # the mask at the destination goes with its dataset (checked above for overwrite)
        mask = _Publication(os.path.join(folder, T.LOSS_MASK_DIR), f"{url.rstrip('/')}/{T.LOSS_MASK_DIR}",
                            storage_options, True)
        if mask.manifest.build_id != main.manifest.loss_mask:
            raise FormatError(f"loss_mask: the mask in the folder has build id {mask.manifest.build_id}, not the "
                              f"{main.manifest.loss_mask} the dataset's manifest names", path=mask.path,
                              field="loss_mask")
    for stage in (mask, main):
        if stage is not None:
            stage.upload(log)
    if mask is not None:
        mask.switch()
    main.switch()            # the switch: readers now open the new dataset
    if mask is not None:
        mask.cleanup(log)
    main.cleanup(log, drop_mask=mask is None)
    return main.manifest


class _Publication:
    """One TOKSTREAM dataset going up: checked, its shards uploaded, its manifest put, the
    objects of the dataset it replaced removed (the steps :func:`publish_tokstream` orders)."""

    def __init__(self, folder: str, url: str, storage_options: dict[str, Any] | None, overwrite: bool) -> None:
        self.folder = folder
        self.path = os.path.join(folder, T.MANIFEST_NAME)
        try:
            self.raw = read_document(self.path, limit=T.MAX_MANIFEST_BYTES, field="manifest")
        except FileNotFoundError:
            raise NotFoundError("manifest.json: not found (not a finished tokstream dataset)", path=self.path,
                                field="manifest") from None
        self.manifest = T.parse_manifest(self.raw, path=self.path)
        self.store = store = open_store(url, storage_options)
        self.old: dict[str, str] | None = None          # the shards of the dataset replaced, if any
        if store.head(T.MANIFEST_NAME) is not None:
            if not overwrite:
                raise ConfigError("destination: a dataset is already there; pass overwrite=True (--overwrite) to "
                                  "replace it (readers see the old one until the new one is complete)",
                                  path=store.name(T.MANIFEST_NAME), field="destination")
            try:
                prev = T.parse_manifest(store.get(T.MANIFEST_NAME, limit=T.MAX_MANIFEST_BYTES, field="manifest"),
                                        path=store.name(T.MANIFEST_NAME))
                self.old = {s.name: s.build_id for s in prev.shards}
            except FormatError:
                self.old = {}          # a damaged manifest: nothing of it is kept
        old = self.old or {}
        for s in self.manifest.shards:
            if s.name in old and old[s.name] != s.build_id:
                raise ConfigError(f"shard {s.name!r}: the dataset at the destination has a shard of that name with "
                                  f"other contents; write the new dataset with unique shard names "
                                  f"(TokenStreamWriter(prefix=unique_shard_prefix()))", path=store.name(s.name),
                                  field="shards")

    def upload(self, log: Callable[[str], None] | None) -> None:
        store, old = self.store, self.old or {}
        todo = [s for s in self.manifest.shards if old.get(s.name) != s.build_id or not _complete(store, s)]

        def one(entry: T.ShardEntry) -> None:
            base = os.path.join(self.folder, entry.name)
            for fname in sorted(entry.files):
                store.put(f"{entry.name}/{fname}", os.path.join(base, fname))
            store.put(f"{entry.name}/{T.SHARD_MANIFEST_NAME}", os.path.join(base, T.SHARD_MANIFEST_NAME))
        run_io(one, todo, UPLOAD_THREADS, "zerobatch-upload")
        if log:
            log(f"uploaded {len(todo)} of {len(self.manifest.shards)} shards to {store.url}")

    def switch(self) -> None:
        self.store.put(T.MANIFEST_NAME, self.raw)

    def cleanup(self, log: Callable[[str], None] | None, *, drop_mask: bool = False) -> None:
        """Remove what the new manifest does not name: the replaced dataset's shards and those
        killed uploads left (zerobatch's shard names only), and with ``drop_mask`` (a dataset
        without a loss mask replacing one) the old ``loss_mask/``."""
        keep = {s.name for s in self.manifest.shards}
        old = self.old or {}
        removed = 0
        for key, _ in self.store.list(""):
            top, _, rest = key.partition("/")
            if not rest or top in keep:
                continue
            if top in old or _OWN_SHARD.match(top) or (drop_mask and self.old is not None
                                                       and top == T.LOSS_MASK_DIR):
                self.store.delete(key)
                removed += 1
        if log and removed:
            log(f"removed {removed} objects of the previous dataset or of unfinished uploads")


def _complete(store: ObjectStore, entry: T.ShardEntry) -> bool:
    """Whether every object of ``entry`` is at the store with its manifest size (a shard a
    killed upload finished, or the same shard in the dataset there now)."""
    for fname, f in entry.files.items():
        if store.head(f"{entry.name}/{fname}") != f.size + T.TRAILER_SIZE:
            return False
    return store.head(f"{entry.name}/{T.SHARD_MANIFEST_NAME}") is not None


def check_remote_destination(url: str, overwrite: bool, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether a dataset is at ``url`` (checked before any work).

    Raises:
        ConfigError: there is one and not ``overwrite``.
    """
    store = open_store(url, storage_options)
    if store.head(T.MANIFEST_NAME) is None:
        return False
    if not overwrite:
        raise ConfigError("destination: a dataset is already there; pass --overwrite to replace it (readers see the "
                          "old one until the new one is complete)", path=store.name(T.MANIFEST_NAME),
                          field="destination")
    return True


def check_remote_file(url: str, overwrite: bool, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether an object is at ``url`` (checked before any work).

    Raises:
        ConfigError: there is one and not ``overwrite``.
    """
    root, key = split_url(url)
    store = open_store(root, storage_options)
    if store.head(key) is None:
        return False
    if not overwrite:
        raise ConfigError("destination: an object is already there; pass --overwrite to replace it (readers see the "
                          "old one until the new one is complete)", path=store.name(key), field="destination")
    return True


def publish_file(path: str, url: str, *, storage_options: dict[str, Any] | None = None,
                 overwrite: bool = False) -> None:
    """Upload the single-file dataset ``path`` (an LLMBATCH or LLMCHNK file) to ``url`` as one
    object: a single PUT, or a multipart upload for large files, which the store makes visible
    only once complete, so readers see the old object or the new one, never a part.

    Raises:
        ConfigError: an object is at ``url`` and not ``overwrite``.
        WriteError: the upload failed after the retry budget.
    """
    check_remote_file(url, overwrite, storage_options)
    root, key = split_url(url)
    open_store(root, storage_options).put(key, path)


def check_remote_zrecord(url: str, overwrite: bool = False, storage_options: dict[str, Any] | None = None) -> bool:
    """Refuse a ZRECORD destination at ``url`` that holds a store (or the start of one).

    A store at a URL is write-once: its readers fetch table pages and records as they go,
    and a store replaced under them could give one gather records of two commits; publish a
    new store to a new prefix instead.

    Raises:
        ConfigError: ``meta.json`` or ``commit.zr`` is there (``overwrite`` too).
    """
    from zerobatch.formats import zrecord as Z
    store = open_store(url, storage_options)
    if store.head(Z.COMMIT_NAME) is None:
        return False
    how = " (--overwrite does not apply: readers fetch a store's records as they go)" if overwrite else ""
    raise ConfigError(f"destination: a ZRECORD store is already there; stores at a URL are write-once: publish to a "
                      f"new prefix{how}", path=store.name(Z.COMMIT_NAME), field="destination")


def publish_zrecord(folder: str | os.PathLike[str], url: str, *, storage_options: dict[str, Any] | None = None,
                    overwrite: bool = False, log: Callable[[str], None] | None = None) -> int:
    """Upload the closed ZRECORD store at ``folder`` to ``url``, for readers
    (:class:`~zerobatch.readers.zrecord.ZRecordStore` at a URL, read-only).

    What readers need goes up, in parallel: each field's offset table and check file (the
    committed entries) and each live chunk up to its last record (chunk files grow in sparse
    steps locally); then ``meta.json`` and last ``commit.zr``, the object a reader's open
    needs, so a killed upload leaves nothing a reader opens (``commit.zr`` missing) and a
    rerun uploads again. Returns the bytes uploaded.

    Raises:
        ConfigError: a writer holds the store (or left a journal: open it once to recover),
            or a store is at ``url`` already (:func:`check_remote_zrecord`).
        CorruptError: ``meta.json`` and ``commit.zr`` disagree.
        WriteError: an upload failed after the retry budget.
    """
    import numpy as np

    from zerobatch.core import xxh3_64, zrstore
    from zerobatch.formats import zrecord as Z
    from zerobatch.formats.errors import CorruptError

    folder = os.fspath(folder)
    if zrstore.writer_alive(folder) or os.path.lexists(os.path.join(folder, Z.JOURNAL_NAME)):
        raise ConfigError("source: a writer holds the store or left a journal; close the writer (or open the store "
                          "once, which recovers) before publishing", path=folder, field="writer.lock")
    meta = zrstore.read_meta(os.path.join(folder, Z.META_NAME))
    with open(os.path.join(folder, Z.COMMIT_NAME), "rb") as f:
        commit_raw = f.read(Z.COMMIT_SIZE)
    commit = Z.unpack_commit(commit_raw, xxh3_64, path=os.path.join(folder, Z.COMMIT_NAME), key=meta.key)
    if commit.seq & 1 or (meta.generation, meta.length, meta.num_chunks) != (commit.generation, commit.length,
                                                                            commit.num_chunks):
        raise CorruptError("commit.zr and meta.json disagree (a commit in progress?)", path=folder, field="generation")
    check_remote_zrecord(url, overwrite, storage_options)
    store = open_store(url, storage_options)
    n = commit.length
    uploads: list[tuple[str, int]] = []
    extent: dict[int, int] = {}
    for f in meta.fields:
        uploads.append((Z.offset_name(f.name), max(n, 1) * Z.ENTRY_SIZE))
        uploads.append((Z.check_name(f.name), max(n, 1) * Z.CHECK_SIZE))
        entries = np.fromfile(os.path.join(folder, Z.offset_name(f.name)), Z.ENTRY_DTYPE, count=n)
        live = entries[entries["length"] > 0]
        if live.size:
            ends = live["offset"].astype(np.int64) + live["length"].astype(np.int64)
            chunks = live["chunk"].astype(np.int64)
            top = np.zeros(int(chunks.max()) + 1, np.int64)
            np.maximum.at(top, chunks, ends)
            for c in np.flatnonzero(top).tolist():
                extent[c] = max(extent.get(c, 0), int(top[c]))
    uploads += [(Z.chunk_name(c), size) for c, size in sorted(extent.items())]
    for name, size in uploads:
        have = os.path.getsize(os.path.join(folder, name))
        if have < size:
            raise CorruptError(f"{name}: {have} bytes, the committed entries need {size}", path=folder, field=name)

    def upload(item: tuple[str, int]) -> None:
        name, size = item
        store.put(name, os.path.join(folder, name), size=size)
        if log is not None:
            log(f"uploaded {name} ({size} bytes)")
    run_io(upload, uploads, UPLOAD_THREADS, "zerobatch-upload")
    with open(os.path.join(folder, Z.META_NAME), "rb") as f:
        store.put(Z.META_NAME, f.read())
    store.put(Z.COMMIT_NAME, commit_raw)     # last: the store exists for readers from here on
    return sum(size for _, size in uploads) + Z.COMMIT_SIZE


def publish_folder(folder: str | os.PathLike[str], url: str, *, storage_options: dict[str, Any] | None = None,
                   overwrite: bool = False, log: Callable[[str], None] | None = None) -> None:
    """Publish the dataset ``folder`` (a folder or a single file) to ``url`` in its format's
    order: the publish its registry record names (``Format.publish``).

    Raises:
        ConfigError: not a dataset of a format that can be published.
    """
    publish(folder, url, storage_options=storage_options, overwrite=overwrite, log=log)


def publish(path: str | os.PathLike[str], url: str, *, storage_options: dict[str, Any] | None = None,
            overwrite: bool = False, log: Callable[[str], None] | None = None) -> None:
    """Publish the dataset at ``path`` to ``url`` with the publish its format's registry
    record names (data first, what makes it visible last).

    Raises:
        ConfigError: not a dataset of a format that can be published.
    """
    from zerobatch.formats.registry import identify
    local = os.fspath(path)
    try:
        if os.path.isdir(local):
            fmt = identify(folder_files=set(os.listdir(local)))
        else:
            with open(local, "rb") as f:
                fmt = identify(head=f.read(16))
    except OSError:
        fmt = None
    if fmt is None or not fmt.publish:
        raise ConfigError("publish: not a dataset of a format that can be published to a URL", path=local,
                          field="path")
    fn = fmt.resolve("publish")
    if fn is publish_file:
        fn(local, url, storage_options=storage_options, overwrite=overwrite)
    else:
        fn(path, url, storage_options=storage_options, overwrite=overwrite, log=log)
