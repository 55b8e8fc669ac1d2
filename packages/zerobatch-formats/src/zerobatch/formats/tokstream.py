"""TOKSTREAM: sharded token streams with documents and per-token metadata.

The single source of truth for the layout in ``docs/formats/tokstream.md``: file names,
the trailer every file ends with, the dtypes, limits, and the manifest (``manifest.json``
for the dataset, ``shard.json`` per shard) with its strict parser. Pure Python; the readers
and writers build on it.

A dataset is a folder::

    manifest.json                 the dataset: dtypes, counts, the shards in order
    <shard>/shard.json            one shard's own record (the same entry as in the manifest)
    <shard>/tokens.bin            N records: token (u16 or u32) [+ metadata_id u32], packed
    <shard>/documents.index       D + 1 u64: token offset of each document start, then N
    <shard>/metadata.index        M + 1 u64: byte offset of each metadata blob, then its size
    <shard>/metadata.bin          the serialized metadata blobs, back to back

Every data file ends with a 32-byte trailer (magic, the shard's build id, the file kind), so
its payload starts at byte 0 (``np.memmap`` reads it as written) and a file from another
build is refused at open after one small read. All integers are little-endian.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from collections.abc import Sequence
from typing import Any

from zerobatch.formats.errors import CorruptError, FormatError, LimitExceededError, UnsupportedVersionError
from zerobatch.formats.registry import Format
from zerobatch.formats.strict_json import loads_strict

__all__ = [
    "FORMAT",
    "CODECS",
    "CHECKSUM_CHUNK",
    "DEFAULT_CHECKSUM_BLOCK",
    "MAX_CHECKSUM_BLOCK",
    "MIN_CHECKSUM_BLOCK",
    "VERSIONS",
    "DATA_FILES",
    "FILE_KINDS",
    "digest_sizes",
    "FORMAT_NAME",
    "MANIFEST_NAME",
    "LOSS_MASK_DIR",
    "MAX_INDEX_ENTRIES_PER_SHARD",
    "MAX_MANIFEST_BYTES",
    "MAX_METADATA_PER_SHARD",
    "MAX_SHARDS",
    "NO_METADATA",
    "SHARD_MANIFEST_NAME",
    "TRAILER_MAGIC",
    "TRAILER_SIZE",
    "TRAILER_STRUCT",
    "VERSION",
    "DatasetManifest",
    "FileEntry",
    "ShardEntry",
    "pack_trailer",
    "chunk_digest_ranges",
    "data_files",
    "num_chunks",
    "build_id_material",
    "check_block",
    "parse_manifest",
    "parse_shard_manifest",
    "record_dtype_descr",
    "record_itemsize",
    "token_dtype_for_vocab",
    "unpack_trailer",
]

#: ``format`` field of every manifest.
FORMAT_NAME = "zerobatch-tokstream"
#: The format version this release writes.
VERSION = 2
#: The format versions this release reads: 1 (16 MiB checksum chunks), 2 (the checksum block
#: size recorded in the manifest, ``checksum_block``).
VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
SHARD_MANIFEST_NAME = "shard.json"
#: Files of a shard and their kind codes in the trailer.
FILE_KINDS = {"tokens.bin": 1, "documents.index": 2, "metadata.index": 3, "metadata.bin": 4, "checksums.bin": 5}
#: The data files, in the order ``checksums.bin`` lists their chunk digests.
DATA_FILES = ("tokens.bin", "documents.index", "metadata.index", "metadata.bin")
#: Trailer: magic, shard build id (16 bytes), file kind (u32), reserved (u32, zero).
TRAILER_STRUCT = "<8s16sII"
TRAILER_SIZE = struct.calcsize(TRAILER_STRUCT)
TRAILER_MAGIC = b"ZBTSTRL1"
#: ``metadata_id`` of a token no metadata span covers.
NO_METADATA = 0xFFFFFFFF
#: Metadata blobs per shard: ids are shard-local u32, NO_METADATA reserved.
MAX_METADATA_PER_SHARD = NO_METADATA - 1
#: Shards per dataset (the manifest is read whole at open).
MAX_SHARDS = 1 << 20
#: Largest manifest accepted (about 300 bytes per shard).
#: Tokens per shard the writers start a new shard at, by default (``TokenStreamWriter``,
#: ``zerobatch convert --shard-tokens``): 2**28, 512 MiB-1 GiB of tokens per shard file.
DEFAULT_SHARD_TOKENS = 1 << 28
MAX_MANIFEST_BYTES = 1 << 30
#: File checksums are XXH3-64 over the XXH3-64 digests of consecutive blocks of the file
#: (``checksums.bin`` keeps the block digests, so a reader checks each block on first use).
#: Version 1 datasets use blocks of this size (16 MiB).
CHECKSUM_CHUNK = 1 << 24
#: Version 2 records its block size (``checksum_block``, a power of two in
#: [MIN_CHECKSUM_BLOCK, MAX_CHECKSUM_BLOCK]); writers use this one by default: 1 KiB, so that a
#: random 2049-token window (4 KiB of uint16) is checked, and fetched from object storage, with
#: about 1 KiB of neighbouring bytes instead of a 16 MiB chunk. The digests cost 8 bytes per
#: block (0.8 % of the data).
DEFAULT_CHECKSUM_BLOCK = 1 << 10
MIN_CHECKSUM_BLOCK = 1 << 9
MAX_CHECKSUM_BLOCK = 1 << 24
#: Documents (and metadata blobs) per shard a writer puts in one shard: keeps every index
#: file within 64 MiB, so a reader checks each index in full at open.
MAX_INDEX_ENTRIES_PER_SHARD = (1 << 23) - 1
#: Metadata serializers a writer may record; a reader needs the same one to decode.
CODECS = ("json", "numpy", "bytes", "pickle")

#: The folder of a chat dataset's loss mask (a TOKSTREAM dataset of one 0/1 per token).
LOSS_MASK_DIR = "loss_mask"
_HEX128 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{16}$")
_SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_U64 = 2**64 - 1
_I63 = 2**63 - 1


def token_dtype_for_vocab(vocab_size: int) -> str:
    """``"uint16"`` for vocabularies up to 65536 ids, else ``"uint32"`` (up to 2**32)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= 2**32:
        raise LimitExceededError(f"vocab_size must be an integer in [1, 2**32], got {vocab_size!r}",
                                 field="vocab_size")
    return "uint16" if vocab_size <= 2**16 else "uint32"


