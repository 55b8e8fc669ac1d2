"""Block digests: XXH3-64 over the XXH3-64s of consecutive fixed-size blocks of a byte stream,
so a digest of gigabytes is computed (and checked) in bounded memory, from pieces that need
not be contiguous."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from zerobatch.core import xxh3_64

__all__ = ["BlockDigest", "block_digest"]


class BlockDigest:
    """Feed bytes in any pieces; :meth:`digest` is the same for any split of the same stream.

    Args:
        block: bytes per block (the last block may be shorter; an empty stream has no block).
    """

    def __init__(self, block: int) -> None:
        if block < 1:
            raise ValueError("block must be positive")
        self.block = block
        self._pending = bytearray()
        self._digests = bytearray()

    def feed(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        block = self.block
        at = 0
        if self._pending:
            take = min(block - len(self._pending), len(view))
            self._pending += view[:take]
            at = take
            if len(self._pending) == block:
                self._digests += xxh3_64(bytes(self._pending)).to_bytes(8, "little")
                self._pending.clear()
        while len(view) - at >= block:
            self._digests += xxh3_64(view[at:at + block]).to_bytes(8, "little")
            at += block
        if at < len(view):
            self._pending += view[at:]

    def digest(self) -> int:
        """The digest of everything fed so far (feeding may not go on afterwards)."""
        if self._pending:
            self._digests += xxh3_64(bytes(self._pending)).to_bytes(8, "little")
            self._pending.clear()
        return xxh3_64(bytes(self._digests))


def block_digest(pieces: Iterable[Any], block: int) -> int:
    """The :class:`BlockDigest` of ``pieces`` fed in order."""
    d = BlockDigest(block)
    for p in pieces:
        d.feed(p)
    return d.digest()
