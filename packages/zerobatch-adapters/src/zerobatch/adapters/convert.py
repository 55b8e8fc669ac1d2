"""Conversions between the formats (NumPy only): every output written atomically, in
bounded memory.

- :func:`llmchnk_to_llmbatch`: an LLMCHNK file to an LLMBATCH file at any batch size (the way
  to change the batch size of a ``.batch`` file: convert it to LLMCHNK and back);
- :func:`llmbatch_to_llmchnk`: an LLMBATCH file's records (rows, in file order) to LLMCHNK.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from zerobatch.formats.errors import ConfigError
from zerobatch.readers.llmbatch import BatchFileReader
from zerobatch.readers.llmchnk import LLMChunkReader
from zerobatch.writers.llmbatch import write_batch_dataset
from zerobatch.writers.llmchnk import LLMChunkWriter

__all__ = ["llmbatch_to_llmchnk", "llmchnk_to_llmbatch"]

#: Records read per gather while converting.
GROUP = 1024


def llmchnk_to_llmbatch(src: str | os.PathLike[str], dst: str | os.PathLike[str], batch_size: int, *,
                        seq_len: int | None = None, seed: int = 0, shuffle: bool = True,
                        pad_id: int | None = None) -> int:
    """Write the records of an LLMCHNK file as an LLMBATCH file of ``batch_size`` records per
    batch (shuffled with ``seed`` exactly as the seed's writer does, or in order).

    Args:
        seq_len: tokens per record in the output (default: the header's).
        pad_id: ``None`` (default) refuses records of another length; an id pads short
            records and longer ones are cut.

    Returns:
        The number of batches written (the last ``num_records % batch_size`` records are dropped,
        as the seed's writer does).

    Raises:
        ConfigError: no ``seq_len`` known, or a record of another length without ``pad_id``
            (naming the record).
    """
    reader = LLMChunkReader(src)
    try:
        width = reader.seq_len if seq_len is None else int(seq_len)
        if width <= 0:
            raise ConfigError("seq_len: the file has no nominal record length; give one", path=reader.path,
                              field="seq_len")
        n = reader.num_records
        if pad_id is None:
            lengths = reader.lengths()
            wrong = np.flatnonzero(lengths != width)
            if wrong.size:
                i = int(wrong[0])
                raise ConfigError(f"record {i} has {int(lengths[i])} tokens, not {width}; pass pad_id to pad or cut",
                                  path=reader.path, field="seq_len")

        def records() -> Iterator[np.ndarray]:
            for start in range(0, n, GROUP):
                idx = np.arange(start, min(n, start + GROUP))
                tokens, _ = reader.gather(idx, width, pad_id=pad_id or 0)
                yield tokens
        return write_batch_dataset(dst, records(), n, batch_size, width, seed, shuffle=shuffle)
    finally:
        reader.close()


def llmbatch_to_llmchnk(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, dtype: str = "uint32") -> int:
    """Write every record (row) of an LLMBATCH file, in file order, as an LLMCHNK file whose
    nominal length is the file's ``seq_len``. Returns the number of records."""
    reader = BatchFileReader(src)
    try:
        with LLMChunkWriter(dst, seq_len=reader.seq_len, dtype=dtype) as w:
            for b in range(reader.num_batches):
                w.add_many(reader.read_batch(b))
        return w.num_records
    finally:
        reader.close()
