"""What a zerobatch loader reads: one :class:`Source` per way of cutting a dataset into items.

A source is a view of one reader: it numbers its items ``0 .. num_items - 1`` (an LLMBATCH
file's pre-formed batches, a token stream's windows or documents, a record store's records),
reads a step's items through the reader's public batch read (compiled, GIL-releasing), and
declares in :attr:`Source.output` what a step is handed out as: one array, an ``(x, y)`` pair
of views of one buffer (next-token windows), or a dict with the document-boundary outputs
and metadata (:class:`Array` and :class:`Value` leaves). The PyTorch and JAX loaders build
that output from a read with one generic function each. Sources are NumPy only; every source
pickles as its arguments, so loaders work in spawned worker processes.

A read returns either one dict of arrays whose first axis is the step (``stacked``: every
step of the read has the same shapes) or a list of per-step dicts.

The sources, one module per format (each module's ``__all__`` is exported here, so a new
format's source is its own module):

- :class:`LLMBatchSource` (``llmbatch``): the file's ``[batch_size, seq_len]`` batches; the
  default order is the seed's block shuffle;
- :class:`LLMChunkSource` (``llmchnk``): records padded or cut to a row length chosen at read time;
- :class:`TokenWindows`, :class:`TokenDocuments` (``tokstream``): windows anywhere in a token
  stream (with document boundaries and metadata on request), whole documents padded to a width;
- :class:`RecordFields` (``zrecord``): records of a store, by field;
- :class:`FeatureWindows` (``features``): windows of rows of a flat feature matrix;
- :class:`NpyTokenWindows` (``npy``): next-token windows of a folder of ``.npy`` token files;
- :class:`Mixture` (``mixture``): several sources interleaved in exact proportions.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from typing import TYPE_CHECKING, Any

from zerobatch.adapters.sources._base import CHUNK_BYTES, IGNORE_INDEX, Array, Source, Value, build
from zerobatch.formats.errors import ConfigError

if TYPE_CHECKING:
    # What the loop below exports, spelled out for type checkers and IDEs, which do not run
    # it (tests/test_repository.py fails when this differs from what the loop finds, so a
    # new format's source module stays all a new source needs, plus its names here).
    from zerobatch.adapters.sources.features import FeatureWindows as FeatureWindows
    from zerobatch.adapters.sources.llmbatch import LLMBatchSource as LLMBatchSource
    from zerobatch.adapters.sources.llmchnk import LLMChunkSource as LLMChunkSource
    from zerobatch.adapters.sources.mixture import Curriculum as Curriculum, Mixture as Mixture
    from zerobatch.adapters.sources.npy import NpyTokenWindows as NpyTokenWindows
    from zerobatch.adapters.sources.packed import (FlatDocuments as FlatDocuments,
                                                   PackedDocuments as PackedDocuments,
                                                   RecordDocuments as RecordDocuments)
    from zerobatch.adapters.sources.tokstream import TokenDocuments as TokenDocuments, TokenWindows as TokenWindows
    from zerobatch.adapters.sources.zrecord import RecordFields as RecordFields
    __all__ = ["Array", "CHUNK_BYTES", "Curriculum", "FeatureWindows", "FlatDocuments", "IGNORE_INDEX",
               "LLMBatchSource", "LLMChunkSource", "Mixture", "NpyTokenWindows", "PackedDocuments", "RecordDocuments",
               "RecordFields", "Source", "TokenDocuments", "TokenWindows", "Value", "build", "open_source"]
else:
    __all__ = ["CHUNK_BYTES", "IGNORE_INDEX", "Array", "Source", "Value", "build", "open_source"]
    # every source module's names (one module per format: no shared edit)
    for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")):
        _mod = importlib.import_module(f"{__name__}.{_module}")
        for _name in _mod.__all__:
            globals()[_name] = getattr(_mod, _name)
            __all__.append(_name)
    del _module, _mod, _name
    __all__.sort()


def open_source(value: Any, **kwargs: Any) -> Source:
    """A source for ``value``: a source as is; an open LLMBATCH reader, or the path of a dataset
    whose format has a default source that needs no arguments (a ``.batch`` file).

    Raises:
        ConfigError: a path that does not exist; a dataset of a format with no default source
            (naming its sources: ``TokenWindows(path, seq_len)``...); anything else.
    """
    if isinstance(value, Source):
        return value
    from zerobatch.core.remote import local_or_none
    from zerobatch.readers.llmbatch import BatchFileReader
    if isinstance(value, BatchFileReader):
        return globals()["LLMBatchSource"](value, **kwargs)
    path = local_or_none(value)
    if path is not None and os.path.exists(path):
        from zerobatch.adapters.sources._base import _what, how_to_read
        from zerobatch.readers.detect import find

        fmt = find(path)
        if fmt is not None and fmt.default_source is not None:
            return fmt.resolve("default_source")(value, **kwargs)
        if fmt is not None:
            raise ConfigError(f"source: {_what(fmt)}, which the loader does not open from a path alone: give "
                              f"it {how_to_read(fmt, value)}", path=value, field="source")
    elif path is not None:
        raise ConfigError("source: the path does not exist", path=value, field="source")
    raise ConfigError(f"source: expected a zerobatch source (LLMBatchSource, TokenWindows, TokenDocuments, "
                      f"RecordFields, Mixture) or a .batch file, got {value!r}", field="source")
