"""What ``convert --to`` writes: every format whose registry record names a target
(``Format.convert``, in ``zerobatch.prepare.formats.<fmt>``) and the exports to other
trainers' formats (:mod:`zerobatch.prepare.exports`); the destination checks made before any
work, the atomic folder build, and Megatron's ``--split`` into train, valid and test.

What a target can do beyond writing documents is a field of its registry record, never a
list here: ``url_check`` (written to a URL), ``row_ids`` (``--row-ids``), ``doc_metadata``
(``--metadata-fields``), ``streams`` (a chat conversion's ``loss_mask`` beside the tokens),
``task_parts`` (``convert --task I --tasks N``), ``convert_stream`` (records cut from a stream
without document boundaries)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from zerobatch.core.io import fsync_dir, replace_folder, sweep_orphans
from zerobatch.core.remote import is_url, redact
from zerobatch.formats import registry
from zerobatch.formats.errors import ConfigError, LimitExceededError
from zerobatch.prepare.exports import EXPORTS
from zerobatch.prepare.options import ConvertOptions
from zerobatch.prepare.sources import documents

__all__ = ["SPLIT_NAMES", "Chunks", "Target", "build_folder", "capable", "check_destination",
           "check_target_destination", "document_range", "documents", "parse_split", "records", "split_destination",
           "split_ranges", "stream_target", "target_help", "targets", "write_target"]

#: ``(tokens, lengths)`` pieces of whole documents, a new iterator per call.
Chunks = Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]
#: The datasets ``--split`` writes, in order (Megatron's names).
SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class Target:
    """What a format's conversion target is told (``write(dst, chunks, target)`` of its
    registry record's ``convert``).

    Attributes:
        num_tokens: tokens in the source.
        vocab: ids are below it (every piece of ``chunks`` is checked already).
        dtype: ``"uint16"`` or ``"uint32"``: the stored token type.
        eod: the end-of-document id, when there is one.
        options: the conversion's options.
        log: called with each line of the report.
        rows: with ``--row-ids``, the source row of every document, in order (an iterator
            made per call); targets that store per-document metadata keep it.
        meta: with ``--metadata-fields``, the fields of every document, in order (likewise).
        streams: named streams beside the tokens, aligned with them document for document
            (a chat conversion's ``loss_mask``: one 0/1 per token), as ``chunks``; a target
            writes those its registry record's ``streams`` name.
    """

    num_tokens: int
    vocab: int
    dtype: str
    eod: int | None
    options: ConvertOptions
    log: Callable[[str], None]
    rows: Callable[[], Iterator[int]] | None = None
    meta: Callable[[], Iterator[dict[str, Any]]] | None = None
    streams: Mapping[str, Chunks] = field(default_factory=dict)


def records(chunks: Chunks, seq_len: int) -> Iterator[np.ndarray]:
    """The concatenated stream cut into ``[k, seq_len]`` uint32 records (tail dropped)."""
    carry = np.zeros(0, np.uint32)
    for tokens, _ in chunks():
        t = np.concatenate([carry, tokens.astype(np.uint32, copy=False)]) if carry.size else \
            np.asarray(tokens, np.uint32)
        k = t.size // seq_len
        if k:
            yield t[:k * seq_len].reshape(k, seq_len)
        carry = t[k * seq_len:].copy()


def capable(what: str) -> list[str]:
    """The ``--to`` formats whose registry record says they can do ``what`` (a field of
    :class:`~zerobatch.formats.registry.Format`: ``row_ids``, ``doc_metadata``, ``url_check``,
    ``task_parts``; ``loss_mask``: a stream they write), folder formats first."""
    found = [f for f in registry.formats() if f.convert and
             (what in f.streams if what == "loss_mask" else bool(getattr(f, what)))]
    return [f.name for f in sorted(found, key=lambda f: (f.layout == "file", f.name))]


def refuse_unless(to: str, what: str, message: str, field: str) -> None:
    """A :class:`ConfigError` ``message`` (``{to}``: the target; ``{them}``: those that can,
    joined by "or") unless ``to`` can do ``what`` (:func:`capable`)."""
    them = capable(what)
    if to not in them:
        raise ConfigError(message.format(to=to, them=" or ".join(them)), field=field)


def check_destination(dst: str, layout: str, overwrite: bool) -> bool:
    """Whether ``dst`` holds something ``overwrite`` replaces (checked before any work).

    Raises:
        ConfigError: ``dst`` exists (a file, or a folder that is not empty) and ``overwrite``
            is false; or it is a folder where a file is written, or the other way round.
    """
    if not os.path.lexists(dst) or (os.path.isdir(dst) and not os.path.islink(dst) and not os.listdir(dst)):
        return False
    is_folder = os.path.isdir(dst) and not os.path.islink(dst)
    if is_folder != (layout == "folder"):
        raise ConfigError(f"destination: already exists and is a {'folder' if is_folder else 'file'}, but this "
                          f"format is written as a {layout}; remove it or choose another name", path=dst,
                          field="destination")
    if not overwrite:
        raise ConfigError("destination: already exists; pass --overwrite to replace it (the old dataset stays "
                          "readable until the new one is complete)", path=dst, field="destination")
    return True


def parse_split(text: str | None) -> list[float] | None:
    """Megatron's ``--split`` weights (``"969,30,1"``, ``"98,2"``, ``"0.9,0.1"``), normalized.

    Raises:
        ConfigError: not 1 to 3 non-negative numbers with a positive sum.
    """
    if text is None:
        return None
    try:
        weights = [float(w) for w in str(text).replace("/", ",").split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(not w >= 0 for w in weights) or not sum(weights) > 0 \
            or any(w == float("inf") for w in weights):
        raise ConfigError(f"--split: expected 1 to 3 weights for {', '.join(SPLIT_NAMES)} such as 969,30,1, got "
                          f"{text!r}", field="split")
    total = sum(weights)
    return [w / total for w in weights]


def split_ranges(num_docs: int, weights: list[float]) -> list[tuple[int, int]]:
    """The document range of each split, in order: Megatron's rule (each split takes
    ``round(weight * num_docs)`` documents, the last split what is left)."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * num_docs)))
    shift = bounds[-1] - num_docs
    bounds = [b - shift if i == len(bounds) - 1 else min(b, num_docs) for i, b in enumerate(bounds)]
    return [(bounds[i], max(bounds[i], bounds[i + 1])) for i in range(len(weights))]


