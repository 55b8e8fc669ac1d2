"""zerobatch.samplers: the orders every zerobatch loader reads in.

- :class:`BlockShuffleOrder`: blocks of consecutive items in a per-epoch random order (the
  LLMBATCH loader's order);
- :class:`RankShard`: a round-robin slice of a global order per rank, equal step counts on
  every rank, no communication;
- :class:`OrderState`: the small JSON-able state for an exact resume.

Backed by GIL-free kernels in ``zerobatch.core``; NumPy only, never torch.
"""

from zerobatch.core._checks import check_count, check_rank, check_seed
from zerobatch.samplers._version import __version__
from zerobatch.samplers.block_shuffle import BlockShuffleOrder
from zerobatch.samplers.sharding import RankShard
from zerobatch.samplers.state import OrderState, state_from_json, state_to_json

__all__ = [
    "BlockShuffleOrder",
    "OrderState",
    "RankShard",
    "__version__",
    "check_count",
    "check_rank",
    "check_seed",
    "state_from_json",
    "state_to_json",
]
