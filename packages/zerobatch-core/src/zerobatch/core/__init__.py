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
  GIL released from start to finish, stopped around ``fork`` and at exit.

The kernels release the GIL in their inner loops. If the compiled extensions are missing
this import fails with the command that rebuilds them; ``ZEROBATCH_PUREPYTHON=1`` selects the
pure-NumPy twins in ``zerobatch.core._reference`` instead (slow; for debugging).
"""

import os as _os

from zerobatch.core._version import __version__

PURE_PYTHON = _os.environ.get("ZEROBATCH_PUREPYTHON") == "1"

if PURE_PYTHON:
    from zerobatch.core._reference import (
        FeistelPermutation,
        FileMapping,
        LLMBatchSlots,
        WindowGather,
        epoch_seed,
        gather_windows,
        random_draws,
        block_shuffle_items,
        hash_slots,
        llmbatch_batch_offsets,
        llmbatch_geometry,
        max_u32,
        pad_rows,
        pack_llmbatch_header,
        parse_llmbatch_header,
        widen_u32,
        xxh3_64,
        xxh3_kernel,
    )
    from zerobatch.core._reference import RecordGather, buffer_views, zrecord_status_error
    from zerobatch.core._reference import ChunkRecords, gather_rows, locate_windows
else:
    try:
        from zerobatch.core._feistel import FeistelPermutation, epoch_seed, random_draws
        from zerobatch.core._mapping import FileMapping
        from zerobatch.core._gather import LLMBatchSlots, max_u32, pad_rows, widen_u32
        from zerobatch.core._hash import hash_slots, xxh3_64, xxh3_kernel
        from zerobatch.core._header import llmbatch_geometry, pack_llmbatch_header, parse_llmbatch_header
        from zerobatch.core._offsets import block_shuffle_items, llmbatch_batch_offsets
        from zerobatch.core._tokstream import WindowGather, gather_windows
        from zerobatch.core._zrecord import RecordGather, buffer_views
        from zerobatch.core._zrecord import status_error as zrecord_status_error
        from zerobatch.core._llmchnk import ChunkRecords
        from zerobatch.core._features import gather_rows
        from zerobatch.core._features import locate as locate_windows
    except ImportError as _exc:  # pragma: no cover - exercised by a broken install only
        raise ImportError(
            "zerobatch.core: the compiled extensions are missing or broken "
            f"({_exc}). Reinstall them with: python -m pip install --force-reinstall "
            "--no-deps zerobatch-core (or set ZEROBATCH_PUREPYTHON=1 for the slow pure-Python "
            "kernels)"
        ) from _exc

from zerobatch.core import io, pool
from zerobatch.core.pool import TaskPool, shared_pool

__all__ = [
    "ChunkRecords",
    "FeistelPermutation",
    "FileMapping",
    "LLMBatchSlots",
    "PURE_PYTHON",
    "RecordGather",
    "TaskPool",
    "WindowGather",
    "__version__",
    "block_shuffle_items",
    "buffer_views",
    "epoch_seed",
    "gather_rows",
    "gather_windows",
    "zrecord_status_error",
    "random_draws",
    "hash_slots",
    "io",
    "llmbatch_batch_offsets",
    "llmbatch_geometry",
    "locate_windows",
    "max_u32",
    "pack_llmbatch_header",
    "pad_rows",
    "parse_llmbatch_header",
    "pool",
    "shared_pool",
    "widen_u32",
    "xxh3_64",
    "xxh3_kernel",
]
