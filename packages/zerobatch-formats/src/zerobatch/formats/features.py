"""Flat feature matrices: one contiguous ``[rows, features]`` float matrix on disk and a
``metadata.json`` mapping each key (a stock symbol, a sensor, a document) to its row range
(``docs/formats/features.md``). Constants, limits and the strict metadata parser.

A dataset folder holds::

    metadata.json               the commit point (strict JSON, written last, atomically)
    features-<build_id>.bin     rows * features little-endian floats, row-major
    features-<build_id>.sums    one u64 XXH3-64 per block of block_bytes of the .bin file

The data files carry the build id in their names, so a rebuild never touches the files a
reader of the previous build has mapped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from typing import Any

from zerobatch.formats.errors import CorruptError, IntegrityError, LimitExceededError, UnsupportedVersionError
from zerobatch.formats.registry import Format
from zerobatch.formats.strict_json import loads_strict

__all__ = ["FORMAT", "BLOCK_BYTES", "DTYPES", "FeatureMeta", "KeyRange", "MAX_METADATA_BYTES", "METADATA", "VERSION",
           "data_file_names", "parse_metadata"]

VERSION = 1
METADATA = "metadata.json"
#: Bytes per checksummed block of the data file.
BLOCK_BYTES = 1 << 20
#: The metadata file is refused above this size before it is parsed.
MAX_METADATA_BYTES = 256 << 20
#: Element types: name -> (numpy little-endian dtype, itemsize).
DTYPES = {"float32": ("<f4", 4), "float64": ("<f8", 8), "float16": ("<f2", 2)}
#: Largest number of features per row.
MAX_FEATURES = 1 << 24

_BUILD_ID = re.compile(r"^[0-9a-f]{16}$")
_HEX64 = re.compile(r"^[0-9a-f]{16}$")


def data_file_names(build_id: str) -> tuple[str, str]:
    """The data and checksum file names of a build (names a reader builds itself)."""
    return f"features-{build_id}.bin", f"features-{build_id}.sums"


@dataclasses.dataclass(frozen=True)
class KeyRange:
    key: str
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class FeatureMeta:
    """The parsed ``metadata.json``."""

    dtype: str
    num_rows: int
    num_features: int
    build_id: str
    block_bytes: int
    sums_xxh3: str
    keys: tuple[KeyRange, ...]
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    columns: tuple[str, ...] | None

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def np_dtype(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def data_bytes(self) -> int:
        return self.num_rows * self.num_features * self.itemsize

    @property
    def num_blocks(self) -> int:
        return -(-self.data_bytes // self.block_bytes)

    def to_json(self, digest: Callable[[bytes], int]) -> dict[str, Any]:
        """The document to write, with its ``metadata_xxh3`` (``digest`` is XXH3-64)."""
        d: dict[str, Any] = {
            "zerobatch_features": VERSION, "dtype": self.dtype, "num_rows": self.num_rows,
            "num_features": self.num_features, "build_id": self.build_id, "block_bytes": self.block_bytes,
            "sums_xxh3": self.sums_xxh3,
            "keys": [{"key": k.key, "start": k.start, "stop": k.stop} for k in self.keys],
        }
        if self.mean is not None:
            d["normalization"] = {"mean": list(self.mean), "std": list(self.std or ())}
        if self.columns is not None:
            d["columns"] = list(self.columns)
        d["metadata_xxh3"] = f"{digest(canonical(d)):016x}"
        return d


def canonical(d: dict[str, Any]) -> bytes:
    """The bytes ``metadata_xxh3`` covers: the document without that field, as sorted,
    compact JSON (floats as Python writes them, which parse back to the same value)."""
    body = {k: v for k, v in d.items() if k != "metadata_xxh3"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _int(d: dict[str, Any], name: str, path: Any, *, minimum: int = 0, maximum: int = 2**63 - 1) -> int:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise CorruptError(f"{name}: must be an integer, got {v!r}", path=path, field=name)
    if not minimum <= v <= maximum:
        raise LimitExceededError(f"{name}: {v} is outside [{minimum}, {maximum}]", path=path, field=name)
    return v


def _floats(v: Any, n: int, name: str, path: Any, *, positive: bool = False) -> tuple[float, ...]:
    if not isinstance(v, list) or len(v) != n:
        raise CorruptError(f"{name}: must be a list of {n} numbers", path=path, field=name)
    out = []
    for x in v:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or (positive and x <= 0):
            raise CorruptError(f"{name}: {x!r} is not a finite{' positive' if positive else ''} number",
                               path=path, field=name)
        out.append(float(x))
    return tuple(out)


def parse_metadata(raw: bytes, *, path: Any = None, digest: Callable[[bytes], int] | None = None) -> FeatureMeta:
    """Parse and check ``metadata.json``: every field typed and in range, the key ranges
    contiguous from 0 to ``num_rows``, sizes that do not overflow, and (with ``digest``,
    XXH3-64) the document against its ``metadata_xxh3``.

    Raises:
        LimitExceededError: too large, or a count out of range. UnsupportedVersionError:
        another version or dtype. CorruptError: anything malformed (naming the field).
    """
    if len(raw) > MAX_METADATA_BYTES:
        raise LimitExceededError(f"metadata: {len(raw)} bytes exceeds {MAX_METADATA_BYTES}", path=path,
                                 field="metadata")
    d = loads_strict(raw, error=CorruptError, field="metadata", path=path)
    if not isinstance(d, dict):
        raise CorruptError("metadata: expected a JSON object", path=path, field="metadata")
    stored = d.get("metadata_xxh3")
    if not isinstance(stored, str) or not _HEX64.match(stored):
        raise CorruptError(f"metadata_xxh3: must be 16 lowercase hex digits, got {stored!r}", path=path,
                           field="metadata_xxh3")
    if digest is not None and f"{digest(canonical(d)):016x}" != stored:
        raise IntegrityError("metadata_xxh3: the metadata does not match its checksum (a field was changed)",
                             path=path, field="metadata_xxh3")
    if d.get("zerobatch_features") != VERSION or isinstance(d.get("zerobatch_features"), bool):
        raise UnsupportedVersionError(f"zerobatch_features: version {d.get('zerobatch_features')!r} (this release "
                                      f"reads {VERSION})", path=path, field="zerobatch_features")
    dtype = d.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise UnsupportedVersionError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)}", path=path, field="dtype")
    rows = _int(d, "num_rows", path)
    feats = _int(d, "num_features", path, minimum=1, maximum=MAX_FEATURES)
    if rows > (2**63 - 1) // (feats * DTYPES[dtype][1]):
        raise LimitExceededError("num_rows: the matrix size overflows 64 bits", path=path, field="num_rows")
    block = _int(d, "block_bytes", path, minimum=4096, maximum=1 << 30)
    build_id, sums = d.get("build_id"), d.get("sums_xxh3")
    if not isinstance(build_id, str) or not _BUILD_ID.match(build_id):
        raise CorruptError(f"build_id: must be 16 lowercase hex digits, got {build_id!r}", path=path, field="build_id")
    if not isinstance(sums, str) or not _HEX64.match(sums):
        raise CorruptError(f"sums_xxh3: must be 16 lowercase hex digits, got {sums!r}", path=path, field="sums_xxh3")
    keys_raw = d.get("keys")
    if not isinstance(keys_raw, list):
        raise CorruptError("keys: must be a list", path=path, field="keys")
    keys, at, seen = [], 0, set()
    for e in keys_raw:
        if not isinstance(e, dict) or set(e) != {"key", "start", "stop"}:
            raise CorruptError("keys: each entry is {key, start, stop}", path=path, field="keys")
        name = e["key"]
        if not isinstance(name, str) or not name or name in seen:
            raise CorruptError(f"keys: a key must be a unique non-empty string, got {name!r}", path=path, field="keys")
        start, stop = _int(e, "start", path), _int(e, "stop", path)
        if start != at or stop < start or stop > rows:
            raise CorruptError(f"keys: {name!r} covers [{start}, {stop}); the ranges must be contiguous from 0 to "
                               f"num_rows ({rows}), the next starts at {at}", path=path, field="keys")
        seen.add(name)
        keys.append(KeyRange(name, start, stop))
        at = stop
    if at != rows:
        raise CorruptError(f"keys: the ranges end at row {at}, num_rows is {rows}", path=path, field="keys")
    mean = std = None
    norm = d.get("normalization")
    if norm is not None:
        if not isinstance(norm, dict) or set(norm) != {"mean", "std"}:
            raise CorruptError("normalization: must be {mean, std}", path=path, field="normalization")
        mean = _floats(norm["mean"], feats, "normalization.mean", path)
        std = _floats(norm["std"], feats, "normalization.std", path, positive=True)
    columns = d.get("columns")
    if columns is not None:
        if not isinstance(columns, list) or len(columns) != feats or not all(isinstance(c, str) for c in columns):
            raise CorruptError(f"columns: must be a list of {feats} strings", path=path, field="columns")
        columns = tuple(columns)
    extra = sorted(set(d) - {"zerobatch_features", "dtype", "num_rows", "num_features", "build_id", "block_bytes",
                             "sums_xxh3", "keys", "normalization", "columns", "metadata_xxh3"})
    if extra:
        raise CorruptError(f"{extra[0]}: unknown field", path=path, field=extra[0])
    return FeatureMeta(dtype=dtype, num_rows=rows, num_features=feats, build_id=build_id, block_bytes=block,
                       sums_xxh3=sums, keys=tuple(keys), mean=mean, std=std, columns=columns)


#: This format in the registry (:mod:`zerobatch.formats.registry`).
FORMAT = Format(
    name="features", title="feature matrix", layout="folder", markers=(METADATA,), spec="docs/formats/features.md",
    summary="one float feature matrix and the row ranges of its keys; windows that never cross a key",
    reader="zerobatch.readers.features:FeatureMatrix", writer="zerobatch.writers.features:write_feature_matrix",
    kernel="zerobatch.core._features", sources=("zerobatch.adapters.sources.features:FeatureWindows",),
    cli="zerobatch.cli.formats.features:Features")
