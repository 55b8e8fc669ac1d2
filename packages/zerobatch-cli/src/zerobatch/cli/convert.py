"""``zerobatch convert``: any source (:mod:`zerobatch.cli.sources`) into any zerobatch format.

Text is tokenized with a Hugging Face ``tokenizer.json``, a tiktoken encoding, a SentencePiece
model or a function (:mod:`zerobatch.cli.tokenizer`), the end-of-document id appended to every
document, on ``--workers`` processes. Each group of
``--docs-per-shard`` documents is tokenized into a staging file of its own under
``DST.zbconvert/`` (written atomically, named by its place in the input), so a conversion
that was interrupted resumes with the groups not yet done; the staging folder remembers the
input files (names, sizes, modification times), the tokenizer and the options, and a
mismatch starts over. The target is then written from the staged tokens (every zerobatch
writer is atomic) and the staging folder removed.

Token files (``.npy``, nanoGPT ``.bin``, Megatron ``.bin``/``.idx``) go straight to the
target from a memory map.

Targets, from documents: every format whose registry record names a ``convert`` target
(``zerobatch.cli.formats.<fmt>.write``):

* ``llmbatch``: the documents concatenated and cut into ``--seq-len`` records (the tail that
  does not fill one is dropped), shuffled with ``--seed`` into ``--batch-size`` batches;
* ``llmchnk``: one record per document (a document longer than ``--seq-len``, when given, is
  cut into records of that length);
* ``tokstream``: the documents, in shards of about ``--shard-tokens`` tokens;
* ``zrecord``: one record per document, field ``tokens``.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from zerobatch.cli._version import __version__
from zerobatch.cli.exports import EXPORTS
from zerobatch.cli.sources import TextSource, documents, open_sources
from zerobatch.cli.tokenizer import TextTokenizer, load_tokenizer
from zerobatch.cli.workers import WorkerPool
from zerobatch.core import xxh3_64
from zerobatch.core.io import fsync_dir, replace_folder, sweep_orphans
from zerobatch.core.remote import is_url, local_path, redact
from zerobatch.formats import registry
from zerobatch.formats.tokstream import DEFAULT_SHARD_TOKENS
from zerobatch.formats.errors import (ConfigError, CorruptError, LimitExceededError, NotFoundError, WriteError,
                                     ZerobatchError)

__all__ = ["ConvertOptions", "Target", "build_folder", "check_destination", "convert", "documents", "find_eod",
           "load_tokenizer", "records", "targets"]

#: The targets a URL destination takes (folder datasets other than TOKSTREAM, and exports of
#: several files, are written to local paths).
URL_TARGETS = ("tokstream", "zrecord", "llmbatch", "llmchnk")
#: Special tokens tried, in order, as the end-of-document token when none is named.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]", "<eod>")
#: Special tokens tried, in order, as the beginning-of-document token of ``--add-bos``
#: (Llama 3, Llama 2 / Mistral, DeepSeek, Gemma, BERT).
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<bos>", "[CLS]")
STAGING_SUFFIX = ".zbconvert"
#: Targets that keep a document's source row (``--row-ids``).
ROW_TARGETS = ("tokstream", "zrecord")
PLAN_NAME = "plan.json"


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
            (:mod:`zerobatch.cli.tokenizer`).
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
        compress: zrecord: ``raw`` or ``flate``.
        vocab_size: ids must be below it (default: the tokenizer's, else the largest id + 1).
        dtype: ``auto``, ``uint16`` or ``uint32``: the stored token type.
        quiet: no progress bars.
        task, tasks: distributed preparation (text to tokstream): this is task ``task`` of
            ``tasks``; it writes its share of the inputs as finished parts, and
            ``zerobatch commit`` assembles the dataset (:mod:`zerobatch.cli.tasks`).
        unit_bytes: distributed preparation: bytes of a large JSONL or line-split text file
            per unit of work.
        metadata_fields: text to tokstream: fields of each JSONL record (columns of Parquet or
            HF rows) kept as the document's metadata (``{"id": ..., "url": ...}``).
        chat: JSONL conversations (``messages``: role/content) to tokstream, rendered with the
            tokenizer folder's chat template, with a loss mask (:mod:`zerobatch.cli.chat`).
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


# --------------------------------------------------------------------------------------------
# Tokenizing into staged shards

_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Any, eod: int, staging: str, parallel: bool, bos: int | None = None) -> None:
    if not parallel:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tok=load_tokenizer(tokenizer), eod=eod, staging=staging, bos=bos)


def _shard_path(staging: str, k: int) -> str:
    return os.path.join(staging, f"shard-{k:06d}.npz")


def _tokenize_shard(k: int, texts: list[str], rows: list[int] | None = None,
                    metas: list[dict[str, Any]] | None = None) -> tuple[int, int, int]:
    """Tokenize one group, start each document with the beginning-of-document id (when there
    is one), end it with the end-of-document id, stage it; returns (k, tokens, docs)."""
    from zerobatch.core.io import AtomicFile

    tok, eod, bos = _WORKER["tok"], _WORKER["eod"], _WORKER.get("bos")
    head = 0 if bos is None else 1
    encs = tok.encode_batch(texts) if texts else []
    lengths = np.fromiter((len(e) + 1 + head for e in encs), np.int64, len(encs))
    tokens = np.empty(int(lengths.sum()), np.uint32)
    ends = np.cumsum(lengths)
    pos = 0
    for e, end in zip(encs, ends, strict=True):
        if head:
            tokens[pos] = bos
        n = int(end) - pos - 1 - head
        tokens[pos + head:pos + head + n] = e
        tokens[pos + head + n] = eod
        pos = int(end)
    buf = io.BytesIO()
    top = np.array([int(tokens.max()) if tokens.size else -1], np.int64)
    extra = {} if rows is None else {"rows": np.asarray(rows, np.int64)}
    if metas is not None:   # one JSON text per document (no pickles in a staged shard)
        extra["meta"] = np.array([json.dumps(m, default=str, ensure_ascii=False) for m in metas], dtype=str)
    np.savez(buf, tokens=tokens, lengths=lengths, top=top, **extra)
    with AtomicFile(_shard_path(_WORKER["staging"], k)) as f:
        f.write(buf.getbuffer())
    return k, int(tokens.size), int(lengths.size)


def _shard_summary(path: str) -> tuple[int, int, int] | None:
    """``(tokens, documents, largest id)`` of a staged shard, from its small members only
    (shards are written atomically: one under its final name is complete); None when it
    cannot be read."""
    try:
        with np.load(path, allow_pickle=False) as z:
            lengths, top = z["lengths"], z["top"]
    except (OSError, ValueError, KeyError, EOFError):
        return None
    if lengths.ndim != 1 or top.shape != (1,):
        return None
    return int(lengths.sum()), int(lengths.size), int(top[0])


def _read_shard(path: str, member: str | None = None) -> tuple[np.ndarray, np.ndarray] | np.ndarray | None:
    """A staged shard's ``(tokens, lengths)``, or one ``member`` of it; None when it cannot
    be read."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if member is not None:
                return z[member]
            tokens, lengths = z["tokens"], z["lengths"]
    except (OSError, ValueError, KeyError, EOFError):
        return None
    if tokens.ndim != 1 or lengths.ndim != 1 or int(lengths.sum()) != tokens.size:
        return None
    return tokens, lengths


