from typing import Any

import numpy as np

def locate_windows(cum: np.ndarray, starts: np.ndarray, stride: int, indices: Any, rows: np.ndarray,
                   keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
def gather_rows(buffer: Any, row_bytes: int, total_rows: int, rows: Any, count: int, out: Any) -> Any: ...
