"""LLMBATCH (ZeroBatch v2): batch-native token files. Constants, limits and the header type.

This module is the single source of truth for the byte layout documented in
``docs/formats/llmbatch.md``. The compiled kernels in ``zerobatch.core`` declare the same
numbers in ``_layout.pxd``; a test keeps the two in agreement.

Layout of a file (little-endian throughout)::

    [0, 4096)                      header (fields below, then zeros)
    [4096 + i * padded, ... )      batch i: batch_size * seq_len uint32 tokens, zero-padded
                                   to a multiple of 4096 bytes
    [trailer_offset, file end)     zerobatch extension only: one u64 XXH3-64 per batch slot

The seed's header occupies bytes 0..40; zerobatch writes an integrity extension into the
reserved bytes (which the seed leaves as zeros, and which a reader written from the seed's
spec ignores) and a checksum trailer after the last batch (which such a reader never reaches).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from zerobatch.formats.registry import Format

__all__ = [
    "FORMAT",
    "BATCH_ALIGNMENT",
    "CHECKSUM_SIZE",
    "DTYPE_UINT32",
    "EXT_FLAG_BATCH_CHECKSUMS",
    "EXT_FLAG_MAX_TOKEN",
    "EXT_FLAGS_KNOWN",
    "EXT_MAGIC",
    "EXT_RESERVED_START",
    "EXT_VERSION",
    "FIELD_OFFSETS",
    "FILE_EXTENSION",
    "HASH_ALGO_XXH3_64",
    "HEADER_HASH_OFFSET",
    "HEADER_SIZE",
    "HEADER_STRUCT",
    "LLMBatchHeader",
    "MAGIC",
    "MAX_BATCH_BYTES",
    "MAX_BATCH_SIZE",
    "MAX_SEQ_LEN",
    "TOKEN_ITEMSIZE",
    "VERSION",
    "build_id",
]

#: First 8 bytes of every LLMBATCH file.
MAGIC = b"LLMBATCH"
#: The only format version defined by the seed.
VERSION = 1
#: Size of the header; batch 0 starts here.
HEADER_SIZE = 4096
#: Every batch slot is padded with zeros to a multiple of this many bytes.
BATCH_ALIGNMENT = 4096
#: ``struct`` format of the seed's fields at offset 0.
HEADER_STRUCT = "<8sIIIQIII"
#: Token dtype code 0: little-endian uint32. No other code is defined.
DTYPE_UINT32 = 0
#: Bytes per token.
TOKEN_ITEMSIZE = 4
#: Suggested file name extension.
FILE_EXTENSION = ".batch"

#: Byte offset of every header field (seed fields, then the zerobatch extension).
FIELD_OFFSETS = {
    "magic": 0,
    "version": 8,
    "batch_size": 12,
    "seq_len": 16,
    "num_batches": 20,
    "dtype": 28,
    "seed": 32,
    "total_records": 36,
    # zerobatch integrity extension (all zero in a file written from the seed's spec)
    "ext_magic": 40,
    "ext_version": 48,
    "ext_flags": 52,
    "hash_algo": 56,
    "max_token": 60,
    "trailer_offset": 64,
    "trailer_size": 72,
    "trailer_hash": 80,
    "build_id": 88,
    "header_hash": 4088,
}
#: Bytes 104..4088 are reserved and must be zero.
EXT_RESERVED_START = 104

#: Marks the zerobatch extension at offset 40.
EXT_MAGIC = b"ZBATCHX1"
#: Version of the extension block.
EXT_VERSION = 1
#: The trailer holds one XXH3-64 per batch slot (its ``padded_batch_bytes`` bytes).
EXT_FLAG_BATCH_CHECKSUMS = 1
#: ``max_token`` holds the largest token id in the file.
EXT_FLAG_MAX_TOKEN = 2
#: Every flag bit this release understands; any other set bit is refused.
EXT_FLAGS_KNOWN = EXT_FLAG_BATCH_CHECKSUMS | EXT_FLAG_MAX_TOKEN
#: Hash algorithm code 1: XXH3-64 with seed 0 (xxHash 0.8).
HASH_ALGO_XXH3_64 = 1
#: The header hash covers bytes [0, HEADER_HASH_OFFSET) and is stored there.
HEADER_HASH_OFFSET = 4088
#: Bytes per trailer entry.
CHECKSUM_SIZE = 8

#: Largest ``batch_size`` accepted by writers and readers.
MAX_BATCH_SIZE = 2**31 - 1
#: Largest ``seq_len`` accepted by writers and readers.
MAX_SEQ_LEN = 2**31 - 1
#: Largest batch (``batch_size * seq_len * 4``) accepted: 16 GiB, so that no header can make a
#: reader allocate more than 32 GiB for one ``int64`` batch.
MAX_BATCH_BYTES = 2**34


@dataclasses.dataclass(frozen=True)
class LLMBatchHeader:
    """A parsed and validated LLMBATCH header, with the sizes derived from it.

    Instances come from ``zerobatch.core.parse_llmbatch_header``, which has already checked
    every field against the file's real size; building one by hand skips those checks.

    Attributes:
        batch_size: samples per batch.
        seq_len: tokens per sample.
        num_batches: batches in the file.
        seed: shuffle seed recorded by the writer.
        total_records: source records before batching (the remainder was dropped).
        version: format version (1).
        dtype: token dtype code (0 = uint32).
        raw_batch_bytes: ``batch_size * seq_len * 4``.
        padded_batch_bytes: ``raw_batch_bytes`` rounded up to a multiple of 4096.
        data_offset: byte offset of batch 0 (4096).
        trailer_offset: first byte after the last batch slot.
        trailer_size: bytes of the checksum trailer (0 without checksums).
        file_size: the size the file must have.
        has_extension: the zerobatch integrity extension is present.
        ext_flags: extension flags (0 without the extension).
        has_checksums: the trailer holds one XXH3-64 per batch slot.
        max_token: largest token id in the file, or ``None`` when the file does not record it.
        trailer_hash: XXH3-64 of the trailer (0 without checksums).
        header_hash: XXH3-64 of header bytes [0, 4088) (0 without the extension).
        build_id: 16 bytes identifying the write that produced the file (``None`` without the
            extension).
    """

    batch_size: int
    seq_len: int
    num_batches: int
    seed: int
    total_records: int
    version: int
    dtype: int
    raw_batch_bytes: int
    padded_batch_bytes: int
    data_offset: int
    trailer_offset: int
    trailer_size: int
    file_size: int
    has_extension: bool
    ext_flags: int
    has_checksums: bool
    max_token: int | None
    trailer_hash: int
    header_hash: int
    build_id: bytes | None

    @property
    def tokens_per_batch(self) -> int:
        """``batch_size * seq_len``."""
        return self.batch_size * self.seq_len

    @property
    def num_tokens(self) -> int:
        """Tokens stored in the file."""
        return self.num_batches * self.batch_size * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dictionary of every field (``build_id`` as hex)."""
        out = dataclasses.asdict(self)
        out["build_id"] = self.build_id.hex() if self.build_id is not None else None
        out["tokens_per_batch"] = self.tokens_per_batch
        out["num_tokens"] = self.num_tokens
        return out