class _Progress:
    """A tqdm bar over the input's work units with tokens/s in its postfix."""

    def __init__(self, total: int, unit: str, quiet: bool, desc: str) -> None:
        self.bar = None
        self.tokens = 0
        self.t0 = time.perf_counter()
        if not quiet:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=unit, unit_scale=True, desc=desc, file=sys.stderr, mininterval=0.5,
                            dynamic_ncols=True)

    def update(self, work: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.tokens:,} tokens, {rate / 1e3:,.0f}K tok/s", refresh=False)
            self.bar.update(work)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def tokenize_to_staging(source: TextSource, tokenizer: Any, eod: int, staging: str, *, workers: int,
                        quiet: bool, log: Callable[[str], None], bos: int | None = None,
                        rows: bool = False) -> list[str]:
    """Tokenize ``source`` into ``staging`` (resuming what is there) with ``tokenizer`` (what
    :func:`zerobatch.cli.tokenizer.load_tokenizer` takes); returns the shard files."""
    plan = {"version": 2, "source": source.fingerprint(), "eod": eod, "bos": bos, "rows": rows,
            "meta_fields": list(source.meta_fields),
            "tokenizer": load_tokenizer(tokenizer).fingerprint}
    plan_path = os.path.join(staging, PLAN_NAME)
    if os.path.isdir(staging):
        try:
            old = json.loads(open(plan_path, encoding="utf-8").read())
        except (OSError, ValueError):
            old = None
        if old != plan:
            log(f"{staging}: staged shards of a different conversion (input, tokenizer or options changed): "
                "starting over")
            shutil.rmtree(staging)
    if not os.path.isdir(staging):
        os.makedirs(staging)
        from zerobatch.core.io import AtomicFile

        with AtomicFile(plan_path) as f:
            f.write(json.dumps(plan, indent=1).encode())
    done = {name for name in os.listdir(staging) if name.startswith("shard-") and name.endswith(".npz")}
    progress = _Progress(source.total_work, source.unit, quiet, "tokenize")
    paths: list[str] = []
    resumed = 0
    pool = None
    if workers > 1:
        pool = WorkerPool(workers, _init_worker, (tokenizer, eod, staging, False, bos))
    else:
        _init_worker(tokenizer, eod, staging, True, bos)
    pending: deque[tuple[Any, int]] = deque()
    try:
        def drain(limit: int) -> None:
            while len(pending) > limit:
                res, work = pending.popleft()
                _, ntok, _ = WorkerPool.result(res) if pool is not None else res
                progress.update(work, ntok)

        for k, (texts, work, row_ids, metas) in enumerate(source.shards_with_rows()):
            path = _shard_path(staging, k)
            paths.append(path)
            if os.path.basename(path) in done and _shard_summary(path) is not None:
                resumed += 1
                progress.update(work, 0)
                continue
            if pool is not None:
                pending.append((pool.submit(_tokenize_shard, k, texts, row_ids if rows else None, metas), work))
                drain(2 * workers)       # bounded: never more than 2 groups per worker in flight
            else:
                pending.append((_tokenize_shard(k, texts, row_ids if rows else None, metas), work))
                drain(0)
        drain(0)
    finally:
        progress.close()
        if pool is not None:
            pool.close()
    if resumed:
        log(f"resumed: {resumed} of {len(paths)} tokenized groups were already staged in {staging}")
    return paths