def record_dtype_descr(token_dtype: str, metadata: bool) -> list[tuple[str, str]] | str:
    """The NumPy dtype description of one ``tokens.bin`` record (packed, little-endian)."""
    code = {"uint16": "<u2", "uint32": "<u4"}[token_dtype]
    return [("token", code), ("metadata_id", "<u4")] if metadata else code


def pack_trailer(build_id: bytes, kind: int) -> bytes:
    """The 32-byte trailer of a shard file of ``kind`` (see :data:`FILE_KINDS`)."""
    return struct.pack(TRAILER_STRUCT, TRAILER_MAGIC, build_id, kind, 0)


def unpack_trailer(raw: bytes, *, path: Any = None) -> tuple[bytes, int]:
    """``(build_id, kind)`` of a trailer.

    Raises:
        CorruptError: wrong magic or non-zero reserved bytes.
    """
    if len(raw) != TRAILER_SIZE:
        raise CorruptError(f"trailer: {len(raw)} bytes, expected {TRAILER_SIZE}", path=path, field="trailer")
    magic, build_id, kind, reserved = struct.unpack(TRAILER_STRUCT, raw)
    if magic != TRAILER_MAGIC:
        raise CorruptError(f"trailer: magic {magic!r} is not {TRAILER_MAGIC!r} (not a zerobatch "
                           "tokstream file, or truncated)", path=path, field="trailer")
    if reserved:
        raise CorruptError("trailer: reserved bytes are not zero", path=path, field="trailer")
    return build_id, kind


