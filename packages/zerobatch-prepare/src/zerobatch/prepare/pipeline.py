"""``zerobatch convert`` as a function: any source (:mod:`zerobatch.prepare.sources`) into any
zerobatch format, on one pipeline::

    source      text, JSONL, Parquet, a Hugging Face dataset / conversations (--chat) / token files
    encoder     text: a tokenizer; chat: a chat template and the loss mask (zerobatch.prepare.encoders)
    staging     groups encoded on --workers processes into DST.zbconvert/ (resumable)
    streams     tokens; loss_mask with --chat
    target      the format's registry record's convert (zerobatch.prepare.targets), or an export;
                or, with --task I --tasks N, finished parts that zerobatch commit assembles

Text is tokenized with a Hugging Face ``tokenizer.json``, a tiktoken encoding, a SentencePiece
model or a function (:mod:`zerobatch.prepare.tokenizer`), the end-of-document id appended to
every document. Each group of ``--docs-per-shard`` documents (``--chat``: of
:data:`~zerobatch.prepare.encoders.CHAT_GROUP` conversations) is staged in a file of its own
(:mod:`zerobatch.prepare.staging`), so a conversion that was interrupted resumes with the
groups not yet done; the staging folder remembers the input files (names, sizes, modification
times), the tokenizer and the options, and a mismatch starts over. The target is then written
from the staged documents (every zerobatch writer is atomic) and the staging folder removed.

Token files (``.npy``, nanoGPT ``.bin``, Megatron ``.bin``/``.idx``) and zerobatch datasets go
straight to the target from a memory map.

Targets, from documents: every format whose registry record names a ``convert`` target
(``zerobatch.prepare.formats.<fmt>.write``):

* ``llmbatch``: the documents concatenated and cut into ``--seq-len`` records (the tail that
  does not fill one is dropped), shuffled with ``--seed`` into ``--batch-size`` batches;
* ``llmchnk``: one record per document (a document longer than ``--seq-len``, when given, is
  cut into records of that length);
* ``tokstream``: the documents, in shards of about ``--shard-tokens`` tokens (and a chat
  conversion's loss mask beside them);
* ``zrecord``: one record per document, field ``tokens``.
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from zerobatch.core.remote import is_url, local_path, redact
from zerobatch.formats.errors import ConfigError, NotFoundError, WriteError, ZerobatchError
import zerobatch.prepare.tasks as TK
from zerobatch.prepare._version import __version__
from zerobatch.prepare.encoders import UNDECODABLE, ChatEncoder, Encoder, TextEncoder, report
from zerobatch.prepare.options import TEXT_DOCUMENTS, ConvertOptions, find_eod
from zerobatch.prepare.sources import TextSource, documents, open_sources
from zerobatch.prepare.staging import Totals, stage, staged_chunks, staged_meta, staged_rows, staged_totals, \
    staging_folder
from zerobatch.prepare.targets import SPLIT_NAMES, Chunks, Target, build_folder, check_destination, \
    check_target_destination, document_range, parse_split, records, refuse_unless, split_destination, split_ranges, \
    targets, tokens_in_ranges, write_target
from zerobatch.prepare.tokenizer import load_tokenizer

__all__ = ["ConvertOptions", "Target", "build_folder", "check_destination", "convert", "documents", "find_eod",
           "load_tokenizer", "records", "run_task", "targets"]


@dataclass
class Input:
    """What a conversion writes: documents of tokens (``chunks``), what they hold
    (``totals``), the end-of-document id, and what goes with each document (its source row,
    its fields, the named streams beside its tokens)."""

    chunks: Chunks
    totals: Totals
    eod: int | None
    rows: Callable[[], Iterator[int]] | None = None
    meta: Callable[[], Iterator[dict[str, Any]]] | None = None
    streams: dict[str, Chunks] = field(default_factory=dict)


def convert(src: str | os.PathLike[str] | list[Any], dst: str, *, to: str, log: Callable[[str], None] = print,
            **options: Any) -> str:
    """Convert ``src`` (any source :mod:`zerobatch.prepare.sources` reads) into a ``to``
    dataset at ``dst``: ``zerobatch convert`` as a function.

    Args:
        src: a file, folder or glob of text, JSONL, Parquet, a Hugging Face ``save_to_disk``
            folder, ``.npy``, nanoGPT ``.bin`` or Megatron ``.bin``/``.idx``; or a list of
            text sources of any kinds (JSONL, Parquet, text, HF), read in the order given.
        dst: the file (llmbatch, llmchnk) or folder (tokstream, zrecord) to write.
        to: the target format (one of :func:`targets`).
        log: called with each line of the report.
        options: the fields of :class:`ConvertOptions` (``tokenizer=``, ``seq_len=``...).

    Returns:
        The one-line summary of what was written (also given to ``log``).

    Raises:
        ConfigError: an option out of range, or a source that cannot be converted.
        NotFoundError: a missing input or destination folder.
        FormatError: a damaged input (Megatron index, tokenizer file...).
        LimitExceededError: a token id beyond the vocabulary.
        WriteError: the destination could not be written (nothing is left under its name).
    """
    args, srcs, dst, weights = _arguments(src, dst, to, options)
    if args.task is not None or args.tasks is not None:
        return run_task(srcs, dst, args, log)    # the tasks share the destination folder
    chat = ChatEncoder.template(args) if _is_chat(args) else None
    # before any work: an existing destination is refused (or, with --overwrite, replaced at the end)
    outputs: list[tuple[str | None, str]] = [(None, dst)] if weights is None else [
        (name, split_destination(dst, name, args.to)) for name, w in zip(SPLIT_NAMES, weights, strict=False) if w > 0]
    for _, out in outputs:
        check_target_destination(args.to, out, args.overwrite)
    if args.metadata_fields:
        refuse_unless(args.to, "doc_metadata", "--metadata-fields: {to} keeps no per-document fields; use --to {them}",
                      "metadata_fields")
    if args.row_ids:
        refuse_unless(args.to, "row_ids", "--row-ids: {to} keeps no per-document metadata; use --to {them}", "row_ids")
    t0 = time.perf_counter()
    source = _source(srcs, args, chat, log)
    encoder, summary, totals = _run(" ".join(srcs), source, chat, dst, outputs, args, weights, log)
    for line in encoder.notes(totals) if encoder is not None else ():
        log(line)
    dt = time.perf_counter() - t0
    line, result = (encoder.report(redact(dst), args.to, summary, totals, dt) if encoder is not None else
                    (report(redact(dst), args.to, summary, totals.tokens, dt), summary))
    log(line)
    return result


def _arguments(src: Any, dst: Any, to: str, options: dict[str, Any]
               ) -> tuple[ConvertOptions, list[str], str, list[float] | None]:
    """The options, the sources and the destination checked: ``(options, sources,
    destination, --split weights)``."""
    args = ConvertOptions(to=to, **options)
    if args.split in TEXT_DOCUMENTS:          # release 0.1's --split file|line|blank
        args = args.replace(documents=args.split, split=None)
    weights = parse_split(args.split)
    srcs = [os.fspath(src)] if isinstance(src, (str, os.PathLike)) else [os.fspath(p) for p in src]
    dst = os.fspath(dst)
    dst = dst.rstrip("/") or dst
    if args.to not in targets():
        raise ConfigError(f"--to must be one of {targets()}, got {args.to!r}", field="to")
    if args.workers < 1:
        raise ConfigError("--workers must be at least 1", field="workers")
    dst = local_path(dst)
    parent = os.path.dirname(os.path.abspath(dst))
    if not is_url(dst) and not os.path.isdir(parent):
        raise NotFoundError("destination: the parent folder does not exist", path=dst, field="destination")
    return args, srcs, dst, weights


def _is_chat(args: ConvertOptions) -> bool:
    return bool(args.chat or args.chat_roles)


def _open(srcs: list[str], args: ConvertOptions) -> Any:
    return open_sources(srcs, args.source_kind, text_field=args.field, split=args.documents, hf_split=args.hf_split,
                        docs_per_shard=args.docs_per_shard, dtype=args.token_dtype, eod=args.eod_id,
                        text_errors=args.text_errors, meta_fields=tuple(args.metadata_fields or ()))


def _source(srcs: list[str], args: ConvertOptions, chat: tuple[Any, str] | None, log: Callable[[str], None]) -> Any:
    """The input: the conversations of ``--chat``, else the source of ``srcs`` (its files
    listed when there are several)."""
    if chat is not None:
        from zerobatch.prepare.conversations import ConversationSource
        return ConversationSource(srcs, chat[1], args.text_errors)
    source = _open(srcs, args)
    inputs = [f for f in source.files if not f.endswith(".idx")]
    if len(inputs) > 1:
        shown = ", ".join(os.path.basename(f) for f in inputs[:8]) + (", ..." if len(inputs) > 8 else "")
        log(f"source: {len(inputs)} files, in this order: {shown}")
    return source


def _run(src: str, source: Any, chat: tuple[Any, str] | None, dst: str, outputs: list[tuple[str | None, str]],
         args: ConvertOptions, weights: list[float] | None, log: Callable[[str], None]
         ) -> tuple[Encoder | None, str, Totals]:
    """Encode (and stage) the input of ``src`` (the sources, as messages name them), then
    write every output; ``(encoder, summary, totals)``. Staged groups stay for a rerun when
    the run is interrupted or the disk fails, and go otherwise."""
    staging = None
    encoder: Encoder | None = None
    try:
        if chat is not None:
            encoder = ChatEncoder(chat[0], source, chat[1], args.text_errors)
        elif isinstance(source, TextSource):
            encoder = TextEncoder.from_options(source, args, rows=args.row_ids)
        if encoder is not None:
            staging = staging_folder(dst)
            inp = _staged(encoder, staging, args, log)
            args = encoder.options(args)
        else:   # token files or a zerobatch dataset
            inp = _tokens(src, source, args, weights, log)
        if inp.totals.tokens == 0:
            raise ConfigError(encoder.empty if encoder is not None else Encoder.empty, path=src, field="source")
        summary = _write(args, outputs, inp, weights, log)
    except BaseException as exc:
        if staging is not None and os.path.isdir(staging):
            # interrupted, or the disk failed: the staged groups stay and a rerun resumes from
            # them; any other fault (bad input, bad options) a rerun would meet again
            if isinstance(exc, (KeyboardInterrupt, SystemExit, WriteError)) or (
                    isinstance(exc, OSError) and not isinstance(exc, ZerobatchError)):
                log(f"{staging}: the tokenized groups are kept; run the same command again to resume")
            else:
                shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if hasattr(source, "close"):
            source.close()
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)
    return encoder, summary, inp.totals


def _staged(encoder: Encoder, staging: str, args: ConvertOptions, log: Callable[[str], None]) -> Input:
    """The input encoded into ``staging`` (resuming what is there)."""
    paths = stage(encoder, staging, workers=args.workers, quiet=args.quiet, log=log)
    return Input(functools.partial(staged_chunks, paths), staged_totals(paths), encoder.eod,
                 rows=functools.partial(staged_rows, paths) if args.row_ids else None,
                 meta=functools.partial(staged_meta, paths) if args.metadata_fields else None,
                 streams={s: functools.partial(staged_chunks, paths, s) for s in encoder.streams[1:]})


def _tokens(src: str, source: Any, args: ConvertOptions, weights: list[float] | None,
            log: Callable[[str], None]) -> Input:
    """The documents of token files or a zerobatch dataset, the options checked against them."""
    if not source.has_boundaries and weights is not None:
        raise ConfigError(f"--split: this {source.kind} stream has no document boundaries to split at; give "
                          f"--eod-id", path=src, field="split")
    if not source.has_boundaries:
        from zerobatch.prepare.targets import stream_target
        if not stream_target(args.to):
            raise ConfigError(f"--eod-id: this {source.kind} stream has no document boundaries, and --to "
                              f"{args.to} stores documents; give the id that ends each document (nanoGPT's "
                              f"prepare.py appends <|endoftext|>, 50256 for GPT-2), or --to llmbatch, which "
                              f"cuts records from the stream as one", path=src, field="eod_id")
        log(f"{src}: no --eod-id, so no document boundaries: records are cut from the tokens as one stream")
    if args.row_ids:
        raise ConfigError("--row-ids: token files keep every document, so document i is source row i",
                          field="row_ids")
    if args.metadata_fields:
        raise ConfigError("--metadata-fields: token files have no fields", field="metadata_fields")
    if args.bos_id is not None or args.add_bos:
        raise ConfigError("--bos-id / --add-bos: token files are converted as they are; a beginning-of-"
                          "document token is added only when tokenizing text", field="bos_id")
    # the largest id decides the vocabulary and the stored dtype; with --vocab-size given
    # the writers check every id against it, so the pass over the data is not needed
    top = source.scan_max() if args.vocab_size is None else args.vocab_size - 1
    return Input(source.chunks, Totals(tokens=source.num_tokens, top=top), args.eod_id)


def _write(args: ConvertOptions, outputs: list[tuple[str | None, str]], inp: Input, weights: list[float] | None,
           log: Callable[[str], None]) -> str:
    """Every output written (the destination, or each ``--split`` of it); the summary."""
    t = inp.totals
    if weights is None:
        return write_target(args.to, outputs[0][1], inp.chunks, num_tokens=t.tokens, max_token=t.top, args=args,
                            eod=inp.eod, log=log, rows=inp.rows, meta=inp.meta, streams=inp.streams)
    ranges = split_ranges(sum(lengths.size for _, lengths in inp.chunks()), weights)
    tokens_in = tokens_in_ranges(inp.chunks, ranges)
    kept = [(r, n) for r, n, w in zip(ranges, tokens_in, weights, strict=True) if w > 0]
    parts = []
    for (name, out), ((a, b), n) in zip(outputs, kept, strict=True):
        if n == 0:
            raise ConfigError(f"--split: the {name} split gets no tokens ({b - a} of the documents)", field="split")
        part = write_target(args.to, out, document_range(inp.chunks, a, b), num_tokens=n, max_token=t.top,
                            args=args, eod=inp.eod, log=log, rows=_islice(inp.rows, a, b),
                            meta=_islice(inp.meta, a, b),
                            streams={s: document_range(c, a, b) for s, c in inp.streams.items()})
        log(f"{name}: documents [{a:,}, {b:,}) -> {redact(out)}: {part}")
        parts.append(f"{name} {b - a:,} documents")
    return ", ".join(parts)


def _islice(items: Callable[[], Iterator[Any]] | None, a: int, b: int) -> Callable[[], Iterator[Any]] | None:
    """``items`` restricted to ``[a, b)`` (None: None)."""
    if items is None:
        return None
    return lambda: itertools.islice(items(), a, b)


def _nonempty(chunks: Iterator[tuple[np.ndarray, np.ndarray]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The chunks without their empty documents (what :func:`documents` skips)."""
    for tokens, lengths in chunks:
        yield tokens, (lengths if lengths.size == 0 or int(lengths.min()) > 0 else lengths[lengths > 0])


