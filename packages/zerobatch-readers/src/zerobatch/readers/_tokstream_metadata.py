"""The per-token metadata of TOKSTREAM windows: the distinct objects of a batch, decoded on
access (:class:`MetadataObjects`), and the ids and keys that point at them
(:class:`WindowMetadata`)."""

from __future__ import annotations

import io
import operator
import pickle
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, overload

import numpy as np

from zerobatch.formats.errors import CorruptError, OutOfRangeError
from zerobatch.formats.strict_json import loads_strict
from zerobatch.readers._tokstream_shard import Shard

__all__ = ["MetadataObjects", "WindowMetadata", "decoder"]


def decoder(codec: str, folder: str) -> Callable[[memoryview], Any]:
    """The decoder of a dataset's metadata codec (``json``, ``numpy``, ``pickle``, ``bytes``).

    Raises (when called):
        CorruptError: a blob that does not decode.
    """
    def decode(blob: memoryview) -> Any:
        try:
            if codec == "json":
                # the spec's codec: strict JSON (no NaN / Infinity, no duplicate keys, UTF-8)
                return loads_strict(bytes(blob), error=CorruptError, field="metadata", path=folder)
            if codec == "numpy":
                return np.load(io.BytesIO(blob), allow_pickle=False)
            if codec == "pickle":
                return pickle.loads(blob)
            return blob
        except (ValueError, EOFError, pickle.UnpicklingError) as exc:
            raise CorruptError(f"metadata: a blob does not decode as {codec} ({exc})", path=folder,
                               field="metadata") from None
    return decode


class MetadataObjects(Sequence[Any]):
    """The distinct metadata objects of a batch, each decoded when first accessed.

    A sequence: ``objects[i]`` is the object that ``ids == i`` refers to. Blobs are
    ``memoryview`` slices of ``metadata.bin`` (of the mapping, or of the batch's reads in
    the pread backend), never copied; with ``decode`` each is decoded on first access and
    kept, so a training step that reads only the ids pays for no Python objects.
    """

    __slots__ = ("_table", "_shards", "_blobs", "_decode", "_cache", "_n")

    def __init__(self, table: np.ndarray, shards: list[Shard], blobs: list[memoryview] | None,
                 decode: Callable[[memoryview], Any] | None) -> None:
        self._n = len(table)
        self._table = table
        self._shards = shards
        self._blobs = blobs                  # pread backend: read with the batch
        self._decode = decode
        self._cache: dict[int, Any] = {}

    def _blob(self, i: int) -> memoryview:
        if self._blobs is not None:
            return self._blobs[i]
        k, _, a, b = self._table[i].tolist()
        shard = self._shards[k]
        shard.check_metadata_range(a, b)
        return shard.read("metadata.bin", a, b - a)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = operator.index(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise OutOfRangeError(f"metadata object {i} of {self._n}")
        if i not in self._cache:
            blob = self._blob(i)
            self._cache[i] = blob if self._decode is None else self._decode(blob)
        return self._cache[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"MetadataObjects({self._n} objects)"


class WindowMetadata(NamedTuple):
    """The metadata of one window, or of a batch of windows.

    ``ids`` holds one ``int32`` per token (shape ``(length,)`` for a window, ``(B, length)``
    for a batch): an index into ``objects``, or -1 where no metadata covers the token.
    ``objects`` (:class:`MetadataObjects`) are the distinct metadata in order of first
    appearance, decoded on access; ``keys`` names each as ``(shard, shard-local metadata
    id)`` (``int64 (len(objects), 2)``), stable across batches, so a caller may cache
    decoded objects by key.
    """

    ids: np.ndarray
    objects: MetadataObjects
    keys: np.ndarray
