"""JAX adapter: the zerobatch loader yielding NumPy arrays or ``jax.Array`` s.

:class:`Loader` is the same loader as :class:`zerobatch.adapters.torch.Loader` (one
implementation, :mod:`zerobatch.adapters._loader`): the same sources, orders, read-ahead
threads and state, sharded over JAX processes by ``jax.process_index()`` /
``jax.process_count()`` with no communication. It needs ``jax`` (``pip install
zerobatch-adapters[jax]``), not torch.

Example::

    loader = Loader(TokenWindows("data/tokens", seq_len=2048), batch_size=8, seed=1)
    for x, y in loader:                 # jax.Array int32 (8, 2048), this process's rows
        state = train_step(state, x, y)
    ckpt["loader"] = loader.state_dict()

With ``sharding`` (a ``jax.sharding.Sharding`` over the global batch) every batch becomes one
global ``jax.Array`` assembled from each process's rows
(``jax.make_array_from_process_local_data``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

try:
    import jax
except ImportError as exc:  # pragma: no cover - exercised only without jax
    raise ImportError("zerobatch.adapters.jax needs jax: pip install 'zerobatch-adapters[jax]'") from exc

from zerobatch.adapters import sources as _sources
from zerobatch.adapters._loader import DEFAULT_PREFETCH, DEFAULT_SEED, BaseLoader
from zerobatch.adapters.sources import *  # noqa: F403 - every source, re-exported with the loader
from zerobatch.formats.errors import ConfigError

# a list plus the sources' names, in forms type checkers follow (every source is re-exported)
__all__ = ["Loader"]
__all__ += _sources.__all__
__all__.sort()

OUTPUTS = ("jax", "numpy")


def _jax_device(device: Any) -> Any:
    """``device`` as what ``jax.device_put`` takes, checked now rather than at the first batch.

    Raises:
        ConfigError: a platform JAX has no backend for here, an index past its devices, or
            something that names no device.
    """
    if device is None or isinstance(device, (jax.Device, jax.sharding.Sharding)):
        return device
    if not isinstance(device, str):
        raise ConfigError(f"device: must be a jax.Device, a platform name ('cpu', 'gpu', 'tpu', 'gpu:1') or "
                          f"None, got {device!r}", field="device")
    platform, sep, number = device.partition(":")
    if sep and not number.isdigit():
        raise ConfigError(f"device: {device!r} is not a platform name with a device number ('gpu:1')",
                          field="device")
    try:
        devices = jax.local_devices(backend=platform)      # this process's own: the ones it can put on
    except RuntimeError as exc:
        raise ConfigError(f"device: {device!r} but JAX has no {platform} backend here ({exc})",
                          field="device") from None
    index = int(number) if sep else 0
    if index >= len(devices):
        raise ConfigError(f"device: {device!r} but JAX has {len(devices)} {platform} device(s)",
                          field="device")
    return devices[index]


class Loader(BaseLoader):
    """Batches of a zerobatch source for this JAX process.

    Args:
        source, batch_size, global_batch_size, shuffle, seed, drop_last, tail, order,
        epoch, prefetch, num_threads: as for :class:`zerobatch.adapters.torch.Loader`.
        rank, world_size: default ``jax.process_index()`` / ``jax.process_count()``.
        dtype: ``int32`` (default, JAX's integer) or ``int64`` (needs ``jax_enable_x64``
            for ``jax.Array`` output).
        output: ``"jax"`` (``jax.Array`` on ``device``, or global arrays over
            ``sharding``) or ``"numpy"``.
        device: a ``jax.Device`` for the arrays (default: JAX's default device), or a
            platform name (``"cpu"``, ``"gpu"``, ``"tpu"``, ``"gpu:1"``: that platform's
            first, or numbered, local device); checked when the loader is made (a platform JAX
            cannot start here raises a :class:`ConfigError`, field ``device``).
        sharding: a ``jax.sharding.Sharding`` of the global batch; each array becomes a
            global array made of every process's rows.
        headspace: as for :class:`zerobatch.adapters.torch.Loader`.
    """

    def __init__(self, source: Any, batch_size: int | None = None, *, global_batch_size: int | None = None,
                 shuffle: bool = True, seed: int = DEFAULT_SEED, drop_last: bool = True, tail: str | None = None,
                 order: Any = None, rank: int | None = None, world_size: int | None = None, epoch: int = 0,
                 prefetch: int = DEFAULT_PREFETCH, num_threads: int | None = None, dtype: Any = np.int32, output: str = "jax",
                 device: Any = None, sharding: Any = None, headspace: int | None = None) -> None:
        if rank is None and world_size is None:
            rank, world_size = jax.process_index(), jax.process_count()
        if output not in OUTPUTS:
            raise ConfigError(f"output must be one of {OUTPUTS}, got {output!r}", field="output")
        super().__init__(source, batch_size, global_batch_size=global_batch_size, shuffle=shuffle, seed=seed,
                         drop_last=drop_last, tail=tail, order=order, rank=rank, world_size=world_size, epoch=epoch,
                         prefetch=prefetch, num_threads=num_threads, dtype=dtype, headspace=headspace)
        if output == "jax" and self.dtype == np.int64 and not jax.config.jax_enable_x64:
            raise ConfigError("dtype int64 needs jax_enable_x64 (jax.config.update('jax_enable_x64', True)); "
                              "JAX would silently cut the ids to int32", field="dtype")
        if device is not None and sharding is not None:
            raise ConfigError("pass device or sharding, not both", field="sharding")
        self.output = output
        self.device = _jax_device(device)
        self.sharding = sharding

    def __iter__(self) -> Iterator[Any]:
        return self._iter()

    def _array(self, value: Any) -> Any:
        if self.output == "numpy" or not isinstance(value, np.ndarray):
            return value
        if self.sharding is not None:
            return jax.make_array_from_process_local_data(self.sharding, value)
        return jax.device_put(value, self.device)

    def _finish(self, step: Any) -> Any:
        # Built first, converted after: a next-token pair's two views of one array become two
        # arrays (JAX has no views).
        if self.output == "numpy":
            return step
        return jax.tree_util.tree_map(self._array, step, is_leaf=lambda v: not isinstance(v, (tuple, list, dict)))
