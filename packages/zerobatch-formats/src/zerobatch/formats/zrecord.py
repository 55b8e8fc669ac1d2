"""ZRECORD: a multi-field record store with chunks and per-record compression.

The single source of truth for the layout in ``docs/formats/zrecord.md``: file names, the
offset-table entry, the record container, the commit file, the journal, the fields and the
strict ``meta.json`` parser. Pure Python; the readers and writers build on it.

A store is a folder::

    meta.json            length, chunks (count, records per chunk, the unfull ones), fields, the
                     store's identity and a checksum of all of it
    commit.zr            the committed length / chunk count / generation / epoch, seqlocked
    <field>.offset       one 16-byte entry per record: chunk_id u32, offset u64, length u32
    <field>.check        one CRC-32 per entry (over the entry, its index and field number)
    chunk/<id>.zr        record containers back to back, 16-byte aligned
    writer.lock          held (flock, exclusive) by the one writer
    switch.lock          held exclusive while a rebalance swaps files, shared by opening readers
    epoch-<E>.lock       held shared by every reader of epoch E (old chunks live until free)
    journal.zr           only between a commit point and the end of applying it

All integers are little-endian.

Every file carries the store's identity (version 2): ``store_id``, a random nonzero u64 drawn
when the store is created, is XORed into each record's xxh3, each entry's CRC-32 (folded to 32
bits) and the commit file's xxh3, and ``meta.json`` states it under its own checksum. A chunk,
a table or a commit file copied from another store of the same layout fails its check.
Version 1 stores (zerobatch 0.1: no identity, no ``meta.json`` checksum) are read with a key of
0; writers refuse them (a writer acts on ``meta.json`` and must be able to trust it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
from zerobatch.formats.errors import ConfigError, CorruptError, LimitExceededError, UnsupportedVersionError
from zerobatch.formats.registry import Format
from zerobatch.formats.strict_json import loads_strict

__all__ = [
    "FORMAT",
    "CHUNK_DIR",
    "CODECS",
    "COMMIT_NAME",
    "COMMIT_SIZE",
    "COMMIT_STRUCT",
    "COMMIT_MAGIC",
    "DTYPES",
    "ENTRY_DTYPE",
    "ENTRY_SIZE",
    "FORMAT_NAME",
    "JOURNAL_HEADER",
    "JOURNAL_KIND_COMMIT",
    "JOURNAL_KIND_REBALANCE",
    "JOURNAL_MAGIC",
    "JOURNAL_NAME",
    "JOURNAL_UPDATE_DTYPE",
    "MAX_FIELDS",
    "MAX_META_BYTES",
    "META_NAME",
    "OFFSET_GROW_ENTRIES",
    "RECORD_ALIGN",
    "RECORD_HEADER",
    "RECORD_HEADER_SIZE",
    "RECORD_MAGIC",
    "SWITCH_LOCK_NAME",
    "VERSION",
    "WRITER_LOCK_NAME",
    "CHUNK_GROW_BYTES",
    "CHECK_SIZE",
    "check_name",
    "entry_checks",
    "FieldSpec",
    "StoreMeta",
    "chunk_name",
    "epoch_lock_name",
    "offset_name",
    "pack_commit",
    "parse_meta",
    "record_span",
    "unpack_commit",
]

FORMAT_NAME = "zerobatch-zrecord"
VERSION = 2
#: Versions readers accept (1: no store identity, no meta.json checksum; read only).
READ_VERSIONS = (1, 2)
META_NAME = "meta.json"
COMMIT_NAME = "commit.zr"
JOURNAL_NAME = "journal.zr"
WRITER_LOCK_NAME = "writer.lock"
SWITCH_LOCK_NAME = "switch.lock"
CHUNK_DIR = "chunk"
MAX_META_BYTES = 1 << 20
MAX_FIELDS = 256
#: Offset tables grow this many entries at a time (16 MiB), chunk files this many bytes.
OFFSET_GROW_ENTRIES = 1 << 20
CHUNK_GROW_BYTES = 1 << 30

#: One offset-table entry. ``length`` 0 means "absent".
ENTRY_DTYPE = np.dtype([("chunk", "<u4"), ("offset", "<u8"), ("length", "<u4")], align=False)
ENTRY_SIZE = ENTRY_DTYPE.itemsize

#: The record container: xxh3 of bytes [8, physical_length), logical length, codec, magic,
#: field number; then the stored payload (raw bytes, or a raw deflate stream).
RECORD_HEADER = struct.Struct("<QIBBH")
RECORD_HEADER_SIZE = RECORD_HEADER.size
RECORD_MAGIC = 0x5A
#: Records start on 16-byte boundaries, so a raw payload (at +16) is aligned for any dtype.
RECORD_ALIGN = 16
CODECS = {"raw": 0, "flate": 1}

#: The commit file: magic, version, flags (none defined: 0), seq (odd while a writer applies
#: changes in place),
#: length, num_chunks, generation, epoch, xxh3 of the 32 bytes from ``length`` to ``epoch``.
COMMIT_STRUCT = struct.Struct("<8sIIQQQQQQ")
COMMIT_SIZE = 4096
COMMIT_MAGIC = b"ZRCOMMIT"

#: The journal: magic, kind, reserved, generation, epoch, length, num_chunks, number of
#: updates, bytes of the JSON part, xxh3 of everything after this header.
JOURNAL_HEADER = struct.Struct("<8sIIQQQQQQQ")
JOURNAL_MAGIC = b"ZRJOURN1"
JOURNAL_KIND_COMMIT = 1
JOURNAL_KIND_REBALANCE = 2
#: One in-place change of an offset table, as the journal lists it.
JOURNAL_UPDATE_DTYPE = np.dtype([("index", "<u8"), ("field", "<u4"), ("chunk", "<u4"),
                                 ("offset", "<u8"), ("length", "<u4"), ("pad", "<u4")])

#: Field dtypes: the seed's names, each a little-endian NumPy dtype. ``bytes`` is untyped.
DTYPES = {
    "bool": "|b1", "u8": "|u1", "i8": "|i1", "u16": "<u2", "i16": "<i2", "u32": "<u4",
    "i32": "<i4", "u64": "<u8", "i64": "<i8", "f16": "<f2", "f32": "<f4", "f64": "<f8",
    "bytes": "|u1",
}
_NUMPY_TO_NAME = {np.dtype(v).str: k for k, v in DTYPES.items() if k != "bytes"}

_FIELD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_MAX_SHAPE_DIMS = 8
_MAX_CHUNKS = (1 << 32) - 1
_MAX_LENGTH = (1 << 48)


def offset_name(field: str) -> str:
    return f"{field}.offset"


def check_name(field: str) -> str:
    return f"{field}.check"


#: Bytes of one entry's check.
CHECK_SIZE = 4


def key32(key: int) -> int:
    """The store key folded to the 32 bits XORed into every entry check."""
    return (key ^ (key >> 32)) & 0xFFFFFFFF


def entry_checks(entries: Any, first_index: int, field_no: int, key: int = 0) -> np.ndarray:
    """The CRC-32 checks (``<u4``) of consecutive entries starting at ``first_index``:
    CRC-32 (zlib's) of the 16 entry bytes, the index as u64 and the field number as u32,
    XOR :func:`key32` of the store key. A CRC detects every single-bit flip of what it
    covers, by construction; the key makes a table of another store fail."""
    import zlib

    raw = np.ascontiguousarray(entries, dtype=ENTRY_DTYPE).view(np.uint8).reshape(-1, ENTRY_SIZE)
    out = np.empty(len(raw), "<u4")
    tail = struct.Struct("<QI")
    k32 = key32(key)
    for i in range(len(raw)):
        out[i] = zlib.crc32(tail.pack(first_index + i, field_no), zlib.crc32(raw[i])) ^ k32
    return out


def chunk_name(chunk_id: int) -> str:
    return f"{CHUNK_DIR}/{chunk_id}.zr"


def epoch_lock_name(epoch: int) -> str:
    return f"epoch-{epoch}.lock"


def record_span(payload_len: int) -> int:
    """Bytes a record with a ``payload_len``-byte stored payload takes in a chunk."""
    return (RECORD_HEADER_SIZE + payload_len + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN


def dtype_name(dtype: Any) -> str:
    """The field dtype name of a NumPy dtype (``float32`` -> ``f32``)."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    name = _NUMPY_TO_NAME.get(dt.str)
    if name is None:
        raise ConfigError(f"dtype: {dt} has no ZRECORD field dtype (one of {sorted(DTYPES)})", field="dtype")
    return name


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One field: ``shape`` is the fixed shape of every record, or None for variable length."""

    name: str
    dtype: str = "bytes"
    shape: tuple[int, ...] | None = None
    compress: str = "raw"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _FIELD_NAME.match(self.name):
            raise ConfigError(f"fields: name {self.name!r} must match {_FIELD_NAME.pattern}", field="name")
        if self.dtype not in DTYPES:
            raise ConfigError(f"fields: {self.name}: dtype {self.dtype!r} is not one of {sorted(DTYPES)}",
                              field="dtype")
        if self.compress not in CODECS:
            raise ConfigError(f"fields: {self.name}: compress {self.compress!r} is not one of {sorted(CODECS)}",
                              field="compress")
        if self.shape is not None:
            shape = tuple(self.shape)
            if (len(shape) > _MAX_SHAPE_DIMS or
                    not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and 0 < d < 1 << 32
                            for d in shape)):
                raise ConfigError(f"fields: {self.name}: shape {self.shape!r} must be up to {_MAX_SHAPE_DIMS} "
                                  "positive dimensions", field="shape")
            object.__setattr__(self, "shape", tuple(int(d) for d in shape))
            if self.fixed_bytes >= (1 << 32) - RECORD_HEADER_SIZE:
                raise ConfigError(f"fields: {self.name}: a record of shape {self.shape} is 4 GiB or more",
                                  field="shape")

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype])

    @property
    def codec(self) -> int:
        return CODECS[self.compress]

    @property
    def fixed_bytes(self) -> int:
        """Bytes of one record of a fixed-shape field, 0 for variable length."""
        if self.shape is None:
            return 0
        size = self.np_dtype.itemsize
        for d in self.shape:       # Python ints: a product past 2**63 must not wrap
            size *= d
        return size

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype,
                "shape": None if self.shape is None else list(self.shape), "compress": self.compress}


@dataclasses.dataclass(frozen=True)
class StoreMeta:
    """The contents of ``meta.json``.

    ``unfull`` lists the chunks still being filled: ``(chunk_id, write_pos, record_count)``.
    ``retired`` lists chunks a rebalance replaced, by epoch, until no reader of it is left.
    """

    length: int
    num_chunks: int
    chunk_size: int
    fields: tuple[FieldSpec, ...]
    unfull: tuple[tuple[int, int, int], ...] = ()
    generation: int = 0
    epoch: int = 0
    written_bytes: int = 0
    retired: tuple[tuple[int, tuple[int, ...]], ...] = ()
    first_chunk: int = 0
    #: The store's identity (0 only in a version 1 store); see the module docstring.
    store_id: int = 0
    version: int = VERSION

    @property
    def key(self) -> int:
        """What every checksum of the store is XORed with."""
        return self.store_id

    def field(self, name: str) -> FieldSpec:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        """The document ``meta.json`` holds, with its checksum (version 2)."""
        if self.version != VERSION or not 0 < self.store_id < 1 << 64:
            raise ConfigError(f"meta.json: only version {VERSION} stores with a store_id are written",
                              field="version")
        doc = {
            "format": FORMAT_NAME,
            "version": VERSION,
            "store_id": f"{self.store_id:016x}",
            "length": self.length,
            "generation": self.generation,
            "epoch": self.epoch,
            "chunks": {"num": self.num_chunks, "size": self.chunk_size,
                       "unfull": [list(u) for u in self.unfull],
                       "written_bytes": self.written_bytes, "first": self.first_chunk},
            "fields": [f.to_json() for f in self.fields],
            "retired": [{"epoch": e, "chunks": list(c)} for e, c in self.retired],
        }
        doc["checksum"] = meta_checksum(doc)
        return doc


def meta_checksum(doc: dict[str, Any]) -> str:
    """BLAKE2b-64 (hex) of ``doc`` without its ``checksum`` key, serialized canonically (sorted
    keys, no spaces): what ``meta.json``'s ``checksum`` must be."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def _int(value: Any, field: str, lo: int, hi: int, path: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise CorruptError(f"meta.json: {field} must be an integer in [{lo}, {hi}], got {value!r}",
                           path=path, field=field)
    return value


