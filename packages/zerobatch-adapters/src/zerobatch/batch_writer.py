"""The seed's writer module: ``from zerobatch.batch_writer import write_batch_file, write_batch_dataset``.

Kept so the seed's code examples run unchanged; both functions are the zerobatch
implementations in :mod:`zerobatch.writers.llmbatch`.
"""

from zerobatch.formats.llmbatch import HEADER_SIZE, MAGIC
from zerobatch.writers.llmbatch import write_batch_dataset, write_batch_file

__all__ = ["HEADER_SIZE", "MAGIC", "write_batch_dataset", "write_batch_file"]
