"""The options of a conversion (:class:`ConvertOptions`, ``zerobatch convert``'s flags as
fields) and the end-of-document token they name."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from zerobatch.formats.errors import ConfigError
from zerobatch.formats.tokstream import DEFAULT_SHARD_TOKENS

if TYPE_CHECKING:
    from zerobatch.prepare.tokenizer import TextTokenizer

__all__ = ["BOS_CANDIDATES", "EOD_CANDIDATES", "TEXT_DOCUMENTS", "ConvertOptions", "find_eod"]

#: Special tokens tried, in order, as the end-of-document token when none is named.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]", "<eod>")
#: Special tokens tried, in order, as the beginning-of-document token of ``--add-bos``
#: (Llama 3, Llama 2 / Mistral, DeepSeek, Gemma, BERT).
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<bos>", "[CLS]")
#: What plain text's ``documents`` (and release 0.1's ``--split``) take.
TEXT_DOCUMENTS = ("file", "line", "blank")


@dataclass(frozen=True)
class ConvertOptions:
    """Everything a conversion is told besides its source and destination (the command line's
    options; see ``zerobatch convert --help``).

    Attributes:
        to: the target format (one of :func:`targets`).
        source_kind: the source kind (``text``, ``jsonl``, ``parquet``, ``hf``, ``npy``,
            ``nanogpt``, ``megatron``); default: from the name.
        tokenizer: text sources: a Hugging Face ``tokenizer.json``, ``tiktoken:NAME``, a
            SentencePiece ``.model``, or (Python) a function ``texts -> id lists``
            (:mod:`zerobatch.prepare.tokenizer`).
        eod_token, eod_id: the end-of-document token (text) or id (flat token files).
        bos_id, add_bos: text: start every document with this id, or (``add_bos``) with the
            tokenizer's beginning-of-document token (Llama- and DeepSeek-style documents).
        text_errors: ``replace`` (default: undecodable text becomes U+FFFD, counted in the
            report) or ``strict`` (refused, naming the file and line).
        overwrite: replace an existing destination (default: refuse it before any work).
        row_ids: text to tokstream or zrecord: keep each document's source row (its place
            among the source's documents, empty and null ones included) as metadata
            ``{"row": i}`` (tokstream) or field ``row`` (zrecord).
        field: the text field of JSONL, Parquet or HF rows.
        documents: plain text: ``file``, ``line`` or ``blank``: a document per file, line or
            blank-line block.
        split: Megatron's ``--split``: weights ``"969,30,1"`` (or ``"0.98,0.01,0.01"``) cut
            the documents, in order, into train, valid and test datasets written side by side
            (:func:`split_destination`); ``file``, ``line`` or ``blank`` still mean
            ``documents`` (release 0.1's option).
        hf_split: the split of a saved ``DatasetDict``.
        token_dtype: nanoGPT ``.bin`` token type.
        workers: tokenizer processes (and ZRECORD writer threads).
        docs_per_shard: documents per tokenized staging group.
        seq_len: llmbatch: tokens per record (default 512); llmchnk: cut longer documents.
        batch_size, seed, shuffle: llmbatch: records per batch, the shuffle seed, whether to shuffle.
        shard_tokens: tokstream: tokens per shard.
        spread: tokstream: spread the shards over ``16 ** spread`` key prefixes (0-4: hex digits
            of a tag before each shard's name), for object stores that serve a rate per prefix.
        compress: zrecord: ``raw`` or ``flate``.
        vocab_size: ids must be below it (default: the tokenizer's, else the largest id + 1).
        dtype: ``auto``, ``uint16`` or ``uint32``: the stored token type.
        quiet: no progress bars.
        task, tasks: distributed preparation (text to tokstream): this is task ``task`` of
            ``tasks``; it writes its share of the inputs as finished parts, and
            ``zerobatch commit`` assembles the dataset (:mod:`zerobatch.prepare.tasks`).
        unit_bytes: distributed preparation: bytes of a large JSONL or line-split text file
            per unit of work.
        metadata_fields: text to tokstream: fields of each JSONL record (columns of Parquet or
            HF rows) kept as the document's metadata (``{"id": ..., "url": ...}``).
        chat: JSONL conversations (``messages``: role/content) to tokstream, rendered with the
            tokenizer folder's chat template, with a loss mask (:mod:`zerobatch.prepare.chat`).
        chat_roles: the roles whose tokens the loss mask keeps (default: assistant).
    """

    to: str
    source_kind: str | None = None
    tokenizer: Any = None
    eod_token: str | None = None
    eod_id: int | None = None
    bos_id: int | None = None
    add_bos: bool = False
    text_errors: str = "replace"
    overwrite: bool = False
    row_ids: bool = False
    field: str = "text"
    documents: str = "file"
    split: str | None = None
    hf_split: str = "train"
    token_dtype: str | None = None
    workers: int = max(1, min(8, os.cpu_count() or 1))
    docs_per_shard: int = 1024
    seq_len: int | None = None
    batch_size: int = 32
    seed: int = 42
    shuffle: bool = True
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    spread: int = 0
    compress: str = "raw"
    vocab_size: int | None = None
    dtype: str = "auto"
    quiet: bool = False
    task: int | None = None
    tasks: int | None = None
    unit_bytes: int = 64 << 20
    metadata_fields: tuple[str, ...] | None = None
    chat: bool = False
    chat_roles: tuple[str, ...] | None = None

    def replace(self, **changes: Any) -> ConvertOptions:
        return ConvertOptions(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})


def find_eod(tok: TextTokenizer, token: str | None, path: Any, *, candidates: tuple[str, ...] = EOD_CANDIDATES,
             option: str = "--eod-token", what: str = "end-of-document") -> int:
    """The id of ``token`` (or of the first known end-of-document token the vocabulary has)."""
    names = (token,) if token else candidates
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    field = option.lstrip("-").replace("-", "_")
    if token:
        raise ConfigError(f"{option}: {token!r} is not in the tokenizer's vocabulary", path=path, field=field)
    raise ConfigError(f"{option}: the tokenizer has none of {', '.join(candidates)}; name its {what} token",
                      path=path, field=field)
