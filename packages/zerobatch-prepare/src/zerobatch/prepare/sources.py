"""Inputs of ``zerobatch convert``: text corpora to tokenize, and token files made for other
trainers.

Every source is read as *documents*. Text sources (plain text, JSONL, Parquet, a Hugging
Face dataset saved with ``save_to_disk``) yield groups of document strings, tokenized later;
token sources (``.npy``, nanoGPT's flat ``.bin``, Megatron's ``.bin`` + ``.idx``) yield
``(tokens, lengths)`` chunks straight from a memory map: ``tokens`` is the documents'
ids concatenated, ``lengths`` the tokens of each document.

A damaged or unexpected input raises a :class:`~zerobatch.formats.errors.ZerobatchError`
naming the file and the field (a JSON line that does not parse names its line number).

Text that cannot be decoded (bytes that are not UTF-8, or a lone UTF-16 surrogate escaped in
JSON, as JavaScript tools write) follows ``text_errors``: ``"replace"`` (the default: each bad
sequence becomes U+FFFD and the document is counted in :attr:`TextSource.undecodable`) or
``"strict"`` (a :class:`~zerobatch.formats.errors.CorruptError` naming the file and line).
Empty and null documents are skipped and counted in :attr:`TextSource.empty`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import gzip
import io
import json
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from zerobatch.formats.errors import ConfigError, CorruptError, NotFoundError, TruncatedError, ZerobatchError

if TYPE_CHECKING:
    from pyarrow.parquet import ParquetFile

__all__ = [
    "TEXT_KINDS",
    "TOKEN_KINDS",
    "MixedTextSource",
    "TextSource",
    "TokenSource",
    "DatasetSource",
    "detect_kind",
    "documents",
    "open_documents",
    "open_source",
    "open_sources",
]

TEXT_KINDS = ("text", "jsonl", "parquet", "hf")
TEXT_ERRORS = ("replace", "strict")
TOKEN_KINDS = ("npy", "nanogpt", "megatron", "zerobatch")

#: Megatron's MMapIndexedDataset index: magic, version 1, dtype codes.
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
#: llm.c / modded-nanogpt token files: a 256 x int32 header ``(magic, version, tokens, 0...)``,
#: then the tokens. ``(magic, version) -> token type``: GPT-2 (uint16), LLaMA 3 (uint32).
LLMC_HEADER_BYTES = 1024
LLMC_KINDS = {(20240520, 1): np.uint16, (20240801, 7): np.uint32}
#: Tokens per chunk a token source yields (bounded memory whatever the file size).
CHUNK_TOKENS = 1 << 22


#: Words of a file name that say which split of a dataset it holds.
SPLIT_WORDS = {"train": "train", "training": "train", "val": "validation", "valid": "validation",
               "validation": "validation", "dev": "validation", "test": "test", "eval": "validation"}


def _dataset_folder(folder: str) -> str | None:
    """The zerobatch format whose marker files ``folder`` holds (its own files are never a
    source to convert: a TOKSTREAM's ``tokens.bin`` is not a nanoGPT file)."""
    from zerobatch.formats import registry

    try:
        names = set(os.listdir(folder))
    except OSError:
        return None
    if "shard.json" in names:       # a TOKSTREAM shard (of a dataset, or of one being written)
        return "TOKSTREAM shard"
    fmt = registry.identify(folder_files=names)
    return None if fmt is None else fmt.title


def _split_of(path: str) -> str | None:
    words = [w for w in re.split(r"[^a-z]+", os.path.basename(path).lower()) if w]
    found = {SPLIT_WORDS[w] for w in words if w in SPLIT_WORDS}
    return found.pop() if len(found) == 1 else None


def _files(path: str, patterns: tuple[str, ...]) -> list[str]:
    """``path`` itself, or the files of folder ``path`` matching ``patterns`` (in it and its
    subfolders, zerobatch datasets aside), sorted.

    Raises:
        ConfigError: ``path`` is a zerobatch dataset, or a folder whose files belong to
            several splits (``train.bin`` and ``val.bin``): name the files to convert.
    """
    if any(ch in path for ch in "*?["):
        found = sorted(glob.glob(path))
    elif os.path.isdir(path):
        title = _dataset_folder(path)
        if title is not None:
            raise ConfigError(f"source: this folder is a {title} dataset, not a source to convert", path=path,
                              field="source")
        found = []
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if _dataset_folder(os.path.join(root, d)) is None)
            found += [os.path.join(root, n) for n in names if any(fnmatch.fnmatch(n, pat) for pat in patterns)]
        found.sort()
        splits = sorted({s for s in map(_split_of, found) if s is not None})
        if len(splits) > 1:
            shown = ", ".join(os.path.relpath(p, path) for p in found[:6]) + (", ..." if len(found) > 6 else "")
            raise ConfigError(f"source: the folder holds files of several splits ({', '.join(splits)}: {shown}); "
                              f"name the files to convert (a file or a glob such as {os.path.join(path, '*train*')})",
                              path=path, field="source")
    elif os.path.exists(path):
        found = [path]
    else:
        raise NotFoundError("source: no such file or folder", path=path, field="source")
    found = [p for p in found if os.path.isfile(p)]
    if not found:
        raise NotFoundError(f"source: no input files (looked for {', '.join(patterns)})", path=path, field="source")
    return found


