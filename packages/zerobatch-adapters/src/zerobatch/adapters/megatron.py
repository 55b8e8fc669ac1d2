"""Megatron-core reads TOKSTREAM datasets in place: no export to ``.bin``/``.idx``.

::

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from zerobatch.adapters.megatron import ZerobatchGPTDataset

    config = GPTDatasetConfig(random_seed=1234, sequence_length=4096, blend=(["data/web", "data/code"], [0.7, 0.3]),
                              split="100,0,0", path_to_cache="cache/", tokenizer=tokenizer, ...)
    train, valid, test = BlendedMegatronDatasetBuilder(ZerobatchGPTDataset, [num_samples, 0, 0],
                                                       lambda: True, config).build()

A path of the blend that is a TOKSTREAM dataset (a folder or URL with a zerobatch manifest)
is read through :class:`TokenStreamDocuments`; any other path is a Megatron ``.bin``/``.idx``
prefix, read by Megatron's own ``IndexedDataset``: zerobatch and Megatron datasets blend in
one ``blend``. Everything above the low-level dataset is Megatron's: its document, sample
and shuffle indexes, its cache, its blending, its samplers. So the samples are exactly those
Megatron builds from the same tokens exported to ``.bin``/``.idx`` (tested sample for sample),
and a run resumes as every Megatron run does, from the ``consumed_train_samples`` of its own
checkpoint, in O(1) (samples are indexed, not streamed).

Why this hook (tested with megatron-core 0.16.1): ``MegatronDataset.build_low_level_dataset``
and ``numel_low_level_dataset`` are the two static methods ``BlendedMegatronDatasetBuilder``
calls to open each path of a blend (its ``MockGPTDataset`` overrides them the same way), and
``GPTDataset`` reads its low-level dataset through three members only: ``sequence_lengths``,
``get(idx, offset, length)`` and ``path_prefix`` (the default cache folder).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

try:
    from megatron.core.datasets.gpt_dataset import GPTDataset
except ImportError as exc:  # pragma: no cover - exercised only without megatron-core
    raise ImportError("zerobatch.adapters.megatron needs megatron-core: "
                      "pip install 'zerobatch-adapters[megatron]'") from exc

from zerobatch.core.checks import check_count
from zerobatch.formats.errors import ConfigError

__all__ = ["TokenStreamDocuments", "ZerobatchGPTDataset", "is_tokstream"]


#: the URL schemes Megatron reads its own ``.bin``/``.idx`` prefixes from (object storage)
MEGATRON_SCHEMES = ("s3", "msc")

#: documents whose lengths are read at once when a dataset is opened
SPAN_BLOCK = 1 << 22


def is_tokstream(path: str) -> bool:
    """Whether ``path`` names a TOKSTREAM dataset rather than a Megatron ``.bin``/``.idx``
    prefix: a folder holding a zerobatch ``manifest.json`` (or any folder that is not itself
    a Megatron prefix: zerobatch then says what it lacks); a URL holding one (Megatron
    prefixes in object storage, ``s3://`` and ``msc://``, are told apart by a HEAD of
    ``<url>/manifest.json``: a Megatron prefix has none); any other URL (Megatron reads none)."""
    from zerobatch.core.remote import is_url, local_path, open_store, split_url
    from zerobatch.formats.tokstream import MANIFEST_NAME

    path = os.fspath(path)
    scheme, sep, _ = path.partition("://")
    if sep and scheme.lower() != "file":
        if scheme.lower() not in MEGATRON_SCHEMES:
            return True
        if not is_url(path):           # msc://: Megatron's multi-storage client, not a zerobatch store
            return False
        root, key = split_url(path.rstrip("/"))
        return open_store(root).head(f"{key}/{MANIFEST_NAME}" if key else MANIFEST_NAME) is not None
    local = local_path(path)
    if os.path.isfile(os.path.join(local, MANIFEST_NAME)):
        return True
    return os.path.isdir(local) and not _megatron_pair_at(local)


def _megatron_pair_at(prefix: str) -> bool:
    return os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin")


class TokenStreamDocuments:
    """A TOKSTREAM dataset as Megatron's low-level dataset: one sequence per document.

    Args:
        path: the dataset folder or URL.
        verify: check chunk checksums on first read.

    Attributes:
        sequence_lengths: ``int32`` length of every document (what Megatron's
            ``IndexedDataset.sequence_lengths`` holds); documents of 2**31 tokens or more are
            refused.
        path_prefix: ``path`` (a ``file://`` URL's folder; Megatron puts its index cache under
            it unless ``path_to_cache`` is set, which a URL needs).
    """

    def __init__(self, path: str, *, verify: bool = True) -> None:
        from zerobatch.core.remote import local_path
        from zerobatch.readers.tokstream import TokenStreamReader
        # (a file:// URL's folder: Megatron makes its default index cache under it)
        self.path_prefix = str(local_path(path))
        self.reader = TokenStreamReader(path, verify=verify)
        n = self.reader.num_documents
        # 12 bytes a document, read a block at a time (no int64 copies of the whole index)
        self.starts = np.empty(n, np.int64)
        self.sequence_lengths = np.empty(n, np.int32)
        for first in range(0, n, SPAN_BLOCK):
            starts, stops = self.reader.document_spans(np.arange(first, min(n, first + SPAN_BLOCK), dtype=np.int64))
            lengths = stops - starts
            if int(lengths.max()) >= 2**31:
                raise ConfigError(f"{path}: a document of {int(lengths.max())} tokens: Megatron's sequence lengths "
                                  f"are int32", field="sequence_lengths")
            self.starts[first:first + starts.size] = starts
            self.sequence_lengths[first:first + starts.size] = lengths

    @property
    def document_indices(self) -> np.ndarray:
        """One sequence per document: document ``k`` is sequences ``[k, k + 1)`` (what
        Megatron's masked-LM datasets ask for; ``GPTDataset`` does not)."""
        return np.arange(len(self) + 1, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``idx`` (to its end when
        ``length`` is ``None``), as Megatron's ``IndexedDataset.get``.

        Raises:
            IndexError: ``idx`` outside the documents.
            ConfigError: ``offset`` or ``length`` outside the document.
        """
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise IndexError(f"{self.path_prefix}: document {idx} is outside [0, {len(self)})")
        n = int(self.sequence_lengths[idx])
        offset = check_count(offset, "offset", maximum=n)
        length = n - offset if length is None else check_count(length, "length", maximum=n - offset)
        if length == 0:
            return np.empty(0, np.int64)
        start = int(self.starts[idx]) + offset
        return self.reader.windows([start], length, dtype=np.int64)[0]

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)


class ZerobatchGPTDataset(GPTDataset):
    """Megatron's ``GPTDataset`` over TOKSTREAM datasets read in place (and over Megatron
    ``.bin``/``.idx`` prefixes, in the same blend): pass it to ``BlendedMegatronDatasetBuilder``."""

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        return int(low_level_dataset.sequence_lengths.shape[0])

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: Any) -> Any:
        """Raises:
            ConfigError: a dataset at a URL and no ``path_to_cache`` (Megatron would make its
                index cache in a local folder named after the URL)."""
        if is_tokstream(dataset_path):
            if "://" in dataset_path and not dataset_path.lower().startswith("file://") \
                    and not getattr(config, "path_to_cache", None):
                from zerobatch.core.remote import redact
                raise ConfigError(f"path_to_cache: {redact(dataset_path)} is a URL; give "
                                  f"GPTDatasetConfig(path_to_cache=...) for Megatron's index cache",
                                  field="path_to_cache")
            return TokenStreamDocuments(dataset_path)
        return GPTDataset.build_low_level_dataset(dataset_path, config)
