"""Encoded documents staged on disk, so that an interrupted conversion resumes.

Each group of documents an encoder (:mod:`zerobatch.prepare.encoders`) takes is encoded into
a staging file of its own under ``DST.zbconvert/`` (written atomically, named by its place in
the input): its tokens, their document lengths, the largest id, and what else the encoder
keeps per document (source rows, metadata fields, a chat conversation's loss mask) or counts
(``counts``: conversations that render to no tokens, tokens trained on). The staging folder
remembers the encoder's plan (the input files with their sizes and modification times, the
tokenizer or template, the options); a run with another plan starts over, one with the same
plan encodes only the groups not staged yet. Groups are encoded on ``workers`` processes
(:class:`~zerobatch.prepare.workers.WorkerPool`, started only when there are two groups or
more), at most two per worker in flight.
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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from zerobatch.core import xxh3_64  # type: ignore[attr-defined]
from zerobatch.core.io import AtomicFile
from zerobatch.core.remote import is_url
from zerobatch.formats.errors import CorruptError
from zerobatch.prepare.workers import WorkerPool

__all__ = ["PLAN_NAME", "STAGING_SUFFIX", "Progress", "Totals", "stage", "staged_chunks", "staged_meta",
           "staged_rows", "staged_totals", "staging_folder", "write_shard"]

STAGING_SUFFIX = ".zbconvert"
PLAN_NAME = "plan.json"


def staging_folder(dst: str) -> str:
    """Where the encoded documents are staged: ``DST.zbconvert/`` beside a local
    destination; for a URL, a folder named by the URL in the temporary folder (so a rerun
    finds it)."""
    if is_url(dst):
        key = f"{xxh3_64(dst.encode('utf-8')):016x}"
        return os.path.join(tempfile.gettempdir(), f"zerobatch-convert-{key}{STAGING_SUFFIX}")
    return os.path.abspath(dst) + STAGING_SUFFIX


class Progress:
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

    def finish(self) -> None:
        """The bar filled (work no group stood for: blank lines at the end of the input)."""
        if self.bar is not None and self.bar.total:
            self.bar.update(max(0, self.bar.total - self.bar.n))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def shard_path(staging: str, k: int) -> str:
    return os.path.join(staging, f"shard-{k:06d}.npz")


def write_shard(staging: str, k: int, tokens: np.ndarray, lengths: np.ndarray,
                members: Mapping[str, np.ndarray] | None = None, *,
                counts: dict[str, int] | None = None) -> tuple[int, int, int]:
    """Stage group ``k``: ``tokens`` (its documents back to back), ``lengths``, ``members``
    (arrays of the encoder's by name, e.g. ``rows``, ``meta``, ``loss_mask``) and ``counts``,
    written atomically; returns ``(k, tokens, documents)``."""
    buf = io.BytesIO()
    top = np.array([int(tokens.max()) if tokens.size else -1], np.int64)
    extra = dict(members or {})
    if counts is not None:   # JSON text, as every staged member (no pickles in a staged shard)
        extra["counts"] = np.array(json.dumps(counts, sort_keys=True))
    np.savez(buf, tokens=tokens, lengths=lengths, top=top, **extra)  # type: ignore[arg-type]
    with AtomicFile(shard_path(staging, k)) as f:
        f.write(buf.getbuffer())
    return k, int(tokens.size), int(lengths.size)


@dataclass
class Totals:
    """What the staged groups hold: tokens, documents, the largest id (-1: none) and the sum
    of each of their ``counts``."""

    tokens: int = 0
    documents: int = 0
    top: int = -1
    counts: dict[str, int] = field(default_factory=dict)


def _shard_summary(path: str) -> Totals | None:
    """A staged shard's :class:`Totals`, from its small members only (shards are written
    atomically: one under its final name is complete); None when it cannot be read."""
    try:
        with np.load(path, allow_pickle=False) as z:
            lengths, top = z["lengths"], z["top"]
            counts = json.loads(str(z["counts"])) if "counts" in z.files else {}
    except (OSError, ValueError, KeyError, EOFError):
        return None
    if lengths.ndim != 1 or top.shape != (1,) or not isinstance(counts, dict):
        return None
    return Totals(int(lengths.sum()), int(lengths.size), int(top[0]), counts)


def _read_shard(path: str, member: str | None = None) -> tuple[np.ndarray, np.ndarray] | np.ndarray | None:
    """A staged shard's ``(tokens, lengths)`` (``member``: that array instead of the tokens),
    or with ``member`` and no lengths (``rows``, ``meta``) that array alone; None when it
    cannot be read."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if member in ("rows", "meta"):
                return z[member]
            tokens, lengths = z[member or "tokens"], z["lengths"]
    except (OSError, ValueError, KeyError, EOFError):
        return None
    if tokens.ndim != 1 or lengths.ndim != 1 or int(lengths.sum()) != tokens.size:
        return None
    return tokens, lengths


