"""zerobatch.readers: open, validate and read zerobatch files with zero copies.

One module per format:

- :mod:`zerobatch.readers.llmbatch`: :class:`BatchFileReader` for LLMBATCH files.

NumPy only: importing this package never imports torch.
"""

from zerobatch.readers import llmbatch
from zerobatch.readers._version import __version__
from zerobatch.readers.llmbatch import BatchFileReader, VerifyReport

__all__ = ["BatchFileReader", "VerifyReport", "__version__", "llmbatch"]
