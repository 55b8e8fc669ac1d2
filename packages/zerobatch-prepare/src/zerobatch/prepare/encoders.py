"""What turns a conversion's input into documents of token ids: an :class:`Encoder`.

* :class:`TextEncoder`: text documents (:class:`~zerobatch.prepare.sources.TextSource`)
  tokenized with a Hugging Face ``tokenizer.json``, a tiktoken encoding, a SentencePiece model
  or a function (:mod:`zerobatch.prepare.tokenizer`), each started with the
  beginning-of-document id (``--add-bos`` / ``--bos-id``) and ended with the end-of-document
  id; one stream, ``tokens`` (with each document's source row and fields when asked).
* :class:`ChatEncoder`: conversations (:class:`~zerobatch.prepare.conversations.ConversationSource`)
  rendered with a tokenizer folder's chat template (:mod:`zerobatch.prepare.chat`); two
  streams, ``tokens`` and ``loss_mask`` (one 0/1 per token: the tokens trained on).

Either runs the same way (:func:`zerobatch.prepare.staging.stage`): its :meth:`Encoder.groups`
of input, each encoded by :attr:`Encoder.task` on a worker process set up by
:meth:`Encoder.worker`, staged as a file; :meth:`Encoder.plan` is what a staged run and a
distributed task record of it; :meth:`Encoder.unit` the encoder of one unit of work.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from zerobatch.formats.errors import ConfigError
from zerobatch.prepare.options import BOS_CANDIDATES, ConvertOptions, find_eod
from zerobatch.prepare.staging import Totals, write_shard
from zerobatch.prepare.tokenizer import load_tokenizer

__all__ = ["CHAT_GROUP", "ChatEncoder", "Encoder", "TextEncoder", "report"]

#: Conversations a ``--chat`` worker process renders and tokenizes per task.
CHAT_GROUP = 256
UNDECODABLE = ("{n:,} {what} had undecodable text (invalid UTF-8 or lone UTF-16 surrogates), replaced with "
               "U+FFFD (--text-errors strict refuses them)")


class Encoder(abc.ABC):
    """Input to documents of token ids, in named streams (see the module documentation).

    Attributes:
        name: what its progress bar is called.
        streams: the streams of each document it writes, ``tokens`` first.
        source: its input (``files``, ``total_work`` in ``unit``, ``fingerprint()``).
        vocab: ids are below it (None: unknown until the documents are seen).
        eod: the end-of-document id it ends documents with (None: none).
        empty: the error when the input holds no document.
        documents: what its documents are called in reports.
        task_note: what a distributed task's summary adds.
    """

    name = ""
    streams: tuple[str, ...] = ("tokens",)
    source: Any
    vocab: int | None = None
    eod: int | None = None
    empty = "source: no tokens to convert"
    documents = "documents"
    task_note = ""

    @abc.abstractmethod
    def plan(self) -> dict[str, Any]:
        """What identifies its documents beside the source (tokenizer or template, options):
        the fields a distributed preparation's plan records."""

    def staging_plan(self) -> dict[str, Any]:
        """What a staged run records: a rerun with another one starts over."""
        return {"version": 2, "encoder": self.name, "source": self.source.fingerprint(), **self.plan()}

    @abc.abstractmethod
    def groups(self) -> Iterator[tuple[tuple[Any, ...], int]]:
        """``(payload, work)`` per group of input: :attr:`task`'s arguments after the group's
        number, and the progress it stands for."""

    @abc.abstractmethod
    def worker(self, staging: str, local: bool) -> tuple[Callable[..., None], tuple[Any, ...]]:
        """The initializer of a process that runs :attr:`task` (and its arguments) for
        ``staging``; ``local``: it runs on this process, no worker processes (a tokenizer may use threads)."""

    #: ``task(k, *payload) -> (k, tokens, documents)``: group ``k`` encoded and staged (a
    #: module-level function, so worker processes can run it)
    task: Callable[..., tuple[int, int, int]]

    @abc.abstractmethod
    def unit(self, unit: Any) -> Encoder:
        """The encoder of one unit of work (:class:`~zerobatch.prepare.tasks.Unit`)."""

    def options(self, args: ConvertOptions) -> ConvertOptions:
        """``args`` with the vocabulary the documents are written with."""
        if args.vocab_size is None and self.vocab is not None:
            return args.replace(vocab_size=self.vocab)
        return args

    def notes(self, totals: Totals) -> list[str]:
        """The lines the report gives before its summary (what was skipped or replaced)."""
        return []

    def report(self, shown: str, to: str, summary: str, totals: Totals, seconds: float) -> tuple[str, str]:
        """The report's last line and what ``convert`` returns."""
        return report(shown, to, summary, totals.tokens, seconds), summary


