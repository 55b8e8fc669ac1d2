from typing import Any

import numpy as np

def mixture_walk(
    weights: Any, since: np.ndarray, target: np.ndarray | None, t: int, n: int, moving: bool, watch: int = ...,
    base: int = ..., targets: Any = ..., found: np.ndarray | None = ...
) -> tuple[int, int]: ...