# --------------------------------------------------------------------------------------------
# Distributed preparation: task I of N


def run_task(srcs: list[str], dst: str, args: ConvertOptions, log: Callable[[str], None]) -> str:
    """``convert --task I --tasks N``: task ``I``'s units of the inputs encoded and written into
    ``dst`` as finished parts of each stream (:mod:`zerobatch.prepare.tasks`; with ``--chat``
    the loss mask into ``dst/loss_mask``, a preparation of its own with the same units and
    shard cuts, which ``zerobatch commit`` commits first); returns a summary. A unit's mask is
    written before its tokens, so a unit whose tokens are finished has its mask too."""
    _check_task(args)
    encoder = _task_encoder(srcs, args)
    t0 = time.perf_counter()
    source = encoder.source
    units = TK.plan_units(source, args.unit_bytes)
    plan = {"version": 1, "zerobatch": __version__, "tasks": args.tasks, "units": [u.to_list() for u in units],
            "source": source.fingerprint(), "vocab_size": encoder.vocab, "shard_tokens": args.shard_tokens,
            **encoder.plan()}
    d = TK.Destination(dst)
    streams = [("tokens", d, plan, encoder.vocab, encoder.eod)]
    if "loss_mask" in encoder.streams:
        from zerobatch.readers.tokstream import LOSS_MASK_DIR
        streams.append((LOSS_MASK_DIR, d.child(LOSS_MASK_DIR), {**plan, "stream": LOSS_MASK_DIR, "vocab_size": 2},
                        2, None))
    for _, sd, splan, _, _ in streams:
        if not sd.remote:
            os.makedirs(sd.root, exist_ok=True)
        TK.write_plan(sd, splan)
    task, tasks = int(args.task or 0), int(args.tasks or 1)      # both given (_check_task)
    run = TK.TaskRun(d, len(units), task, tasks, hint=TK.spread_hint(source, units, tasks))
    undecodable = 0
    for u in run.todo:
        unit = encoder.unit(units[u])
        staging = d.scratch(f"unit-{u:06d}.staging")
        try:
            paths = stage(unit, staging, workers=args.workers, quiet=args.quiet, log=log)
            for name, sd, splan, vocab, eod in reversed(streams):     # the mask first, the tokens last
                _write_unit(sd, u, paths, name, splan, vocab, eod, args)
        finally:
            if d.remote:            # local staging (in _parts) stays for a rerun after a crash to resume
                d.release(staging)
        d.release(staging)
        undecodable += unit.source.undecodable
    if undecodable:
        log(UNDECODABLE.format(n=undecodable, what=encoder.documents))
    summary = run.summary(encoder.task_note)
    log(f"{summary} in {time.perf_counter() - t0:.1f} s; when every task is done: zerobatch commit {d.shown}")
    return summary