def report(shown: str, to: str, summary: str, tokens: int, seconds: float) -> str:
    """The last line of a conversion's report: what was written where, how fast."""
    return f"wrote {shown} ({to}): {summary} in {seconds:.1f} s ({tokens / max(seconds, 1e-9) / 1e6:,.2f}M tokens/s)"


# --------------------------------------------------------------------------------------------
# Text

_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Any, eod: int, staging: str, parallel: bool, bos: int | None = None) -> None:
    if not parallel:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tok=load_tokenizer(tokenizer), eod=eod, staging=staging, bos=bos)


def _tokenize_shard(k: int, texts: list[str], rows: list[int] | None = None,
                    metas: list[dict[str, Any]] | None = None) -> tuple[int, int, int]:
    """Tokenize one group, start each document with the beginning-of-document id (when there
    is one), end it with the end-of-document id, stage it; returns (k, tokens, docs)."""
    tok, eod, bos = _WORKER["tok"], _WORKER["eod"], _WORKER.get("bos")
    head = 0 if bos is None else 1
    encs = tok.encode_batch(texts) if texts else []
    lengths = np.fromiter((len(e) + 1 + head for e in encs), np.int64, len(encs))
    tokens = np.empty(int(lengths.sum()), np.uint32)
    ends = np.cumsum(lengths)
    pos = 0
    for e, end in zip(encs, ends, strict=True):
        if bos is not None:
            tokens[pos] = bos
        n = int(end) - pos - 1 - head
        tokens[pos + head:pos + head + n] = e
        tokens[pos + head + n] = eod
        pos = int(end)
    extra: dict[str, np.ndarray] = {} if rows is None else {"rows": np.asarray(rows, np.int64)}
    if metas is not None:   # one JSON text per document (no pickles in a staged shard)
        extra["meta"] = np.array([json.dumps(m, default=str, ensure_ascii=False) for m in metas], dtype=str)
    return write_shard(_WORKER["staging"], k, tokens, lengths, extra)