def split_destination(dst: str, name: str, to: str) -> str:
    """Where split ``name`` of destination ``dst`` goes: ``corpus`` -> ``corpus_train``,
    ``out.chunk`` -> ``out_train.chunk``, Megatron ``prefix`` -> ``prefix_train``."""
    stem, ext = os.path.splitext(dst)
    if to == "megatron" and ext in (".bin", ".idx"):
        return f"{stem}_{name}"
    if ext and to in [f.name for f in registry.formats() if f.layout == "file"] + ["nanogpt"]:
        return f"{stem}_{name}{ext}"
    return f"{dst}_{name}"


def document_range(chunks: Chunks, a: int, b: int) -> Chunks:
    """``chunks`` restricted to documents ``[a, b)``."""
    def gen() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        seen = 0
        for tokens, lengths in chunks():
            n = lengths.size
            lo, hi = max(a - seen, 0), min(b - seen, n)
            if lo < hi:
                ends = np.cumsum(lengths)
                start = int(ends[lo - 1]) if lo else 0
                yield tokens[start:int(ends[hi - 1])], lengths[lo:hi]
            seen += n
            if seen >= b:
                return
    return gen


def tokens_in_ranges(chunks: Chunks, ranges: list[tuple[int, int]]) -> list[int]:
    """Tokens of the documents in each range (one pass over the lengths)."""
    out = [0] * len(ranges)
    seen = 0
    for _, lengths in chunks():
        cum = np.concatenate([[0], np.cumsum(lengths)])
        for k, (a, b) in enumerate(ranges):
            lo, hi = min(max(a - seen, 0), lengths.size), min(max(b - seen, 0), lengths.size)
            out[k] += int(cum[hi] - cum[lo])
        seen += lengths.size
    return out


def build_folder(dst: str, build: Callable[[str], str], *, overwrite: bool = False) -> str:
    """``build(tmp)`` writes a folder dataset under a temporary name, which is then renamed
    into place whole (a failed or killed conversion never leaves a partial dataset under the
    final name); returns ``build``'s summary. With ``overwrite`` an existing dataset is
    swapped for the new one in one step (:func:`zerobatch.core.io.replace_folder`): readers
    see the old dataset or the new one.

    Raises:
        ConfigError: ``dst`` exists and is not an empty folder (and not ``overwrite``).
    """
    if is_url(dst):
        # a dataset at a URL: built locally, then published (shards first, manifest last; a
        # ZRECORD store's chunks and tables first, commit.zr last)
        from zerobatch.writers.remote import publish
        tmp = tempfile.mkdtemp(prefix="zerobatch-upload-")
        try:
            summary = build(os.path.join(tmp, "dataset"))
            publish(os.path.join(tmp, "dataset"), dst, overwrite=overwrite)   # the format's publish
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return summary
    replace = check_destination(dst, "folder", overwrite)
    # what a killed conversion to the same destination left (a process that no longer runs)
    sweep_orphans(os.path.dirname(os.path.abspath(dst)), {os.path.basename(os.path.abspath(dst))})
    tmp = f"{os.path.abspath(dst)}.zbtmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        summary = build(tmp)
        if replace:
            replace_folder(tmp, dst)
        else:
            if os.path.isdir(dst):
                os.rmdir(dst)
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(dst)))
    return summary


