"""Each format's part in preparation, one module per format, named by its registry record:
its ``convert --to`` target, ``write(dst, chunks, target)`` (``Format.convert``), and its
datasets read as documents of tokens (``Format.documents``: a :class:`Documents`), what a
conversion *from* a zerobatch dataset reads (``convert --from zerobatch``, the exports)."""

from __future__ import annotations

import abc
from collections.abc import Iterator

import numpy as np

__all__ = ["PIECE", "Documents"]

#: Tokens read per piece when streaming a dataset's tokens.
PIECE = 1 << 22


class Documents(abc.ABC):
    """A dataset opened to be read as documents: :meth:`lengths` (tokens per document, or per
    record for formats without documents) and :meth:`token_pieces` (the tokens in reading
    order, in bounded pieces).

    Args:
        path: the dataset (a file, folder or URL).
        field: a multi-field format's token field (ZRECORD); others ignore it.
    """

    kind = ""
    #: whether the dataset holds token ids (False: values, which convert does not take)
    tokens = True

    def __init__(self, path: str, field: str | None = None) -> None:
        self.path = path

    @abc.abstractmethod
    def lengths(self) -> np.ndarray:
        """Tokens per document (or per record, for formats without documents)."""

    def token_pieces(self) -> Iterator[np.ndarray]:
        """The tokens in reading order, in bounded pieces (none for non-token formats)."""
        return iter(())

    def close(self) -> None:  # noqa: B027 - a dataset with no reader of its own has nothing to release
        """Release the reader (idempotent)."""