def _obj(value: Any, field: str, keys: set[str], path: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CorruptError(f"meta.json: {field} must be an object", path=path, field=field)
    extra = set(value) - keys
    missing = keys - set(value)
    if extra or missing:
        raise CorruptError(f"meta.json: {field}: unknown keys {sorted(extra)}, missing {sorted(missing)}",
                           path=path, field=field)
    return value


def parse_meta(raw: bytes | str, *, path: Any = None) -> StoreMeta:
    """Parse and validate ``meta.json`` strictly (every key known, every value in range).

    Raises:
        CorruptError: bad JSON, an unknown or missing key, a value out of range, unfull
            chunks that do not exist or repeat, duplicate field names.
        UnsupportedVersionError: another format or a newer version.
    """
    doc, version, store_id = _meta_document(raw, path)
    chunks = _obj(doc["chunks"], "chunks", {"num", "size", "unfull", "written_bytes", "first"}, path)
    num_chunks = _int(chunks["num"], "chunks.num", 0, _MAX_CHUNKS, path)
    first_chunk = _int(chunks["first"], "chunks.first", 0, num_chunks, path)
    chunk_size = _int(chunks["size"], "chunks.size", 1, (1 << 32) - 1, path)
    unfull = _meta_unfull(chunks["unfull"], num_chunks, first_chunk, chunk_size, path)
    fields = _meta_fields(doc["fields"], path)
    retired = _meta_retired(doc["retired"], path)
    epoch = _int(doc["epoch"], "epoch", 0, 1 << 62, path)
    _check_retired(retired, epoch, first_chunk, path)
    return StoreMeta(
        length=_int(doc["length"], "length", 0, _MAX_LENGTH, path),
        num_chunks=num_chunks,
        chunk_size=chunk_size,
        fields=fields,
        unfull=unfull,
        generation=_int(doc["generation"], "generation", 0, 1 << 62, path),
        epoch=epoch,
        written_bytes=_int(chunks["written_bytes"], "chunks.written_bytes", 0, 1 << 62, path),
        retired=retired,
        first_chunk=first_chunk,
        store_id=store_id,
        version=version,
    )


def _meta_document(raw: bytes | str, path: Any) -> tuple[dict[str, Any], int, int]:
    """``meta.json``'s object, its version and store id: the size, format, version, keys and
    (version 2) checksum and store id checked."""
    if len(raw) > MAX_META_BYTES:
        raise LimitExceededError(f"meta.json: {len(raw)} bytes, more than {MAX_META_BYTES}", path=path,
                                 field="meta.json")
    doc = loads_strict(raw, error=CorruptError, field="meta.json", path=path)
    if not isinstance(doc, dict):
        raise CorruptError("meta.json: not an object", path=path, field="meta.json")
    if doc.get("format") != FORMAT_NAME:
        raise UnsupportedVersionError(f"meta.json: format {doc.get('format')!r} is not {FORMAT_NAME!r}",
                                      path=path, field="format")
    version = doc.get("version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise UnsupportedVersionError(f"meta.json: version {version!r} is not one of {READ_VERSIONS}",
                                      path=path, field="version")
    keys = {"format", "version", "length", "generation", "epoch", "chunks", "fields", "retired"}
    store_id = 0
    if version >= 2:
        _obj(doc, "meta.json", keys | {"store_id", "checksum"}, path)
        if doc["checksum"] != meta_checksum(doc):
            raise CorruptError("meta.json: checksum mismatch (the file was damaged or edited)", path=path,
                               field="checksum")
        sid = doc["store_id"]
        if not isinstance(sid, str) or not re.fullmatch(r"[0-9a-f]{16}", sid) or int(sid, 16) == 0:
            raise CorruptError(f"meta.json: store_id must be 16 lowercase hex digits, not zero, got {sid!r}",
                               path=path, field="store_id")
        store_id = int(sid, 16)
    else:
        _obj(doc, "meta.json", keys, path)
    return doc, version, store_id


def _meta_unfull(unfull_raw: Any, num_chunks: int, first_chunk: int, chunk_size: int,
                 path: Any) -> tuple[tuple[int, int, int], ...]:
    """``chunks.unfull``: ``(chunk id, write position, record count)`` of live chunks, each once."""
    if not isinstance(unfull_raw, list) or len(unfull_raw) > 4096:
        raise CorruptError("meta.json: chunks.unfull must be a list of at most 4096 entries", path=path,
                           field="chunks.unfull")
    unfull = []
    for u in unfull_raw:
        if not isinstance(u, list) or len(u) != 3:
            raise CorruptError("meta.json: chunks.unfull entries are [chunk_id, write_pos, record_count]",
                               path=path, field="chunks.unfull")
        cid = _int(u[0], "chunks.unfull.chunk_id", first_chunk, max(num_chunks - 1, 0), path)
        if cid >= num_chunks:
            raise CorruptError(f"meta.json: chunks.unfull names chunk {cid} of {num_chunks}", path=path,
                               field="chunks.unfull")
        pos = _int(u[1], "chunks.unfull.write_pos", 0, 1 << 62, path)
        count = _int(u[2], "chunks.unfull.record_count", 0, chunk_size - 1, path)
        unfull.append((cid, pos, count))
    if len({u[0] for u in unfull}) != len(unfull):
        raise CorruptError("meta.json: chunks.unfull lists a chunk twice", path=path, field="chunks.unfull")
    return tuple(unfull)


def _meta_fields(fields_raw: Any, path: Any) -> tuple[FieldSpec, ...]:
    """``fields``: 1 to :data:`MAX_FIELDS` field specs with distinct names."""
    if not isinstance(fields_raw, list) or not 1 <= len(fields_raw) <= MAX_FIELDS:
        raise CorruptError(f"meta.json: fields must list 1 to {MAX_FIELDS} fields", path=path, field="fields")
    fields = []
    for f in fields_raw:
        f = _obj(f, "fields", {"name", "dtype", "shape", "compress"}, path)
        try:
            fields.append(FieldSpec(f["name"], f["dtype"], None if f["shape"] is None else tuple(f["shape"])
                                    if isinstance(f["shape"], list) else f["shape"], f["compress"]))
        except (ConfigError, TypeError) as exc:
            raise CorruptError(f"meta.json: {exc}", path=path, field="fields") from None
    if len({f.name for f in fields}) != len(fields):
        raise CorruptError("meta.json: two fields share a name", path=path, field="fields")
    return tuple(fields)


def _meta_retired(retired_raw: Any, path: Any) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``retired``: ``(epoch, chunk ids)`` a rebalance retired."""
    if not isinstance(retired_raw, list) or len(retired_raw) > 1024:
        raise CorruptError("meta.json: retired must be a list", path=path, field="retired")
    retired = []
    for r in retired_raw:
        r = _obj(r, "retired", {"epoch", "chunks"}, path)
        ids = r["chunks"]
        if not isinstance(ids, list):
            raise CorruptError("meta.json: retired.chunks must be a list", path=path, field="retired")
        retired.append((_int(r["epoch"], "retired.epoch", 0, 1 << 62, path),
                        tuple(_int(c, "retired.chunks", 0, _MAX_CHUNKS, path) for c in ids)))
    return tuple(retired)


def _check_retired(retired: tuple[tuple[int, tuple[int, ...]], ...], epoch: int, first_chunk: int,
                   path: Any) -> None:
    """What a writer deletes must be what a rebalance retired: chunks below the first live
    one, each once, of epochs before the current one (whose lock readers of it hold)."""
    seen: set[int] = set()
    for e, ids in retired:
        if e >= epoch:
            raise CorruptError(f"meta.json: retired.epoch {e} is not older than the store's epoch {epoch}",
                               path=path, field="retired.epoch")
        for c in ids:
            if c >= first_chunk or c in seen:
                raise CorruptError(f"meta.json: retired chunk {c} is live (the first live chunk is {first_chunk}) "
                                   "or listed twice", path=path, field="retired.chunks")
            seen.add(c)


@dataclasses.dataclass(frozen=True)
class Commit:
    """The values of ``commit.zr``."""

    seq: int
    length: int
    num_chunks: int
    generation: int
    epoch: int
    flags: int = 0


#: The commit file's own version: 1 in both store versions (the store key changes its checksum).
COMMIT_VERSION = 1


def pack_commit(c: Commit, xxh3: Any, key: int = 0) -> bytes:
    body = struct.pack("<QQQQ", c.length, c.num_chunks, c.generation, c.epoch)
    head = COMMIT_STRUCT.pack(COMMIT_MAGIC, COMMIT_VERSION, c.flags, c.seq, c.length, c.num_chunks, c.generation,
                              c.epoch, xxh3(body) ^ key)
    return head + bytes(COMMIT_SIZE - len(head))


def unpack_commit(raw: bytes | memoryview, xxh3: Any, *, path: Any = None, key: int = 0) -> Commit:
    """Parse the commit file's first 64 bytes (the caller retries while ``seq`` is odd);
    ``key``: the store key from ``meta.json``."""
    if len(raw) < COMMIT_STRUCT.size:
        raise CorruptError(f"commit.zr: {len(raw)} bytes, fewer than {COMMIT_STRUCT.size}", path=path,
                           field="commit.zr")
    magic, version, flags, seq, length, num_chunks, generation, epoch, digest = COMMIT_STRUCT.unpack_from(raw)
    if magic != COMMIT_MAGIC:
        raise CorruptError("commit.zr: bad magic", path=path, field="magic")
    if version != COMMIT_VERSION:
        raise UnsupportedVersionError(f"commit.zr: version {version} is not {COMMIT_VERSION}", path=path,
                                      field="version")
    if flags:
        raise CorruptError(f"commit.zr: unknown flags {flags:#x}", path=path, field="flags")
    if xxh3(bytes(raw[24:56])) ^ key != digest:
        raise CorruptError("commit.zr: checksum mismatch (damaged, or the commit file of another store)",
                           path=path, field="checksum")
    if length > _MAX_LENGTH or num_chunks > _MAX_CHUNKS:
        raise CorruptError("commit.zr: length or num_chunks out of range", path=path, field="length")
    return Commit(seq, length, num_chunks, generation, epoch, flags)


def check_fields(fields: Sequence[FieldSpec | dict[str, Any]]) -> tuple[FieldSpec, ...]:
    """Normalize a writer's field list (FieldSpec or dicts) and check it."""
    out = []
    for f in fields:
        if isinstance(f, dict):
            try:
                f = FieldSpec(**f)
            except TypeError as exc:
                raise ConfigError(f"fields: {exc}", field="fields") from None
        if not isinstance(f, FieldSpec):
            raise ConfigError(f"fields: {f!r} is not a FieldSpec or dict", field="fields")
        out.append(f)
    if not 1 <= len(out) <= MAX_FIELDS:
        raise ConfigError(f"fields: 1 to {MAX_FIELDS} fields, got {len(out)}", field="fields")
    if len({f.name for f in out}) != len(out):
        raise ConfigError("fields: two fields share a name", field="fields")
    return tuple(out)


__all__ += ["COMMIT_VERSION", "Commit", "READ_VERSIONS", "check_fields", "dtype_name", "key32", "meta_checksum"]


#: This format in the registry (:mod:`zerobatch.formats.registry`).
FORMAT = Format(
    name="zrecord", title="ZRECORD", layout="folder", markers=(META_NAME, COMMIT_NAME), spec="docs/formats/zrecord.md",
    summary="a multi-field record store with atomic appends, edits and threaded checked gathers",
    reader="zerobatch.readers.zrecord:ZRecordStore", writer="zerobatch.writers.zrecord:ZRecordWriter",
    kernel="zerobatch.core._zrecord", sources=("zerobatch.adapters.sources.zrecord:RecordFields",),
    cli="zerobatch.cli.formats.zrecord:ZRecord",
    documents="zerobatch.prepare.formats.zrecord:ZRecordDocuments",
    convert="zerobatch.prepare.formats.zrecord:write",
    url_check="zerobatch.writers.remote:check_remote_zrecord", row_ids=True,
    publish="zerobatch.writers.remote:publish_zrecord")
