"""zerobatch.core: the compiled kernels every zerobatch package calls, and file I/O helpers.

Everything here is imported from this module, never from ``zerobatch.core._<kernel>``:

- LLMBATCH headers: :func:`parse_llmbatch_header`, :func:`pack_llmbatch_header`,
  :func:`llmbatch_geometry`;
- offsets and orders: :func:`llmbatch_batch_offsets`, :func:`block_shuffle_items`,
  :class:`FeistelPermutation` (gfc-compatible pseudorandom permutation of any range),
  :func:`epoch_seed`, :func:`random_draws` (counter-mode uniform draws);
- ZRECORD: :class:`RecordGather` (seqlocked entry snapshots, checked record copies and
  inflate) and the store files in :mod:`zerobatch.core.zrstore`;
- TOKSTREAM: :class:`WindowGather` / :func:`gather_windows` (token windows across shards into one
  buffer);
- gathers: :class:`LLMBatchSlots` (verified batch reads into int64 / int32 / uint32 buffers),
  :func:`widen_u32`, :func:`max_u32`, :func:`pad_rows` (a padded batch's padding, mask and
  labels in one pass);
- checksums: :func:`xxh3_64`, :func:`hash_slots`, :func:`xxh3_kernel` (the SIMD loop chosen at run time);
- :mod:`zerobatch.core.io`: atomic writes, safe opens; :class:`FileMapping`: read-only
  mappings that hold no file descriptor;
- :mod:`zerobatch.core.pool`: :class:`TaskPool`, worker threads that run gathers with the
  GIL released from start to finish, stopped around ``fork`` and at exit;
- :mod:`zerobatch.core.checks`: the argument checks every package shares;
- :mod:`zerobatch.core.status`: the kernels' status codes and :func:`~zerobatch.core.status.raise_for_status`,
  the one map from a code to its exception.

The names come from the kernel table (:mod:`zerobatch.core._kernels`): every compiled module
``_<name>`` with its pure-Python twin ``_twins/<name>.py``. The kernels release the GIL in
their inner loops. If a compiled extension is missing this import fails with the command
that rebuilds it; ``ZEROBATCH_PUREPYTHON=1`` selects the twins instead (slow; for debugging).
"""

from zerobatch.core._kernels import PURE_PYTHON, exports
from zerobatch.core._version import __version__

_KERNEL_EXPORTS = exports()
globals().update(_KERNEL_EXPORTS)

from zerobatch.core import checks, io, pool, status  # noqa: E402 - after the kernels they wrap
from zerobatch.core.pool import shared_pool  # noqa: E402

__all__ = sorted([*_KERNEL_EXPORTS, "PURE_PYTHON", "__version__", "checks", "io", "pool", "shared_pool", "status"])
