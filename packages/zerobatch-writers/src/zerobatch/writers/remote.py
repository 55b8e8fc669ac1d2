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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from zerobatch.core.io import read_document
from zerobatch.core.remote import ObjectStore, split_url
from zerobatch.formats import tokstream as T
from zerobatch.formats.errors import ConfigError, FormatError, NotFoundError

__all__ = ["UPLOAD_THREADS", "check_remote_destination", "check_remote_file", "publish_file", "publish_tokstream",
           "unique_shard_prefix"]

#: Shard uploads in flight.
UPLOAD_THREADS = 8
#: Shard names :func:`unique_shard_prefix` makes (what a rerun may remove when no manifest names them).
_OWN_SHARD = re.compile(r"^shard-[0-9a-f]{8}-\d{5,}$")


def unique_shard_prefix() -> str:
    """A shard-name prefix no earlier upload used (``shard-<8 hex>-``): the shards of a new
    dataset never overwrite the objects of the one readers see now."""
    return f"shard-{os.urandom(4).hex()}-"


def publish_tokstream(folder: str | os.PathLike[str], url: str, *, storage_options: dict[str, Any] | None = None,
                      overwrite: bool = False, log: Callable[[str], None] | None = None) -> T.DatasetManifest:
    """Upload the finished dataset at ``folder`` to ``url`` (see the module documentation).

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
    path = os.path.join(folder, T.MANIFEST_NAME)
    try:
        raw = read_document(path, limit=T.MAX_MANIFEST_BYTES, field="manifest")
    except FileNotFoundError:
        raise NotFoundError("manifest.json: not found (not a finished tokstream dataset)", path=path,
                            field="manifest") from None
    manifest = T.parse_manifest(raw, path=path)
    store = ObjectStore(url, storage_options)
    old: dict[str, str] = {}
    if store.head(T.MANIFEST_NAME) is not None:
        if not overwrite:
            raise ConfigError("destination: a dataset is already there; pass overwrite=True (--overwrite) to replace "
                              "it (readers see the old one until the new one is complete)",
                              path=store.name(T.MANIFEST_NAME), field="destination")
        try:
            prev = T.parse_manifest(store.get(T.MANIFEST_NAME, limit=T.MAX_MANIFEST_BYTES, field="manifest"),
                                    path=store.name(T.MANIFEST_NAME))
            old = {s.name: s.build_id for s in prev.shards}
        except FormatError:
            old = {}          # a damaged manifest: nothing of it is kept
    for s in manifest.shards:
        if s.name in old and old[s.name] != s.build_id:
            raise ConfigError(f"shard {s.name!r}: the dataset at the destination has a shard of that name with other "
                              f"contents; write the new dataset with unique shard names (TokenStreamWriter(prefix="
                              f"unique_shard_prefix()))", path=store.name(s.name), field="shards")
    todo = [s for s in manifest.shards if old.get(s.name) != s.build_id or not _complete(store, s)]

    def upload(entry: T.ShardEntry) -> None:
        base = os.path.join(folder, entry.name)
        for fname in sorted(entry.files):
            store.put(f"{entry.name}/{fname}", os.path.join(base, fname))
        store.put(f"{entry.name}/{T.SHARD_MANIFEST_NAME}", os.path.join(base, T.SHARD_MANIFEST_NAME))
    if todo:
        with ThreadPoolExecutor(min(UPLOAD_THREADS, len(todo)), thread_name_prefix="zerobatch-upload") as pool:
            for f in [pool.submit(upload, s) for s in todo]:
                f.result()
    if log:
        log(f"uploaded {len(todo)} of {len(manifest.shards)} shards to {store.url}")
    store.put(T.MANIFEST_NAME, raw)       # the switch: readers now open the new dataset
    keep = {s.name for s in manifest.shards}
    removed = 0
    for key, _ in store.list(""):
        top, _, rest = key.partition("/")
        if rest and top not in keep and (top in old or _OWN_SHARD.match(top)):
            store.delete(key)
            removed += 1
    if log and removed:
        log(f"removed {removed} objects of the previous dataset or of unfinished uploads")
    return manifest


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
    store = ObjectStore(url, storage_options)
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
    store = ObjectStore(root, storage_options)
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
    ObjectStore(root, storage_options).put(key, path)
