"""Index orders: where each global position of an epoch (or of an endless stream) points.

An order maps *positions* (0, 1, 2, ... in the order they are consumed) to *items* (indices
into a dataset of ``num_items``). :class:`~zerobatch.samplers.IndexSampler` cuts positions
into global batches and deals them to ranks; the order only says which item a position is.
Every order is a pure function of ``(seed, epoch, position)``, computed in O(1) per position
by compiled kernels in :mod:`zerobatch.core`, so any step can be computed without the steps
before it.

Epoch orders visit every item exactly once per epoch (``epoch_length == num_items``):

- :class:`SequentialOrder`: ``0, 1, 2, ...`` in every epoch;
- :class:`GlobalRandomOrder`: a fresh pseudorandom permutation of all items each epoch, the
  :class:`~zerobatch.core.FeistelPermutation` keyed by ``epoch_seed(seed, epoch)``: O(1)
  memory however many items;
- :class:`~zerobatch.samplers.BlockShuffleOrder`: blocks of consecutive items in a per-epoch
  random order (the LLMBATCH loader's order).

Streams never end (``epoch_length is None``; the epoch is always 0):

- :class:`SlidingOrder`: the items as a ring, position ``p`` is item ``p mod num_items``, so a
  window that reaches the end wraps to the start;
- :class:`RandomOrder`: independent uniform draws with replacement, draw ``p`` computed from
  ``(seed, p)`` alone (counter mode).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, ClassVar

import numpy as np

from zerobatch.core import FeistelPermutation, epoch_seed, random_draws
from zerobatch.formats.errors import ConfigError, OutOfRangeError
from zerobatch.core.checks import check_count, check_seed, positions_and_out

__all__ = [
    "GlobalRandomOrder",
    "IndexOrder",
    "RandomOrder",
    "SequentialOrder",
    "SlidingOrder",
]


class IndexOrder(ABC):
    """Base of the index orders (see the module documentation).

    Subclasses set :attr:`kind`, :attr:`num_items`, :attr:`seed` and implement
    :meth:`_items`; :meth:`params` lists what else the order depends on, all of which a
    saved state must match.
    """

    #: Name of the order in a saved state.
    kind: ClassVar[str] = ""
    #: Whether the order has epochs (each a permutation of the items) or is an endless stream.
    has_epochs: ClassVar[bool] = True

    num_items: int
    seed: int = 0

    @property
    def epoch_length(self) -> int | None:
        """Positions per epoch (``num_items``), or ``None`` for an endless stream."""
        return self.num_items if self.has_epochs else None

    def params(self) -> dict[str, Any]:
        """Parameters besides ``seed`` and ``num_items`` that define the order (JSON types)."""
        return {}

    def items(self, epoch: int, positions: Any, out: np.ndarray | None = None) -> np.ndarray:
        """The items at ``positions`` of ``epoch`` (``int64``, shaped like ``positions``).

        Raises:
            IndexError: a position outside ``[0, epoch_length)`` (or negative, for streams).
            ConfigError: a bad epoch or ``out``.
        """
        epoch = check_count(epoch, "epoch")
        pos, out = positions_and_out(positions, out)
        self._items(epoch, pos, out.reshape(-1))
        return out

    @abstractmethod
    def _items(self, epoch: int, positions: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill the flat ``out`` with the items at the flat ``int64`` ``positions``."""

    def positions_of(self, epoch: int, items: Any) -> np.ndarray:
        """The inverse of :meth:`items`: the position of each of ``items`` in ``epoch``
        (``int64``, shaped like ``items``), computed as the order is, in O(1) per item
        (provenance: when was an item read). Epoch orders only: in an endless stream an item
        comes back forever (see :meth:`SlidingOrder.positions_of`), or at random.

        Raises:
            IndexError: an item outside ``[0, num_items)``.
            ConfigError: an order with no inverse (random draws with replacement).
        """
        epoch = check_count(epoch, "epoch")
        arr = np.asarray(items)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ConfigError(f"items must be integers, got {arr.dtype}", field="items")
        flat = np.ascontiguousarray(arr, dtype=np.int64).reshape(-1)
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.num_items):
            raise OutOfRangeError(f"an item is outside [0, {self.num_items})", field="items")
        return self._positions_of(epoch, flat).reshape(arr.shape)

    def _positions_of(self, epoch: int, items: np.ndarray) -> np.ndarray:
        raise ConfigError(f"a {self.kind} order has no inverse: its items are not a permutation", field="order")

    def _check_range(self, positions: np.ndarray) -> None:
        if positions.size:
            lo, hi = int(positions.min()), int(positions.max())
            limit = self.epoch_length
            if lo < 0 or (limit is not None and hi >= limit):
                raise OutOfRangeError(f"a position is outside [0, {'inf' if limit is None else limit})")

    def __repr__(self) -> str:
        fields = {"num_items": self.num_items, "seed": self.seed, **self.params()}
        inner = ", ".join(f"{k}={v!r}" for k, v in fields.items())
        return f"{type(self).__name__}({inner})"


