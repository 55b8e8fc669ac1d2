"""A Ray Data ``Datasink`` that tokenizes a text column and writes a TOKSTREAM dataset, one part
per write task, committed when the write completes (the task/commit contract of
:mod:`zerobatch.prepare.tasks`)::

    import ray
    from zerobatch.prepare.integrations.ray import TokenStreamDatasink

    ray.data.read_parquet("corpus/").write_datasink(TokenStreamDatasink("out/", "tokenizer.json"))

Write task ``i`` (Ray's task index) writes its blocks' rows, in order, as the unit ``i``: shards
``part-<i>-<k>`` and its finished-unit record; a task Ray retries replaces its own unfinished
part. ``on_write_complete`` (on the driver, once every task has written) records the plan and
commits: ``manifest.json`` from the parts in task order. The rows of the text column are the
documents (empty ones skipped, as ``convert`` does), each followed by the end-of-document id;
``metadata_columns`` keeps those columns of each row as its TOKSTREAM metadata.

The output folder must be one every Ray worker and the driver reach (a local folder on one
machine, a shared filesystem on a cluster).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ray.data import Datasink
from zerobatch.formats.tokstream import DEFAULT_SHARD_TOKENS

__all__ = ["TokenStreamDatasink"]


class TokenStreamDatasink(Datasink):
    """See the module documentation.

    Args:
        output_folder: the dataset folder (reached by every worker and the driver) or URL
            (s3://bucket/dataset).
        tokenizer: what ``zerobatch convert --tokenizer`` takes.
        text_column: the column of the documents' text.
        eod_token, eod_id: the end-of-document token or id (default: the tokenizer's).
        shard_tokens: tokens per shard.
        metadata_columns: columns kept as each document's metadata.
    """

    def __init__(self, output_folder: str | os.PathLike[str], tokenizer: Any, *, text_column: str = "text",
                 eod_token: str | None = None, eod_id: int | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                 metadata_columns: Sequence[str] = ()) -> None:
        from zerobatch.core.remote import is_url
        folder = os.fspath(output_folder)
        self.output_folder = folder if is_url(folder) else os.path.abspath(folder)
        self.tokenizer = tokenizer
        self.text_column = text_column
        self.eod_token, self.eod_id = eod_token, eod_id
        self.shard_tokens = shard_tokens
        self.metadata_columns = tuple(metadata_columns)

    def get_name(self) -> str:
        return "zerobatch TOKSTREAM"

    def _tokenizer(self) -> tuple[Any, int, int]:
        from zerobatch.prepare.options import find_eod
        from zerobatch.prepare.tokenizer import load_tokenizer
        from zerobatch.formats.errors import ConfigError
        tok = load_tokenizer(self.tokenizer)
        eod = self.eod_id if self.eod_id is not None else find_eod(tok, self.eod_token, self.tokenizer)
        if tok.vocab_size is None:
            raise ConfigError("tokenizer: it does not say its vocabulary size", field="tokenizer")
        return tok, eod, tok.vocab_size

    def on_write_start(self, *args: Any, **kwargs: Any) -> None:
        from zerobatch.prepare.tasks import Destination
        from zerobatch.formats import tokstream as T
        from zerobatch.formats.errors import ConfigError
        d = Destination(self.output_folder)
        if d.exists(T.MANIFEST_NAME):
            raise ConfigError("destination: a dataset is committed there already", path=d.shown,
                              field="destination")
        d.prepare()

    def write(self, blocks: Iterable[Any], ctx: Any) -> dict[str, Any]:
        import zerobatch.prepare.tasks as TK
        from ray.data.block import BlockAccessor
        from zerobatch.formats.errors import ConfigError
        tok, eod, vocab = self._tokenizer()
        metas: list[dict[str, Any]] = []

        def documents() -> Iterator[np.ndarray]:
            for block in blocks:
                table = BlockAccessor.for_block(block).to_arrow()
                names = table.column_names
                for col in (self.text_column, *self.metadata_columns):
                    if col not in names:
                        raise ConfigError(f"no column {col!r} (columns: {names})", path=self.output_folder,
                                          field="text_column")
                texts = [t or "" for t in table.column(self.text_column).to_pylist()]
                cols = {c: table.column(c).to_pylist() for c in self.metadata_columns}
                for i, ids in enumerate(tok.encode_batch(texts)):
                    if not texts[i]:
                        continue
                    out = np.empty(len(ids) + 1, np.uint32)
                    out[:-1] = ids
                    out[-1] = eod
                    if self.metadata_columns:
                        metas.append({c: cols[c][i] for c in self.metadata_columns})
                    yield out

        def meta_iter() -> Iterator[dict[str, Any]]:
            while True:
                yield metas.pop(0)

        record = TK.write_unit(self.output_folder, ctx.task_idx, documents(), vocab_size=vocab,
                               eod=eod if eod < vocab else None, shard_tokens=self.shard_tokens,
                               metas=meta_iter() if self.metadata_columns else None)
        return {"unit": ctx.task_idx, "documents": record["documents"], "tokens": record["tokens"]}

    def on_write_complete(self, write_result: Any) -> None:
        import zerobatch.prepare.tasks as TK
        tok, eod, vocab = self._tokenizer()
        units = [r["unit"] for r in write_result.write_returns]
        n = max(units) + 1 if units else 0
        TK.write_plan(self.output_folder, {
            "version": 1, "tasks": n, "units": [["ray write task", [u, u + 1]] for u in range(n)],
            "source": {"engine": "ray"}, "tokenizer": tok.fingerprint, "eod": eod, "bos": None, "vocab_size": vocab,
            "shard_tokens": self.shard_tokens, "metadata_fields": list(self.metadata_columns),
            "build_ids": "recorded"})     # written after the units, which name no plan
        TK.commit(self.output_folder, log=lambda *_: None)