class TextEncoder(Encoder):
    """Text documents tokenized (see the module documentation).

    Args:
        source: the documents (a :class:`~zerobatch.prepare.sources.TextSource`).
        tokenizer: what :func:`~zerobatch.prepare.tokenizer.load_tokenizer` takes.
        eod, bos: the end- and beginning-of-document ids (``bos`` None: none).
        vocab: ids are below it (None: the tokenizer does not say).
        fingerprint: the tokenizer's.
        rows: stage each document's source row (``--row-ids``).
    """

    name = "tokenize"
    task = staticmethod(_tokenize_shard)

    def __init__(self, source: Any, tokenizer: Any, eod: int | None, bos: int | None, vocab: int | None,
                 fingerprint: str, *, rows: bool = False) -> None:
        self.source, self.tokenizer, self.eod, self.bos = source, tokenizer, eod, bos
        self.vocab, self.fingerprint, self.rows = vocab, fingerprint, rows

    @classmethod
    def from_options(cls, source: Any, args: ConvertOptions, *, rows: bool = False) -> TextEncoder:
        """The encoder of ``args`` (``--tokenizer``, ``--eod-token`` / ``--eod-id``, ``--bos-id``
        / ``--add-bos``, ``--vocab-size``) over ``source``.

        Raises:
            ConfigError: no tokenizer given, or no end-of-document (beginning-of-document) token.
        """
        if not args.tokenizer:
            raise ConfigError(f"--tokenizer: a {source.kind} source needs a tokenizer to tokenize with (a "
                              f"tokenizer.json, tiktoken:NAME or a SentencePiece .model)", field="tokenizer")
        tok = load_tokenizer(args.tokenizer)
        eod = args.eod_id if args.eod_id is not None else find_eod(tok, args.eod_token, args.tokenizer)
        bos = args.bos_id
        if bos is None and args.add_bos:
            bos = find_eod(tok, None, args.tokenizer, candidates=BOS_CANDIDATES, option="--add-bos",
                           what="beginning-of-document (or give --bos-id)")
        vocab = args.vocab_size if args.vocab_size is not None else tok.vocab_size
        return cls(source, args.tokenizer, eod, bos, vocab, tok.fingerprint, rows=rows)

    def plan(self) -> dict[str, Any]:
        return {"tokenizer": self.fingerprint, "eod": self.eod, "bos": self.bos,
                "metadata_fields": list(self.source.meta_fields)}

    def staging_plan(self) -> dict[str, Any]:
        # the layout of release 0.1's staging folders, so that they resume
        return {"version": 2, "source": self.source.fingerprint(), "eod": self.eod, "bos": self.bos,
                "rows": self.rows, "meta_fields": list(self.source.meta_fields), "tokenizer": self.fingerprint}

    def groups(self) -> Iterator[tuple[tuple[Any, ...], int]]:
        for texts, work, row_ids, metas in self.source.shards_with_rows():
            yield (texts, row_ids if self.rows else None, metas), work

    def worker(self, staging: str, local: bool) -> tuple[Callable[..., None], tuple[Any, ...]]:
        return _init_worker, (self.tokenizer, self.eod, staging, local, self.bos)

    def unit(self, unit: Any) -> TextEncoder:
        from zerobatch.prepare.tasks import unit_source
        return TextEncoder(unit_source(self.source, unit), self.tokenizer, self.eod, self.bos, self.vocab,
                           self.fingerprint)

    def notes(self, totals: Totals) -> list[str]:
        out = []
        if self.source.empty:
            out.append(f"skipped {self.source.empty:,} empty or null documents (so document i is not always "
                       f"source row i)")
        if self.source.undecodable:
            out.append(UNDECODABLE.format(n=self.source.undecodable, what=self.documents))
        return out


# --------------------------------------------------------------------------------------------
# Chat

_CHAT: Any = None


def _init_chat_worker(folder: str, roles: tuple[str, ...], staging: str | None = None) -> None:
    from zerobatch.prepare.chat import ChatTemplate
    _use_chat(ChatTemplate(folder, roles), staging)


def _use_chat(chat: Any, staging: str | None) -> None:
    global _CHAT
    _CHAT = chat
    _WORKER.update(staging=staging)


