"""zerobatch.writers: build zerobatch files, always atomically (temporary file, fsync, rename).

One module per format:

- :mod:`zerobatch.writers.llmbatch`: LLMBATCH batch-native files
  (:func:`write_batch_file`, :func:`write_batch_dataset`, :class:`LLMBatchWriter`).
"""

from zerobatch.writers import llmbatch
from zerobatch.writers._version import __version__
from zerobatch.writers.llmbatch import LLMBatchWriter, write_batch_dataset, write_batch_file

__all__ = ["LLMBatchWriter", "__version__", "llmbatch", "write_batch_dataset", "write_batch_file"]
