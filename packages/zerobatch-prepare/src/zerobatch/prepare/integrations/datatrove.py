"""A datatrove pipeline step that tokenizes documents and writes them as a TOKSTREAM dataset,
one part per datatrove task, on the task/commit contract of :mod:`zerobatch.prepare.tasks`.

::

    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from zerobatch.prepare.integrations.datatrove import TokenStreamStep
    from zerobatch.prepare.tasks import commit

    LocalPipelineExecutor([JsonlReader("corpus/"), TokenStreamStep("out/", "tokenizer.json")],
                          tasks=64, workers=8, logging_dir="logs/").run()
    commit("out/")                # once every task has finished

Task ``rank`` of ``world_size`` writes its documents (in the order its readers give them) as
the unit ``rank``: shards ``part-<rank>-<k>``, then its finished-unit record. A task run again
(datatrove reruns the tasks it has not marked completed, ``skip_completed``) replaces its own
unfinished shards and nothing else. ``commit`` (or ``zerobatch commit out/``) assembles the
dataset from the parts in rank order, refusing while a task is missing. Under datatrove's
Slurm or Ray executors the same step runs unchanged; the commit runs once after them, as a
dependent stage of :class:`TokenStreamCommit`::

    tokenize = SlurmPipelineExecutor([JsonlReader("corpus/"), TokenStreamStep("/shared/out", "tok.json")],
                                     tasks=512, time="4:00:00", partition="cpu", logging_dir="logs/tok")
    SlurmPipelineExecutor([TokenStreamCommit("/shared/out")], tasks=1, time="0:30:00", partition="cpu",
                          logging_dir="logs/commit", depends=tokenize).run()

The step was called ``TokenStreamWriter``, the name of the TOKSTREAM writer
(:class:`zerobatch.writers.tokstream.TokenStreamWriter`) too; the import path of earlier
releases, ``zerobatch.cli.integrations.datatrove``, keeps that name for it.

Documents are tokenized in batches with the tokenizer ``convert`` takes (a Hugging Face
``tokenizer.json``, ``tiktoken:NAME``, a SentencePiece ``.model``), each followed by the
end-of-document id; ``metadata_fields`` keeps those keys of each document's datatrove metadata
(and ``"id"``: its id) as its TOKSTREAM metadata.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from zerobatch.formats.errors import ConfigError
from zerobatch.formats.tokstream import DEFAULT_SHARD_TOKENS

__all__ = ["TokenStreamCommit", "TokenStreamStep"]


class TokenStreamStep(PipelineStep):
    """Tokenize the pipeline's documents and write this task's part of a TOKSTREAM dataset
    (see the module documentation). The last step of a pipeline: it yields no documents (it
    holds none beyond a batch).

    Args:
        output_folder: the dataset folder (local or shared) or URL (s3://bucket/dataset), the same
            for every task.
        tokenizer: what ``zerobatch convert --tokenizer`` takes.
        eod_token: the end-of-document token (default: the tokenizer's, as ``convert`` finds
            it); ``eod_id``: its id instead.
        batch_size: documents per ``encode_batch`` call.
        shard_tokens: tokens per shard.
        metadata_fields: keys of each document's metadata (``"id"``: the document's id) kept
            as its TOKSTREAM metadata.
    """

    name = "zerobatch TOKSTREAM"
    type = "Tokenizer"
    _requires_dependencies = ["tokenizers"]

    def __init__(self, output_folder: str | os.PathLike[str], tokenizer: Any, *, eod_token: str | None = None,
                 eod_id: int | None = None, batch_size: int = 1000, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                 metadata_fields: Sequence[str] = ()) -> None:
        super().__init__()
        from zerobatch.core.remote import is_url
        folder = os.fspath(output_folder)
        self.output_folder = folder if is_url(folder) else os.path.abspath(folder)
        self.tokenizer = tokenizer
        self.eod_token, self.eod_id = eod_token, eod_id
        self.batch_size = batch_size
        self.shard_tokens = shard_tokens
        self.metadata_fields = tuple(metadata_fields)

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        import zerobatch.prepare.tasks as TK
        from zerobatch.prepare.options import find_eod
        from zerobatch.prepare.tokenizer import load_tokenizer

        tok = load_tokenizer(self.tokenizer)
        eod = self.eod_id if self.eod_id is not None else find_eod(tok, self.eod_token, self.tokenizer)
        vocab = tok.vocab_size
        if vocab is None:       # a tokenizer function: the plan and the shards need the vocabulary size
            raise ConfigError("tokenizer: it does not say its vocabulary size", field="tokenizer")
        TK.write_plan(self.output_folder, {
            "version": 1, "tasks": world_size, "units": [["datatrove task", [r, r + 1]] for r in range(world_size)],
            "source": {"engine": "datatrove"}, "tokenizer": tok.fingerprint, "eod": eod, "bos": None,
            "vocab_size": vocab, "shard_tokens": self.shard_tokens, "metadata_fields": list(self.metadata_fields),
            "build_ids": "recorded"})     # a task's documents are not decided by the plan: no seed
        metas: collections.deque[dict[str, Any]] = collections.deque()

        def batches() -> Iterator[list[Any]]:
            batch: list[Any] = []
            for doc in data:
                batch.append(doc)
                if len(batch) == self.batch_size:
                    yield batch
                    batch = []
            if batch:
                yield batch

        def documents() -> Iterator[np.ndarray]:
            for batch in batches():
                yield from self._encode(tok, eod, batch, metas)

        def chunks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for batch in batches():       # a batch's documents back to back: one write per batch
                docs = list(self._encode(tok, eod, batch, metas))
                if docs:
                    yield np.concatenate(docs), np.fromiter(map(len, docs), np.int64, len(docs))

        def meta_iter() -> Iterator[dict[str, Any]]:
            while True:
                yield metas.popleft()     # a document's fields are queued before it is handed out

        if self.metadata_fields:
            TK.write_unit(self.output_folder, rank, documents(), vocab_size=vocab, eod=eod if eod < vocab else None,
                          shard_tokens=self.shard_tokens, metas=meta_iter())
        else:
            TK.write_unit(self.output_folder, rank, chunks=chunks(), vocab_size=vocab,
                          eod=eod if eod < vocab else None, shard_tokens=self.shard_tokens)
        yield from ()

    def _encode(self, tok: Any, eod: int, batch: list[Any], metas: Any) -> Iterator[np.ndarray]:
        with self.track_time(unit="batch"):
            encoded = tok.encode_batch([d.text for d in batch])
        for doc, ids in zip(batch, encoded, strict=True):
            if not doc.text:
                self.stat_update("empty")
                continue
            tokens = np.empty(len(ids) + 1, np.uint32)
            tokens[:-1] = ids
            tokens[-1] = eod
            self.stat_update("documents")
            self.stat_update("tokens", value=int(tokens.size))
            if self.metadata_fields:
                metas.append({f: (doc.id if f == "id" else doc.metadata.get(f)) for f in self.metadata_fields})
            yield tokens


class TokenStreamCommit(PipelineStep):
    """The commit as a datatrove stage: a pipeline of this step alone, one task, run by an
    executor that ``depends`` on the tokenizing one (a dependent Slurm job, or after the local
    or Ray executor's tasks), assembles the dataset (:func:`zerobatch.prepare.tasks.commit`).
    Idempotent: datatrove running it again finds the dataset committed.

    Args:
        output_folder: the folder or URL the :class:`TokenStreamStep` tasks wrote into.
    """

    name = "zerobatch commit"
    type = "Writer"

    def __init__(self, output_folder: str | os.PathLike[str]) -> None:
        super().__init__()
        from zerobatch.core.remote import is_url
        folder = os.fspath(output_folder)
        self.output_folder = folder if is_url(folder) else os.path.abspath(folder)

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        import zerobatch.prepare.tasks as TK

        if data:
            yield from data
        if rank == 0:
            manifest = TK.commit(self.output_folder, log=lambda *_: None)
            self.stat_update("shards", value=len(manifest.shards))
            self.stat_update("tokens", value=manifest.num_tokens)
