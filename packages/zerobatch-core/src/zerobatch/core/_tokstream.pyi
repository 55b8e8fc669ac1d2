from typing import Any

import numpy as np

class WindowGather:
    total: int
    def __init__(
        self,
        bases: Any,
        cum: Any,
        itemsize: int,
        token_size: int,
        vocab: int,
        paths: list[str] | None = ...,
        documents: list[np.ndarray] | None = ...,
    ) -> None: ...
    def gather_ranges(self, starts: Any, stops: Any, out: np.ndarray) -> np.ndarray: ...
    def boundaries(
        self,
        starts: Any,
        length: int,
        position_ids: np.ndarray | None = ...,
        segment_ids: np.ndarray | None = ...,
        cu_seqlens: np.ndarray | None = ...,
        *,
        position_dtype: Any = ...,
        segments: bool = ...,
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, int]: ...
    def gather(self, starts: Any, length: int, out: np.ndarray, pool: Any = ...) -> np.ndarray: ...

def gather_windows(
    bases: Any, cum: Any, itemsize: int, token_size: int, vocab: int, starts: Any, length: int, out: np.ndarray,
    paths: list[str] | None = ...
) -> np.ndarray: ...