def targets() -> list[str]:
    """What ``zerobatch convert --to`` writes: the formats whose registry record has a target,
    and the exports to other trainers' formats (:mod:`zerobatch.prepare.exports`)."""
    return [f.name for f in registry.formats() if f.convert] + sorted(EXPORTS)


def stream_target(to: str) -> bool:
    """Whether target ``to`` takes a token stream without document boundaries (it cuts
    records from the concatenation: the registry record's ``convert_stream``, or an export
    that writes a flat stream)."""
    return EXPORTS[to].stream if to in EXPORTS else registry.get(to).convert_stream


def target_help() -> str:
    """One line per ``--to`` target."""
    lines = [f"{f.name}: {f.summary}" for f in registry.formats() if f.convert]
    return "; ".join(lines + [f"{name}: {e.summary}" for name, e in sorted(EXPORTS.items())])


def check_target_destination(to: str, dst: str, overwrite: bool) -> None:
    """:func:`check_destination` for every file target ``to`` writes at ``dst``; at a URL, the
    check its registry record names (``url_check``).

    Raises:
        ConfigError: something is there and not ``overwrite``; or a URL for a target its
            record does not write to URLs.
    """
    if is_url(dst):
        fmt = None if to in EXPORTS else registry.get(to)
        if fmt is None or not fmt.url_check:
            raise ConfigError(f"destination: a URL takes --to {' or '.join(capable('url_check'))} ({to} is written "
                              f"to local paths)", path=redact(dst), field="destination")
        fmt.resolve("url_check")(dst, overwrite)
    elif to in EXPORTS:
        for path in EXPORTS[to].files(dst):
            check_destination(path, "file", overwrite)
    else:
        check_destination(dst, registry.get(to).layout, overwrite)


def _checked(chunks: Chunks, vocab: int, total: int, desc: str, quiet: bool) -> Chunks:
    """``chunks`` with every piece checked against the vocabulary (so no id is ever cut to fit
    the stored type), with a progress bar over the tokens written."""
    def checked() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="tok", unit_scale=True, desc=desc, file=sys.stderr, mininterval=0.5,
                   disable=bool(quiet))
        try:
            for tokens, lengths in chunks():
                if tokens.size:
                    lo, hi = int(tokens.min()), int(tokens.max())
                    if lo < 0 or hi >= vocab:
                        raise LimitExceededError(f"tokens: id {hi if hi >= vocab else lo} is outside the vocabulary "
                                                 f"[0, {vocab}) (see --vocab-size)", field="vocab_size")
                yield tokens, lengths
                bar.update(tokens.size)
        finally:
            bar.close()
    return checked


def write_target(target: str, dst: str, chunks: Chunks, *, num_tokens: int, max_token: int, args: ConvertOptions,
                 eod: int | None, log: Callable[[str], None], rows: Callable[[], Iterator[int]] | None = None,
                 meta: Callable[[], Iterator[dict[str, Any]]] | None = None,
                 streams: Mapping[str, Chunks] | None = None) -> str:
    """Write ``dst`` in format ``target`` (its registry record's ``convert``) from ``chunks``
    (and the named ``streams`` beside them); returns a one-line summary."""
    if target not in targets():
        raise ConfigError(f"--to must be one of {targets()}, got {target!r}", field="to")
    vocab = args.vocab_size if args.vocab_size else max_token + 1
    if max_token >= vocab:
        raise LimitExceededError(f"--vocab-size: token id {max_token} is not below {vocab}", field="vocab_size")
    dtype = args.dtype if args.dtype not in (None, "auto") else ("uint16" if vocab <= 1 << 16 else "uint32")
    if dtype == "uint16" and vocab > 1 << 16:
        raise ConfigError(f"--dtype uint16 cannot hold token id {max_token}", field="dtype")
    checked = _checked(chunks, vocab, num_tokens, f"write {target}", args.quiet)
    write = EXPORTS[target].write if target in EXPORTS else registry.get(target).resolve("convert")
    spec = Target(num_tokens, vocab, dtype, eod, args, log, rows, meta, dict(streams or {}))
    if is_url(dst) and target not in EXPORTS and registry.get(target).layout == "file":
        # a single-file dataset at a URL: written locally, then uploaded as one object (whole or
        # not at all); folder datasets (TOKSTREAM, ZRECORD) publish themselves (build_folder)
        from zerobatch.writers.remote import publish
        tmp = tempfile.mkdtemp(prefix="zerobatch-upload-")
        try:
            local = os.path.join(tmp, dst.rstrip("/").rsplit("/", 1)[-1] or "dataset")
            summary = write(local, checked, spec)
            publish(local, dst, overwrite=bool(args.overwrite))     # the format's publish
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return summary.replace(local, redact(dst))
    return write(dst, checked, spec)
