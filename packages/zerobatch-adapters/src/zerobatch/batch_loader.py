"""The seed's reader module: ``from zerobatch.batch_loader import BatchFileReader, BatchNativeLoader``.

Kept so the seed's code examples run unchanged; both names are the zerobatch implementations
(:class:`zerobatch.readers.llmbatch.BatchFileReader`,
:class:`zerobatch.adapters.torch.BatchNativeLoader`).
"""

from zerobatch.adapters.torch import BatchNativeLoader
from zerobatch.formats.llmbatch import HEADER_SIZE
from zerobatch.readers.llmbatch import BatchFileReader

__all__ = ["HEADER_SIZE", "BatchFileReader", "BatchNativeLoader"]
