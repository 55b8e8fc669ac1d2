"""zerobatch.adapters: trainer adapters on top of the readers and samplers.

- :mod:`zerobatch.adapters.sources`: what a loader reads (LLMBATCH batches, token-stream
  windows and documents, ZRECORD fields, mixtures), NumPy only;
- :mod:`zerobatch.adapters.torch`: :class:`~zerobatch.adapters.torch.Loader` (one stateful
  loader over every source, also an ``IterableDataset``) and the seed's
  :class:`~zerobatch.adapters.torch.BatchNativeLoader` (imports torch);
- :mod:`zerobatch.adapters.jax`: the same loader yielding ``jax.Array`` or NumPy (imports jax);
- :mod:`zerobatch.adapters.loaderx`: the loaderx workflow over ZRECORD stores;
- inside trainers, resuming from their own checkpoints (each imports its trainer, behind the
  extra of the same name; docs/trainers/): :mod:`zerobatch.adapters.hf` (Hugging Face
  ``Trainer``, TRL, accelerate), :mod:`zerobatch.adapters.lightning`,
  :mod:`zerobatch.adapters.grain`, :mod:`zerobatch.adapters.torchtitan`,
  :mod:`zerobatch.adapters.megatron` (TOKSTREAM read in place by
  ``BlendedMegatronDatasetBuilder``) and :mod:`zerobatch.adapters.olmo` (an OLMo-core
  ``DocumentSource``).

Importing this package does not import torch; importing ``zerobatch.adapters.torch`` does.
The seed's own import paths, ``zerobatch.batch_loader`` and ``zerobatch.batch_writer``, are
provided by this distribution too.
"""

from zerobatch.adapters._version import __version__

__all__ = ["__version__"]
