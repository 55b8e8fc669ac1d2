"""Block-shuffle order: the order ``BatchNativeLoader`` reads an LLMBATCH file in.

The ``n`` items are cut into blocks of ``block_size`` consecutive items (the last block
shorter when ``block_size`` does not divide ``n``). Each epoch visits the blocks in the order
of a permutation drawn with ``numpy.random.default_rng(seed ^ epoch).permutation(num_blocks)``
(PCG64), and the items inside each block in ascending order, so reads stay sequential for a
whole block (the OS read-ahead works) while the block order changes every epoch.

Mapping an epoch position to an item is O(1) (``zerobatch.core.block_shuffle_items``, GIL
released); only the block permutation is stored: 8 bytes per block.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from zerobatch.core import block_shuffle_items
from zerobatch.core.checks import check_count, check_seed
from zerobatch.samplers.orders import IndexOrder

__all__ = ["BlockShuffleOrder"]


class BlockShuffleOrder(IndexOrder):
    """The block-shuffle order of ``num_items`` items, for every epoch.

    Args:
        num_items: items to order (batches of an LLMBATCH file).
        block_size: consecutive items per block, at least 1.
        seed: integer in ``[0, 2**64)``; epoch ``e`` uses ``seed ^ e``.
        shuffle: ``False`` gives the identity order in every epoch.

    Raises:
        ConfigError: an argument out of range.
    """

    kind = "block-shuffle"

    def __init__(self, num_items: int, block_size: int = 256, *, seed: int = 42, shuffle: bool = True) -> None:
        self.num_items = check_count(num_items, "num_items")
        self.block_size = check_count(block_size, "block_size", minimum=1)
        self.seed = check_seed(seed)
        self.shuffle = bool(shuffle)
        self.num_blocks = -(-self.num_items // self.block_size)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()

    def params(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "shuffle": self.shuffle}

    def block_permutation(self, epoch: int) -> np.ndarray:
        """The order blocks are visited in during ``epoch`` (``int64``, read-only)."""
        epoch = check_count(epoch, "epoch")
        perm = self._cache.get(epoch)
        if perm is None:
            if self.shuffle:
                perm = np.random.default_rng(self.seed ^ epoch).permutation(self.num_blocks).astype(np.int64)
            else:
                perm = np.arange(self.num_blocks, dtype=np.int64)
            perm.flags.writeable = False
            self._cache[epoch] = perm
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return perm

    def _items(self, epoch: int, positions: np.ndarray, out: np.ndarray) -> np.ndarray:
        if not self.shuffle:
            self._check_range(positions)
            out[...] = positions
            return out
        return block_shuffle_items(self.block_permutation(epoch), self.block_size, self.num_items,
                                   positions, out)

    def _positions_of(self, epoch: int, items: np.ndarray) -> np.ndarray:
        """Each item's block's place in the epoch's block order, the blocks before it (all
        whole but the dataset's last, shorter one) and its place in its block."""
        if not self.shuffle:
            return items.copy()
        perm = self.block_permutation(epoch)
        rank = np.empty_like(perm)
        rank[perm] = np.arange(perm.size, dtype=np.int64)
        block = items // self.block_size
        j = rank[block]
        short = self.num_blocks * self.block_size - self.num_items    # what the last block lacks
        last_before = rank[self.num_blocks - 1] < j
        return j * self.block_size - np.where(last_before, short, 0) + (items - block * self.block_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The whole order of ``epoch`` (``num_items`` int64: allocate only for small sizes)."""
        return self.items(epoch, np.arange(self.num_items, dtype=np.int64))

    def block_of(self, item: int) -> tuple[int, int]:
        """``(first, stop)``: the item range of the block holding ``item``."""
        first = (item // self.block_size) * self.block_size
        return first, min(first + self.block_size, self.num_items)

