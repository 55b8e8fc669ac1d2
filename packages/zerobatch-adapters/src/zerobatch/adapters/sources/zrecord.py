"""ZRECORD as a loader source: records of a store, by field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zerobatch.adapters.sources._base import Array, Source, Value, check_dataset, open_reader
from zerobatch.core.checks import check_count
from zerobatch.formats.errors import ConfigError, OutOfRangeError

__all__ = ["RecordFields"]


class RecordFields(Source):
    """Records of a ZRECORD store, by field.

    Args:
        store: the store folder (or its URL: object storage, read-only) or an open
            :class:`~zerobatch.readers.zrecord.ZRecordStore`.
        fields: the fields to read (default: all).
        pad_to: for variable-length fields, the row width of a padded ``[batch, pad_to]``
            array (longer records are cut) with a ``<field>_mask``; an int for every such
            field or a dict by field. Unpadded variable-length fields come as lists of arrays.
        pad_value: the value written into padding.
        token_fields: fields holding token ids: handed out in the loader's ``dtype``
            (``int64`` by default) instead of their stored type.

    Fixed-shape fields come as ``[batch, *shape]`` arrays (absent records are zeros). One
    field is handed out as itself, several as a dict by name. A store that grows after the
    loader was made keeps serving its first ``num_items`` records.
    """

    kind = "zrecord"
    item_name = "records"

    def __init__(self, store: Any, fields: Sequence[str] | None = None, *, pad_to: int | dict[str, int] | None = None,
                 pad_value: int | float = 0, token_fields: Sequence[str] = (), num_threads: int = 1) -> None:
        super().__init__()
        from zerobatch.readers.zrecord import ZRecordStore
        check_dataset(store, "RecordFields", ("zrecord",))
        self.store = open_reader(store, ZRecordStore, num_threads=num_threads)
        self.fingerprint = self.store.fingerprint   # the store's identity, checked by a loaded state
        names = self.store.keys() if fields is None else list(fields)
        specs = {}
        for name in names:
            try:
                specs[name] = self.store.meta.field(name)
            except KeyError:
                raise ConfigError(f"fields: the store has no field {name!r} (it has {self.store.keys()})",
                                  path=self.store.path, field="fields") from None
        self.fields = names
        self._fixed = {n: s.shape is not None for n, s in specs.items()}
        self._dtypes = {n: s.np_dtype for n, s in specs.items()}
        if isinstance(pad_to, dict):
            unknown = sorted(set(pad_to) - set(names))
            if unknown:
                raise ConfigError(f"pad_to: {unknown[0]!r} is not a read field", field="pad_to")
            self.pad_to = {n: check_count(w, f"pad_to[{n}]", minimum=1) for n, w in pad_to.items()}
        elif pad_to is None:
            self.pad_to = {}
        else:
            w = check_count(pad_to, "pad_to", minimum=1)
            self.pad_to = {n: w for n in names if not self._fixed[n]}
        self.pad_value = pad_value
        self.token_fields = set(token_fields)
        unknown = sorted(self.token_fields - set(names))
        if unknown:
            raise ConfigError(f"token_fields: {unknown[0]!r} is not a read field", field="token_fields")
        self.stacked = all(self._fixed[n] or n in self.pad_to for n in names)
        outputs: dict[str, Any] = {}
        for n in names:
            stacked_field = self._fixed[n] or n in self.pad_to
            outputs[n] = Array(n) if stacked_field else Value(n)
            if n in self.pad_to:
                outputs[f"{n}_mask"] = Array(f"{n}_mask")
        # one field is handed out as itself, several (or a padded one and its mask) as a dict
        self.output = next(iter(outputs.values())) if len(outputs) == 1 else outputs
        self.num_items = len(self.store)

    @property
    def access(self) -> Any:
        return self.store.access

    def prepare(self, items: np.ndarray) -> None:
        """A store at a URL: the entries and records of these items fetched in the
        background, steps ahead of their read."""
        if self.store.access.fetched:
            self.store.prefetch(items.reshape(-1), self.fields)

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any] | list[dict[str, Any]]:
        steps, per = items.shape
        flat = items.reshape(-1)
        try:
            batch = self.store.gather(flat, self.fields)
        except OutOfRangeError as exc:
            raise OutOfRangeError(f"the store now holds {len(self.store)} records, fewer than the {self.num_items} "
                                  f"this source was made for (records were deleted since): {exc.message}",
                                  path=self.store.path, field="num_items") from exc
        with batch:
            data: dict[str, Any] = {}
            for name in self.fields:
                value = batch[name]
                cast = dtype if name in self.token_fields else None
                if self._fixed[name]:
                    data[name] = value if cast is None else value.astype(cast)
                elif name in self.pad_to:
                    width = self.pad_to[name]
                    arr = np.full((flat.size, width), self.pad_value, dtype=cast or self._dtypes[name])
                    mask = np.zeros((flat.size, width), dtype=bool)
                    for row, rec in enumerate(value):
                        k = min(len(rec), width)
                        arr[row, :k] = rec[:k]
                        mask[row, :k] = True
                    data[name], data[f"{name}_mask"] = arr, mask
                else:
                    data[name] = [np.array(rec, dtype=cast) for rec in value]
        if self.stacked:
            return {k: v.reshape(steps, per, *v.shape[1:]) for k, v in data.items()}
        return [{k: v[s * per:(s + 1) * per] for k, v in data.items()} for s in range(steps)]

    def close(self) -> None:
        self.store.close()
