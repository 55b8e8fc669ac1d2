"""The seed's reader module: ``from zerobatch.batch_loader import BatchFileReader, BatchNativeLoader``.

Kept so the seed's code examples run unchanged; both names are the zerobatch implementations
(:class:`zerobatch.adapters.torch.BatchFileReader`, the LLMBATCH reader with the seed's
``read_batch_torch``, and :class:`zerobatch.adapters.torch.BatchNativeLoader`).
"""

from zerobatch.adapters.torch import BatchFileReader, BatchNativeLoader
from zerobatch.formats.llmbatch import HEADER_SIZE

__all__ = ["HEADER_SIZE", "BatchFileReader", "BatchNativeLoader"]