def _start(staging: str, plan: dict[str, Any], log: Callable[[str], None]) -> set[str]:
    """``staging`` made ready for ``plan`` (cleared when it holds another plan's groups);
    the names of the groups staged there."""
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
        with AtomicFile(plan_path) as f:
            f.write(json.dumps(plan, indent=1).encode())
    return {name for name in os.listdir(staging) if name.startswith("shard-") and name.endswith(".npz")}


class _Runner:
    """The encoder's task run on each group: on this process, or on ``workers`` processes
    with at most two groups per worker in flight; ``progress`` advances as groups finish."""

    def __init__(self, encoder: Any, staging: str, workers: int, progress: Progress) -> None:
        self.task, self.progress = encoder.task, progress
        init, initargs = encoder.worker(staging, local=workers < 2)
        self.pool = WorkerPool(workers, init, initargs) if workers > 1 else None
        if self.pool is None:
            init(*initargs)
        self.limit = 2 * workers if self.pool is not None else 0
        self.pending: deque[tuple[Any, int]] = deque()

    def submit(self, k: int, payload: tuple[Any, ...], work: int) -> None:
        res = self.pool.submit(self.task, k, *payload) if self.pool is not None else self.task(k, *payload)
        self.pending.append((res, work))
        self.drain(self.limit)

    def drain(self, limit: int = 0) -> None:
        while len(self.pending) > limit:
            res, work = self.pending.popleft()
            _, ntok, _ = WorkerPool.result(res) if self.pool is not None else res
            self.progress.update(work, ntok)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def stage(encoder: Any, staging: str, *, workers: int, quiet: bool, log: Callable[[str], None]) -> list[str]:
    """The groups of ``encoder`` (:class:`~zerobatch.prepare.encoders.Encoder`) encoded into
    ``staging``, resuming what is there (see the module documentation); returns the staged
    files, in input order."""
    done = _start(staging, encoder.staging_plan(), log)
    source = encoder.source
    progress = Progress(source.total_work, source.unit, quiet, encoder.name)
    paths: list[str] = []
    resumed = 0
    groups = iter(encoder.groups())
    try:
        head = list(itertools.islice(groups, 2))     # one group: no worker processes
        run = _Runner(encoder, staging, workers if len(head) > 1 else 1, progress)
        try:
            for k, (payload, work) in enumerate(itertools.chain(head, groups)):
                path = shard_path(staging, k)
                paths.append(path)
                if os.path.basename(path) in done and _shard_summary(path) is not None:
                    resumed += 1
                    progress.update(work, 0)
                    continue
                run.submit(k, payload, work)
            run.drain()
        finally:
            run.close()
        progress.finish()
    finally:
        progress.close()
    if resumed:
        log(f"resumed: {resumed} of {len(paths)} tokenized groups were already staged in {staging}")
    return paths


def _unreadable(path: str, what: str = "cannot be read") -> CorruptError:
    return CorruptError(f"staging: a staged shard {what}; delete the staging folder and convert again", path=path,
                        field="staging")


def staged_chunks(paths: list[str], stream: str = "tokens") -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(tokens, lengths)`` of every staged group, in order (``stream``: that stream's values
    instead of the tokens, e.g. ``loss_mask``)."""
    for p in paths:
        got = _read_shard(p, None if stream == "tokens" else stream)
        if not isinstance(got, tuple):
            raise _unreadable(p)
        yield got


def staged_rows(paths: list[str]) -> Iterator[int]:
    """The source row of every staged document, in order (``convert --row-ids``)."""
    for p in paths:
        rows = _read_shard(p, "rows")
        if not isinstance(rows, np.ndarray) or rows.ndim != 1:
            raise _unreadable(p, "has no source rows")
        yield from rows.tolist()


def staged_meta(paths: list[str]) -> Iterator[dict[str, Any]]:
    """The fields of every staged document, in order (``convert --metadata-fields``)."""
    for p in paths:
        meta = _read_shard(p, "meta")
        if not isinstance(meta, np.ndarray) or meta.ndim != 1:
            raise _unreadable(p, "has no document fields")
        for text in meta.tolist():
            yield json.loads(text)


def staged_totals(paths: list[str]) -> Totals:
    """The :class:`Totals` of the staged groups (their small members only)."""
    out = Totals()
    for p in paths:
        got = _shard_summary(p)
        if got is None:
            raise _unreadable(p)
        out.tokens, out.documents = out.tokens + got.tokens, out.documents + got.documents
        out.top = max(out.top, got.top)
        for k, v in got.counts.items():
            out.counts[k] = out.counts.get(k, 0) + v
    return out
