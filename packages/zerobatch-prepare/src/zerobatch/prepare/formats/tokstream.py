"""TOKSTREAM in preparation: its ``convert --to`` target (with a chat conversion's loss mask
beside the tokens), and its datasets read as documents."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
from zerobatch.prepare.formats import PIECE, Documents
from zerobatch.prepare.sources import documents
from zerobatch.prepare.targets import Chunks, Target, build_folder

__all__ = ["TokenStreamDocuments", "write"]


class TokenStreamDocuments(Documents):
    """A TOKSTREAM dataset's documents, in order."""

    kind = "tokstream"

    def __init__(self, path: str, field: str | None = None) -> None:
        super().__init__(path)
        from zerobatch.readers.tokstream import TokenStreamReader

        self.r = TokenStreamReader(path)

    def lengths(self) -> np.ndarray:
        starts, stops = self.r.document_spans(np.arange(self.r.num_documents))
        return (stops - starts).astype(np.int64)

    def token_pieces(self) -> Iterator[np.ndarray]:
        for s in range(0, self.r.num_tokens, PIECE):
            yield self.r.window(s, min(PIECE, self.r.num_tokens - s))

    def close(self) -> None:
        self.r.close()


def write(dst: str, chunks: Chunks, target: Target) -> str:
    """``convert --to tokstream``: the documents, in shards of about ``--shard-tokens`` tokens
    (built under a temporary name and renamed into place); with a ``loss_mask`` stream (a
    chat conversion), its mask as the dataset's ``loss_mask`` sub-dataset, which the
    dataset's manifest names."""
    from zerobatch.core.remote import is_url
    from zerobatch.readers.tokstream import LOSS_MASK_DIR
    from zerobatch.writers.remote import check_remote_destination, unique_shard_prefix
    from zerobatch.writers.tokstream import TokenStreamWriter
    # shards replacing a dataset in object storage get names no earlier upload used, so they
    # never overwrite the objects of the dataset readers see until the new manifest is in
    # place; a new dataset keeps the plain names (two conversions of the same input make the
    # same dataset, build id included)
    replacing = is_url(dst) and check_remote_destination(dst, True)
    prefix = unique_shard_prefix() if replacing else "shard-"
    mask = target.streams.get(LOSS_MASK_DIR)

    def build(folder: str) -> str:
        eod = target.eod if target.eod is not None and target.eod < target.vocab else None
        w = TokenStreamWriter(folder, vocab_size=max(target.vocab, 1), eod_token=eod,
                              shard_tokens=target.options.shard_tokens,
                              metadata=target.rows is not None or target.meta is not None, prefix=prefix,
                              spread=target.options.spread)
        m = None if mask is None else TokenStreamWriter(os.path.join(folder, LOSS_MASK_DIR), vocab_size=2,
                                                         shard_tokens=target.options.shard_tokens, prefix=prefix,
                                                         spread=target.options.spread)
        try:
            n = _add_documents(w, chunks, target)
            if mask is not None and m is not None:
                for tokens, lengths in mask():
                    m.add_documents(tokens, lengths)
        except BaseException:
            w.abort()
            if m is not None:
                m.abort()
            raise
        manifest = w.close(loss_mask=None if m is None else m.close())   # the manifest names its mask's build id
        return f"{n:,} documents in {len(manifest.shards)} shards"
    return f"{build_folder(dst, build, overwrite=target.options.overwrite)}, {target.num_tokens:,} tokens"


def _add_documents(w: Any, chunks: Chunks, target: Target) -> int:
    """Every document of ``chunks`` added to writer ``w`` with its metadata (``--row-ids``,
    ``--metadata-fields``); returns how many."""
    n = 0
    rows = None if target.rows is None else target.rows()
    metas = None if target.meta is None else target.meta()
    for doc in documents(chunks):
        meta = None if metas is None else next(metas)
        if rows is not None:
            meta = {**(meta or {}), "row": next(rows)}
        w.add_document(doc, meta)
        n += 1
    return n
