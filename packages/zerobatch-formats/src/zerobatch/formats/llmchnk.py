"""LLMCHNK (ZeroBatch v1): token records with an offset table. Constants, limits, the header
and the structural checks every reader runs (``docs/formats/llmchnk.md``).

Layout of a file (little-endian throughout)::

    [0, 32)                         header
    [32, 32 + 8 * (N + 1))          offset table: N + 1 u64 absolute byte offsets
    [offsets[0], offsets[N])        the records, back to back (record i is
                                    [offsets[i], offsets[i + 1]), a whole number of tokens)
    [offsets[N], file end)          with FLAG_CHECKSUMS: N u64 XXH3-64 record checksums, the
                                    u64 digest of header + table + checksums, the trailer magic

The seed names the format (a 32-byte header, per-record random access through an offset
table, batching at read time) but not its bytes; this module defines them.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

from zerobatch.formats.errors import CorruptError, LimitExceededError, TruncatedError, UnsupportedVersionError
from zerobatch.formats.registry import Format

__all__ = [
    "FORMAT",
    "DIGEST_BLOCK",
    "DTYPES",
    "DTYPE_UINT16",
    "DTYPE_UINT32",
    "FILE_EXTENSION",
    "FLAGS_KNOWN",
    "FLAG_CHECKSUMS",
    "HEADER_SIZE",
    "HEADER_STRUCT",
    "LLMChunkHeader",
    "MAGIC",
    "MAX_RECORD_TOKENS",
    "TRAILER_MAGIC",
    "VERSION",
    "Geometry",
    "geometry",
    "pack_header",
    "parse_header",
]

#: First 8 bytes of every LLMCHNK file.
MAGIC = b"LLMCHNK\0"
#: The format version this module defines.
VERSION = 1
#: Size of the header; the offset table starts here.
HEADER_SIZE = 32
#: ``struct`` format of the header: magic, version, flags, num_records, seq_len, dtype.
HEADER_STRUCT = "<8sIIQII"
#: Flag bit 0: the checksum trailer is present.
FLAG_CHECKSUMS = 1
#: Every flag bit this version defines (any other bit set is refused).
FLAGS_KNOWN = FLAG_CHECKSUMS
#: Token dtype codes.
DTYPE_UINT32 = 0
DTYPE_UINT16 = 1
#: code -> (numpy dtype name, itemsize)
DTYPES = {DTYPE_UINT32: ("<u4", 4), DTYPE_UINT16: ("<u2", 2)}
#: Last 8 bytes of a file with checksums.
TRAILER_MAGIC = b"LLMCHKS1"
#: The table digest is XXH3-64 over the XXH3-64s of consecutive blocks of this many bytes of
#: ``header || offset table || record checksums`` (so it is computed in bounded memory).
DIGEST_BLOCK = 1 << 20
#: Longest record (tokens); a record is also bounded by the file.
MAX_RECORD_TOKENS = 2**31 - 1
#: Conventional file name suffix.
FILE_EXTENSION = ".chunk"



@dataclasses.dataclass(frozen=True)
class LLMChunkHeader:
    """The header fields.

    Attributes:
        num_records: records in the file (``N``).
        seq_len: the nominal record length in tokens (0: none; records may differ from it).
        dtype: token dtype code (:data:`DTYPE_UINT32` or :data:`DTYPE_UINT16`).
        flags: :data:`FLAG_CHECKSUMS` or 0.
        version: :data:`VERSION`.
    """

    num_records: int
    seq_len: int
    dtype: int = DTYPE_UINT32
    flags: int = FLAG_CHECKSUMS
    version: int = VERSION

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def np_dtype(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def checksums(self) -> bool:
        return bool(self.flags & FLAG_CHECKSUMS)


def pack_header(h: LLMChunkHeader) -> bytes:
    """The 32 header bytes of ``h``."""
    return struct.pack(HEADER_STRUCT, MAGIC, h.version, h.flags, h.num_records, h.seq_len, h.dtype)


def parse_header(data: bytes, *, path: Any = None) -> LLMChunkHeader:
    """Parse and check the 32 header bytes (magic, version, flags, dtype).

    Raises:
        TruncatedError: fewer than 32 bytes.
        CorruptError: bad magic or unknown dtype code; UnsupportedVersionError: another
            version or unknown flag bits.
    """
    if len(data) < HEADER_SIZE:
        raise TruncatedError(f"header: the file has {len(data)} bytes, the header needs {HEADER_SIZE}",
                             path=path, field="header")
    magic, version, flags, n, seq_len, dtype = struct.unpack_from(HEADER_STRUCT, data, 0)
    if magic != MAGIC:
        raise CorruptError(f"magic: expected {MAGIC!r}, got {magic!r} (not an LLMCHNK file)", path=path, field="magic")
    if version != VERSION:
        raise UnsupportedVersionError(f"version: {version} (this release reads {VERSION})", path=path, field="version")
    if flags & ~FLAGS_KNOWN:
        raise UnsupportedVersionError(f"flags: unknown bits {flags & ~FLAGS_KNOWN:#x}", path=path, field="flags")
    if dtype not in DTYPES:
        raise CorruptError(f"dtype: unknown code {dtype}", path=path, field="dtype")
    return LLMChunkHeader(num_records=n, seq_len=seq_len, dtype=dtype, flags=flags, version=version)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Where the parts of a file lie, derived from the header and the file size."""

    table_offset: int
    data_start: int
    data_end: int
    checksums_offset: int
    digest_offset: int
    file_size: int


