from typing import Any

import numpy as np

PACKING_ALGORITHMS: tuple[str, ...]

def pack_plan(lengths: Any, capacity: int, buffer: int = ...,
              algorithm: str = ...) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...
def pack_rows(flat: Any, piece_len: Any, piece_row: Any, seq_len: int, tokens: np.ndarray, segment_ids: np.ndarray,
              position_ids: np.ndarray, mask: np.ndarray, labels: np.ndarray | None = ...,
              cu_seqlens: np.ndarray | None = ..., pad_id: int = ..., ignore_id: int = ...,
              mask_boundaries: bool = ..., label_values: Any = ...) -> tuple[np.ndarray, int]: ...
def flat_layout(tokens: np.ndarray, lengths: Any, position_ids: np.ndarray | None, labels: np.ndarray | None = ...,
                ignore_id: int = ...) -> np.ndarray | None: ...