def build_id(seed_fields: bytes, max_token: int, trailer: Any) -> bytes:
    """The 16-byte ``build_id`` of a file with checksums: BLAKE2b-128 (personalized
    ``zerobatch-llmb``) of the seed's 40 header bytes (magic, version, ``batch_size``,
    ``seq_len``, ``num_batches``, ``dtype``, ``seed``, ``total_records``), ``max_token`` as
    u32 and the checksum trailer. It binds the geometry and ``max_token`` to the batch
    checksums: a header edited (and re-hashed) to serve the batches in another shape, or to
    claim a smaller ``max_token``, no longer matches its build id, and readers refuse it."""
    h = hashlib.blake2b(digest_size=16, person=b"zerobatch-llmb")
    h.update(bytes(seed_fields[:40]))
    h.update(int(max_token).to_bytes(4, "little"))
    h.update(memoryview(trailer).cast("B") if not hasattr(trailer, "astype") else
             trailer.astype("<u8", copy=False).tobytes())
    return h.digest()


#: This format in the registry (:mod:`zerobatch.formats.registry`).
FORMAT = Format(
    name="llmbatch", title="LLMBATCH", layout="file", magic=MAGIC, spec="docs/formats/llmbatch.md",
    summary="pre-formed, page-aligned [batch_size, seq_len] batches, read with zero copies",
    reader="zerobatch.readers.llmbatch:BatchFileReader", writer="zerobatch.writers.llmbatch:LLMBatchWriter",
    kernel="zerobatch.core._gather", sources=("zerobatch.adapters.sources.llmbatch:LLMBatchSource",),
    default_source="zerobatch.adapters.sources.llmbatch:LLMBatchSource",
    cli="zerobatch.cli.formats.llmbatch:LLMBatch",
    documents="zerobatch.prepare.formats.llmbatch:LLMBatchDocuments",
    convert="zerobatch.prepare.formats.llmbatch:write", convert_stream=True,
    url_check="zerobatch.writers.remote:check_remote_file", publish="zerobatch.writers.remote:publish_file")