def _check_task(args: ConvertOptions) -> None:
    """The options of ``--task I --tasks N`` checked."""
    if args.task is None or args.tasks is None:
        raise ConfigError("--task and --tasks go together (task I of N, I from 0)", field="tasks")
    if isinstance(args.tasks, bool) or not isinstance(args.tasks, int) or args.tasks < 1:
        raise ConfigError(f"--tasks must be at least 1, got {args.tasks!r}", field="tasks")
    if isinstance(args.task, bool) or not isinstance(args.task, int) or not 0 <= args.task < args.tasks:
        raise ConfigError(f"--task must be in [0, {args.tasks}), got {args.task!r}", field="task")
    refuse_unless(args.to, "task_parts", "--tasks: distributed preparation writes --to {them} (not {to})", "to")
    for option, value in (("--split", args.split), ("--row-ids", args.row_ids or None),
                          ("--overwrite", args.overwrite or None)):
        if value is not None:
            raise ConfigError(f"{option}: not with --tasks", field="tasks")


def _task_encoder(srcs: list[str], args: ConvertOptions) -> Encoder:
    """The encoder of a distributed task, over the text source whose units the tasks share.

    Raises:
        ConfigError: a source that is not text (or conversations), or a vocabulary of
            unknown size.
    """
    chat = ChatEncoder.template(args) if _is_chat(args) else None
    source = _open(srcs, args)
    if not isinstance(source, TextSource):
        raise ConfigError("--chat: conversations come from JSONL or Parquet files" if chat is not None else
                          f"--tasks: distributed preparation tokenizes text (JSONL, Parquet, text, HF); a "
                          f"{source.kind} source is converted by one process", path=" ".join(srcs),
                          field="chat" if chat is not None else "tasks")
    if chat is not None:
        return ChatEncoder(chat[0], source, chat[1], args.text_errors)
    encoder = TextEncoder.from_options(source, args)
    if encoder.vocab is None:
        raise ConfigError("--vocab-size: the tokenizer does not say its vocabulary size, and every task must write "
                          "the same token type", field="vocab_size")
    return encoder


def _write_unit(d: TK.Destination, u: int, paths: list[str], stream: str, plan: dict[str, Any], vocab: int,
                eod: int | None, args: ConvertOptions) -> None:
    """Stream ``stream`` of unit ``u``'s staged documents written as finished parts in ``d``."""
    eod = eod if eod is not None and eod < vocab else None
    seed = TK.unit_seed(plan, u)
    if stream == "tokens" and args.metadata_fields:
        TK.write_unit(d, u, documents(functools.partial(staged_chunks, paths)), vocab_size=vocab, eod=eod,
                      shard_tokens=args.shard_tokens, metas=staged_meta(paths), build_seed=seed)
    else:
        TK.write_unit(d, u, chunks=_nonempty(staged_chunks(paths, stream)), vocab_size=vocab, eod=eod,
                      shard_tokens=args.shard_tokens, build_seed=seed)
