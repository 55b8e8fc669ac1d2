"""Flat feature matrices as a loader source: windows of rows that never cross a key."""

from __future__ import annotations

from typing import Any

import numpy as np

from zerobatch.adapters.sources._base import CHUNK_BYTES, Array, Source, check_dataset
from zerobatch.formats.errors import ConfigError

__all__ = ["FeatureWindows"]


class FeatureWindows(Source):
    """Windows of a flat feature matrix (``zerobatch.readers.features``): ``W`` rows of one
    key, never crossing into the next, with the next ``horizon`` rows as the target.

    Args:
        folder: the dataset folder or an open :class:`~zerobatch.readers.features.FeatureMatrix`.
        window, stride, horizon: as for ``FeatureMatrix``.

    A step is ``x`` (``[B, W, features]`` floats), or ``(x, y)`` with a horizon. The loader's
    ``dtype`` (for token ids) does not apply: values keep the matrix's float type.
    """

    kind = "features"
    item_name = "windows"

    def __init__(self, folder: Any, window: int | None = None, *, stride: int = 1, horizon: int = 0,
                 verify: bool = True) -> None:
        super().__init__()
        from zerobatch.readers.features import FeatureMatrix
        if isinstance(folder, FeatureMatrix):
            self.matrix = folder
        else:
            check_dataset(folder, "FeatureWindows", ("features",))
            if window is None:
                raise ConfigError("window: give the rows per window", field="window")
            self.matrix = FeatureMatrix(folder, window, stride=stride, horizon=horizon, verify=verify)
        self.horizon = self.matrix.horizon
        self.output = (Array("x"), Array("y")) if self.horizon else Array("x")
        self.num_items = len(self.matrix)
        self.fingerprint = self.matrix.build_id

    def geometry(self) -> dict[str, Any]:
        m = self.matrix
        return {"window": int(m.window), "stride": int(m.stride), "horizon": int(m.horizon)}

    @property
    def access(self) -> Any:
        return self.matrix.access

    def prepare(self, items: np.ndarray) -> None:
        """A dataset at a URL: the blocks of these windows fetched in the background, steps
        ahead of their read."""
        if self.matrix.access.fetched:
            self.matrix.prefetch(items.reshape(-1))

    def chunk_steps(self, items_per_step: int) -> int:
        m = self.matrix
        return max(1, CHUNK_BYTES // max(1, items_per_step * (m.window + m.horizon) * m.row_bytes))

    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any]:
        steps, per = items.shape
        x, y = self.matrix.windows(items.reshape(-1))
        out = {"x": x.reshape(steps, per, *x.shape[1:])}
        if y is not None:
            out["y"] = y.reshape(steps, per, *y.shape[1:])
        return out