def staged_chunks(paths: list[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for p in paths:
        got = _read_shard(p)
        if got is None:
            raise CorruptError("staging: a staged shard cannot be read; delete the staging folder and convert "
                               "again", path=p, field="staging")
        yield got


def staged_rows(paths: list[str]) -> Iterator[int]:
    """The source row of every staged document, in order (``convert --row-ids``)."""
    for p in paths:
        rows = _read_shard(p, "rows")
        if not isinstance(rows, np.ndarray) or rows.ndim != 1:
            raise CorruptError("staging: a staged shard has no source rows; delete the staging folder and convert "
                               "again", path=p, field="staging")
        yield from rows.tolist()


def staged_meta(paths: list[str]) -> Iterator[dict[str, Any]]:
    """The fields of every staged document, in order (``convert --metadata-fields``)."""
    for p in paths:
        meta = _read_shard(p, "meta")
        if not isinstance(meta, np.ndarray) or meta.ndim != 1:
            raise CorruptError("staging: a staged shard has no document fields; delete the staging folder and "
                               "convert again", path=p, field="staging")
        for text in meta.tolist():
            yield json.loads(text)


def staged_totals(paths: list[str]) -> tuple[int, int, int]:
    """(tokens, documents, largest id) over the staged shards (their small members only)."""
    tokens = docs = 0
    top = -1
    for p in paths:
        got = _shard_summary(p)
        if got is None:
            raise CorruptError("staging: a staged shard cannot be read; delete the staging folder and convert "
                               "again", path=p, field="staging")
        tokens, docs, top = tokens + got[0], docs + got[1], max(top, got[2])
    return tokens, docs, top


# --------------------------------------------------------------------------------------------
# Writing targets


Chunks = Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]


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
    """

    num_tokens: int
    vocab: int
    dtype: str
    eod: int | None
    options: ConvertOptions
    log: Callable[[str], None]
    rows: Callable[[], Iterator[int]] | None = None
    meta: Callable[[], Iterator[dict[str, Any]]] | None = None


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


TEXT_DOCUMENTS = ("file", "line", "blank")
#: The datasets ``--split`` writes, in order (Megatron's names).
SPLIT_NAMES = ("train", "valid", "test")


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


def _tokens_in_ranges(chunks: Chunks, ranges: list[tuple[int, int]]) -> list[int]:
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


def staging_folder(dst: str) -> str:
    """Where the tokenized documents are staged: ``DST.zbconvert/`` beside a local
    destination; for a URL, a folder named by the URL in the temporary folder (so a rerun
    finds it)."""
    if is_url(dst):
        key = f"{xxh3_64(dst.encode('utf-8')):016x}"
        return os.path.join(tempfile.gettempdir(), f"zerobatch-convert-{key}{STAGING_SUFFIX}")
    return os.path.abspath(dst) + STAGING_SUFFIX


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
        from zerobatch.writers.remote import publish_folder
        tmp = tempfile.mkdtemp(prefix="zerobatch-upload-")
        try:
            summary = build(os.path.join(tmp, "dataset"))
            publish_folder(os.path.join(tmp, "dataset"), dst, overwrite=overwrite)
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
    and the exports to other trainers' formats (:mod:`zerobatch.cli.exports`)."""
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
    """:func:`check_destination` for every file target ``to`` writes at ``dst``."""
    if is_url(dst):
        if to == "tokstream":
            from zerobatch.writers.remote import check_remote_destination
            check_remote_destination(dst, overwrite)
            return
        if to == "zrecord":
            from zerobatch.writers.remote import check_remote_zrecord
            check_remote_zrecord(dst, overwrite)
            return
        if to in EXPORTS or registry.get(to).layout != "file":
            raise ConfigError(f"destination: a URL takes --to {' or '.join(URL_TARGETS)} ({to} is written to local "
                              f"paths)", path=redact(dst), field="destination")
        from zerobatch.writers.remote import check_remote_file
        check_remote_file(dst, overwrite)
    elif to in EXPORTS:
        for path in EXPORTS[to].files(dst):
            check_destination(path, "file", overwrite)
    else:
        check_destination(dst, registry.get(to).layout, overwrite)


def write_target(target: str, dst: str, chunks: Chunks, *, num_tokens: int, max_token: int, args: ConvertOptions,
                 eod: int | None, log: Callable[[str], None], rows: Callable[[], Iterator[int]] | None = None,
                 meta: Callable[[], Iterator[dict[str, Any]]] | None = None) -> str:
    """Write ``dst`` in format ``target`` (its registry record's ``convert``); returns a
    one-line summary."""
    if target not in targets():
        raise ConfigError(f"--to must be one of {targets()}, got {target!r}", field="to")
    vocab = args.vocab_size if args.vocab_size else max_token + 1
    if max_token >= vocab:
        raise LimitExceededError(f"--vocab-size: token id {max_token} is not below {vocab}", field="vocab_size")
    dtype = args.dtype if args.dtype not in (None, "auto") else ("uint16" if vocab <= 1 << 16 else "uint32")
    if dtype == "uint16" and vocab > 1 << 16:
        raise ConfigError(f"--dtype uint16 cannot hold token id {max_token}", field="dtype")
    source_chunks = chunks

    def checked() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The source's pieces, each checked against the vocabulary (so no id is ever cut to
        fit the stored type), with a progress bar over the tokens written."""
        from tqdm import tqdm

        bar = tqdm(total=num_tokens, unit="tok", unit_scale=True, desc=f"write {target}", file=sys.stderr,
                   mininterval=0.5, disable=bool(args.quiet))
        try:
            for tokens, lengths in source_chunks():
                if tokens.size:
                    lo, hi = int(tokens.min()), int(tokens.max())
                    if lo < 0 or hi >= vocab:
                        raise LimitExceededError(f"tokens: id {hi if hi >= vocab else lo} is outside the vocabulary "
                                                 f"[0, {vocab}) (see --vocab-size)", field="vocab_size")
                yield tokens, lengths
                bar.update(tokens.size)
        finally:
            bar.close()
    write = EXPORTS[target].write if target in EXPORTS else registry.get(target).resolve("convert")
    spec = Target(num_tokens, vocab, dtype, eod, args, log, rows, meta)
    if is_url(dst) and target not in EXPORTS and registry.get(target).layout == "file":
        # a single-file dataset at a URL: written locally, then uploaded as one object (whole or
        # not at all); folder datasets (TOKSTREAM, ZRECORD) publish themselves (build_folder)
        from zerobatch.writers.remote import publish_file
        tmp = tempfile.mkdtemp(prefix="zerobatch-upload-")
        try:
            local = os.path.join(tmp, dst.rstrip("/").rsplit("/", 1)[-1] or "dataset")
            summary = write(local, checked, spec)
            publish_file(local, dst, overwrite=bool(args.overwrite))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return summary.replace(local, redact(dst))
    return write(dst, checked, spec)


def convert(src: str | os.PathLike[str] | list[Any], dst: str, *, to: str, log: Callable[[str], None] = print,
            **options: Any) -> str:
    """Convert ``src`` (any source :mod:`zerobatch.cli.sources` reads) into a ``to`` dataset at
    ``dst``: ``zerobatch convert`` as a function.

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
    args = ConvertOptions(to=to, **options)
    if args.split in TEXT_DOCUMENTS:          # release 0.1's --split file|line|blank
        args = args.replace(documents=args.split, split=None)
    weights = parse_split(args.split)
    srcs = [os.fspath(src)] if isinstance(src, (str, os.PathLike)) else [os.fspath(p) for p in src]
    src, dst = srcs[0] if len(srcs) == 1 else " ".join(srcs), os.fspath(dst)
    dst = dst.rstrip("/") or dst
    if args.to not in targets():
        raise ConfigError(f"--to must be one of {targets()}, got {args.to!r}", field="to")
    if args.workers < 1:
        raise ConfigError("--workers must be at least 1", field="workers")
    dst = local_path(dst)
    parent = os.path.dirname(os.path.abspath(dst))
    if not is_url(dst) and not os.path.isdir(parent):
        raise NotFoundError("destination: the parent folder does not exist", path=dst, field="destination")
    if args.task is not None or args.tasks is not None:
        return run_task(srcs, dst, args, log)    # the tasks share the destination folder
    if args.chat or args.chat_roles:
        return convert_chat(srcs, dst, args, log)
    # before any work: an existing destination is refused (or, with --overwrite, replaced at the end)
    outputs = [(None, dst)] if weights is None else [(name, split_destination(dst, name, args.to))
                                                     for name, w in zip(SPLIT_NAMES, weights, strict=False) if w > 0]
    for _, out in outputs:
        check_target_destination(args.to, out, args.overwrite)
    if args.metadata_fields and args.to != "tokstream":
        raise ConfigError(f"--metadata-fields: {args.to} keeps no per-document fields; use --to tokstream",
                          field="metadata_fields")
    if args.row_ids and args.to not in ROW_TARGETS:
        raise ConfigError(f"--row-ids: {args.to} keeps no per-document metadata; use --to {' or '.join(ROW_TARGETS)}",
                          field="row_ids")
    t0 = time.perf_counter()
    source = _open(srcs, args)
    inputs = [f for f in source.files if not f.endswith(".idx")]
    if len(inputs) > 1:
        shown = ", ".join(os.path.basename(f) for f in inputs[:8]) + (", ..." if len(inputs) > 8 else "")
        log(f"source: {len(inputs)} files, in this order: {shown}")
    staging = None
    eod: int | None
    try:
        if isinstance(source, TextSource):
            tok, eod, bos = text_tokenizer(source, args)
            vocab = tok.vocab_size
            del tok
            staging = staging_folder(dst)
            paths = tokenize_to_staging(source, args.tokenizer, eod, staging, workers=args.workers,
                                        quiet=args.quiet, log=log, bos=bos, rows=args.row_ids)
            num_tokens, num_docs, top = staged_totals(paths)
            if args.vocab_size is None and vocab is not None:
                args = args.replace(vocab_size=vocab)

            def chunks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
                return staged_chunks(paths)

            def rows() -> Iterator[int]:
                return staged_rows(paths)

            def meta() -> Iterator[dict[str, Any]]:
                return staged_meta(paths)
        else:   # token files or a zerobatch dataset
            if not source.has_boundaries and weights is not None:
                raise ConfigError(f"--split: this {source.kind} stream has no document boundaries to split at; give "
                                  f"--eod-id", path=src, field="split")
            if not source.has_boundaries:
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
            eod = args.eod_id
            num_tokens = source.num_tokens
            # the largest id decides the vocabulary and the stored dtype; with --vocab-size given
            # the writers check every id against it, so the pass over the data is not needed
            top = source.scan_max() if args.vocab_size is None else args.vocab_size - 1
            chunks = source.chunks
        if num_tokens == 0:
            raise ConfigError("source: no tokens to convert", path=src, field="source")
        if weights is None:
            summary = write_target(args.to, dst, chunks, num_tokens=num_tokens, max_token=top, args=args, eod=eod,
                                   log=log, rows=rows if args.row_ids else None,
                                   meta=meta if args.metadata_fields else None)
        else:
            ranges = split_ranges(sum(lengths.size for _, lengths in chunks()), weights)
            tokens_in = _tokens_in_ranges(chunks, ranges)
            parts = []
            for (name, out), (a, b), n in zip(outputs, [r for r, w in zip(ranges, weights, strict=True) if w > 0],
                                               [n for n, w in zip(tokens_in, weights, strict=True) if w > 0],
                                               strict=True):
                if n == 0:
                    raise ConfigError(f"--split: the {name} split gets no tokens ({b - a} of the documents)",
                                      field="split")
                part_rows = part_meta = None
                if args.row_ids:
                    def part_rows(a: int = a, b: int = b) -> Iterator[int]:
                        return itertools.islice(rows(), a, b)
                if args.metadata_fields:
                    def part_meta(a: int = a, b: int = b) -> Iterator[dict[str, Any]]:
                        return itertools.islice(meta(), a, b)
                part = write_target(args.to, out, document_range(chunks, a, b), num_tokens=n, max_token=top,
                                    args=args, eod=eod, log=log, rows=part_rows, meta=part_meta)
                log(f"{name}: documents [{a:,}, {b:,}) -> {redact(out)}: {part}")
                parts.append(f"{name} {b - a:,} documents")
            summary = ", ".join(parts)
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
    if isinstance(source, TextSource):
        if source.empty:
            log(f"skipped {source.empty:,} empty or null documents (so document i is not always source row i)")
        if source.undecodable:
            log(f"{source.undecodable:,} documents had undecodable text (invalid UTF-8 or lone UTF-16 surrogates), "
                f"replaced with U+FFFD (--text-errors strict refuses them)")
    dt = time.perf_counter() - t0
    log(f"wrote {redact(dst)} ({args.to}): {summary} in {dt:.1f} s ({num_tokens / max(dt, 1e-9) / 1e6:,.2f}M tokens/s)")
    return summary


