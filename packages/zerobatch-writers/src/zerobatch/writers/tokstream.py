"""Write TOKSTREAM datasets: sharded token streams with documents and per-token metadata.

- :class:`ShardWriter` writes one shard (its own folder) from documents, streaming every file
  to disk as it goes; shards are independent, so processes can write shards of one dataset
  in parallel, each under its own name.
- :func:`assemble` writes ``manifest.json`` from the shards' ``shard.json`` records, without
  touching token data.
- :class:`TokenStreamWriter` is the one-process convenience: it rolls over to a new shard
  every ``shard_tokens`` tokens and assembles the manifest on :meth:`~TokenStreamWriter.close`.

Every file is written atomically (temporary name, ``fsync``, rename, ``fsync`` of the folder)
and ``shard.json`` is written last, so a shard folder without ``shard.json`` is unfinished and
``assemble`` refuses it. Layout: ``docs/formats/tokstream.md``.

Metadata is serialized by the dataset's codec: ``"json"`` (default; compact, sorted keys),
``"numpy"`` (a ``.npy`` image of an array), ``"bytes"`` (bytes-like as is), or ``"pickle"``
(only when asked for by name: unpickling runs code).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from zerobatch.core import hash_slots, max_u32, xxh3_64
from zerobatch.core.io import AtomicFile, local_destination, make_folder, read_document
from zerobatch.formats import tokstream as T
from zerobatch.formats.errors import ConfigError, FormatError, LimitExceededError, NotFoundError, ReadError

__all__ = ["ShardWriter", "TokenStreamWriter", "assemble", "manifest_of", "seeded_build_id", "serialize_metadata"]


def serialize_metadata(obj: Any, codec: str) -> bytes:
    """One metadata blob in ``codec`` (see the module documentation).

    Raises:
        ConfigError: the object cannot be serialized by the codec.
    """
    try:
        if codec == "json":
            return json.dumps(obj, separators=(",", ":"), sort_keys=True, allow_nan=False).encode("utf-8")
        if codec == "numpy":
            if not isinstance(obj, np.ndarray) or obj.dtype.hasobject:
                raise TypeError(f"expected a numpy array without objects, got {type(obj).__name__}")
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(obj), allow_pickle=False)
            return buf.getvalue()
        if codec == "bytes":
            return bytes(memoryview(obj).cast("B"))
        if codec == "pickle":
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"metadata: cannot serialize with codec {codec!r}: {exc}", field="metadata") from exc
    raise ConfigError(f"codec must be one of {T.CODECS}, got {codec!r}", field="codec")


def seeded_build_id(seed: bytes, name: str) -> bytes:
    """The build id of shard ``name`` written with ``build_seed=seed``: BLAKE2b-128 of the name
    keyed with BLAKE2b-512 of the seed (what a distributed commit recomputes for each part)."""
    return hashlib.blake2b(name.encode("utf-8"), digest_size=16, key=hashlib.blake2b(seed).digest()).digest()


class _HashedFile:
    """An atomic file whose payload is checksummed (chunked XXH3) as it is written, and which
    ends with the shard trailer on commit."""

    def __init__(self, path: str, build_id: bytes, kind: int, block: int) -> None:
        self.file = AtomicFile(path)
        self.build_id, self.kind, self.block = build_id, kind, block
        self.size = 0
        self._pending = bytearray()
        self._digests: list[np.ndarray] = []

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        if not len(view):
            return
        self.file.write(view)
        self.size += len(view)
        block = self.block
        at = 0
        if self._pending:
            # complete the block begun by earlier writes
            at = min(block - len(self._pending), len(view))
            self._pending += view[:at]
            if len(self._pending) < block:
                return
            self._digests.append(np.array([xxh3_64(self._pending)], dtype="<u8"))
            self._pending.clear()
        # whole blocks are hashed straight from the caller's buffer, in one compiled call;
        # only a tail is kept
        count = (len(view) - at) // block
        if count:
            self._digests.append(hash_slots(view, at, block, count))
        self._pending += view[at + count * block:]

    def digests(self) -> np.ndarray:
        """The block digests of the payload (``T.num_chunks(size, block)`` of them, as ``<u8``)."""
        tail = [np.array([xxh3_64(bytes(self._pending))], dtype="<u8")] \
            if self._pending or not self._digests else []
        return np.concatenate(self._digests + tail).astype("<u8", copy=False)

    def checksum(self) -> str:
        return f"{xxh3_64(self.digests().tobytes()):016x}"

    def commit(self, *, top: bool = False) -> T.FileEntry:
        """Finish the file: with ``top`` (``checksums.bin``), the digests of its payload's
        blocks are written after it (the top level of the digests: a reader checks one page of
        digests against them without fetching the rest); the entry's checksum is their hash
        either way."""
        digests = self.digests()
        entry = T.FileEntry(self.size + (digests.nbytes if top else 0), f"{xxh3_64(digests.tobytes()):016x}")
        if top:
            self.file.write(digests.tobytes())
        self.file.write(T.pack_trailer(self.build_id, self.kind))
        self.file.commit()
        return entry

    def abort(self) -> None:
        self.file.abort()


class ShardWriter:
    """Write one shard of a TOKSTREAM dataset, document by document.

    Args:
        folder: the dataset folder (created if missing); the shard goes to ``folder/name``.
        name: the shard's name (letters, digits, ``._-``; unique in the dataset). Shards are
            read in the order of their names unless :func:`assemble` is given an order.
        vocab_size: token ids must be below it; decides the token dtype (``uint16`` up to
            65536, else ``uint32``).
        metadata: store a ``metadata_id`` per token and the metadata blobs.
        eod_token: the end-of-document token id, if the data has one (recorded only).
        codec: the metadata serializer (``"json"``, ``"numpy"``, ``"bytes"``, ``"pickle"``).
        checksum_block: bytes per checksum block (a power of two from 512 to 16 MiB; default
            1 KiB): a reader checks, and a remote reader fetches, whole blocks.
        build_seed: derive the shard's build id (which ties its files together, and which
            caches key on) from this seed and ``name``, known before any document is written
            (distributed preparation binds parts to their plan this way), instead of from the
            shard's contents at close (the default: equal contents, equal id). A seed must
            only ever name the same contents (derive it from everything that decides them:
            inputs, tokenizer, options, version).

    Use as a context manager, or call :meth:`close` (commit) / :meth:`abort`.

    Raises:
        ConfigError, LimitExceededError: bad arguments.
        WriteError: a write failed (``errno`` kept); nothing is left under the final names.
    """

    def __init__(self, folder: str | os.PathLike[str], name: str, *, vocab_size: int, metadata: bool = False,
                 eod_token: int | None = None, codec: str = "json",
                 checksum_block: int = T.DEFAULT_CHECKSUM_BLOCK, build_seed: bytes | None = None) -> None:
        try:
            self.checksum_block = T.check_block(checksum_block)
        except FormatError as exc:
            raise ConfigError(exc.message, field="checksum_block") from None
        if not isinstance(name, str) or not T._SHARD_NAME.match(name):
            raise ConfigError(f"name: {name!r} is not a valid shard name (letters, digits, '._-')", field="name")
        self.token_dtype = T.token_dtype_for_vocab(vocab_size)
        self.vocab_size = vocab_size
        self.metadata = bool(metadata)
        if eod_token is not None and (isinstance(eod_token, bool) or not isinstance(eod_token, int)
                                      or not 0 <= eod_token < vocab_size):
            raise ConfigError(f"eod_token must be an id below vocab_size, got {eod_token!r}", field="eod_token")
        self.eod_token = eod_token
        if codec not in T.CODECS:
            raise ConfigError(f"codec must be one of {T.CODECS}, got {codec!r}", field="codec")
        self.codec = codec if self.metadata else None
        self.name = name
        self.path = make_folder(os.path.join(os.path.abspath(os.fspath(local_destination(folder, field="folder"))),
                                             name))
        if os.path.lexists(os.path.join(self.path, T.SHARD_MANIFEST_NAME)):
            raise ConfigError(f"name: shard {name!r} already exists in this dataset", path=self.path, field="name")
        if build_seed is not None and not isinstance(build_seed, bytes):
            raise ConfigError("build_seed must be bytes", field="build_seed")
        # derived from the seed and the name (distributed preparation binds parts to their
        # plan and unit this way); without a seed, from the shard's contents at close, so two
        # writes of the same documents with the same options get the same build id (a loader
        # state resumes on a re-tokenized copy). A placeholder until then: trailers are
        # written at close.
        self._seeded = build_seed is not None
        self._build = bytes(16) if build_seed is None else seeded_build_id(build_seed, name)
        self.dtype = np.dtype(T.record_dtype_descr(self.token_dtype, self.metadata))
        self.num_tokens = 0
        self.num_documents = 0
        self.num_metadata = 0
        self._meta_offset = 0
        self._files: dict[str, _HashedFile] = {}
        try:
            for fname in T.data_files(self.metadata):
                self._files[fname] = _HashedFile(os.path.join(self.path, fname), self._build, T.FILE_KINDS[fname],
                                                self.checksum_block)
        except BaseException:
            self.abort()
            raise
        if self.metadata:
            self._files["metadata.index"].write(np.zeros(1, dtype="<u8"))
        self.closed = False

    # -----------------------------------------------------------------------------------

    def _tokens(self, tokens: Any) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ConfigError(f"tokens: expected a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}",
                              field="tokens")
        if arr.size == 0:
            raise ConfigError("tokens: a document holds at least one token", field="tokens")
        lo = int(arr.min())
        hi = max_u32(arr) if arr.dtype == np.uint32 and arr.flags.c_contiguous else int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise LimitExceededError(f"tokens: id {bad} is outside the vocabulary [0, {self.vocab_size})",
                                     field="tokens")
        return arr

    def _add_metadata(self, obj: Any) -> int:
        if self.num_metadata >= T.MAX_INDEX_ENTRIES_PER_SHARD:
            raise LimitExceededError(f"metadata: a shard holds at most {T.MAX_INDEX_ENTRIES_PER_SHARD} blobs",
                                     field="metadata")
        blob = serialize_metadata(obj, self.codec or "json")
        self._files["metadata.bin"].write(blob)
        self._meta_offset += len(blob)
        self._files["metadata.index"].write(np.array([self._meta_offset], dtype="<u8"))
        self.num_metadata += 1
        return self.num_metadata - 1

    def add_document(self, tokens: Any, metadata: Any = None, *,
                     spans: Sequence[tuple[int, int, Any]] | None = None) -> int:
        """Append one document.

        Args:
            tokens: 1-D integer array-like of ids in ``[0, vocab_size)``, at least one.
            metadata: an object attached to every token of the document (metadata datasets).
            spans: ``(start, stop, obj)`` ranges of the document's tokens with their own
                metadata (a concept on a span, say): in order, non-overlapping, inside the
                document; they take precedence over ``metadata``. Tokens covered by neither
                get ``NO_METADATA`` (``0xFFFFFFFF``).

        Returns:
            The document's index in this shard.

        Raises:
            ConfigError: empty or non-integer tokens, bad spans, metadata on a dataset
                without metadata, or an object the codec cannot serialize.
            LimitExceededError: a token id outside the vocabulary, too many metadata blobs.
        """
        if self.closed:
            raise ConfigError("the shard is closed", path=self.path, field="shard")
        if self.num_documents >= T.MAX_INDEX_ENTRIES_PER_SHARD:
            raise LimitExceededError(f"documents: a shard holds at most {T.MAX_INDEX_ENTRIES_PER_SHARD} documents",
                                     field="documents")
        arr = self._tokens(tokens)
        n = arr.size
        if not self.metadata and (metadata is not None or spans):
            raise ConfigError("metadata: this dataset was created without metadata", field="metadata")
        checked: list[tuple[int, int, Any]] = []
        if spans:
            prev = 0
            for k, span in enumerate(spans):
                if not isinstance(span, tuple) or len(span) != 3:
                    raise ConfigError(f"spans[{k}]: expected (start, stop, metadata)", field="spans")
                a, b, obj = span
                if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, np.integer)) \
                        or not isinstance(b, (int, np.integer)) or not prev <= a < b <= n:
                    raise ConfigError(f"spans[{k}]: ({a}, {b}) must be increasing, non-overlapping and "
                                      f"within the document's {n} tokens", field="spans")
                checked.append((int(a), int(b), obj))
                prev = int(b)
        if self.num_metadata + len(checked) + (metadata is not None) > T.MAX_INDEX_ENTRIES_PER_SHARD:
            raise LimitExceededError(f"metadata: a shard holds at most {T.MAX_INDEX_ENTRIES_PER_SHARD} blobs",
                                     field="metadata")
        rec = np.empty(n, dtype=self.dtype)
        if self.metadata:
            rec["token"] = arr
            ids = rec["metadata_id"]
            ids[:] = self._add_metadata(metadata) if metadata is not None else T.NO_METADATA
            for a, b, obj in checked:
                ids[a:b] = self._add_metadata(obj)
        else:
            rec[...] = arr
        self._files["documents.index"].write(np.array([self.num_tokens], dtype="<u8"))
        self._files["tokens.bin"].write(rec)
        self.num_tokens += n
        self.num_documents += 1
        return self.num_documents - 1

    def add_documents(self, tokens: Any, lengths: Any) -> None:
        """Append many documents at once (a dataset without metadata): ``tokens`` holds them
        back to back, ``lengths`` their sizes (each at least 1). The same shard as as many
        :meth:`add_document` calls, in two writes.

        Raises:
            ConfigError: bad lengths, or a dataset with metadata.
            LimitExceededError: an id outside the vocabulary, or more documents than a shard
                holds.
        """
        if self.closed:
            raise ConfigError("the shard is closed", path=self.path, field="shard")
        if self.metadata:
            raise ConfigError("add_documents: a dataset with metadata takes add_document", field="metadata")
        lens = np.asarray(lengths)
        if lens.ndim != 1 or lens.dtype.kind not in "iu" or (lens.size and int(lens.min()) < 1):
            raise ConfigError("lengths: a 1-D array of positive document sizes", field="lengths")
        if not lens.size:
            return
        arr = self._tokens(tokens)
        if int(lens.sum()) != arr.size:
            raise ConfigError(f"lengths: they add up to {int(lens.sum())}, not the {arr.size} tokens", field="lengths")
        if self.num_documents + lens.size > T.MAX_INDEX_ENTRIES_PER_SHARD:
            raise LimitExceededError(f"documents: a shard holds at most {T.MAX_INDEX_ENTRIES_PER_SHARD} documents",
                                     field="documents")
        starts = np.empty(lens.size, dtype="<u8")
        starts[0] = self.num_tokens
        np.cumsum(lens[:-1], out=starts[1:])
        starts[1:] += self.num_tokens
        self._files["documents.index"].write(starts)
        self._files["tokens.bin"].write(np.ascontiguousarray(arr, dtype=self.dtype))
        self.num_tokens += arr.size
        self.num_documents += lens.size

    def options(self) -> dict[str, Any]:
        return {"token_dtype": self.token_dtype, "vocab_size": self.vocab_size, "metadata": self.metadata,
                "eod_token": self.eod_token, "codec": self.codec, "checksum_block": self.checksum_block}

    def _content_id(self) -> bytes:
        """The build id of a shard written without a seed: BLAKE2b-128 of its name, options,
        counts and the block digests of every data file (what a reader checks its bytes
        against), so equal contents give equal ids and any other contents another."""
        h = hashlib.blake2b(digest_size=16, person=b"zb-tokstream-id")
        h.update(json.dumps([self.name, self.options(), self.num_tokens, self.num_documents, self.num_metadata],
                            sort_keys=True).encode("utf-8"))
        for fname in sorted(self._files):
            f = self._files[fname]
            h.update(f"{fname}:{f.size}:".encode("utf-8"))
            h.update(f.digests().tobytes())
        return h.digest()

    def close(self) -> T.ShardEntry:
        """Finish the shard: commit every file, then ``shard.json``.

        Returns:
            The shard's manifest entry.
        """
        if self.closed:
            raise ConfigError("the shard is closed", path=self.path, field="shard")
        try:
            self._files["documents.index"].write(np.array([self.num_tokens], dtype="<u8"))
            if not self._seeded:
                self._build = self._content_id()
                for f in self._files.values():
                    f.build_id = self._build
            files = {fname: f.commit() for fname, f in self._files.items()}
            # the chunk digests of every data file, so that a reader checks chunks on first use
            sums = _HashedFile(os.path.join(self.path, "checksums.bin"), self._build, T.FILE_KINDS["checksums.bin"],
                               self.checksum_block)
            self._files["checksums.bin"] = sums
            for fname in T.data_files(self.metadata):
                sums.write(self._files[fname].digests())
            files["checksums.bin"] = sums.commit(top=True)
        except BaseException:
            self.abort()
            raise
        entry = T.ShardEntry(self.name, self._build.hex(), self.num_tokens, self.num_documents,
                             self.num_metadata, files)
        record = {"format": T.FORMAT_NAME, "version": T.VERSION, **self.options(), "shard": entry.to_dict()}
        with AtomicFile(os.path.join(self.path, T.SHARD_MANIFEST_NAME)) as f:
            f.write(json.dumps(record, indent=1, sort_keys=True).encode("utf-8"))
        self.closed = True
        return entry

    def abort(self) -> None:
        """Drop the shard: no file of it is left under its final name."""
        for f in self._files.values():
            f.abort()
        self.closed = True

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if self.closed:
            return
        if exc_type is None:
            self.close()
        else:
            self.abort()


def assemble(folder: str | os.PathLike[str], shards: Iterable[str] | None = None, *,
             loss_mask: str | None = None) -> T.DatasetManifest:
    """Write ``folder/manifest.json`` from the shards' ``shard.json`` records.

    Reads only the small ``shard.json`` files (token data is never touched), checks that every
    shard shares the dataset's options (dtype, vocabulary, metadata, end-of-document token,
    codec), and writes the manifest atomically.

    Args:
        folder: the dataset folder.
        shards: shard names in reading order (default: every sub-folder holding a
            ``shard.json``, sorted by name).
        loss_mask: the build id of the dataset's loss mask (``folder/loss_mask``, assembled
            before): the manifest names it, binding the mask to these tokens.

    Raises:
        NotFoundError: no shard, or a named shard without ``shard.json`` (unfinished).
        FormatError: a ``shard.json`` that is damaged or disagrees with the others.
    """
    folder = os.path.abspath(os.fspath(local_destination(folder, field="folder")))
    if shards is None:
        try:
            # a sub-folder with anything named shard.json is a finished shard (one whose
            # shard.json is not a regular file is damage, refused below, never skipped)
            names = sorted(e.name for e in os.scandir(folder)
                           if e.is_dir() and os.path.lexists(os.path.join(e.path, T.SHARD_MANIFEST_NAME)))
        except FileNotFoundError:
            raise NotFoundError("the dataset folder does not exist", path=folder, field="folder") from None
        except OSError as exc:
            raise ReadError(f"the dataset folder cannot be listed: {exc.strerror}", errno=exc.errno, path=folder,
                            field="folder") from None
    else:
        names = list(shards)
    if not names:
        raise NotFoundError("no finished shard (a folder with shard.json) in the dataset", path=folder,
                            field="shards")
    def records() -> Iterable[tuple[str, bytes, str]]:
        for name in names:
            path = os.path.join(folder, str(name), T.SHARD_MANIFEST_NAME)
            try:
                raw = read_document(path, limit=T.MAX_MANIFEST_BYTES, field="shard.json")
            except NotFoundError:
                raise NotFoundError(f"shard {name!r} has no shard.json (unfinished or missing)", path=path,
                                    field="shards") from None
            yield str(name), raw, path
    manifest = manifest_of(records(), loss_mask=loss_mask)
    with AtomicFile(os.path.join(folder, T.MANIFEST_NAME)) as f:
        f.write(json.dumps(manifest.to_dict(), indent=1).encode("utf-8"))
    return manifest


def manifest_of(shards: Iterable[tuple[str, bytes, Any]], *, loss_mask: str | None = None) -> T.DatasetManifest:
    """The dataset manifest of shards given as ``(name, shard.json bytes, where they came
    from)`` in reading order (what :func:`assemble` writes; also for shards at a URL), naming
    the build id of its loss mask if it has one.

    Raises:
        FormatError: a ``shard.json`` that is damaged, names another shard, or disagrees with
            the others (dtype, vocabulary, metadata, end-of-document token, codec).
    """
    options: dict[str, Any] = {}
    entries = []
    for name, raw, path in shards:
        opts, entry = T.parse_shard_manifest(raw, path=path)
        if entry.name != name:
            raise FormatError(f"shard.name: {entry.name!r} is not the folder's name {name!r}", path=path,
                              field="shard.name")
        options = options or opts
        if opts != options:
            diff = sorted(k for k in set(opts) | set(options) if opts.get(k) != options.get(k))
            raise FormatError(f"{diff[0]}: shard {name!r} has {opts.get(diff[0])!r} but the dataset has "
                              f"{options.get(diff[0])!r}", path=path, field=diff[0])
        entries.append(entry)
    if not entries:
        raise NotFoundError("no shard to assemble", field="shards")
    if loss_mask is not None and not (isinstance(loss_mask, str) and T._HEX128.match(loss_mask)):
        raise ConfigError(f"loss_mask: a build id of 32 hex digits, got {loss_mask!r}", field="loss_mask")
    ids, record = T.build_id_material(options, entries)
    build_id = f"{xxh3_64(ids):016x}{xxh3_64(record):016x}"
    return T.DatasetManifest(shards=tuple(entries), build_id=build_id, loss_mask=loss_mask, **options)


def spread_tag(name: str, digits: int) -> str:
    """The prefix tag of shard ``name`` spread over ``16 ** digits`` prefixes: the first
    ``digits`` hex digits of its name's XXH3 (stable: a rerun names its shards alike)."""
    return f"{xxh3_64(name.encode()):016x}"[:digits]