# ---------------------------------------------------------------------------------------
# manifests


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One data file of a shard: payload size (without the trailer) and checksum."""

    size: int
    xxh3: str

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "xxh3": self.xxh3}


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One shard: where it is, what it holds, and its files."""

    name: str
    build_id: str
    num_tokens: int
    num_documents: int
    num_metadata: int
    files: dict[str, FileEntry]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "build_id": self.build_id,
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "num_metadata": self.num_metadata,
            "files": {k: v.to_dict() for k, v in sorted(self.files.items())},
        }


@dataclasses.dataclass(frozen=True)
class DatasetManifest:
    """The dataset: its dtypes and options, and its shards in reading order."""

    token_dtype: str
    vocab_size: int
    metadata: bool
    eod_token: int | None
    codec: str | None
    build_id: str
    shards: tuple[ShardEntry, ...]
    #: the checksum block size (version 2); ``None`` for a version 1 dataset (16 MiB chunks)
    checksum_block: int | None = None
    #: the build id of the dataset's loss mask (``loss_mask/``, ``convert --chat``), which
    #: binds the mask to these tokens: a mask with another build id, or none, is damage.
    #: ``None``: no mask, or one written before masks were bound (matched by geometry only).
    #: Not covered by ``build_id`` (older releases read the tokens of a chat dataset).
    loss_mask: str | None = None

    @property
    def version(self) -> int:
        return 1 if self.checksum_block is None else 2

    @property
    def block(self) -> int:
        """Bytes per checksum block (16 MiB for version 1)."""
        return CHECKSUM_CHUNK if self.checksum_block is None else self.checksum_block

    @property
    def top_digests(self) -> bool:
        """Whether ``checksums.bin`` ends with top-level digests (version 2)."""
        return self.checksum_block is not None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.shards)

    def options(self) -> dict[str, Any]:
        """The dataset-wide fields every shard must share (``checksum_block`` from version 2
        on: a version 1 build id does not cover it)."""
        out = {"token_dtype": self.token_dtype, "vocab_size": self.vocab_size,
               "metadata": self.metadata, "eod_token": self.eod_token, "codec": self.codec}
        if self.checksum_block is not None:
            out["checksum_block"] = self.checksum_block
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            **self.options(),
            "build_id": self.build_id,
            **({"loss_mask": {"build_id": self.loss_mask}} if self.loss_mask is not None else {}),
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "shards": [s.to_dict() for s in self.shards],
        }


