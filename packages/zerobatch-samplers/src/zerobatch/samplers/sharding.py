"""Rank sharding with no communication: each rank reads its own slice of a global order.

Global order positions are dealt round-robin: at global step ``s`` rank ``r`` of ``W`` takes
position ``start + s * W + r``, where ``start`` is the number of positions already consumed
in the epoch (0 at the start of an epoch, the saved count after a resume). Every rank gets
the same number of steps, so collectives never wait on a rank that ran out:

- ``drop_last=True`` drops the tail of fewer than ``W`` positions;
- ``drop_last=False`` pads the last step by wrapping to the start of the epoch's order, and
  says how many positions of the epoch were padding.

Resuming with another world size works because the state is a count of global positions:
``W`` ranks that consumed ``k`` steps consumed ``k * W`` positions, and ``W'`` new ranks
continue at that position, skipping and repeating nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from zerobatch.formats.errors import OutOfRangeError
from zerobatch.core.checks import check_count, check_rank

__all__ = ["RankShard"]


@dataclasses.dataclass(frozen=True)
class RankShard:
    """The positions one rank reads in one epoch.

    Args:
        num_positions: positions in the epoch's global order.
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks, at least 1.
        drop_last: drop the tail that does not fill a step on every rank (else pad it).
        start: positions of the epoch already consumed (by any number of ranks).

    Raises:
        ConfigError: an argument out of range.
    """

    num_positions: int
    rank: int = 0
    world_size: int = 1
    drop_last: bool = True
    start: int = 0

    def __post_init__(self) -> None:
        check_count(self.num_positions, "num_positions")
        check_rank(self.rank, self.world_size)
        check_count(self.start, "start")

    @property
    def remaining(self) -> int:
        """Positions of the epoch not yet consumed (0 once the epoch is done)."""
        return max(self.num_positions - self.start, 0)

    @property
    def num_steps(self) -> int:
        """Steps every rank takes from ``start`` to the end of the epoch."""
        if self.drop_last:
            return self.remaining // self.world_size
        return -(-self.remaining // self.world_size)

    @property
    def padding(self) -> int:
        """Positions re-read (wrapped) to even out the last step; 0 with ``drop_last``."""
        if self.drop_last:
            return 0
        return self.num_steps * self.world_size - self.remaining

    @property
    def dropped(self) -> int:
        """Positions of the epoch no rank reads; 0 without ``drop_last``."""
        return self.remaining - self.num_steps * self.world_size if self.drop_last else 0

    def consumed_after(self, steps: int) -> int:
        """Global positions consumed in the epoch once every rank has taken ``steps`` steps."""
        return self.start + steps * self.world_size

    def positions(self, first_step: int, count: int) -> np.ndarray:
        """Epoch positions this rank reads at steps ``first_step .. first_step + count - 1``.

        Positions past the end of the epoch (padding) wrap to its beginning (modulo the
        epoch's length, so even an epoch shorter than ``world_size`` fills every step).
        """
        first_step = check_count(first_step, "first_step")
        count = check_count(count, "count")
        if first_step + count > self.num_steps:
            raise OutOfRangeError(f"steps [{first_step}, {first_step + count}) exceed the epoch's "
                             f"{self.num_steps} steps")
        pos = self.start + (first_step + np.arange(count, dtype=np.int64)) * self.world_size + self.rank
        if not self.drop_last and self.num_positions:
            pos %= self.num_positions
        return pos