def _encode_chat_group(group: list[tuple[Any, ...]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids, loss mask)`` of each ``(where, messages, ...)`` of ``group``, with the process's
    template (:func:`_init_chat_worker`)."""
    return [_CHAT.encode(messages, where=where) for where, messages, *_ in group]


def _stage_chat_group(k: int, group: list[tuple[Any, ...]]) -> tuple[int, int, int]:
    """Render and tokenize one group of conversations and stage them, with their loss masks
    (a conversation that renders to no tokens is counted as ``empty`` and left out)."""
    encoded = [(ids, mask) for ids, mask in _encode_chat_group(group) if ids.size]
    lengths = np.fromiter((ids.size for ids, _ in encoded), np.int64, len(encoded))
    tokens = np.concatenate([ids for ids, _ in encoded]).astype(np.uint32) if encoded else np.zeros(0, np.uint32)
    mask = np.concatenate([m for _, m in encoded]).astype(np.uint8) if encoded else np.zeros(0, np.uint8)
    counts = {"empty": len(group) - len(encoded), "trained": int(np.count_nonzero(mask))}
    return write_shard(_WORKER["staging"], k, tokens, lengths, {"loss_mask": mask}, counts=counts)


class ChatEncoder(Encoder):
    """Conversations rendered with a chat template and tokenized, with their loss masks (see
    the module documentation).

    Args:
        chat: the template (a :class:`~zerobatch.prepare.chat.ChatTemplate`).
        source: the conversations (a :class:`~zerobatch.prepare.conversations.ConversationSource`),
            or, for a distributed preparation's plan, the text source of the same files.
        field: the field of each record that holds its messages.
    """

    name = "chat"
    streams = ("tokens", "loss_mask")
    empty = "source: no conversation to convert"
    documents = "conversations"
    task_note = " (chat, with the loss mask)"
    task = staticmethod(_stage_chat_group)

    def __init__(self, chat: Any, source: Any, field: str, text_errors: str = "replace") -> None:
        self.chat, self.source, self.field, self.text_errors = chat, source, field, text_errors
        self.vocab = chat.vocab_size

    @staticmethod
    def template(args: ConvertOptions) -> tuple[Any, str]:
        """The template of ``--chat`` (``--tokenizer`` a folder, ``--chat-roles``) and the field
        of the messages, the options checked.

        Raises:
            ConfigError: an option ``--chat`` does not take, or a tokenizer that is not a folder.
        """
        from zerobatch.prepare.chat import DEFAULT_ROLES, ChatTemplate
        from zerobatch.prepare.targets import refuse_unless
        refuse_unless(args.to, "loss_mask", "--chat: chat data is written --to {them} (not {to}), with its loss mask",
                      "to")
        for option, value in (("--split", args.split), ("--row-ids", args.row_ids or None),
                              ("--metadata-fields", args.metadata_fields or None)):
            if value is not None:
                raise ConfigError(f"{option}: not with --chat", field="chat")
        if not isinstance(args.tokenizer, (str, os.PathLike)):
            raise ConfigError("--chat: --tokenizer must be a Hugging Face tokenizer folder (tokenizer.json and "
                              "tokenizer_config.json with its chat_template)", field="tokenizer")
        chat = ChatTemplate(args.tokenizer, args.chat_roles or DEFAULT_ROLES)
        return chat, "messages" if args.field == "text" else args.field

    def plan(self) -> dict[str, Any]:
        return {"chat": self.chat.fingerprint, "field": self.field}

    def staging_plan(self) -> dict[str, Any]:
        return {**super().staging_plan(), "group": CHAT_GROUP}

    def groups(self) -> Iterator[tuple[tuple[Any, ...], int]]:
        for group, work in self.source.groups(CHAT_GROUP):
            yield (group,), work

    def worker(self, staging: str, local: bool) -> tuple[Callable[..., None], tuple[Any, ...]]:
        if local:                     # this process: the template it has
            return _use_chat, (self.chat, staging)
        return _init_chat_worker, (self.chat.folder, self.chat.roles, staging)

    def unit(self, unit: Any) -> ChatEncoder:
        from zerobatch.prepare.conversations import ConversationSource
        return ChatEncoder(self.chat, ConversationSource([unit.file], self.field, self.text_errors, units=[unit]),
                           self.field, self.text_errors)

    def options(self, args: ConvertOptions) -> ConvertOptions:
        return args.replace(vocab_size=self.vocab)

    def notes(self, totals: Totals) -> list[str]:
        out = []
        if totals.counts.get("empty"):
            out.append(f"skipped {totals.counts['empty']:,} conversations that render to no tokens")
        if self.source.undecodable:
            out.append(UNDECODABLE.format(n=self.source.undecodable, what=self.documents))
        return out

    def report(self, shown: str, to: str, summary: str, totals: Totals, seconds: float) -> tuple[str, str]:
        line = (f"wrote {shown} ({to}, chat): {totals.documents:,} conversations, {totals.tokens:,} tokens, "
                f"{totals.counts.get('trained', 0):,} of them trained on ({', '.join(self.chat.roles)}) in "
                f"{seconds:.1f} s")
        return line, line