def trailer_size(h: LLMChunkHeader) -> int:
    """Bytes after the records: N checksums, the digest, the trailer magic."""
    return 8 * h.num_records + 16 if h.checksums else 0


def geometry(h: LLMChunkHeader, file_size: int, *, path: Any = None) -> Geometry:
    """Check that the header's count fits the file (before anything proportional to it is
    read) and place the table, records and trailer.

    Raises:
        LimitExceededError: ``num_records`` larger than the file could hold.
        TruncatedError: a file too short for its table and trailer.
    """
    n = h.num_records
    per_record = 8 + (8 if h.checksums else 0)        # a table entry (+ a checksum) per record
    fixed = HEADER_SIZE + 8 + (16 if h.checksums else 0)
    if file_size < fixed:
        raise TruncatedError(f"file: {file_size} bytes, the header, table end and trailer need {fixed}",
                             path=path, field="file")
    if n > (file_size - fixed) // per_record:
        raise LimitExceededError(
            f"num_records: {n} records need at least {fixed + n * per_record} bytes of table and trailer, "
            f"the file has {file_size}", path=path, field="num_records")
    data_start = HEADER_SIZE + 8 * (n + 1)
    data_end = file_size - trailer_size(h)
    return Geometry(table_offset=HEADER_SIZE, data_start=data_start, data_end=data_end,
                    checksums_offset=data_end, digest_offset=data_end + 8 * n, file_size=file_size)


#: This format in the registry (:mod:`zerobatch.formats.registry`).
FORMAT = Format(
    name="llmchnk", title="LLMCHNK", layout="file", magic=MAGIC, spec="docs/formats/llmchnk.md",
    summary="token records behind an offset table, each checksummed; any batch size at read time",
    reader="zerobatch.readers.llmchnk:LLMChunkReader", writer="zerobatch.writers.llmchnk:LLMChunkWriter",
    kernel="zerobatch.core._llmchnk", sources=("zerobatch.adapters.sources.llmchnk:LLMChunkSource",),
    cli="zerobatch.cli.formats.llmchnk:LLMChunk",
    documents="zerobatch.prepare.formats.llmchnk:LLMChunkDocuments",
    convert="zerobatch.prepare.formats.llmchnk:write", url_check="zerobatch.writers.remote:check_remote_file",
    publish="zerobatch.writers.remote:publish_file")
