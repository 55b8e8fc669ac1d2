"""The import path of earlier releases for ``zerobatch convert`` as a function: it is
:func:`zerobatch.prepare.convert` (the pipeline, :mod:`zerobatch.prepare.pipeline`), and the
conversion targets' helpers are in :mod:`zerobatch.prepare.targets`."""

from zerobatch.prepare.options import ConvertOptions, find_eod
from zerobatch.prepare.pipeline import convert
from zerobatch.prepare.targets import Chunks, Target, build_folder, check_destination, documents, records, targets
from zerobatch.prepare.tokenizer import load_tokenizer

__all__ = ["Chunks", "ConvertOptions", "Target", "build_folder", "check_destination", "convert", "documents",
           "find_eod", "load_tokenizer", "records", "targets"]
