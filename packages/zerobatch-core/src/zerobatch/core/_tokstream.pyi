from typing import Any

import numpy as np

from zerobatch.core._pool import TaskPool

class BlockChecks:
    block_bytes: int
    num_shards: int
    lock: Any
    def __init__(self, block_counts: Any, block_bytes: int = ...) -> None: ...
    def set_digests(self, shard: int, digests: np.ndarray, list_hash: int) -> None: ...
    @property
    def ready(self) -> bool: ...
    @property
    def pending(self) -> int: ...
    @property
    def addresses(self) -> np.ndarray: ...
    def checked(self, shard: int, block: int) -> bool: ...
    def mark(self, shard: int, first: int, count: int = ...) -> int: ...
    def mark_shard(self, shard: int) -> int: ...
    def claim(self, pairs: Any) -> np.ndarray: ...
    def release(self, pairs: Any) -> None: ...
    def mark_pairs(self, pairs: Any) -> int: ...
    def reset(self, shard: int) -> None: ...

class WindowTicket:
    def wait(self) -> np.ndarray: ...
    def cancel(self, wait: bool = ...) -> bool: ...

class WindowGather:
    total: int
    num_shards: int
    paths: list[str] | None
    checks: BlockChecks | None
    def __init__(
        self,
        bases: Any,
        cum: Any,
        itemsize: int,
        token_size: int,
        vocab: int,
        paths: list[str] | None = ...,
        documents: list[np.ndarray] | None = ...,
        metadata_indexes: list[np.ndarray] | None = ...,
        num_shards: int | None = ...,
        checks: BlockChecks | None = ...,
    ) -> None: ...
    def unchecked_chunks(
        self, starts: Any, length: int | None = ..., stops: Any = ..., checked: Any = ..., chunk_bytes: int = ...,
        cap: int = ...
    ) -> np.ndarray: ...
    def gather(self, starts: Any, length: int, out: np.ndarray, pool: TaskPool | None = ..., fds: Any = ..., *,
               labels: np.ndarray | None = ..., mask: WindowGather | None = ..., mask_fds: Any = ...,
               label_shift: int = ..., ignore_id: int = ...) -> np.ndarray: ...
    def gather_async(self, pool: TaskPool, starts: Any, length: int, out: np.ndarray, *,
                     labels: np.ndarray | None = ..., mask: WindowGather | None = ..., label_shift: int = ...,
                     ignore_id: int = ...) -> WindowTicket: ...
    def metadata_ids(
        self, starts: Any, length: int, ids: np.ndarray | None = ..., out: np.ndarray | None = ..., fds: Any = ...
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
        fds: Any = ...,
        labels: np.ndarray | None = ...,
        mask: WindowGather | None = ...,
        mask_fds: Any = ...,
        label_shift: int = ...,
        ignore_id: int = ...,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, int]: ...
    def gather_ranges(self, starts: Any, stops: Any, out: np.ndarray, fds: Any = ...,
                      position_ids: np.ndarray | None = ..., labels: np.ndarray | None = ..., ignore_id: int = ..., *,
                      mask: WindowGather | None = ..., mask_fds: Any = ..., label_shift: int = ...) -> np.ndarray: ...
    def gather_ranges_async(self, pool: TaskPool, starts: Any, stops: Any, out: np.ndarray,
                            position_ids: np.ndarray | None = ..., labels: np.ndarray | None = ...,
                            ignore_id: int = ..., *, mask: WindowGather | None = ...,
                            label_shift: int = ...) -> WindowTicket: ...
    @property
    def num_documents(self) -> int: ...
    def document_spans(self, indices: Any, starts: np.ndarray | None = ...,
                       stops: np.ndarray | None = ...) -> tuple[np.ndarray, np.ndarray]: ...
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

def gather_windows(
    bases: Any, cum: Any, itemsize: int, token_size: int, vocab: int, starts: Any, length: int, out: np.ndarray,
    paths: list[str] | None = ...
) -> np.ndarray: ...

def _meta_path(simd: bool | None = ...) -> str: ...
