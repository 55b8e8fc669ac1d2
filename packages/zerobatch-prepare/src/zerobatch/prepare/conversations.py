"""Conversations to render with a chat template (``convert --chat``): JSONL records or
Parquet rows whose ``field`` (``messages``) is a list of role/content messages.

A :class:`ConversationSource` reads them in order, from whole files or from units of work
(:class:`zerobatch.prepare.tasks.Unit`: a byte range of a JSONL file, row groups of a Parquet
one), each with where it comes from (file and line, or row) for error messages. Undecodable
text (bytes that are not UTF-8, a lone UTF-16 surrogate escaped in JSON) follows
``text_errors`` as text sources do: ``"replace"`` substitutes U+FFFD and counts the
conversation in :attr:`ConversationSource.undecodable`; ``"strict"`` raises a
:class:`~zerobatch.formats.errors.CorruptError` naming the file, line and message.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
import dataclasses
from dataclasses import dataclass
from typing import Any

from zerobatch.formats.errors import ConfigError, CorruptError
from zerobatch.prepare.sources import TEXT_ERRORS, _files, _open_bytes, _open_parquet, json_record, span_lines

__all__ = ["CHAT_PATTERNS", "ConversationSource"]

#: The files of a folder (or glob) that hold conversations.
CHAT_PATTERNS = ("*.jsonl", "*.jsonl.gz", "*.ndjson", "*.json", "*.parquet")
#: ``(where, messages, work)``: a conversation, where it is, the input bytes read for it.
Record = tuple[str, Any, int]


@dataclass
class ConversationSource:
    """The conversations of ``paths`` (files, folders or globs, in order), or of ``units``
    (parts of them); :meth:`groups` yields them ``size`` at a time with the input bytes each
    group stands for (progress in :attr:`unit` out of :attr:`total_work`)."""

    paths: list[str]
    field: str = "messages"
    text_errors: str = "replace"
    units: list[Any] | None = None
    kind: str = "chat"
    unit: str = "B"
    #: conversations with undecodable text (replaced with U+FFFD), counted as they are read
    undecodable: int = 0
    parts: list[tuple[str, Any, int]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.text_errors not in TEXT_ERRORS:
            raise ConfigError(f"--text-errors must be one of {TEXT_ERRORS}, got {self.text_errors!r}",
                              field="text_errors")
        self.parts = _parts(self.paths, self.units)

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(path for path, _, _ in self.parts))

    @property
    def total_work(self) -> int:
        return sum(size for _, _, size in self.parts)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the input: file names, sizes, modification times, parts, options."""
        return {"kind": self.kind, "field": self.field, "text_errors": self.text_errors,
                "parts": [[os.path.abspath(p), None if span is None else list(span), os.path.getsize(p),
                           os.stat(p).st_mtime_ns] for p, span, _ in self.parts]}

    def groups(self, size: int) -> Iterator[tuple[list[Record], int]]:
        """The conversations in groups of ``size`` and the input bytes each group read."""
        group: list[Record] = []
        for record in self.records():
            group.append(record)
            if len(group) == size:
                yield group, sum(r[2] for r in group)
                group = []
        if group:
            yield group, sum(r[2] for r in group)

    def records(self) -> Iterator[Record]:
        """Every conversation, in order (counting :attr:`undecodable` from zero)."""
        self.undecodable = 0
        for path, span, size in self.parts:
            if path.lower().endswith(".parquet"):
                yield from self._parquet(path, span, size)
            else:
                yield from self._jsonl(path, span)

    def _cleaned(self, messages: Any, path: str, where: str, bad: bool) -> Any:
        fixed, replaced = _clean_text(messages)
        if replaced and self.text_errors == "strict":
            at = next((i for i, m in enumerate(messages) if _clean_text(m)[1]), None) \
                if isinstance(messages, list) else None
            raise CorruptError(f"{where}: {'' if at is None else f'message {at}: '}holds a lone UTF-16 surrogate "
                               f"(an escape such as \\ud83d without its pair); --text-errors replace substitutes "
                               f"U+FFFD", path=path, field=where.split(" after ")[0])
        if replaced or bad:
            self.undecodable += 1
        return fixed

    def _parquet(self, path: str, span: tuple[int, int] | None, size: int) -> Iterator[Record]:
        name = os.path.basename(path)
        after = "" if span is None else f" of row groups {span[0]}-{span[1] - 1}"
        with _open_parquet(path) as pf:
            if self.field not in pf.schema_arrow.names:
                raise CorruptError(f"parquet: no column {self.field!r} (a list of messages; choose it with --field; "
                                   f"columns: {pf.schema_arrow.names})", path=path, field=self.field)
            groups = None if span is None else list(range(*span))
            rows = (pf.metadata.num_rows if groups is None else
                    sum(pf.metadata.row_group(g).num_rows for g in groups))
            row = done = 0
            for batch in pf.iter_batches(batch_size=1024, columns=[self.field], row_groups=groups):
                for messages in batch.column(0).to_pylist():
                    row += 1
                    work, done = size * row // max(rows, 1) - done, size * row // max(rows, 1)
                    where = f"row {row}{after}"
                    yield f"{name} {where}", self._cleaned(messages, path, where, False), work

    def _jsonl(self, path: str, span: tuple[int, int] | None) -> Iterator[Record]:
        name = os.path.basename(path)
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
                line, bad = self._decode(raw, path, where, lineno)
                if lineno == 1 and line.startswith("\ufeff"):
                    line = line[1:]                      # a byte-order mark
                obj = json_record(line, path, where, self.field, "a list of messages; choose it with --field")
                yield f"{name} {where}", self._cleaned(obj[self.field], path, where, bad), carry
                carry = 0

    def _decode(self, raw: bytes, path: str, where: str, lineno: int) -> tuple[str, bool]:
        try:
            return raw.decode("utf-8"), False
        except UnicodeDecodeError as exc:
            if self.text_errors == "strict":
                raise CorruptError(f"{where}: byte {exc.start} of it is not UTF-8 ({exc.reason}); "
                                   f"--text-errors replace substitutes U+FFFD", path=path,
                                   field=f"line {lineno}") from None
            return raw.decode("utf-8", "replace"), True


def _parts(paths: list[str], units: list[Any] | None) -> list[tuple[str, Any, int]]:
    """``(file, span, bytes)`` of what a source reads: each file of ``paths`` whole, or each
    of ``units``; ``bytes`` is its share of the input, the progress it stands for."""
    parts = ([(u.file, u.span) for u in units] if units is not None else
             [(path, None) for src in paths for path in _files(src, CHAT_PATTERNS)])
    out = []
    for path, span in parts:
        size = os.path.getsize(path)
        if span is not None and path.lower().endswith(".parquet"):
            with _open_parquet(path) as pf:
                rows = sum(pf.metadata.row_group(g).num_rows for g in range(*span))
                size = size * rows // max(pf.metadata.num_rows, 1)
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
