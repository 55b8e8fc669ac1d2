"""zerobatch.adapters: trainer adapters on top of the readers and samplers.

- :mod:`zerobatch.adapters.torch`: :class:`~zerobatch.adapters.torch.BatchNativeLoader`
  (imports torch);
- :mod:`zerobatch.adapters._prefetch`: ordered read-ahead on threads.

Importing this package does not import torch; importing ``zerobatch.adapters.torch`` does.
The seed's own import paths, ``zerobatch.batch_loader`` and ``zerobatch.batch_writer``, are
provided by this distribution too.
"""

from zerobatch.adapters._version import __version__

__all__ = ["__version__"]