def _object_url(path: Any) -> bool:
    return isinstance(path, str) and "://" in path and path.partition("://")[0].lower() != "file"


class TokenStreamWriter:
    """Write a whole dataset from one process: shards of about ``shard_tokens`` tokens
    (a document never straddles two shards), then the manifest on :meth:`close`.

    Args:
        folder: the dataset folder.
        vocab_size, metadata, eod_token, codec, checksum_block, build_seed: as for
            :class:`ShardWriter`.
        shard_tokens: start a new shard once the current one holds this many tokens.
        prefix: shard names are ``f"{prefix}{k:05d}"``.
        spread: spread the shards over ``16 ** spread`` key prefixes (0-4; default 0: none):
            each shard's name starts with a tag of ``spread`` hex digits and ``_``, drawn from
            a hash of its name (``3a_shard-00001``), so a fleet's requests fall on many
            partitions of an object store instead of one (S3 serves about 5,500 GET/s per
            partitioned prefix). Readers find the shards from the manifest, with no listing,
            and count each tag's requests against its own budget
            (:func:`zerobatch.core.remote.prefix_of`).
        storage_options, overwrite: for a ``folder`` at a URL (``s3://bucket/prefix``, ...):
            the dataset is written to a local temporary folder and published there on
            :meth:`close` (shards first, ``manifest.json`` last: readers see the old dataset
            or the new one, see :func:`zerobatch.writers.remote.publish_tokstream`); a dataset
            already at the URL is replaced only with ``overwrite``.

    Raises:
        ConfigError: a dataset is already in ``folder`` (or at its URL, without ``overwrite``).
    """

    def __init__(self, folder: str | os.PathLike[str], *, vocab_size: int, metadata: bool = False,
                 eod_token: int | None = None, codec: str = "json", shard_tokens: int = T.DEFAULT_SHARD_TOKENS,
                 prefix: str = "shard-", checksum_block: int = T.DEFAULT_CHECKSUM_BLOCK,
                 build_seed: bytes | None = None, storage_options: dict[str, Any] | None = None,
                 overwrite: bool = False, spread: int = 0) -> None:
        if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
            raise ConfigError(f"shard_tokens must be a positive integer, got {shard_tokens!r}", field="shard_tokens")
        if isinstance(spread, bool) or not isinstance(spread, int) or not 0 <= spread <= 4:
            raise ConfigError(f"spread must be 0 to 4 hex digits of prefix, got {spread!r}", field="spread")
        self.spread = spread
        self.url: str | None = None
        self._staging: str | None = None
        self._publish = {"storage_options": storage_options, "overwrite": bool(overwrite)}
        folder = local_destination(folder, field="folder") if not _object_url(folder) else folder
        if _object_url(folder):
            from zerobatch.writers.remote import check_remote_destination, unique_shard_prefix
            self.url = str(folder).rstrip("/")
            if check_remote_destination(self.url, bool(overwrite), storage_options) and prefix == "shard-":
                # names no shard of the dataset there has: its readers keep their objects
                # until the new manifest is in place
                prefix = unique_shard_prefix()
        if not isinstance(prefix, str) or not T._SHARD_NAME.match("0" * (spread + 1) + prefix + "00000"):
            raise ConfigError(f"prefix: {prefix!r} does not make valid shard names", field="prefix")
        if self.url is not None:
            self._staging = tempfile.mkdtemp(prefix="zerobatch-upload-")
            folder = os.path.join(self._staging, "dataset")
        self._shard: ShardWriter | None = None
        try:
            self.folder = make_folder(folder)
            self._kw = {"vocab_size": vocab_size, "metadata": metadata, "eod_token": eod_token, "codec": codec,
                        "checksum_block": checksum_block, "build_seed": build_seed}
            self.shard_tokens = shard_tokens
            self.prefix = prefix
            self.names: list[str] = []
            self._clear_unfinished_run()
            self._open_shard()
        except BaseException:
            self._drop_staging()         # a refused argument leaves no staging folder behind
            raise

    def _clear_unfinished_run(self) -> None:
        """A rerun after a killed run: with no ``manifest.json`` (nothing was committed), the
        shards a previous run of this writer left (``<prefix>NNNNN``, finished or not) are
        removed, so the rerun starts clean. A finished dataset is never touched."""
        if os.path.lexists(os.path.join(self.folder, T.MANIFEST_NAME)):
            raise ConfigError("folder: already holds a finished dataset (manifest.json); write into a new folder",
                              path=self.folder, field="folder")
        pattern = re.compile(r"(?:[0-9a-f]{1,4}_)?" + re.escape(self.prefix) + r"\d{5,}")
        for entry in os.listdir(self.folder):
            path = os.path.join(self.folder, entry)
            if pattern.fullmatch(entry) and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)

    def _open_shard(self) -> None:
        name = f"{self.prefix}{len(self.names):05d}"
        if self.spread:
            name = f"{spread_tag(name, self.spread)}_{name}"
        self._shard = ShardWriter(self.folder, name, **self._kw)
        self.names.append(name)

    def add_document(self, tokens: Any, metadata: Any = None, *,
                     spans: Sequence[tuple[int, int, Any]] | None = None) -> None:
        """Append one document (see :meth:`ShardWriter.add_document`)."""
        if self._shard is None:
            raise ConfigError("the writer is closed", path=self.folder, field="writer")
        sh = self._shard
        blobs = (metadata is not None) + len(spans or ())
        if sh.num_documents and (sh.num_tokens >= self.shard_tokens
                                 or sh.num_documents >= T.MAX_INDEX_ENTRIES_PER_SHARD
                                 or sh.num_metadata + blobs > T.MAX_INDEX_ENTRIES_PER_SHARD):
            sh.close()
            self._open_shard()
        self._shard.add_document(tokens, metadata, spans=spans)

    def add_documents(self, tokens: Any, lengths: Any) -> None:
        """Append many documents at once (see :meth:`ShardWriter.add_documents`), cut into
        shards exactly where as many :meth:`add_document` calls would cut them."""
        if self._shard is None:
            raise ConfigError("the writer is closed", path=self.folder, field="writer")
        lens = np.asarray(lengths)
        if lens.ndim != 1 or lens.dtype.kind not in "iu" or (lens.size and int(lens.min()) < 1):
            raise ConfigError("lengths: a 1-D array of positive document sizes", field="lengths")
        arr = np.asarray(tokens)
        if arr.ndim != 1 or int(lens.sum()) != arr.size:
            raise ConfigError(f"lengths: they add up to {int(lens.sum())}, not the {arr.size} tokens", field="lengths")
        before = np.zeros(lens.size + 1, np.int64)       # tokens before each document
        np.cumsum(lens, out=before[1:])
        i = 0
        while i < lens.size:
            sh = self._shard
            # the documents this shard takes: while it holds fewer than shard_tokens tokens
            # (and fewer than the index limit) when each is added, as add_document decides
            room = max(0, T.MAX_INDEX_ENTRIES_PER_SHARD - sh.num_documents)
            full = np.searchsorted(before[i:], self.shard_tokens - sh.num_tokens + before[i], side="left")
            j = min(lens.size, i + min(int(full), room))
            if j == i:
                if sh.num_documents:
                    sh.close()
                    self._open_shard()
                    continue
                j = i + 1                             # an empty shard takes a document whatever its size
            sh.add_documents(arr[before[i]:before[j]], lens[i:j])
            i = j

    def close(self, *, loss_mask: T.DatasetManifest | None = None) -> T.DatasetManifest:
        """Finish the last shard and write the manifest.

        Args:
            loss_mask: the manifest of this dataset's loss mask (a writer of
                ``folder/loss_mask`` closed before this one): this manifest names its build
                id, so a reader refuses any other mask, or none.
        """
        if self._shard is None:
            raise ConfigError("the writer is closed", path=self.folder, field="writer")
        if loss_mask is not None and self.url is not None:
            self.abort()
            raise ConfigError("loss_mask: a chat dataset goes to a URL with its mask: write both into a local folder "
                              "(the mask in folder/loss_mask), then publish_tokstream(folder, url)",
                              field="loss_mask")
        shard, self._shard = self._shard, None
        try:
            if shard.num_documents == 0 and len(self.names) > 1:
                shard.abort()
                os.rmdir(shard.path)
                self.names.pop()
            else:
                shard.close()
            manifest = assemble(self.folder, self.names,
                                loss_mask=None if loss_mask is None else loss_mask.build_id)
            if self.url is not None:
                from zerobatch.writers.remote import publish_tokstream
                publish_tokstream(self.folder, self.url, **self._publish)   # type: ignore[arg-type]
        finally:
            self._drop_staging()        # published, or failed: nothing stays in the temporary folder
        return manifest

    def abort(self) -> None:
        if self._shard is not None:
            self._shard.abort()
            self._shard = None
        self._drop_staging()

    def _drop_staging(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def __enter__(self) -> TokenStreamWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if self._shard is None:
            return
        if exc_type is None:
            self.close()
        else:
            self.abort()