def _is_dataset(path: str) -> bool:
    """Whether ``path`` is a zerobatch dataset (a file by its magic, a folder by its files)."""
    from zerobatch.formats import registry

    if os.path.isdir(path):
        return _dataset_folder(path) not in (None, "TOKSTREAM shard")
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return False
    return registry.identify(head=head) is not None


def detect_kind(path: str) -> str:
    """The source kind of ``path`` from its name and contents (``--from`` overrides it)."""
    p = path.rstrip("/")
    low = p.lower()
    if _is_dataset(p):
        return "zerobatch"
    if os.path.isdir(p):
        if os.path.exists(os.path.join(p, "state.json")) or os.path.exists(os.path.join(p, "dataset_dict.json")):
            return "hf"
        names = os.listdir(p)
        low_names = [n.lower() for n in names]
        if any(n.endswith(".parquet") for n in low_names) and \
                any(n.endswith((".jsonl", ".jsonl.gz", ".ndjson")) for n in low_names):
            return "mixed"               # records of both kinds: every file, in name order
        for ext, kind in ((".parquet", "parquet"), (".jsonl", "jsonl"), (".jsonl.gz", "jsonl"), (".txt", "text"),
                          (".npy", "npy")):
            if any(n.lower().endswith(ext) for n in names):
                return kind
        if any(n.lower().endswith(".bin") for n in names):
            if any(n.lower().endswith(".idx") for n in names):
                raise ConfigError("source: a folder of Megatron files; name one prefix (PATH/name or name.bin)",
                                  path=p, field="source")
            return "nanogpt"
        raise ConfigError("source: cannot tell the kind of this folder's files; give --from", path=p, field="from")
    if low.endswith((".jsonl", ".jsonl.gz", ".json", ".ndjson")):
        return "jsonl"
    if low.endswith(".parquet"):
        return "parquet"
    if low.endswith(".npy"):
        return "npy"
    if low.endswith(".idx"):
        return "megatron"
    if low.endswith(".bin"):
        return "megatron" if os.path.exists(p[:-4] + ".idx") else "nanogpt"
    if low.endswith((".txt", ".txt.gz", ".md")):
        return "text"
    if not os.path.exists(p) and not any(ch in p for ch in "*?["):
        if os.path.isfile(p + ".bin") and os.path.isfile(p + ".idx"):
            return "megatron"            # a Megatron prefix: PREFIX.bin + PREFIX.idx
        raise NotFoundError("source: no such file or folder", path=p, field="source")
    raise ConfigError("source: cannot tell the kind of this file from its name; give --from", path=p, field="from")


def _open_bytes(path: str) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")  # noqa: SIM115


def json_record(raw: str | bytes, path: str, where: str, field: str, hint: str) -> dict[str, Any]:
    """The JSON object of one JSONL line, holding ``field``.

    Raises:
        CorruptError: not JSON, or not an object with ``field`` (``where``: the line; ``hint``:
            what to do about a missing field).
    """
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise CorruptError(f"{where}: not valid JSON ({getattr(exc, 'msg', exc)})", path=path,
                           field=where.split(" after ")[0]) from None
    if not isinstance(obj, dict) or field not in obj:
        raise CorruptError(f"{where}: no field {field!r} ({hint})", path=path, field=field)
    return obj


def span_lines(f: io.BufferedIOBase, span: tuple[int, int] | None) -> Iterator[bytes]:
    """The lines of ``f`` (each with its ending), or with ``span`` the lines that start
    in bytes ``[a, b)`` of it (a line that starts before ``a`` belongs to the span before)."""
    if span is None:
        yield from f
        return
    a, b = span
    if a:
        f.seek(a - 1)
        if f.read(1) != b"\n":
            f.readline()              # the rest of a line that started in the span before
    pos = f.tell()
    while pos < b:
        raw = f.readline()
        if not raw:
            return
        pos += len(raw)
        yield raw


