from typing import Any

from zerobatch.formats.llmbatch import LLMBatchHeader

def parse_llmbatch_header(buf: Any, file_size: int, *, path: Any = ...) -> LLMBatchHeader: ...
def llmbatch_geometry(batch_size: int, seq_len: int) -> tuple[int, int]: ...
def pack_llmbatch_header(
    *,
    batch_size: int,
    seq_len: int,
    num_batches: int,
    seed: int,
    total_records: int,
    extension: bool = ...,
    checksums: bool = ...,
    max_token: int | None = ...,
    trailer_hash: int = ...,
    build_id: bytes | None = ...,
) -> bytes: ...
