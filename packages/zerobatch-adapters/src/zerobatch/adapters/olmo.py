"""OLMo-core reads TOKSTREAM datasets in place, through its composable data API.

::

    from olmo_core.data.composable import ConcatAndChunkInstanceSource, ComposableDataLoader
    from zerobatch.adapters.olmo import TokenStreamDocumentSource

    docs = TokenStreamDocumentSource("data/web", tokenizer=tokenizer_config, work_dir="work/")
    instances = ConcatAndChunkInstanceSource(docs, sequence_length=4096, work_dir="work/")
    loader = ComposableDataLoader(instances, collator=..., tokenizer=tokenizer_config,
                                  work_dir="work/", global_batch_size=...)

:class:`TokenStreamDocumentSource` is an OLMo-core ``DocumentSource`` (``TokenSource`` with
document offsets, OL#416): every composition OLMo-core builds on a document source works on
it (concatenate and chunk, packing, sampling, mixing, slicing), and a dataset's loss mask
(``convert --chat``) becomes OLMo's ``label_mask``. Everything above it is OLMo-core's: its
instance sources, its global indexes, its data loader and the state the OLMo-core trainer
checkpoints (``tokens_processed``, resumed in O(1)). So instances equal those OLMo-core builds
from the same tokens in its own numpy token files (tested instance for instance, and the
loader's batches after a resume from its own state).

Why this hook (tested with ai2-olmo-core 3.0.0): ``DocumentSource`` is the documented
extension point of ``olmo_core.data.composable`` (its own ``NumpyDocumentSource`` and
``InMemoryDocumentSource`` implement the same five members: ``num_tokens``,
``get_token_range``, ``get_document_offsets``, ``fingerprint`` and ``children``).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np

try:
    from olmo_core.data.composable.token_source import DocumentSource
except ImportError as exc:  # pragma: no cover - exercised only without olmo-core
    raise ImportError("zerobatch.adapters.olmo needs OLMo-core: pip install 'zerobatch-adapters[olmo]'") from exc

from zerobatch.formats.errors import ConfigError

__all__ = ["TokenStreamDocumentSource"]

#: documents whose offsets are read at once by get_document_offsets
OFFSET_BLOCK = 1 << 20


class TokenStreamDocumentSource(DocumentSource):
    """A TOKSTREAM dataset (folder or URL) as an OLMo-core ``DocumentSource``.

    Args:
        path: the dataset.
        work_dir: OLMo-core's local working folder (its sources cache indexes there).
        tokenizer: OLMo-core's ``TokenizerConfig`` of the tokenizer the dataset was made
            with (``eos_token_id`` / ``bos_token_id``, which some compositions ask a source
            for, and OLMo-core's ``generate_doc_lengths`` finds documents by); optional: without
            it the end-of-document id the dataset recorded (``convert`` records the one it
            appended) is the ``eos_token_id``.
        label_mask: hand out the dataset's loss mask as ``label_mask`` (``None``: when the
            dataset has one).
        label: OLMo-core's label of the source (mixtures, visualizations).
        verify: check chunk checksums on first read.

    Raises:
        ConfigError: ``label_mask=True`` and the dataset has no loss mask; a ``tokenizer``
            whose ``eos_token_id`` is not the end-of-document id the dataset recorded (OLMo-core
            would look for document ends its documents do not have).
    """

    def __init__(self, path: str, *, work_dir: Any, tokenizer: Any = None, label_mask: bool | None = None,
                 label: str | None = None, verify: bool = True) -> None:
        super().__init__(work_dir=work_dir, label=label)
        from zerobatch.readers.tokstream import TokenStreamReader
        self.path = str(path)
        self.reader = TokenStreamReader(self.path, verify=verify)
        has_mask = self.reader.manifest.loss_mask is not None
        if label_mask and not has_mask:
            raise ConfigError(f"{self.path}: label_mask=True but the dataset has no loss mask "
                              f"(convert --chat writes one)", field="label_mask")
        self._mask = self.reader.stream("loss_mask") if (has_mask if label_mask is None else label_mask) else None
        self._tokenizer = tokenizer
        eod = self.reader.manifest.eod_token
        if tokenizer is not None and eod is not None and int(tokenizer.eos_token_id) != eod:
            raise ConfigError(f"{self.path}: the tokenizer's eos_token_id is {tokenizer.eos_token_id} but the "
                              f"dataset's documents end with {eod} (its manifest's eod_token): a tokenizer of "
                              f"another vocabulary?", field="tokenizer")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    @property
    def eos_token_id(self) -> int:
        if self._tokenizer is not None:
            return int(self._tokenizer.eos_token_id)
        eod = self.reader.manifest.eod_token
        if eod is None:
            raise ConfigError("eos_token_id: the dataset records no end-of-document id; give "
                              "TokenStreamDocumentSource(tokenizer=TokenizerConfig(...))", field="tokenizer")
        return int(eod)

    @property
    def bos_token_id(self) -> int | None:
        return None if self._tokenizer is None else self._tokenizer.bos_token_id

    @functools.cached_property
    def fingerprint(self) -> str:
        """The dataset's build id (and its loss mask's, when handed out): the same tokens
        written again give the same fingerprint, other tokens another."""
        h = hashlib.sha256(f"class={type(self).__name__},build={self.reader.manifest.build_id},".encode())
        if self._mask is not None:
            h.update(f"mask={self.reader.manifest.loss_mask},".encode())
        return h.hexdigest()

    @property
    def num_tokens(self) -> int:
        return int(self.reader.num_tokens)

    def children(self) -> list[Any]:
        return []

    def get_token_range(self, start_idx: int, end_idx: int) -> dict[str, Any]:
        start, end = self.validate_indices(start_idx, end_idx)
        out: dict[str, Any] = {"input_ids": self.reader.windows([start], end - start, dtype=np.int64)[0]}
        if self._mask is not None:
            out["label_mask"] = self._mask.windows([start], end - start, dtype=np.int32)[0] != 0
        return out

    def get_document_offsets(self) -> Iterator[tuple[int, int]]:
        n = self.reader.num_documents
        for first in range(0, n, OFFSET_BLOCK):
            starts, stops = self.reader.document_spans(np.arange(first, min(n, first + OFFSET_BLOCK)))
            yield from zip(starts.tolist(), stops.tolist())