def text_tokenizer(source: TextSource, args: ConvertOptions) -> tuple[TextTokenizer, int, int | None]:
    """The tokenizer of a text conversion, its end-of-document id and its beginning-of-document
    id (``None``: none), from the options.

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
    return tok, eod, bos


def _nonempty(chunks: Iterator[tuple[np.ndarray, np.ndarray]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The chunks without their empty documents (what :func:`documents` skips)."""
    for tokens, lengths in chunks:
        yield tokens, (lengths if lengths.size == 0 or int(lengths.min()) > 0 else lengths[lengths > 0])


def _open(srcs: list[str], args: ConvertOptions) -> Any:
    return open_sources(srcs, args.source_kind, text_field=args.field, split=args.documents, hf_split=args.hf_split,
                        docs_per_shard=args.docs_per_shard, dtype=args.token_dtype, eod=args.eod_id,
                        text_errors=args.text_errors, meta_fields=tuple(args.metadata_fields or ()))


def run_task(srcs: list[str], dst: str, args: ConvertOptions, log: Callable[[str], None]) -> str:
    """``convert --task I --tasks N``: task ``I``'s units of the inputs tokenized and written
    into ``dst`` as finished parts (:mod:`zerobatch.cli.tasks`); returns a summary."""
    import zerobatch.cli.tasks as TK

    if args.task is None or args.tasks is None:
        raise ConfigError("--task and --tasks go together (task I of N, I from 0)", field="tasks")
    if isinstance(args.tasks, bool) or not isinstance(args.tasks, int) or args.tasks < 1:
        raise ConfigError(f"--tasks must be at least 1, got {args.tasks!r}", field="tasks")
    if isinstance(args.task, bool) or not isinstance(args.task, int) or not 0 <= args.task < args.tasks:
        raise ConfigError(f"--task must be in [0, {args.tasks}), got {args.task!r}", field="task")
    if args.to != "tokstream":
        raise ConfigError(f"--tasks: distributed preparation writes --to tokstream (not {args.to})", field="to")
    for option, value in (("--split", args.split), ("--row-ids", args.row_ids or None),
                          ("--overwrite", args.overwrite or None)):
        if value is not None:
            raise ConfigError(f"{option}: not with --tasks", field="tasks")
    if args.chat or args.chat_roles:
        return run_chat_task(srcs, dst, args, log)
    source = _open(srcs, args)
    if not isinstance(source, TextSource):
        raise ConfigError(f"--tasks: distributed preparation tokenizes text (JSONL, Parquet, text, HF); a "
                          f"{source.kind} source is converted by one process", path=" ".join(srcs), field="tasks")
    t0 = time.perf_counter()
    tok, eod, bos = text_tokenizer(source, args)
    vocab = args.vocab_size if args.vocab_size is not None else tok.vocab_size
    if vocab is None:
        raise ConfigError("--vocab-size: the tokenizer does not say its vocabulary size, and every task must write "
                          "the same token type", field="vocab_size")
    units = TK.plan_units(source, args.unit_bytes)
    fp = source.fingerprint()
    plan = {"version": 1, "zerobatch": __version__, "tasks": args.tasks, "units": [u.to_list() for u in units],
            "metadata_fields": list(args.metadata_fields or ()),
            "source": fp, "tokenizer": tok.fingerprint,
            "eod": eod, "bos": bos, "vocab_size": vocab, "shard_tokens": args.shard_tokens}
    del tok
    if not is_url(dst):
        os.makedirs(dst, exist_ok=True)
    d = TK.Destination(dst)
    TK.write_plan(d, plan)
    run = TK.TaskRun(d, len(units), args.task, args.tasks, hint=TK.spread_hint(source, units, args.tasks))
    for u in run.todo:
        sub = TK.unit_source(source, units[u])
        staging = d.scratch(f"unit-{u:06d}.staging")
        try:
            paths = tokenize_to_staging(sub, args.tokenizer, eod, staging, workers=args.workers, quiet=args.quiet,
                                        log=log, bos=bos)
            if args.metadata_fields:
                TK.write_unit(d, u, documents(lambda paths=paths: staged_chunks(paths)), vocab_size=vocab,
                              eod=eod if eod < vocab else None, shard_tokens=args.shard_tokens,
                              metas=staged_meta(paths), build_seed=TK.unit_seed(plan, u))
            else:
                TK.write_unit(d, u, chunks=_nonempty(staged_chunks(paths)), vocab_size=vocab,
                              eod=eod if eod < vocab else None, shard_tokens=args.shard_tokens,
                              build_seed=TK.unit_seed(plan, u))
        finally:
            if d.remote:            # local staging (in _parts) stays for a rerun after a crash to resume
                d.release(staging)
        d.release(staging)
    summary = run.summary()
    log(f"{summary} in {time.perf_counter() - t0:.1f} s; when every task is done: zerobatch commit {d.shown}")
    return summary