class SequentialOrder(IndexOrder):
    """Items in ascending order, the same in every epoch.

    Args:
        num_items: size of the index space.
    """

    kind = "sequential"

    def __init__(self, num_items: int) -> None:
        self.num_items = check_count(num_items, "num_items")

    def _items(self, epoch: int, positions: np.ndarray, out: np.ndarray) -> np.ndarray:
        self._check_range(positions)
        out[...] = positions
        return out

    def _positions_of(self, epoch: int, items: np.ndarray) -> np.ndarray:
        return items.copy()


class SlidingOrder(IndexOrder):
    """The items as a ring: position ``p`` is item ``p mod num_items``, forever.

    With ``num_items = 10`` and global batches of 4 the batches are ``[0..3] [4..7]
    [8, 9, 0, 1] [2..5] ...``: a window slides over the ring and never truncates at the tail.

    Args:
        num_items: size of the index space (0 gives no batches at all).
    """

    kind = "sliding"
    has_epochs = False

    def __init__(self, num_items: int) -> None:
        self.num_items = check_count(num_items, "num_items")

    def _items(self, epoch: int, positions: np.ndarray, out: np.ndarray) -> np.ndarray:
        self._check_range(positions)
        if self.num_items == 0 and positions.size:
            raise OutOfRangeError("the index space is empty")
        np.remainder(positions, self.num_items or 1, out=out, casting="unsafe")
        return out

    def _positions_of(self, epoch: int, items: np.ndarray) -> np.ndarray:
        """The first position of each item (it comes back every ``num_items`` positions)."""
        return items.copy()


class RandomOrder(IndexOrder):
    """Independent uniform draws with replacement from ``[0, num_items)``.

    Position ``p`` is draw number ``p`` of a Speck64/128 counter-mode stream keyed by
    ``seed`` (:func:`zerobatch.core.random_draws`): computable alone, so step ``k`` never
    needs steps ``0 .. k-1``.

    Args:
        num_items: size of the index space (0 gives no batches at all).
        seed: integer in ``[0, 2**64)``.
    """

    kind = "random"
    has_epochs = False

    def __init__(self, num_items: int, *, seed: int = 0) -> None:
        self.num_items = check_count(num_items, "num_items")
        self.seed = check_seed(seed)

    def _items(self, epoch: int, positions: np.ndarray, out: np.ndarray) -> np.ndarray:
        self._check_range(positions)
        if self.num_items == 0:
            if positions.size:
                raise OutOfRangeError("the index space is empty")
            return out
        return random_draws(self.seed, positions, self.num_items, out)


class GlobalRandomOrder(IndexOrder):
    """Each epoch a fresh pseudorandom permutation of all items, without replacement.

    Epoch ``e`` is ``FeistelPermutation(num_items, rounds, epoch_seed(seed, e))``: O(1)
    memory (a few hundred bytes of round keys) and O(1) per position however large
    ``num_items`` is; the first batch of a 2**38-item epoch is ready in microseconds.

    Args:
        num_items: size of the index space.
        seed: integer in ``[0, 2**64)``.
        rounds: Feistel rounds (default 6).
    """

    kind = "global-random"

    def __init__(self, num_items: int, *, seed: int = 0, rounds: int = 6) -> None:
        self.num_items = check_count(num_items, "num_items")
        self.seed = check_seed(seed)
        self.rounds = check_count(rounds, "rounds", maximum=1024)
        self._perms: OrderedDict[int, FeistelPermutation] = OrderedDict()

    def params(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def permutation(self, epoch: int) -> FeistelPermutation:
        """The permutation of ``epoch`` (cached for the two most recent epochs)."""
        epoch = check_count(epoch, "epoch")
        perm = self._perms.get(epoch)
        if perm is None:
            perm = FeistelPermutation(self.num_items, self.rounds, epoch_seed(self.seed, epoch))
            self._perms[epoch] = perm
            while len(self._perms) > 2:
                self._perms.popitem(last=False)
        return perm

    def _items(self, epoch: int, positions: np.ndarray, out: np.ndarray) -> np.ndarray:
        return self.permutation(epoch).take(positions, out)

    def _positions_of(self, epoch: int, items: np.ndarray) -> np.ndarray:
        return self.permutation(epoch).take(items, inverse=True)

