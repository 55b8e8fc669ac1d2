"""``zerobatch convert --to megatron`` and ``--to nanogpt``: documents written back in the
formats other trainers read, so a zerobatch dataset is never a dead end.

* ``megatron``: ``DST.bin`` + ``DST.idx``, Megatron's ``MMIDIDX`` indexed dataset (version 1),
  one sequence per document, read by megatron-core's ``IndexedDataset(DST)``. Token type as
  megatron-core's builder picks it: ``uint16`` below 65,500 ids, else ``int32``.
* ``nanogpt``: one flat file of the documents' tokens back to back (``uint16``, as nanoGPT's
  ``train.py`` memory-maps it; ``uint32`` for larger vocabularies, which ``train.py`` must then
  be told), no header and no trailer. Documents made by ``convert`` from text end with the
  end-of-document id, as nanoGPT's ``prepare.py`` writes them.

Both are written under temporary names and renamed into place (``DST.bin`` before
``DST.idx``), so a failed export leaves nothing under the final names.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from zerobatch.prepare.sources import documents
from zerobatch.core.io import AtomicFile
from zerobatch.formats.errors import ConfigError

__all__ = ["EXPORTS", "Export"]

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
#: megatron-core's DType codes of the token types written here.
MEGATRON_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}
#: megatron-core's ``DType.optimal_dtype``: uint16 below this many ids, else int32.
MEGATRON_UINT16_BELOW = 65500


@dataclass(frozen=True)
class Export:
    """A ``--to`` target outside zerobatch's formats.

    Attributes:
        summary: one line for ``--help``.
        files: the files it writes for destination ``DST`` (to check before any work).
        write: ``write(dst, chunks, target) -> summary`` (as a format's convert target).
        stream: it writes the tokens as one stream, so it takes a stream without document
            boundaries (as :attr:`zerobatch.formats.registry.Format.convert_stream`).
    """

    summary: str
    files: Callable[[str], list[str]]
    write: Callable[..., str]
    stream: bool = False


def _prefix(dst: str) -> str:
    return dst[:-4] if dst.endswith((".bin", ".idx")) else dst


def megatron_files(dst: str) -> list[str]:
    p = _prefix(dst)
    return [p + ".bin", p + ".idx"]


def write_megatron(dst: str, chunks: Callable[[], Any], target: Any) -> str:
    dtype = np.dtype(np.uint16) if target.vocab < MEGATRON_UINT16_BELOW else np.dtype(np.int32)
    if target.vocab > 2**31:
        raise ConfigError(f"--to megatron: ids up to {target.vocab - 1} do not fit Megatron's int32 tokens",
                          field="vocab_size")
    bin_path, idx_path = megatron_files(dst)
    lengths: list[np.ndarray] = []
    pending: list[int] = []
    with AtomicFile(bin_path) as f:
        for doc in documents(chunks):
            f.write(np.ascontiguousarray(doc, dtype=dtype).tobytes())
            pending.append(doc.size)
            if len(pending) == 1 << 16:
                lengths.append(np.asarray(pending, np.int64))
                pending = []
        lengths.append(np.asarray(pending, np.int64))
        sizes = np.concatenate(lengths)
        if sizes.size and int(sizes.max()) >= 2**31:
            raise ConfigError("--to megatron: a document of 2**31 tokens or more does not fit Megatron's int32 "
                              "sequence lengths", field="to")
        pointers = np.zeros(sizes.size, np.int64)
        if sizes.size > 1:
            np.cumsum(sizes[:-1] * dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(sizes.size + 1, dtype=np.int64)
        with AtomicFile(idx_path) as g:
            g.write(MEGATRON_MAGIC + struct.pack("<QBQQ", 1, MEGATRON_CODES[dtype], sizes.size, doc_idx.size))
            g.write(sizes.astype("<i4").tobytes())
            g.write(pointers.astype("<i8").tobytes())
            g.write(doc_idx.astype("<i8").tobytes())
            f.commit()      # the tokens first: an index never names a .bin that is not there
    return f"{sizes.size:,} documents, {int(sizes.sum()):,} tokens ({dtype}) in {os.path.basename(bin_path)} + .idx"


def nanogpt_files(dst: str) -> list[str]:
    return [dst]


def write_nanogpt(dst: str, chunks: Callable[[], Any], target: Any) -> str:
    dtype = np.dtype(np.uint16) if target.vocab <= 1 << 16 else np.dtype(np.uint32)
    n = 0
    with AtomicFile(dst) as f:
        for tokens, _ in chunks():
            f.write(np.ascontiguousarray(tokens, dtype=dtype).tobytes())
            n += int(tokens.size)
    note = "" if dtype == np.uint16 else " (nanoGPT's train.py reads uint16: set its dtype to np.uint32)"
    return f"{n:,} tokens as flat {dtype}{note}"


EXPORTS: dict[str, Export] = {
    "megatron": Export("Megatron .bin + .idx (megatron-core's IndexedDataset reads it)", megatron_files,
                       write_megatron),
    "nanogpt": Export("one flat uint16 .bin of the documents' tokens (nanoGPT's np.memmap reads it)", nanogpt_files,
                      write_nanogpt, stream=True),
}