def build_id_material(options: dict[str, Any], shards: Sequence[ShardEntry]) -> tuple[bytes, bytes]:
    """What a dataset's ``build_id`` hashes: its 32 hex digits are XXH3-64 of the first value
    (the shards' build ids, back to back) then XXH3-64 of the second (the canonical JSON of
    the dataset options and every shard entry). Every field of ``manifest.json`` that token
    reads depend on is thus covered, and a reader recomputes it at open. (``loss_mask`` is
    not: it is checked against the mask itself, and a release that predates it still reads
    the tokens of a chat dataset.)"""
    ids = b"".join(bytes.fromhex(e.build_id) for e in shards)
    record: dict[str, Any] = {"options": {k: options[k] for k in sorted(options)},
                              "shards": [e.to_dict() for e in shards]}
    return ids, json.dumps(record, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _load_json(raw: bytes, path: Any) -> dict[str, Any]:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise LimitExceededError(f"manifest: {len(raw)} bytes exceeds {MAX_MANIFEST_BYTES}", path=path,
                                 field="manifest")
    value = loads_strict(raw, error=CorruptError, field="manifest", path=path)
    if not isinstance(value, dict):
        raise CorruptError("manifest: expected a JSON object", path=path, field="manifest")
    return value


class _Fields:
    """Typed access to a JSON object's fields; every error names the file and the field."""

    def __init__(self, d: dict[str, Any], path: Any, prefix: str = "") -> None:
        self.d, self.path, self.prefix = d, path, prefix

    def _fail(self, name: str, msg: str) -> FormatError:
        field = self.prefix + name
        return CorruptError(f"{field}: {msg}", path=self.path, field=field)

    def get(self, name: str) -> Any:
        if name not in self.d:
            raise self._fail(name, "missing")
        return self.d[name]

    def int(self, name: str, lo: int = 0, hi: int = _I63, *, optional: bool = False) -> int | None:
        if optional and self.d.get(name) is None:
            return None
        v = self.get(name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._fail(name, f"must be an integer, got {v!r}")
        if not lo <= v <= hi:
            raise self._fail(name, f"must be between {lo} and {hi}, got {v}")
        return v

    def str(self, name: str, pattern: re.Pattern[str] | None = None, choices: tuple[str, ...] | None = None,
            *, optional: bool = False) -> str | None:
        if optional and self.d.get(name) is None:
            return None
        v = self.get(name)
        if not isinstance(v, str) or (pattern is not None and not pattern.match(v)) \
                or (choices is not None and v not in choices):
            raise self._fail(name, f"invalid value {v!r}")
        return v

    def bool(self, name: str) -> bool:
        v = self.get(name)
        if not isinstance(v, bool):
            raise self._fail(name, f"must be true or false, got {v!r}")
        return v

    def dict(self, name: str) -> dict[str, Any]:
        v = self.get(name)
        if not isinstance(v, dict):
            raise self._fail(name, f"must be an object, got {type(v).__name__}")
        return v

    def list(self, name: str) -> list[Any]:
        v = self.get(name)
        if not isinstance(v, list):
            raise self._fail(name, f"must be a list, got {type(v).__name__}")
        return v


def _check_header(f: _Fields) -> int:
    fmt = f.get("format")
    if fmt != FORMAT_NAME:
        raise CorruptError(f"format: {fmt!r} is not {FORMAT_NAME!r}", path=f.path, field="format")
    version = f.get("version")
    if isinstance(version, bool) or version not in VERSIONS:
        raise UnsupportedVersionError(f"version: {version!r} is not supported (this release reads "
                                      f"{', '.join(map(str, VERSIONS))})", path=f.path, field="version")
    return int(version)


def check_block(block: Any, *, path: Any = None, field: str = "checksum_block") -> int:
    """``block`` as a checksum block size: a power of two in [512, 16 MiB].

    Raises:
        CorruptError: another value (``ConfigError`` is the writers' concern).
    """
    if isinstance(block, bool) or not isinstance(block, int) or not MIN_CHECKSUM_BLOCK <= block <= MAX_CHECKSUM_BLOCK \
            or block & (block - 1):
        raise CorruptError(f"{field}: must be a power of two in [{MIN_CHECKSUM_BLOCK}, {MAX_CHECKSUM_BLOCK}], "
                           f"got {block!r}", path=path, field=field)
    return block


def _options(f: _Fields, version: int) -> dict[str, Any]:
    token_dtype = f.str("token_dtype", choices=("uint16", "uint32"))
    vocab = f.int("vocab_size", 1, 2**32)
    if token_dtype != token_dtype_for_vocab(vocab):
        raise CorruptError(f"token_dtype: {token_dtype} does not match vocab_size {vocab}", path=f.path,
                           field="token_dtype")
    metadata = f.bool("metadata")
    eod = f.int("eod_token", 0, vocab - 1, optional=True)
    codec = f.str("codec", choices=CODECS, optional=True)
    if metadata and codec is None:
        raise CorruptError("codec: a dataset with metadata names its codec", path=f.path, field="codec")
    out = {"token_dtype": token_dtype, "vocab_size": vocab, "metadata": metadata, "eod_token": eod,
           "codec": codec}
    if version >= 2:
        out["checksum_block"] = check_block(f.get("checksum_block"), path=f.path)
    elif "checksum_block" in f.d:
        raise CorruptError("checksum_block: version 1 has none (16 MiB chunks)", path=f.path,
                           field="checksum_block")
    return out


def num_chunks(size: int, block: int = CHECKSUM_CHUNK) -> int:
    """Checksum blocks of ``block`` bytes of a payload of ``size`` bytes (an empty payload has
    one, of 0 bytes)."""
    return max(1, -(-size // block))


def digest_sizes(files: dict[str, FileEntry], metadata: bool, block: int = CHECKSUM_CHUNK,
                 top: bool = False) -> tuple[int, int]:
    """``(D, T)``: the bytes of ``checksums.bin``'s block digests of the data files, and of the
    top-level digests after them (version 2: the digest of each ``block`` bytes of the first
    part, so that a reader checks a page of digests without fetching them all; version 1:
    none)."""
    d = 8 * sum(num_chunks(files[f].size, block) for f in data_files(metadata))
    return d, (8 * num_chunks(d, block) if top else 0)


def data_files(metadata: bool) -> tuple[str, ...]:
    """The data files of a shard, in ``checksums.bin`` order."""
    return DATA_FILES if metadata else DATA_FILES[:2]


def chunk_digest_ranges(files: dict[str, FileEntry], metadata: bool,
                        block: int = CHECKSUM_CHUNK) -> dict[str, tuple[int, int]]:
    """Per data file, the ``[first, stop)`` positions of its block digests in ``checksums.bin``
    (u64 entries)."""
    out, at = {}, 0
    for fname in data_files(metadata):
        n = num_chunks(files[fname].size, block)
        out[fname] = (at, at + n)
        at += n
    return out


def record_itemsize(token_dtype: str, metadata: bool) -> int:
    """Bytes per ``tokens.bin`` record: 2 or 4 for the token, plus 4 for a metadata id."""
    return (2 if token_dtype == "uint16" else 4) + (4 if metadata else 0)


def _shard(d: Any, path: Any, prefix: str, metadata: bool, itemsize: int, block: int, top: bool) -> ShardEntry:
    if not isinstance(d, dict):
        raise CorruptError(f"{prefix}: must be an object", path=path, field=prefix.rstrip("."))
    f = _Fields(d, path, prefix)
    name = f.str("name", _SHARD_NAME)
    build_id = f.str("build_id", _HEX128)
    num_tokens = f.int("num_tokens")
    num_documents = f.int("num_documents", 0, num_tokens)
    num_metadata = f.int("num_metadata", 0, MAX_METADATA_PER_SHARD if metadata else 0)
    raw_files = f.dict("files")
    wanted = set(data_files(metadata)) | {"checksums.bin"}
    if set(raw_files) != wanted:
        extra = sorted(set(raw_files) ^ wanted)
        raise CorruptError(f"{prefix}files: expected {sorted(wanted)}, differs in {extra}", path=path,
                           field=f"{prefix}files")
    files = {}
    for fname, fd in raw_files.items():
        if not isinstance(fd, dict):
            raise CorruptError(f"{prefix}files.{fname}: must be an object", path=path, field=f"{prefix}files.{fname}")
        ff = _Fields(fd, path, f"{prefix}files.{fname}.")
        files[fname] = FileEntry(ff.int("size"), ff.str("xxh3", _HEX64))
    expected = {"tokens.bin": num_tokens * itemsize, "documents.index": (num_documents + 1) * 8}
    if metadata:
        expected["metadata.index"] = (num_metadata + 1) * 8
    expected["checksums.bin"] = sum(digest_sizes(files, metadata, block, top))
    for fname, size in expected.items():
        if files[fname].size != size:
            raise CorruptError(f"{prefix}files.{fname}.size: {files[fname].size} bytes does not match the "
                               f"shard's counts ({size} expected)", path=path, field=f"{prefix}files.{fname}.size")
    return ShardEntry(name, build_id, num_tokens, num_documents, num_metadata, files)


def parse_shard_manifest(raw: bytes, *, path: Any = None) -> tuple[dict[str, Any], ShardEntry]:
    """``(dataset options, shard entry)`` from a ``shard.json``.

    Raises:
        CorruptError, UnsupportedVersionError, LimitExceededError: naming the field.
    """
    d = _load_json(raw, path)
    f = _Fields(d, path)
    options = _options(f, _check_header(f))
    itemsize = record_itemsize(options["token_dtype"], options["metadata"])
    return options, _shard(f.dict("shard"), path, "shard.", options["metadata"], itemsize,
                           options.get("checksum_block", CHECKSUM_CHUNK), "checksum_block" in options)


def parse_manifest(raw: bytes, *, path: Any = None) -> DatasetManifest:
    """The dataset manifest, every field type- and range-checked.

    Raises:
        CorruptError: a field missing, of the wrong type or out of range, totals that do not
            add up, duplicate shard names.
        UnsupportedVersionError: another format version.
        LimitExceededError: too many shards or a manifest too large.
    """
    d = _load_json(raw, path)
    f = _Fields(d, path)
    options = _options(f, _check_header(f))
    build_id = f.str("build_id", _HEX128)
    loss_mask = None
    if "loss_mask" in d:
        loss_mask = _Fields(f.dict("loss_mask"), path, "loss_mask.").str("build_id", _HEX128)
    raw_shards = f.list("shards")
    if len(raw_shards) > MAX_SHARDS:
        raise LimitExceededError(f"shards: {len(raw_shards)} exceeds {MAX_SHARDS}", path=path, field="shards")
    itemsize = record_itemsize(options["token_dtype"], options["metadata"])
    block = options.get("checksum_block", CHECKSUM_CHUNK)
    shards = tuple(_shard(s, path, f"shards[{i}].", options["metadata"], itemsize, block, "checksum_block" in options)
                   for i, s in enumerate(raw_shards))
    names = [s.name for s in shards]
    if len(set(names)) != len(names):
        raise CorruptError("shards: duplicate shard names", path=path, field="shards")
    total_tokens = sum(s.num_tokens for s in shards)
    if total_tokens > _I63:
        raise LimitExceededError(f"num_tokens: {total_tokens} exceeds 2**63 - 1", path=path, field="num_tokens")
    m = DatasetManifest(shards=shards, build_id=build_id, loss_mask=loss_mask, **options)
    if f.int("num_tokens") != m.num_tokens:
        raise CorruptError(f"num_tokens: {d['num_tokens']} is not the shards' sum {m.num_tokens}", path=path,
                           field="num_tokens")
    if f.int("num_documents") != m.num_documents:
        raise CorruptError(f"num_documents: {d['num_documents']} is not the shards' sum {m.num_documents}",
                           path=path, field="num_documents")
    return m


#: This format in the registry (:mod:`zerobatch.formats.registry`).
FORMAT = Format(
    name="tokstream", title="TOKSTREAM", layout="folder", markers=(MANIFEST_NAME,),
    spec="docs/formats/tokstream.md",
    summary="sharded token streams with documents and per-token metadata, windows at any position",
    reader="zerobatch.readers.tokstream:TokenStreamReader", writer="zerobatch.writers.tokstream:TokenStreamWriter",
    kernel="zerobatch.core._tokstream",
    sources=("zerobatch.adapters.sources.tokstream:TokenWindows",
             "zerobatch.adapters.sources.tokstream:TokenDocuments"),
    cli="zerobatch.cli.formats.tokstream:TokStream",
    documents="zerobatch.prepare.formats.tokstream:TokenStreamDocuments",
    convert="zerobatch.prepare.formats.tokstream:write",
    url_check="zerobatch.writers.remote:check_remote_destination",
    row_ids=True, doc_metadata=True, streams=("tokens", LOSS_MASK_DIR), task_parts=True,
    publish="zerobatch.writers.remote:publish_tokstream")
