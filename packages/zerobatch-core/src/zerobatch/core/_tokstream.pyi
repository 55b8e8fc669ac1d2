from typing import Any

import numpy as np

def gather_windows(
    bases: Any, cum: Any, itemsize: int, token_size: int, vocab: int, starts: Any, length: int, out: np.ndarray,
    paths: list[str] | None = ...
) -> np.ndarray: ...
