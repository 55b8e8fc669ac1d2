"""zerobatch.prepare: preparing training data as a library, the ``zerobatch`` command's engine.

* :func:`convert` (:mod:`~zerobatch.prepare.pipeline`): any source (text, JSONL, Parquet, Hugging
  Face datasets, conversations with a chat template, ``.npy``, nanoGPT and Megatron files, a
  zerobatch dataset) into any zerobatch format or an export, on one pipeline: an encoder
  (:mod:`~zerobatch.prepare.encoders`: a tokenizer, or a chat template and its loss mask), groups
  staged on worker processes (:mod:`~zerobatch.prepare.staging`), named streams written by the
  format's target (:mod:`~zerobatch.prepare.targets`);
* the task/commit contract (:mod:`~zerobatch.prepare.tasks`): task I of N writes finished
  parts, :func:`commit` assembles the dataset; its steps for datatrove and Ray Data
  (:mod:`~zerobatch.prepare.integrations`);
* the inputs (:mod:`~zerobatch.prepare.sources`, :mod:`~zerobatch.prepare.conversations`),
  tokenizers (:mod:`~zerobatch.prepare.tokenizer`), chat templates (:mod:`~zerobatch.prepare.chat`),
  worker processes (:mod:`~zerobatch.prepare.workers`), exports (:mod:`~zerobatch.prepare.exports`).

It imports no trainer (no torch) and nothing of the command line.
"""

from zerobatch.prepare._version import __version__
from zerobatch.prepare.pipeline import convert
from zerobatch.prepare.options import ConvertOptions
from zerobatch.prepare.targets import targets
from zerobatch.prepare.tasks import Destination, commit
from zerobatch.prepare.tokenizer import load_tokenizer

__all__ = ["ConvertOptions", "Destination", "__version__", "commit", "convert", "load_tokenizer", "targets"]
