"""zerobatch.adapters: trainer adapters on top of the readers and samplers.

- :mod:`zerobatch.adapters.sources`: what a loader reads (LLMBATCH batches, token-stream
  windows and documents, ZRECORD fields, mixtures), NumPy only;
- :mod:`zerobatch.adapters.torch`: :class:`~zerobatch.adapters.torch.Loader` (one stateful
  loader over every source, also an ``IterableDataset``) and the seed's
  :class:`~zerobatch.adapters.torch.BatchNativeLoader` (imports torch);
- :mod:`zerobatch.adapters.jax`: the same loader yielding ``jax.Array`` or NumPy (imports jax);
- :mod:`zerobatch.adapters.loaderx`: the loaderx workflow over ZRECORD stores.

Importing this package does not import torch; importing ``zerobatch.adapters.torch`` does.
The seed's own import paths, ``zerobatch.batch_loader`` and ``zerobatch.batch_writer``, are
provided by this distribution too.
"""

from zerobatch.adapters._version import __version__

__all__ = ["__version__"]
