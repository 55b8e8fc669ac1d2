"""zerobatch.samplers: the orders every zerobatch loader reads in.

Orders (:mod:`zerobatch.samplers.orders`) map global positions to item indices, in O(1) per
position from ``(seed, epoch, position)``:

- :class:`SequentialOrder`, :class:`GlobalRandomOrder` (a Feistel permutation per epoch),
  :class:`BlockShuffleOrder` (the LLMBATCH loader's order): every item once per epoch;
- :class:`SlidingOrder` (a ring) and :class:`RandomOrder` (draws with replacement): endless.

:class:`MixtureOrder` (formerly ``MixtureSchedule``, still importable under that name)
interleaves several sources in exact proportions (Megatron's "largest sampling error first"
rule), each in its own order, resumable after the weights change or sources are added: the
order of a mixture, as an :class:`IndexOrder` is the order of one source.

:class:`IndexSampler` cuts an order into global batches, deals them round-robin to ranks with
no communication, seeks to any step in O(1) and saves / resumes an exact, JSON-able state on
any world size that splits the global batch. It and :class:`MixtureSampler` (a mixture
order's steps) are the two :class:`Schedule` s: the one interface through which every zerobatch
loader plans its reads, records what it delivered and resumes
(:mod:`zerobatch.samplers.schedule`, which also states the one resume rule). :class:`FeistelPermutation` (gfc-compatible, any
range up to ``2**63 - 1``) and :class:`RankShard` are the building blocks; :class:`OrderState`
is the state.

Backed by GIL-free kernels in ``zerobatch.core``; NumPy only, never torch.
"""

from zerobatch.core import FeistelPermutation, epoch_seed, random_draws
from zerobatch.core.checks import check_count, check_rank, check_seed
from zerobatch.samplers._dist import resolve_rank
from zerobatch.samplers._version import __version__
from zerobatch.samplers.block_shuffle import BlockShuffleOrder
from zerobatch.samplers.mixture import MIXTURE_STATE_VERSION, MixtureOrder, MixtureSchedule, WeightSchedule
from zerobatch.samplers.orders import GlobalRandomOrder, IndexOrder, RandomOrder, SequentialOrder, SlidingOrder
from zerobatch.samplers.sampler import TAILS, IndexSampler
from zerobatch.samplers.schedule import MixtureSampler, Planned, Schedule
from zerobatch.samplers.sharding import RankShard
from zerobatch.samplers.state import STATE_VERSION, OrderState, state_from_json, state_to_json

__all__ = [
    "MIXTURE_STATE_VERSION",
    "STATE_VERSION",
    "TAILS",
    "BlockShuffleOrder",
    "FeistelPermutation",
    "GlobalRandomOrder",
    "IndexOrder",
    "IndexSampler",
    "MixtureOrder",
    "MixtureSampler",
    "MixtureSchedule",
    "WeightSchedule",
    "OrderState",
    "Planned",
    "RandomOrder",
    "RankShard",
    "Schedule",
    "SequentialOrder",
    "SlidingOrder",
    "__version__",
    "check_count",
    "check_rank",
    "check_seed",
    "epoch_seed",
    "random_draws",
    "resolve_rank",
    "state_from_json",
    "state_to_json",
]