CHAT_PATTERNS = ("*.jsonl", "*.jsonl.gz", "*.ndjson", "*.json", "*.parquet")


def _chat_parts(srcs: list[str], units: list[Any] | None = None) -> list[tuple[str, Any, int]]:
    """``(file, span, bytes)`` of what :func:`_chat_records` reads: each file of ``srcs`` whole,
    or each of ``units`` (:class:`zerobatch.cli.tasks.Unit`: a byte range of a JSONL file, row
    groups of a Parquet one); ``bytes`` is its share of the input, the progress it stands for."""
    from zerobatch.cli.sources import _files, _pyarrow_parquet
    parts = ([(u.file, u.span) for u in units] if units is not None else
             [(path, None) for src in srcs for path in _files(src, CHAT_PATTERNS)])
    out = []
    for path, span in parts:
        size = os.path.getsize(path)
        if span is not None and path.lower().endswith(".parquet"):
            try:
                meta = _pyarrow_parquet().ParquetFile(path).metadata
                rows = sum(meta.row_group(g).num_rows for g in range(*span))
                size = size * rows // max(meta.num_rows, 1)
            except Exception as exc:  # pyarrow's own errors for damaged files
                raise CorruptError(f"parquet: {exc}", path=path, field="parquet") from None
        elif span is not None:
            size = max(0, min(span[1], size) - span[0])
        out.append((path, span, size))
    return out


