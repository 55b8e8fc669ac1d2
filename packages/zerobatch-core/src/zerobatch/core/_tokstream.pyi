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
        fds: Any = ...,
        metadata_indexes: list[np.ndarray] | None = ...,
        chunk_counts: list[int] | None = ...,
        verifier: Any = ...,
        chunk_bytes: int = ...,
    ) -> None: ...
    pending: int
    def chunk_checked(self, shard: int, chunk: int) -> bool: ...
    def mark_checked(self, shard: int) -> None: ...
    def metadata_ids(
        self, starts: Any, length: int, ids: np.ndarray | None = ..., out: np.ndarray | None = ...
    ) -> tuple[np.ndarray, np.ndarray]: ...
    def gather_with_boundaries(
        self,
        starts: Any,
        length: int,
        out: np.ndarray,
        bounds_length: int | None = ...,
        position_ids: np.ndarray | None = ...,
        segment_ids: np.ndarray | None = ...,
        cu_seqlens: np.ndarray | None = ...,
        *,
        position_dtype: Any = ...,
        segments: bool = ...,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, int]: ...
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

def _meta_path(simd: bool | None = ...) -> str: ...