def _lines(lines: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a binary file (or of a span of it) with their endings, split on ``\n``,
    ``\r\n`` and ``\r`` (Python's universal newlines)."""
    for raw in lines:
        if b"\r" in raw:
            yield from raw.splitlines(keepends=True)
        else:
            yield raw


def _has_surrogates(text: str) -> bool:
    """Whether ``text`` holds a lone UTF-16 surrogate (JSON's ``\\ud83d`` without its pair)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


@dataclass
class TextSource:
    """Documents as strings, in a fixed order, grouped ``docs_per_shard`` at a time.

    ``shards()`` yields ``(texts, work)``: ``work`` is the progress the group stands for,
    in :attr:`unit` (input bytes, or rows for Parquet) out of :attr:`total_work`.
    """

    kind: str
    path: str
    text_field: str = "text"
    split: str = "file"
    hf_split: str = "train"
    docs_per_shard: int = 1024
    text_errors: str = "replace"
    files: list[str] = field(default_factory=list)
    unit: str = "B"
    total_work: int = 0
    #: documents with undecodable text (replaced with U+FFFD), counted by :meth:`shards`
    undecodable: int = 0
    #: empty or null documents, skipped, counted by :meth:`shards`
    empty: int = 0
    #: a part of the one file in :attr:`files` (a distributed task's unit, see
    #: :mod:`zerobatch.prepare.tasks`): bytes ``[a, b)`` of a JSONL or line-split text file (the
    #: lines that start in it), or row groups ``[a, b)`` of a Parquet file; None: every file whole
    span: tuple[int, int] | None = None
    #: fields of each JSONL record (columns of Parquet / HF rows) kept as the document's
    #: metadata (``convert --metadata-fields``); a missing one is None
    meta_fields: tuple[str, ...] = ()
    _meta: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.docs_per_shard < 1:
            raise ConfigError("--docs-per-shard must be at least 1", field="docs_per_shard")
        if self.text_errors not in TEXT_ERRORS:
            raise ConfigError(f"--text-errors must be one of {TEXT_ERRORS}, got {self.text_errors!r}",
                              field="text_errors")
        if self.kind == "text":
            if self.split not in ("file", "line", "blank"):
                raise ConfigError(f"--split must be file, line or blank, got {self.split!r}", field="split")
            self.files = _files(self.path, ("*.txt", "*.txt.gz", "*.md"))
        elif self.kind == "jsonl":
            self.files = _files(self.path, ("*.jsonl", "*.jsonl.gz", "*.ndjson", "*.json"))
        elif self.kind == "parquet":
            self.files = _files(self.path, ("*.parquet",))
            self.unit = "rows"
        elif self.kind == "hf":
            self.files = self._hf_files()
        else:
            raise ConfigError(f"--from: {self.kind!r} is not a text source", field="from")
        if self.meta_fields and self.kind == "text":
            raise ConfigError("--metadata-fields: plain text has no fields (JSONL, Parquet and HF rows do)",
                              path=self.path, field="metadata_fields")
        if self.kind == "parquet":
            total = 0
            for f in self.files:
                with _open_parquet(f) as pf:
                    total += pf.metadata.num_rows
            self.total_work = total
        else:
            self.total_work = sum(os.path.getsize(f) for f in self.files)

    def parts(self) -> list[TextSource]:
        """The sources of one kind this one reads in turn (itself; a
        :class:`MixedTextSource` its parts)."""
        return [self]

    def part_of(self, path: str) -> TextSource:
        """The source of one kind that reads file ``path`` (one of :attr:`files`)."""
        for part in self.parts():
            if path in part.files:
                return part
        raise ConfigError(f"source: {path} is not one of this source's files", path=path, field="source")

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the input: file names, sizes and modification times."""
        return {"kind": self.kind, "field": self.text_field, "split": self.split, "hf_split": self.hf_split,
                "docs_per_shard": self.docs_per_shard, "text_errors": self.text_errors,
                "files": [[os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in self.files]}

    # ---------------------------------------------------------------------------------

    def _hf_files(self) -> list[str]:
        folder = self.path
        dd = os.path.join(folder, "dataset_dict.json")
        if os.path.exists(dd):
            try:
                splits = json.loads(open(dd, encoding="utf-8").read())["splits"]
            except (ValueError, KeyError, TypeError):
                raise CorruptError("dataset_dict.json: no list of splits", path=dd, field="splits") from None
            if self.hf_split not in splits:
                raise ConfigError(f"--hf-split: {self.hf_split!r} is not one of {splits}", path=dd, field="hf_split")
            folder = os.path.join(folder, self.hf_split)
        state = os.path.join(folder, "state.json")
        try:
            with open(state, encoding="utf-8") as f:
                files = [d["filename"] for d in json.load(f)["_data_files"]]
        except FileNotFoundError:
            raise NotFoundError("state.json: not a dataset saved with save_to_disk", path=state,
                                field="state.json") from None
        except (ValueError, KeyError, TypeError):
            raise CorruptError("state.json: no _data_files list of filenames", path=state,
                               field="_data_files") from None
        out = []
        for name in files:
            if not isinstance(name, str) or os.path.isabs(name) or ".." in name.split("/"):
                raise CorruptError(f"_data_files: bad file name {name!r}", path=state, field="_data_files")
            p = os.path.join(folder, name)
            if not os.path.isfile(p):
                raise NotFoundError(f"_data_files: {name} is missing", path=p, field="_data_files")
            out.append(p)
        if not out:
            raise CorruptError("_data_files: the dataset lists no data files", path=state, field="_data_files")
        return out

    def _documents(self) -> Iterator[tuple[str | None, int, bool]]:
        """``(text, work, undecodable)`` per document, ``work`` the progress made since the
        previous one; ``text`` is None for progress alone (blank lines), ``""`` for an empty
        or null document."""
        if self.kind == "text":
            yield from self._text_documents()
        elif self.kind == "jsonl":
            yield from self._jsonl_documents()
        else:
            for text, work in self._arrow_documents():
                yield text, work, False

    def _decode(self, raw: bytes, path: str, lineno: int | None) -> tuple[str, bool]:
        """``raw`` as UTF-8, and whether it needed replacements (``text_errors``)."""
        try:
            return raw.decode("utf-8"), False
        except UnicodeDecodeError as exc:
            if self.text_errors == "strict":
                where = "the file" if lineno is None else f"line {lineno}"
                raise CorruptError(f"{where}: byte {exc.start} of it is not UTF-8 ({exc.reason}); "
                                   f"--text-errors replace substitutes U+FFFD", path=path,
                                   field="text" if lineno is None else f"line {lineno}") from None
            return raw.decode("utf-8", "replace"), True

    def _raw_lines(self, f: io.BufferedIOBase) -> Iterator[bytes]:
        return span_lines(f, self.span)

    def _text_documents(self) -> Iterator[tuple[str | None, int, bool]]:
        for path in self.files:
            size = os.path.getsize(path)
            with _open_bytes(path) as f:
                if self.split == "file":
                    text, bad = self._decode(f.read(), path, None)
                    yield text, size, bad
                    continue
                done = 0
                para: list[str] = []
                para_bad = False
                for lineno, raw in enumerate(_lines(self._raw_lines(f)), 1):
                    done += len(raw)
                    line, bad = self._decode(raw, path, lineno)
                    if self.split == "line":
                        s = line.rstrip("\r\n")
                        if s:
                            yield s, done, bad
                            done = 0
                    elif line.strip():
                        para.append(line)
                        para_bad |= bad
                    elif para:   # a block: its lines, without the newline that ends it
                        yield "".join(para).rstrip("\r\n"), done, para_bad
                        para, done, para_bad = [], 0, False
                if para:
                    yield "".join(para).rstrip("\r\n"), done, para_bad
                    done = 0
                if done:
                    yield None, done, False   # progress only: trailing empty lines

    def _jsonl_documents(self) -> Iterator[tuple[str | None, int, bool]]:
        for path in self.files:
            with _open_bytes(path) as f:
                for lineno, raw in enumerate(self._raw_lines(f), 1):
                    work = len(raw)
                    line, bad = self._decode(raw, path, lineno)
                    if not line.strip():
                        yield None, work, False
                        continue
                    obj = json_record(line, path, f"line {lineno}", self.text_field, "choose one with --field")
                    text = obj[self.text_field]
                    if self.meta_fields:
                        self._meta = {f: obj.get(f) for f in self.meta_fields}
                    if text is None:
                        text = ""
                    if not isinstance(text, str):
                        raise CorruptError(f"line {lineno}: field {self.text_field!r} is not a string",
                                           path=path, field=self.text_field)
                    if _has_surrogates(text):
                        if self.text_errors == "strict":
                            raise CorruptError(f"line {lineno}: field {self.text_field!r} holds a lone UTF-16 "
                                               f"surrogate (an escape such as \\ud83d without its pair); "
                                               f"--text-errors replace substitutes U+FFFD", path=path,
                                               field=f"line {lineno}")
                        # pairs recombine, lone halves become U+FFFD
                        text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
                        bad = True
                    yield text, work, bad

    def _arrow_documents(self) -> Iterator[tuple[str, int]]:
        for path in self.files:
            if self.kind == "parquet":
                with _open_parquet(path) as pf:
                    if self.text_field not in pf.schema_arrow.names:
                        raise ConfigError(f"--field: no column {self.text_field!r} (columns: "
                                          f"{pf.schema_arrow.names})", path=path, field=self.text_field)
                    groups = None if self.span is None else list(range(*self.span))
                    extra = [f for f in self.meta_fields if f != self.text_field]
                    missing = [f for f in extra if f not in pf.schema_arrow.names]
                    if missing:
                        raise ConfigError(f"--metadata-fields: no column {missing[0]!r} (columns: "
                                          f"{pf.schema_arrow.names})", path=path, field="metadata_fields")
                    batches = pf.iter_batches(batch_size=4096, columns=[self.text_field, *extra], row_groups=groups)
                    for b in batches:
                        cols = {f: b.column(f).to_pylist() for f in self.meta_fields}
                        for i, text in enumerate(b.column(0).to_pylist()):
                            if self.meta_fields:
                                self._meta = {f: cols[f][i] for f in self.meta_fields}
                            yield text or "", 1
            else:
                import pyarrow as pa

                size = os.path.getsize(path)
                try:
                    with pa.memory_map(path) as src:
                        reader = pa.ipc.open_stream(src)
                        if self.text_field not in reader.schema.names:
                            raise ConfigError(f"--field: no column {self.text_field!r} (columns: "
                                              f"{reader.schema.names})", path=path, field=self.text_field)
                        col = reader.schema.get_field_index(self.text_field)
                        missing = [f for f in self.meta_fields if f not in reader.schema.names]
                        if missing:
                            raise ConfigError(f"--metadata-fields: no column {missing[0]!r} (columns: "
                                              f"{reader.schema.names})", path=path, field="metadata_fields")
                        first = True
                        for b in reader:
                            cols = {f: b.column(b.schema.get_field_index(f)).to_pylist() for f in self.meta_fields}
                            for i, text in enumerate(b.column(col).to_pylist()):
                                if self.meta_fields:
                                    self._meta = {f: cols[f][i] for f in self.meta_fields}
                                yield text or "", size if first else 0
                                first = False
                except ConfigError:
                    raise
                except Exception as exc:
                    raise CorruptError(f"arrow: {exc}", path=path, field="arrow") from None

    def shards(self) -> Iterator[tuple[list[str], int]]:
        """Groups of ``docs_per_shard`` non-empty documents and the work they stand for
        (counting :attr:`undecodable` and :attr:`empty` documents from zero)."""
        for texts, work, _, _ in self.shards_with_rows():
            yield texts, work

    def shards_with_rows(self) -> Iterator[tuple[list[str], int, list[int], list[dict[str, Any]] | None]]:
        """:meth:`shards` with each document's source row (its place among the source's
        documents, empty and null ones included, file after file, in order) and, with
        :attr:`meta_fields`, its fields (else None)."""
        texts: list[str] = []
        rows: list[int] = []
        metas: list[dict[str, Any]] = []
        work = 0
        row = 0
        self.undecodable = self.empty = 0
        for text, w, bad in self._documents():
            work += w
            self.undecodable += bad
            if text is None:
                continue
            if not text:
                self.empty += 1
            else:
                texts.append(text)
                rows.append(row)
                if self.meta_fields:
                    metas.append(dict(self._meta or {}))
                if len(texts) == self.docs_per_shard:
                    yield texts, work, rows, metas if self.meta_fields else None
                    texts, rows, metas, work = [], [], [], 0
            row += 1
        if texts or work:
            yield texts, work, rows, metas if self.meta_fields else None


@dataclass
class MixedTextSource(TextSource):
    """Text sources of several kinds (JSONL, Parquet, plain text, HF rows) read as one, part
    after part: ``convert a.jsonl b.parquet docs/ DST``, or a folder holding JSONL and Parquet
    files (each file a part, in name order).

    Every option (``text_field``, ``meta_fields``, ...) applies to every part. Progress is
    counted in input bytes: a Parquet part's rows count as its file's bytes, spread evenly.
    """

    members: list[TextSource] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.members:
            raise ConfigError("source: no input given", field="source")
        self.kind, self.unit = "mixed", "B"
        seen: dict[str, str] = {}
        for part in self.members:
            for f in part.files:
                key = os.path.realpath(f)
                if key in seen:
                    raise ConfigError(f"source: {f} is given twice (also as {seen[key]}); each input is read once",
                                      path=f, field="source")
                seen[key] = f
        self.files = [f for part in self.members for f in part.files]
        self.meta_fields = self.members[0].meta_fields
        self.total_work = sum(self._bytes(part) for part in self.members)

    @staticmethod
    def _bytes(part: TextSource) -> int:
        return sum(os.path.getsize(f) for f in part.files) if part.unit == "rows" else part.total_work

    def parts(self) -> list[TextSource]:
        return list(self.members)

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "mixed", "parts": [part.fingerprint() for part in self.members]}

    def _documents(self) -> Iterator[tuple[str | None, int, bool]]:
        for part in self.members:
            # rows of Parquet counted as bytes of its files: the running total scaled, so the
            # part adds up to its bytes exactly
            scale = self._bytes(part) / part.total_work if part.unit == "rows" and part.total_work else 1.0
            done = given = 0
            for text, work, bad in part._documents():
                done += work
                step = round(done * scale) - given
                given += step
                self._meta = part._meta
                yield text, step, bad


def open_sources(paths: str | os.PathLike[str] | list[Any], kind: str | None,
                 **options: Any) -> TextSource | TokenSource | DatasetSource:
    """The source of ``paths``: one path as :func:`open_source` reads it; several text
    sources (of any kinds) as one :class:`MixedTextSource`, read in the order given.

    Raises:
        ConfigError: several paths of which one is not a text source (token files and
            zerobatch datasets convert one at a time).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise ConfigError("source: no input given", field="source")
    if len(paths) == 1:
        return open_source(paths[0], kind, **options)
    parts: list[TextSource] = []
    for p in paths:
        src = open_source(p, kind, **options)
        if not isinstance(src, TextSource):
            raise ConfigError(f"source: several inputs combine only as text to tokenize (JSONL, Parquet, text, HF); "
                              f"this {src.kind} source converts on its own", path=p, field="source")
        parts += src.parts()
    return MixedTextSource("mixed", " ".join(paths), members=parts, **_text_options(options))


def _text_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items()
            if k in ("text_field", "split", "hf_split", "docs_per_shard", "text_errors", "meta_fields")}


@contextlib.contextmanager
def _open_parquet(path: str) -> Iterator[ParquetFile]:
    """``path`` opened with pyarrow, for the reads of the ``with`` block: the one way every
    Parquet input (text or chat, whole or by row groups) is opened.

    Raises:
        ConfigError: pyarrow is not installed.
        CorruptError: pyarrow cannot open or read the file (its own exception types, turned into
            one naming the file); zerobatch's own errors raised in the block pass as they are.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("reading Parquet needs pyarrow: pip install 'zerobatch-prepare[parquet]'",
                          field="from") from None
    try:
        yield pq.ParquetFile(path)
    except ZerobatchError:
        raise
    except Exception as exc:  # pyarrow's own errors for damaged files
        raise CorruptError(f"parquet: {exc}", path=path, field="parquet") from None


# --------------------------------------------------------------------------------------------
# Token sources


@dataclass
class TokenSource:
    """Token files: ``chunks()`` yields ``(tokens, lengths)`` in bounded pieces."""

    kind: str
    path: str
    dtype: str | None = None
    eod: int | None = None
    files: list[str] = field(default_factory=list)
    num_tokens: int = 0
    max_token: int | None = None
    #: whether every document's end is known (False: a flat stream without ``eod``)
    has_boundaries: bool = True
    _arrays: list[np.ndarray] = field(default_factory=list)
    _doc_lengths: list[np.ndarray | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind == "npy":
            self.files = _files(self.path, ("*.npy",))
            for f in self.files:
                self._add_npy(f)
        elif self.kind == "nanogpt":
            self.files = _files(self.path, ("*.bin",))
            dt = np.dtype(self.dtype or "uint16")
            if dt not in (np.uint16, np.uint32):
                raise ConfigError(f"--dtype: nanoGPT files hold uint16 or uint32, got {dt}", field="dtype")
            for f in self.files:
                size = os.path.getsize(f)
                llmc = _llmc_header(f, size)
                if llmc is not None:        # llm.c / modded-nanogpt: the header says type and count
                    ldt, count = llmc
                    self._add(np.memmap(f, dtype=ldt, mode="r", offset=LLMC_HEADER_BYTES, shape=(count,))
                              if count else np.zeros(0, ldt), None)
                    continue
                if size % dt.itemsize:
                    raise TruncatedError(f"file: {size} bytes is not a whole number of {dt} tokens (wrong --dtype?)",
                                         path=f, field="file")
                self._add(np.memmap(f, dtype=dt, mode="r") if size else np.zeros(0, dt), None)
        elif self.kind == "megatron":
            prefix = self.path[:-4] if self.path.endswith((".bin", ".idx")) else self.path
            self.files = [prefix + ".bin", prefix + ".idx"]
            self._add_megatron(prefix)
        else:
            raise ConfigError(f"--from: {self.kind!r} is not a token source", field="from")
        self.num_tokens = sum(int(a.size) for a in self._arrays)
        self.has_boundaries = self.eod is not None or all(n is not None for n in self._doc_lengths)

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "eod": self.eod,
                "files": [[os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in self.files]}

    def _add(self, tokens: np.ndarray, lengths: np.ndarray | None) -> None:
        if tokens.dtype.kind not in "iu":
            raise ConfigError(f"tokens: expected integer token ids, got {tokens.dtype}", path=self.path, field="dtype")
        self._arrays.append(tokens)
        self._doc_lengths.append(lengths)

    def _add_npy(self, path: str) -> None:
        try:
            with open(path, "rb") as f:
                magic = f.read(6)
        except OSError as exc:
            raise CorruptError(f"npy: cannot read the file ({exc.strerror})", path=path, field="npy") from None
        if magic != b"\x93NUMPY":
            raise CorruptError(f"npy: not a .npy file (it starts with {magic!r}, not the .npy magic b'\\x93NUMPY')",
                               path=path, field="magic")
        try:
            a = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise CorruptError(f"npy: {exc}", path=path, field="npy") from None
        except OSError as exc:
            raise CorruptError(f"npy: not a readable .npy file ({exc})", path=path, field="npy") from None
        if a.dtype.kind not in "iu":
            raise ConfigError(f"dtype: expected integer token ids, got {a.dtype}", path=path, field="dtype")
        if a.ndim == 1:
            self._add(a, None)
        elif a.ndim == 2:   # one document per row
            self._add(a.reshape(-1), np.full(a.shape[0], a.shape[1], np.int64))
        else:
            raise ConfigError(f"shape: expected a 1-D stream or a 2-D [documents, length] array, got {a.shape}",
                              path=path, field="shape")

    def _add_megatron(self, prefix: str) -> None:
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise NotFoundError("megatron: the .bin and .idx files must both exist", path=p, field="file")
        size = os.path.getsize(idx_path)
        head_size = len(MEGATRON_MAGIC) + 8 + 1 + 8 + 8
        with open(idx_path, "rb") as f:
            head = f.read(head_size)
        if len(head) < head_size:
            raise TruncatedError(f"header: {len(head)} bytes, the index header needs {head_size}", path=idx_path,
                                 field="header")
        if head[:9] != MEGATRON_MAGIC:
            raise CorruptError(f"magic: {head[:9]!r} is not a Megatron index", path=idx_path, field="magic")
        version, code, nseq, ndoc = struct.unpack_from("<QBQQ", head, 9)
        if version != 1:
            raise CorruptError(f"version: {version} (only version 1 is known)", path=idx_path, field="version")
        if code not in MEGATRON_DTYPES:
            raise CorruptError(f"dtype: code {code} is not an integer token type", path=idx_path, field="dtype")
        dt = np.dtype(MEGATRON_DTYPES[code])
        # sequence lengths int32, pointers int64, document indices int64 (division form: no overflow)
        if nseq > (size - head_size) // 12 or ndoc > (size - head_size - 12 * nseq) // 8:
            raise TruncatedError(f"counts: {nseq} sequences and {ndoc} document indices do not fit in "
                                 f"{size} bytes", path=idx_path, field="counts")
        mm = np.memmap(idx_path, dtype=np.uint8, mode="r")
        seq_len = np.frombuffer(mm, "<i4", nseq, head_size)
        pointers = np.frombuffer(mm, "<i8", nseq, head_size + 4 * nseq)
        doc_idx = np.frombuffer(mm, "<i8", ndoc, head_size + 12 * nseq)
        bin_size = os.path.getsize(bin_path)
        if bin_size % dt.itemsize:
            raise TruncatedError(f"file: {bin_size} bytes is not a whole number of {dt} tokens", path=bin_path,
                                 field="file")
        if nseq:
            if int(seq_len.min()) < 0:
                raise CorruptError("sizes: a negative sequence length", path=idx_path, field="sizes")
            want = np.concatenate([[0], np.cumsum(seq_len.astype(np.int64)[:-1] * dt.itemsize)])
            if not np.array_equal(pointers, want):
                bad = int(np.flatnonzero(pointers != want)[0])
                raise CorruptError(f"pointers: sequence {bad} does not start where the previous one ends",
                                   path=idx_path, field="pointers")
        total = int(seq_len.astype(np.int64).sum()) if nseq else 0
        if total * dt.itemsize != bin_size:
            raise (TruncatedError if total * dt.itemsize > bin_size else CorruptError)(
                f"file: the index describes {total} tokens ({total * dt.itemsize} bytes), the file holds "
                f"{bin_size} bytes", path=bin_path, field="file")
        if ndoc == 0 or int(doc_idx[0]) != 0 or int(doc_idx[-1]) != nseq or np.any(np.diff(doc_idx) < 0):
            raise CorruptError(f"document_indices: must rise from 0 to the {nseq} sequences", path=idx_path,
                               field="document_indices")
        cum = np.concatenate([[0], np.cumsum(seq_len, dtype=np.int64)])
        lengths = np.diff(cum[doc_idx])
        tokens = np.memmap(bin_path, dtype=dt, mode="r") if bin_size else np.zeros(0, dt)
        self._add(tokens, lengths[lengths > 0])

    def scan_max(self) -> int:
        """The largest token id (one pass over the data, cached); -1 when there are none."""
        if self.max_token is None:
            top = -1
            for a in self._arrays:
                for s in range(0, a.size, CHUNK_TOKENS):
                    piece = a[s:s + CHUNK_TOKENS]
                    if piece.size:
                        if int(piece.min()) < 0:
                            raise ConfigError("tokens: a negative token id", path=self.path, field="tokens")
                        top = max(top, int(piece.max()))
            self.max_token = top
        return self.max_token

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(tokens, lengths)`` pieces holding whole documents (a document is cut only if it
        alone exceeds the piece size and has no known boundaries)."""
        for a, lengths in zip(self._arrays, self._doc_lengths, strict=True):
            if lengths is None:
                yield from self._split_stream(a)
                continue
            ends = np.cumsum(lengths)
            start_doc, start = 0, 0
            while start_doc < lengths.size:
                stop_doc = int(np.searchsorted(ends, start + CHUNK_TOKENS, side="right"))
                stop_doc = max(stop_doc, start_doc + 1)
                stop = int(ends[stop_doc - 1])
                yield np.asarray(a[start:stop]), lengths[start_doc:stop_doc]
                start_doc, start = stop_doc, stop

    def _split_stream(self, a: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """A flat stream: documents end at each ``eod`` id (kept with its document); without
        ``eod`` the boundaries are unknown and the stream comes in pieces of ``CHUNK_TOKENS``
        (one stream: only targets that cut records from the concatenation take it, see
        :attr:`has_boundaries`)."""
        pending = a[:0]   # the open document's tokens from earlier pieces
        for s in range(0, a.size, CHUNK_TOKENS):
            piece = np.asarray(a[s:s + CHUNK_TOKENS])
            if self.eod is None:
                yield piece, np.array([piece.size], np.int64)
                continue
            ends = np.flatnonzero(piece == self.eod) + 1
            if ends.size == 0:
                pending = np.concatenate([pending, piece])
                if pending.size >= CHUNK_TOKENS:   # one very long document: cut it
                    yield pending, np.array([pending.size], np.int64)
                    pending = a[:0]
                continue
            last = int(ends[-1])
            body = np.concatenate([pending, piece[:last]]) if pending.size else piece[:last]
            lengths = np.diff(np.concatenate([[0], ends + pending.size])).astype(np.int64)
            yield body, lengths
            pending = piece[last:]
        if pending.size:
            yield np.asarray(pending), np.array([pending.size], np.int64)


class DatasetSource:
    """A zerobatch dataset as a source (``--from zerobatch``): its documents (TOKSTREAM),
    records (LLMCHNK, ZRECORD field ``tokens`` or ``--field``) or rows (LLMBATCH) in reading
    order, each one document; what ``convert --to megatron`` / ``nanogpt`` export."""

    kind = "zerobatch"
    has_boundaries = True
    eod: int | None = None

    def __init__(self, path: str, field: str | None = None) -> None:
        self.path = path
        self.ds = open_documents(path, field=field)
        if not self.ds.tokens:
            self.ds.close()
            raise ConfigError(f"source: a {self.ds.kind} dataset holds values, not tokens", path=path, field="source")
        self.files = [path]
        self.lengths = self.ds.lengths()
        self.num_tokens = int(self.lengths.sum())
        self.max_token: int | None = None

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": os.path.abspath(self.path)}

    def scan_max(self) -> int:
        if self.max_token is None:
            self.max_token = max((int(p.max()) for p in self.ds.token_pieces() if p.size), default=-1)
        return self.max_token

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(tokens, lengths)`` of whole documents, a piece of the dataset at a time."""
        ends = np.cumsum(self.lengths)
        buf = np.zeros(0, np.int64)
        done_docs = 0            # documents yielded
        base = 0                 # the token position buf[0] stands at
        for piece in self.ds.token_pieces():
            buf = np.concatenate([buf, piece]) if buf.size else np.asarray(piece)
            stop_doc = int(np.searchsorted(ends, base + buf.size, side="right"))
            if stop_doc > done_docs:
                cut = int(ends[stop_doc - 1]) - base
                yield buf[:cut], self.lengths[done_docs:stop_doc]
                buf, base, done_docs = buf[cut:], base + cut, stop_doc
        if done_docs != self.lengths.size or buf.size:
            raise CorruptError(f"source: the dataset's tokens ({base + buf.size}) do not match its document lengths "
                               f"({self.num_tokens})", path=self.path, field="source")

    def close(self) -> None:
        self.ds.close()


def open_documents(path: str, *, field: str | None = None) -> Any:
    """The zerobatch dataset at ``path`` read as documents of tokens: its format (recognised
    from the file's magic or the folder's files) and that format's documents reader, which
    its registry record names (``documents``: ``kind``, ``tokens``, ``lengths()``,
    ``token_pieces()``, ``close()``).

    Raises:
        NotFoundError: nothing at ``path``.
        FormatError: not a zerobatch dataset, or a damaged one.
        ConfigError: a format whose datasets hold no documents of tokens.
    """
    from zerobatch.core.remote import is_url, local_path
    from zerobatch.readers.detect import detect

    path = local_path(path)
    if not is_url(path) and not os.path.lexists(path):
        raise NotFoundError("no such file or folder", path=path, field="path")
    fmt = detect(path)
    if not fmt.documents:
        raise ConfigError(f"source: a {fmt.name} dataset holds values, not tokens", path=path, field="source")
    return fmt.resolve("documents")(path, field=field)


def documents(chunks: Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]) -> Iterator[np.ndarray]:
    """The documents of ``(tokens, lengths)`` chunks (what every source yields), one array each."""
    for tokens, lengths in chunks():
        ends = np.cumsum(lengths)
        starts = ends - lengths
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            if b > a:
                yield tokens[a:b]


def _llmc_header(path: str, size: int) -> tuple[np.dtype, int] | None:
    """``(token type, count)`` of an llm.c token file (its magic and version), else None.

    Raises:
        TruncatedError: the header's count does not match the file's size.
    """
    if size < LLMC_HEADER_BYTES:
        return None
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(12), "<i4")
    kind = LLMC_KINDS.get((int(head[0]), int(head[1])))
    if kind is None:
        return None
    dt, count = np.dtype(kind), int(head[2])
    if count < 0 or LLMC_HEADER_BYTES + count * dt.itemsize != size:
        raise TruncatedError(f"header: an llm.c file of {count} {dt} tokens after its 1024-byte header, but the file "
                             f"holds {size} bytes", path=path, field="header")
    return dt, count


def open_source(path: str, kind: str | None, **options: Any) -> TextSource | TokenSource | DatasetSource:
    """The source at ``path`` (``kind`` from ``--from``, else detected)."""
    kind = kind or detect_kind(path)
    if kind == "zerobatch":
        return DatasetSource(path, options.get("text_field") if options.get("text_field") != "text" else None)
    if kind == "mixed":
        files = _files(path, ("*.jsonl", "*.jsonl.gz", "*.ndjson", "*.parquet"))
        return MixedTextSource("mixed", path, members=[
            TextSource("parquet" if f.lower().endswith(".parquet") else "jsonl", f, **_text_options(options))
            for f in files], **_text_options(options))
    if kind in TEXT_KINDS:
        return TextSource(kind, path, **_text_options(options))
    if kind in TOKEN_KINDS:
        return TokenSource(kind, path, **{k: v for k, v in options.items() if k in ("dtype", "eod")})
    raise ConfigError(f"--from must be one of {TEXT_KINDS + TOKEN_KINDS}, got {kind!r}", field="from")