def _clean_text(value: Any) -> tuple[Any, bool]:
    """``value`` (a conversation's strings, lists and dicts) with each lone UTF-16 surrogate
    replaced by U+FFFD (pairs recombined), and whether any was."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace"), True
        return value, False
    if isinstance(value, list):
        items = [_clean_text(v) for v in value]
        return [v for v, _ in items], any(bad for _, bad in items)
    if isinstance(value, dict):
        pairs = [(_clean_text(k), _clean_text(v)) for k, v in value.items()]
        return {k: v for (k, _), (v, _) in pairs}, any(kb or vb for (_, kb), (_, vb) in pairs)
    return value, False


def _chat_records(srcs: list[str], field: str, units: list[Any] | None = None, *, text_errors: str = "replace",
                  tally: dict[str, int] | None = None) -> Iterator[tuple[str, Any, int]]:
    """``(where, messages, work)`` of the conversations of ``srcs`` (or of ``units``, parts of
    them: :class:`zerobatch.cli.tasks.Unit`): JSONL records, or Parquet rows (a column of
    lists of role/content structs); ``where`` names the file and line (or row), ``work`` the
    input bytes read since the record before (:func:`_chat_parts`).

    Undecodable text (bytes that are not UTF-8, a lone UTF-16 surrogate escaped in JSON)
    follows ``text_errors`` as in the text path: ``"replace"`` substitutes U+FFFD and counts
    the conversation in ``tally["undecodable"]``; ``"strict"`` raises a
    :class:`~zerobatch.formats.errors.CorruptError` naming the file, line and message."""
    from zerobatch.cli.sources import TEXT_ERRORS, _open_bytes, _pyarrow_parquet, json_record, span_lines
    if text_errors not in TEXT_ERRORS:
        raise ConfigError(f"--text-errors must be one of {TEXT_ERRORS}, got {text_errors!r}", field="text_errors")
    tally = {} if tally is None else tally
    tally.setdefault("undecodable", 0)

    def cleaned(messages: Any, path: str, where: str, bad: bool) -> Any:
        fixed, replaced = _clean_text(messages)
        if replaced and text_errors == "strict":
            at = next((i for i, m in enumerate(messages) if _clean_text(m)[1]), None) \
                if isinstance(messages, list) else None
            raise CorruptError(f"{where}: {'' if at is None else f'message {at}: '}holds a lone UTF-16 surrogate "
                               f"(an escape such as \\ud83d without its pair); --text-errors replace substitutes "
                               f"U+FFFD", path=path, field=where.split(" after ")[0])
        if replaced or bad:
            tally["undecodable"] += 1
        return fixed

    for path, span, size in _chat_parts(srcs, units):
        name = os.path.basename(path)
        if path.lower().endswith(".parquet"):
            after = "" if span is None else f" of row groups {span[0]}-{span[1] - 1}"
            pq = _pyarrow_parquet()
            try:
                pf = pq.ParquetFile(path)
                if field not in pf.schema_arrow.names:
                    raise CorruptError(f"parquet: no column {field!r} (a list of messages; choose it with --field; "
                                       f"columns: {pf.schema_arrow.names})", path=path, field=field)
                groups = None if span is None else list(range(*span))
                rows = (pf.metadata.num_rows if groups is None else
                        sum(pf.metadata.row_group(g).num_rows for g in groups))
                row = done = 0
                for batch in pf.iter_batches(batch_size=1024, columns=[field], row_groups=groups):
                    for messages in batch.column(0).to_pylist():
                        row += 1
                        work, done = size * row // max(rows, 1) - done, size * row // max(rows, 1)
                        where = f"row {row}{after}"
                        yield f"{name} {where}", cleaned(messages, path, where, False), work
            except CorruptError:
                raise
            except Exception as exc:  # pyarrow's own errors for damaged files
                raise CorruptError(f"parquet: {exc}", path=path, field="parquet") from None
            continue
        after = "" if span is None or not span[0] else f" after byte {span[0]}"
        with _open_bytes(path) as f:
            compressed = getattr(f, "fileobj", None)   # a .gz file: progress in its compressed bytes
            pos = carry = 0
            for lineno, raw in enumerate(span_lines(f, span), 1):
                if compressed is not None:
                    now = compressed.tell()
                    carry, pos = carry + max(0, now - pos), now
                else:
                    carry += len(raw)
                if not raw.strip():
                    continue
                where = f"line {lineno}{after}"
                bad = False
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    if text_errors == "strict":
                        raise CorruptError(f"{where}: byte {exc.start} of it is not UTF-8 ({exc.reason}); "
                                           f"--text-errors replace substitutes U+FFFD", path=path,
                                           field=f"line {lineno}") from None
                    line, bad = raw.decode("utf-8", "replace"), True
                if lineno == 1 and line.startswith("\ufeff"):
                    line = line[1:]                      # a byte-order mark
                obj = json_record(line, path, where, field, "a list of messages; choose it with --field")
                yield f"{name} {where}", cleaned(obj[field], path, where, bad), carry
                carry = 0


def _chat_groups(records: Iterator[tuple[str, Any, int]]) -> Iterator[list[tuple[str, Any, int]]]:
    """``records`` in groups of :data:`CHAT_GROUP`."""
    group: list[tuple[str, Any, int]] = []
    for record in records:
        group.append(record)
        if len(group) == CHAT_GROUP:
            yield group
            group = []
    if group:
        yield group


CHAT_GROUP = 256
"""Conversations a ``--chat`` worker process renders and tokenizes per task."""

_CHAT: Any = None


def _init_chat_worker(folder: str, roles: tuple[str, ...]) -> None:
    global _CHAT
    from zerobatch.cli.chat import ChatTemplate
    _CHAT = ChatTemplate(folder, roles)


def _encode_chat_group(group: list[tuple[Any, ...]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids, loss mask)`` of each ``(where, messages, ...)`` of ``group``, with the process's
    template (:func:`_init_chat_worker`)."""
    return [_CHAT.encode(messages, where=where) for where, messages, *_ in group]


def _chat_progress(srcs: list[str], units: list[Any] | None, quiet: bool) -> _Progress:
    """The progress bar of a ``--chat`` conversion (the text path's: input bytes, tokens/s)."""
    return _Progress(sum(size for _, _, size in _chat_parts(srcs, units)), "B", quiet, "chat")


def _encoded_chat(groups: Iterator[list[tuple[str, Any, int]]], chat: Any, workers: int,
                  progress: _Progress | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The conversations of ``groups`` encoded, in order: on the calling process, or on
    ``workers`` processes (started at the second group, so a small input starts none), with
    at most two groups per worker in flight; ``progress`` (closed at the end) advances by each
    group's input bytes and tokens as its conversations come out."""
    def advance(group: list[tuple[str, Any, int]], encoded: list[tuple[np.ndarray, np.ndarray]]
                ) -> list[tuple[np.ndarray, np.ndarray]]:
        if progress is not None:
            progress.update(sum(r[2] for r in group), sum(int(ids.size) for ids, _ in encoded))
        return encoded

    groups = iter(groups)
    try:
        head = list(itertools.islice(groups, 2))
        everything = itertools.chain(head, groups)
        if workers < 2 or len(head) < 2:
            for group in everything:
                yield from advance(group, [chat.encode(messages, where=where) for where, messages, *_ in group])
        else:
            with WorkerPool(workers, _init_chat_worker, (chat.folder, chat.roles)) as pool:
                pending: deque[Any] = deque()
                for group in everything:
                    pending.append((group, pool.submit(_encode_chat_group, group)))
                    while len(pending) > 2 * workers:
                        group_, res = pending.popleft()
                        yield from advance(group_, WorkerPool.result(res))
                while pending:
                    group_, res = pending.popleft()
                    yield from advance(group_, WorkerPool.result(res))
        if progress is not None and progress.bar is not None and progress.bar.total:
            progress.bar.update(max(0, progress.bar.total - progress.bar.n))   # blank lines at the end
    finally:
        if progress is not None:
            progress.close()


def _chat_setup(args: ConvertOptions) -> tuple[Any, str]:
    """The options of ``--chat`` checked; ``(template, messages field)``."""
    from zerobatch.cli.chat import DEFAULT_ROLES, ChatTemplate
    if args.to != "tokstream":
        raise ConfigError(f"--chat: chat data is written --to tokstream (not {args.to}), with its loss mask",
                          field="to")
    for option, value in (("--split", args.split), ("--row-ids", args.row_ids or None),
                          ("--metadata-fields", args.metadata_fields or None)):
        if value is not None:
            raise ConfigError(f"{option}: not with --chat", field="chat")
    if not isinstance(args.tokenizer, (str, os.PathLike)):
        raise ConfigError("--chat: --tokenizer must be a Hugging Face tokenizer folder (tokenizer.json and "
                          "tokenizer_config.json with its chat_template)", field="tokenizer")
    chat = ChatTemplate(args.tokenizer, args.chat_roles or DEFAULT_ROLES)
    return chat, "messages" if args.field == "text" else args.field


def run_chat_task(srcs: list[str], dst: str, args: ConvertOptions, log: Callable[[str], None]) -> str:
    """``convert --chat --task I --tasks N``: task ``I``'s units of the conversations written
    into ``dst`` as finished parts, and their loss masks into ``dst/loss_mask`` (each stream a
    preparation of its own, with the same units and shard cuts); ``zerobatch commit`` commits
    the mask, then the dataset. A unit's mask is written before its tokens, so a unit whose
    tokens are finished has its mask too."""
    import zerobatch.cli.tasks as TK
    from zerobatch.readers.tokstream import LOSS_MASK_DIR

    chat, field = _chat_setup(args)
    source = _open(srcs, args)
    if not isinstance(source, TextSource):
        raise ConfigError("--chat: conversations come from JSONL or Parquet files", path=" ".join(srcs),
                          field="chat")
    t0 = time.perf_counter()
    units = TK.plan_units(source, args.unit_bytes)
    plan = {"version": 1, "zerobatch": __version__, "tasks": args.tasks, "units": [u.to_list() for u in units],
            "source": source.fingerprint(), "chat": chat.fingerprint, "field": field, "vocab_size": chat.vocab_size,
            "shard_tokens": args.shard_tokens}
    mask_plan = {**plan, "stream": LOSS_MASK_DIR, "vocab_size": 2}
    if not is_url(dst):
        os.makedirs(os.path.join(dst, LOSS_MASK_DIR), exist_ok=True)
    d = TK.Destination(dst)
    md = d.child(LOSS_MASK_DIR)
    TK.write_plan(d, plan)
    TK.write_plan(md, mask_plan)
    run = TK.TaskRun(d, len(units), args.task, args.tasks, hint=TK.spread_hint(source, units, args.tasks))
    tally = {"undecodable": 0}
    for u in run.todo:
        records = _chat_records(srcs, field, [units[u]], text_errors=args.text_errors, tally=tally)
        encoded = [(ids, mask) for ids, mask in _encoded_chat(_chat_groups(records), chat, args.workers,
                                                              _chat_progress(srcs, [units[u]], args.quiet)) if ids.size]
        TK.write_unit(md, u, (m.astype(np.uint16) for _, m in encoded), vocab_size=2, eod=None,
                      shard_tokens=args.shard_tokens, build_seed=TK.unit_seed(mask_plan, u))
        TK.write_unit(d, u, (ids for ids, _ in encoded), vocab_size=chat.vocab_size, eod=None,
                      shard_tokens=args.shard_tokens, build_seed=TK.unit_seed(plan, u))
    if tally["undecodable"]:
        log(f"{tally['undecodable']:,} conversations had undecodable text (invalid UTF-8 or lone UTF-16 "
            f"surrogates), replaced with U+FFFD (--text-errors strict refuses them)")
    summary = run.summary(" (chat, with the loss mask)")
    log(f"{summary} in {time.perf_counter() - t0:.1f} s; when every task is done: zerobatch commit {redact(dst)}")
    return summary


def convert_chat(srcs: list[str], dst: str, args: ConvertOptions, log: Callable[[str], None]) -> str:
    """``convert --chat``: JSONL conversations into a TOKSTREAM dataset (one document per
    conversation, rendered with the tokenizer folder's chat template) and its loss mask
    (``DST/loss_mask``, see :mod:`zerobatch.cli.chat`); returns the summary."""
    from zerobatch.readers.tokstream import LOSS_MASK_DIR
    from zerobatch.writers.tokstream import TokenStreamWriter

    chat, field = _chat_setup(args)
    prefix = "shard-"
    if not is_url(dst):
        check_destination(dst, "folder", args.overwrite)
    else:
        from zerobatch.writers.remote import check_remote_destination, unique_shard_prefix
        if check_remote_destination(dst, args.overwrite):
            # replacing a dataset: names its readers' objects do not have (they keep reading
            # the old dataset until the new manifest is in place)
            prefix = unique_shard_prefix()
    t0 = time.perf_counter()
    counts = {"conversations": 0, "tokens": 0, "trained": 0, "empty": 0, "undecodable": 0}

    def build(folder: str) -> str:
        w = TokenStreamWriter(folder, vocab_size=chat.vocab_size, shard_tokens=args.shard_tokens, prefix=prefix)
        m = TokenStreamWriter(os.path.join(folder, LOSS_MASK_DIR), vocab_size=2, shard_tokens=args.shard_tokens,
                              prefix=prefix)
        try:
            records = _chat_records(srcs, field, text_errors=args.text_errors, tally=counts)
            for ids, mask in _encoded_chat(_chat_groups(records), chat, args.workers,
                                           _chat_progress(srcs, None, args.quiet)):
                if not ids.size:
                    counts["empty"] += 1
                    continue
                w.add_document(ids)
                m.add_document(mask.astype(np.uint16))
                counts["conversations"] += 1
                counts["tokens"] += int(ids.size)
                counts["trained"] += int(mask.sum())
            if not counts["conversations"]:
                raise ConfigError("source: no conversation to convert", path=" ".join(srcs), field="source")
        except BaseException:
            w.abort()
            m.abort()
            raise
        w.close(loss_mask=m.close())     # the dataset's manifest names its mask's build id
        return (f"wrote {redact(dst)} (tokstream, chat): {counts['conversations']:,} conversations, "
                f"{counts['tokens']:,} tokens, {counts['trained']:,} of them trained on "
                f"({', '.join(chat.roles)}) in {time.perf_counter() - t0:.1f} s")

    if is_url(dst):
        from zerobatch.writers.remote import publish_tokstream
        tmp = tempfile.mkdtemp(prefix="zerobatch-chat-")
        try:
            summary = build(os.path.join(tmp, "dataset"))
            # both datasets' shards, then the mask's manifest, then the dataset's (the switch)
            publish_tokstream(os.path.join(tmp, "dataset"), dst, overwrite=args.overwrite)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        summary = build_folder(dst, build, overwrite=args.overwrite)
    if counts["empty"]:
        log(f"skipped {counts['empty']:,} conversations that render to no tokens")
    if counts["undecodable"]:
        log(f"{counts['undecodable']:,} conversations had undecodable text (invalid UTF-8 or lone UTF-16 "
            f"surrogates), replaced with U+FFFD (--text-errors strict refuses them)")
    log(summary)
    return summary
