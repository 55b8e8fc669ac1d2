"""Distributed preparation: ``convert --task I --tasks N`` and ``zerobatch commit``, the
contract any scheduler (a Slurm array, Spark, datatrove, Ray) can drive.

The inputs are cut into **units**, the same for every ``N``: each file whole, except a large
JSONL or line-split text file (cut into byte ranges of about ``unit_bytes``; a line belongs to
the range it starts in) and a Parquet file (one unit per row group). Task ``I`` of ``N`` takes
a contiguous run of ``U // N`` units, one more for the first ``U % N`` tasks (:func:`task_units`;
with fewer units than tasks the others say they have nothing to do and which ``--unit-bytes``
gives each task work, :func:`spread_hint`). For each unit it has not finished, it
tokenizes the unit's documents, writes them as TOKSTREAM shards named ``part-<unit>-<k>``
straight into the destination folder, then records the unit as finished
(``_parts/unit-<unit>.json``, written atomically, naming its shards). A task killed midway and
run again removes its unfinished units' shards and writes them again; finished units are
skipped. Every task writes (or checks) ``_parts/plan.json``: the units, the tokenizer and the
options, so tasks started with different inputs or options are refused.

``commit`` assembles ``manifest.json`` from the finished units' shards in unit order, reading
only their small ``shard.json`` files (no token is read), refuses while any unit is missing
(naming the units not finished yet and their tasks, which may still be running) and changes
nothing then; once it succeeds the ``_parts`` folder goes and a second commit finds the dataset
committed.

Commit trusts no record blindly. ``plan.json`` and every unit record carry ``digest``, the
BLAKE2b-128 of their canonical JSON (sorted keys, no spaces) without it, checked on read; every
field is type-checked (damage is a typed error naming the file and the field); a unit record
names the plan's digest, its shards (``part-<unit>-<k>``, ``k`` from 0), their build ids and its
document and token counts. Each part's ``shard.json`` must give the build id the plan and unit
derive (:func:`part_build_id`; plans whose tasks write without the plan's seed, such as the
Ray sink's, say ``"build_ids": "recorded"`` and are held to the build ids the records name), and
the parts' counts must add up to the record's: a part of another preparation (other inputs,
tokenizer or options), of another unit, or a record that lost its shards is refused by name.
A ``part-`` folder no record names is deleted only when its ``shard.json`` proves it an
abandoned attempt at a unit of this plan (the build id the plan gives that name); anything else
is refused and named. ``manifest.json`` is written only after every check passed. Plans and
records without ``digest`` come from development versions of zerobatch (no release wrote
them) and are refused: prepare such a dataset again into a new folder.

The destination may be a URL (``s3://bucket/dataset``, as the readers take): each task
tokenizes and writes a unit's shards in the temporary folder, uploads them (every shard's
``shard.json`` last), then puts the unit's record; ``commit`` reads the records and the
``shard.json`` objects and puts ``manifest.json`` last, so readers see no dataset until it is
whole. The dataset is the same for any ``N``, byte for byte (shard names and contents depend
on units, not tasks; each shard's build id derives from the plan and the unit, see
:func:`unit_seed`), and holds the documents of a one-process ``convert`` in the same order.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerobatch.prepare.sources import TextSource
from zerobatch.core.io import AtomicFile, read_document
from zerobatch.core.pool import run_io
from zerobatch.core.remote import is_url, open_store, redact
from zerobatch.formats import tokstream as T
from zerobatch.formats.strict_json import loads_strict
from zerobatch.formats.errors import ConfigError, CorruptError, IntegrityError, NotFoundError, ZerobatchError

__all__ = ["DEFAULT_UNIT_BYTES", "PARTS_DIR", "Destination", "TaskRun", "Unit", "commit", "part_build_id",
           "plan_units", "preparation_status", "spread_hint", "task_units", "unit_owner"]

#: Bytes of a large JSONL or line-split text file per unit.
DEFAULT_UNIT_BYTES = 64 << 20
#: The folder of the plan and the finished units' records, inside the destination.
PARTS_DIR = "_parts"
PLAN_NAME = "plan.json"
#: Uploads (and record fetches) in flight at a URL.
UPLOAD_THREADS = 8


@dataclass(frozen=True)
class Unit:
    """A unit of work: a file whole (``span`` None) or part of it (bytes or row groups)."""

    file: str
    span: tuple[int, int] | None = None

    def to_list(self) -> list[Any]:
        return [self.file, None if self.span is None else list(self.span)]


def plan_units(source: TextSource, unit_bytes: int = DEFAULT_UNIT_BYTES) -> list[Unit]:
    """The units of ``source``'s files, in reading order (the same for any number of tasks)."""
    if unit_bytes < 1:
        raise ConfigError("--unit-bytes must be at least 1", field="unit_bytes")
    units: list[Unit] = []
    for f in source.files:
        part = source.part_of(f)
        if part.kind == "parquet":
            from zerobatch.prepare.sources import _open_parquet
            with _open_parquet(f) as pf:
                groups = pf.metadata.num_row_groups
            units += [Unit(f, (g, g + 1)) for g in range(groups)] or [Unit(f)]
            continue
        size = os.path.getsize(f)
        if _splittable(part, f) and size > unit_bytes:
            units += [Unit(f, (a, min(a + unit_bytes, size))) for a in range(0, size, unit_bytes)]
        else:
            units.append(Unit(f))
    return units


def _splittable(part: TextSource, f: str) -> bool:
    """Whether ``f`` (a file of ``part``) is cut into byte ranges when large."""
    return (part.kind == "jsonl" or (part.kind == "text" and part.split == "line")) and not f.endswith(".gz")


def task_units(num_units: int, task: int, tasks: int) -> range:
    """The units of task ``task`` of ``tasks``: a contiguous run, the first tasks taking the
    larger shares (with fewer units than tasks, tasks ``0..units-1`` take one each and the
    others have nothing to do)."""
    q, r = divmod(num_units, tasks)
    start = task * q + min(task, r)
    return range(start, start + q + (task < r))


def unit_owner(num_units: int, u: int, tasks: int) -> int:
    """The task whose :func:`task_units` hold unit ``u``."""
    q, r = divmod(num_units, tasks)
    return u // (q + 1) if u < r * (q + 1) else r + (u - r * (q + 1)) // q


def spread_hint(source: TextSource, units: list[Unit], tasks: int) -> str | None:
    """With fewer ``units`` (of ``source``) than ``tasks``: a sentence saying so and which
    ``--unit-bytes`` gives every task a unit (the largest that does), or that the inputs
    cannot be cut finer; None when every task has work."""
    if len(units) >= tasks:
        return None
    sizes = [os.path.getsize(f) for f in source.files if _splittable(source.part_of(f), f)]
    fixed = sum(1 for u in units if not _splittable(source.part_of(u.file), u.file))

    def count(unit_bytes: int) -> int:
        return fixed + sum(-(-size // unit_bytes) if size > unit_bytes else 1 for size in sizes)

    what = f"the inputs make {len(units)} unit{'s' if len(units) != 1 else ''} for {tasks} tasks"
    if not sizes or count(1) < tasks:
        return (f"{what} and cannot be cut finer (each Parquet row group, gzip file and whole file is one unit): "
                f"run at most {len(units)} tasks")
    lo, hi = 1, max(sizes)          # count(lo) >= tasks > count(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) >= tasks else (lo, mid)
    return f"{what}: --unit-bytes {lo} gives {count(lo)} units, one or more for each task"


def unit_source(source: TextSource, unit: Unit) -> TextSource:
    """``source`` restricted to ``unit`` (a source of one kind)."""
    sub = copy.copy(source.part_of(unit.file))
    sub.files, sub.span = [unit.file], unit.span
    if sub.kind == "parquet":       # progress in rows
        from zerobatch.prepare.sources import _open_parquet
        with _open_parquet(unit.file) as pf:
            meta = pf.metadata
            groups = range(meta.num_row_groups) if unit.span is None else range(*unit.span)
            sub.total_work = sum(meta.row_group(g).num_rows for g in groups)
    elif unit.span is not None:     # in bytes
        sub.total_work = unit.span[1] - unit.span[0]
    else:
        sub.total_work = os.path.getsize(unit.file)
    return sub


class Destination:
    """Where the tasks write: a local (or shared) folder, or a prefix at an object store
    (``s3://bucket/dataset``...). Keys are ``/``-separated paths inside it."""

    def __init__(self, dst: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
        dst = os.fspath(dst)
        self.remote = is_url(dst)
        self.storage_options = storage_options
        self.store = open_store(dst, storage_options) if self.remote else None
        self.root = dst.rstrip("/") if self.remote else os.path.abspath(dst)
        self.shown = redact(self.root) if self.remote else self.root

    def child(self, folder: str) -> Destination:
        """The destination of ``folder`` inside this one (a chat dataset's ``loss_mask``)."""
        sub = f"{self.root}/{folder}" if self.remote else os.path.join(self.root, folder)
        return Destination(sub, self.storage_options)

    def name(self, key: str) -> str:
        """``key``'s path or URL, for messages."""
        return f"{self.shown}/{key}" if self.remote else os.path.join(self.root, key)

    def prepare(self) -> None:
        if not self.remote:
            os.makedirs(os.path.join(self.root, PARTS_DIR), exist_ok=True)

    def read(self, key: str, *, limit: int, field: str) -> bytes | None:
        """Object / file ``key``, or None when there is none."""
        try:
            if self.store is not None:
                return self.store.get(key, limit=limit, field=field)
            return read_document(os.path.join(self.root, key), limit=limit, field=field)
        except NotFoundError:
            return None

    def write(self, key: str, raw: bytes) -> None:
        """``key`` written whole (readers see the old contents or the new)."""
        if self.store is not None:
            self.store.put(key, raw)
            return
        with AtomicFile(os.path.join(self.root, key)) as f:
            f.write(raw)

    def exists(self, key: str) -> bool:
        if self.store is not None:
            return self.store.head(key) is not None
        return os.path.lexists(os.path.join(self.root, key))

    def shards(self, prefix: str) -> list[str]:
        """The shard folders (top-level names) starting with ``prefix``."""
        if self.store is not None:
            # the whole listing, filtered here: object stores match a listing's prefix by path
            # segment ("part-" lists only "part-/..."), not by the start of a name
            return sorted({top for key, _ in self.store.list("") if "/" in key
                           for top in (key.partition("/")[0],) if top.startswith(prefix)})
        return sorted(e.name for e in os.scandir(self.root)
                      if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False))

    def remove(self, name: str) -> None:
        """Shard folder (or ``_parts``) ``name`` and everything in it."""
        if self.store is not None:
            keys = [key for key, _ in self.store.list(name + "/")]
            _parallel(self.store.delete, keys)
        else:
            shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def install(self, folder: str, names: list[str]) -> None:
        """Shards ``names`` of local ``folder`` moved (uploaded) into the destination, each
        shard's ``shard.json`` last."""
        if self.store is None:
            for name in names:
                os.rename(os.path.join(folder, name), os.path.join(self.root, name))
            return
        store = self.store

        def upload(name: str) -> None:
            base = os.path.join(folder, name)
            files = sorted(f for f in os.listdir(base) if f != T.SHARD_MANIFEST_NAME)
            for fname in files:
                store.put(f"{name}/{fname}", os.path.join(base, fname))
            store.put(f"{name}/{T.SHARD_MANIFEST_NAME}", os.path.join(base, T.SHARD_MANIFEST_NAME))
        _parallel(upload, names)

    def scratch(self, what: str) -> str:
        """A local folder for work in progress: in ``_parts`` of a local destination (a
        rerun finds and clears it), in the temporary folder for a URL."""
        if self.store is None:
            return os.path.join(self.root, PARTS_DIR, what)
        return os.path.join(tempfile.mkdtemp(prefix="zerobatch-task-"), what)

    def release(self, scratch: str) -> None:
        """A folder of :meth:`scratch` removed."""
        shutil.rmtree(scratch, ignore_errors=True)
        if self.store is not None:
            shutil.rmtree(os.path.dirname(scratch), ignore_errors=True)


def _parallel(fn: Callable[[Any], None], items: list[Any]) -> None:
    """``fn`` over ``items`` on a short-lived I/O pool (requests and uploads: core.pool.run_io)."""
    run_io(fn, items, UPLOAD_THREADS, "zerobatch-task")


def _record_key(u: int) -> str:
    return f"{PARTS_DIR}/unit-{u:06d}.json"


_PLAN_KEY = f"{PARTS_DIR}/{PLAN_NAME}"
#: The largest plan (its units list) and unit record read.
MAX_PLAN_BYTES = 64 << 20
MAX_RECORD_BYTES = 1 << 20
_PART = re.compile(r"^part-(\d{6})-(\d{5})$")
_HEX128 = re.compile(r"^[0-9a-f]{32}$")
_I63 = (1 << 63) - 1
#: Plan keys and the options they come from, for the message refusing a task of another plan.
_OPTIONS = {"tasks": "--tasks", "units": "the units of the inputs (their files, or --unit-bytes)",
            "source": "the input files (names, sizes or modification times) or their reading options",
            "tokenizer": "--tokenizer", "eod": "the end-of-document token (--eod-token, --eod-id)",
            "bos": "the beginning-of-document token (--bos-id, --add-bos)", "vocab_size": "--vocab-size",
            "shard_tokens": "--shard-tokens", "metadata_fields": "--metadata-fields", "zerobatch": "zerobatch version",
            "chat": "the chat template (--tokenizer, --chat-roles)", "field": "--field", "version": "plan version"}


def _digest(obj: dict[str, Any]) -> str:
    """BLAKE2b-128 of ``obj``'s canonical JSON (sorted keys, no spaces), ``digest`` left out."""
    body = {k: v for k, v in obj.items() if k != "digest"}
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return hashlib.blake2b(raw, digest_size=16, person=b"zb-tasks").hexdigest()


def _sealed(obj: dict[str, Any]) -> bytes:
    """``obj`` with its ``digest``, as written to ``_parts``."""
    return json.dumps({**obj, "digest": _digest(obj)}, indent=1, sort_keys=True, allow_nan=False).encode("utf-8")


def _unseal(raw: bytes, *, path: str, what: str) -> dict[str, Any]:
    """A sealed document parsed strictly (bounded nesting, no duplicate keys or NaN) and its
    digest checked; returned without ``digest``.

    Raises:
        CorruptError: not a JSON object, or no digest.
        IntegrityError: the digest does not match (the file was changed or damaged).
    """
    obj = loads_strict(raw, error=CorruptError, field=what, path=path)
    if not isinstance(obj, dict):
        raise CorruptError(f"{what}: a JSON object expected, got {type(obj).__name__}", path=path, field=what)
    digest = obj.get("digest")
    if digest is None:
        raise CorruptError(f"{what}: no digest (written by a development version of zerobatch, or edited); prepare "
                           f"the dataset again into a new folder", path=path, field="digest")
    if not isinstance(digest, str) or not _HEX128.match(digest):
        raise CorruptError(f"digest: 32 hex digits expected, got {digest!r}", path=path, field="digest")
    if digest != _digest(obj):
        raise IntegrityError(f"digest: {what} does not match its digest {digest} (changed or damaged after it was "
                             f"written)", path=path, field="digest")
    del obj["digest"]
    return obj


def _int(obj: dict[str, Any], key: str, path: str, low: int = 0) -> int:
    v = obj.get(key)
    if v is None and key not in obj:
        raise CorruptError(f"{key}: missing", path=path, field=key)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= _I63:
        raise CorruptError(f"{key}: an integer from {low} to 2**63-1 expected, got {v!r}", path=path, field=key)
    return v


def _check_plan(plan: dict[str, Any], path: str) -> dict[str, Any]:
    """``plan`` (unsealed) with the fields commit relies on type-checked."""
    for key in ("version", "tasks", "units"):
        if key not in plan:
            raise CorruptError(f"{key}: missing", path=path, field=key)
    if _int(plan, "version", path, 1) != 1:
        raise CorruptError(f"version: 1 expected, got {plan['version']!r}", path=path, field="version")
    _int(plan, "tasks", path, 1)
    units = plan["units"]
    if not isinstance(units, list):
        raise CorruptError(f"units: a list expected, got {type(units).__name__}", path=path, field="units")
    for i, unit in enumerate(units):
        span = unit[1] if isinstance(unit, list) and len(unit) == 2 else None
        if not (isinstance(unit, list) and len(unit) == 2 and isinstance(unit[0], str)
                and (span is None or (isinstance(span, list) and len(span) == 2
                                      and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _I63
                                              for x in span) and span[0] < span[1]))):
            raise CorruptError(f"units[{i}]: [file, null or [start, stop]] expected, got {unit!r:.200}", path=path,
                               field="units")
    if plan.get("build_ids", "derived") not in ("derived", "recorded"):
        raise CorruptError(f"build_ids: 'derived' or 'recorded' expected, got {plan.get('build_ids')!r:.100}",
                           path=path, field="build_ids")
    return plan


def _shown(v: Any) -> str:
    text = json.dumps(v, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def write_plan(dst: str | Destination, plan: dict[str, Any]) -> None:
    """``_parts/plan.json`` written (sealed with its digest), or the one there checked to be
    the same.

    Raises:
        ConfigError: another plan is there (other inputs, tokenizer or options: the message
            names each option and both values), or the dataset is committed already.
        CorruptError, IntegrityError: the plan there is damaged.
    """
    d = dst if isinstance(dst, Destination) else Destination(dst)
    if d.exists(T.MANIFEST_NAME):
        raise ConfigError("destination: the dataset is committed already (manifest.json); prepare into a new folder",
                          path=d.shown, field="destination")
    d.prepare()
    raw = _sealed(plan)
    old = d.read(_PLAN_KEY, limit=MAX_PLAN_BYTES, field=PLAN_NAME)
    if old is None:
        d.write(_PLAN_KEY, raw)
        return
    if old != raw:
        theirs = _check_plan(_unseal(old, path=d.name(_PLAN_KEY), what=PLAN_NAME), d.name(_PLAN_KEY))
        mine = json.loads(raw)
        del mine["digest"]
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        said = "; ".join(f"{_OPTIONS.get(k, k)}: this task has {_shown(mine.get(k))}, the other tasks of this "
                         f"preparation have {_shown(theirs.get(k))}" for k in diff)
        raise ConfigError(f"plan.json: {said or 'the plan differs'}; every task of a preparation must get the same "
                          f"inputs and options (or prepare into a new folder)", path=d.name(_PLAN_KEY),
                          field=diff[0] if diff else "plan")


def _check_record(rec: dict[str, Any], u: int, path: str) -> dict[str, Any]:
    """Unit ``u``'s record (unsealed) with every field type-checked and consistent."""
    for key in ("unit", "plan", "shards", "build_ids", "documents", "tokens"):
        if key not in rec:
            raise CorruptError(f"{key}: missing", path=path, field=key)
    if _int(rec, "unit", path) != u:
        raise CorruptError(f"unit: the record of unit {u} says {rec['unit']}", path=path, field="unit")
    plan = rec["plan"]
    if plan is not None and (not isinstance(plan, str) or not _HEX128.match(plan)):
        raise CorruptError(f"plan: the plan's digest (32 hex digits) or null expected, got {plan!r:.100}", path=path,
                           field="plan")
    shards, ids = rec["shards"], rec["build_ids"]
    for key, v in (("shards", shards), ("build_ids", ids)):
        if not isinstance(v, list) or len(v) > T.MAX_SHARDS:
            raise CorruptError(f"{key}: a list expected, got {v!r:.100}", path=path, field=key)
    for k, name in enumerate(shards):
        if name != f"part-{u:06d}-{k:05d}":
            raise CorruptError(f"shards[{k}]: 'part-{u:06d}-{k:05d}' expected, got {name!r:.100}", path=path,
                               field="shards")
    if len(ids) != len(shards) or not all(isinstance(b, str) and _HEX128.match(b) for b in ids):
        raise CorruptError(f"build_ids: a build id (32 hex digits) per shard expected ({len(shards)} shards), got "
                           f"{ids!r:.100}", path=path, field="build_ids")
    docs, tokens = _int(rec, "documents", path), _int(rec, "tokens", path)
    if (docs == 0) != (not shards) or (docs == 0 and tokens != 0):
        raise CorruptError(f"shards: {len(shards)} shards for {docs} documents of {tokens} tokens", path=path,
                           field="shards")
    return rec


def finished(dst: str | Destination, u: int) -> dict[str, Any] | None:
    """Unit ``u``'s record (checked: its digest, every field), if it finished.

    Raises:
        CorruptError, IntegrityError: the record is damaged (naming the file and the field).
    """
    d = dst if isinstance(dst, Destination) else Destination(dst)
    raw = d.read(_record_key(u), limit=MAX_RECORD_BYTES, field="unit")
    if raw is None:
        return None
    path = d.name(_record_key(u))
    return _check_record(_unseal(raw, path=path, what=f"unit-{u:06d}.json"), u, path)


def clear_unit(dst: str | Destination, u: int) -> None:
    """What an unfinished attempt at unit ``u`` left: its shards and its temporary folder."""
    d = dst if isinstance(dst, Destination) else Destination(dst)
    for name in d.shards(f"part-{u:06d}-"):
        d.remove(name)
    if not d.remote:
        shutil.rmtree(d.scratch(f"unit-{u:06d}.tmp"), ignore_errors=True)


def write_unit(dst: str | Destination, u: int, documents: Any = (), *, vocab_size: int, eod: int | None,
               shard_tokens: int, checksum_block: int = T.DEFAULT_CHECKSUM_BLOCK, metas: Any = None,
               chunks: Any = None, build_seed: bytes | None = None) -> dict[str, Any]:
    """Unit ``u``'s ``documents`` (arrays of token ids; ``metas``: their metadata, in order) or
    ``chunks`` (``(tokens, lengths)`` of many documents each, without metadata: written in a
    few calls) as shards ``part-<u>-<k>`` in ``dst``, then its record; returns the record.
    At a URL the shards are written locally, uploaded (each shard's ``shard.json`` last),
    then the record is put. ``build_seed``: the shards' build ids derive from it (see
    :class:`~zerobatch.writers.tokstream.ShardWriter`; :func:`unit_seed` for a plan whose
    build ids are derived), else from their contents. The record names the digest of the
    plan in ``dst`` (None when there is none yet: the Ray sink writes its plan last), the
    shards, their build ids and the counts, sealed with its own digest."""
    from zerobatch.writers.tokstream import TokenStreamWriter
    d = dst if isinstance(dst, Destination) else Destination(dst)
    raw_plan = d.read(_PLAN_KEY, limit=MAX_PLAN_BYTES, field=PLAN_NAME)
    plan_digest = None if raw_plan is None else \
        _digest(_check_plan(_unseal(raw_plan, path=d.name(_PLAN_KEY), what=PLAN_NAME), d.name(_PLAN_KEY)))
    clear_unit(d, u)
    tmp = d.scratch(f"unit-{u:06d}.tmp")
    try:
        w = TokenStreamWriter(tmp, vocab_size=vocab_size, eod_token=eod, shard_tokens=shard_tokens,
                              prefix=f"part-{u:06d}-", checksum_block=checksum_block, metadata=metas is not None,
                              build_seed=build_seed)
        docs = tokens = 0
        try:
            for toks, lens in chunks or ():
                w.add_documents(toks, lens)
                docs += len(lens)
                tokens += len(toks)
            for doc in documents:
                w.add_document(doc, None if metas is None else next(metas))
                docs += 1
                tokens += len(doc)
        except BaseException:
            w.abort()
            raise
        names: list[str] = []
        ids: list[str] = []
        if docs:
            m = w.close()
            names = [e.name for e in m.shards]
            ids = [e.build_id for e in m.shards]
            d.install(tmp, names)
        else:
            w.abort()
        record = {"unit": u, "plan": plan_digest, "shards": names, "build_ids": ids, "documents": docs,
                  "tokens": tokens}
        d.write(_record_key(u), _sealed(record))
    finally:
        d.release(tmp)
    return record


class TaskRun:
    """Task ``task`` of ``tasks`` over ``num_units`` units in ``dst``: :attr:`todo`, its units
    not finished yet (a rerun skips the finished ones and redoes a unit whose record is
    damaged), and the summary a task logs. ``hint``: what :func:`spread_hint` says when there
    are fewer units than tasks."""

    def __init__(self, dst: Destination, num_units: int, task: int, tasks: int, hint: str | None = None) -> None:
        self.num_units, self.task, self.tasks = num_units, task, tasks
        self.mine = task_units(num_units, task, tasks)
        self.damaged: list[str] = []
        self.todo = [u for u in self.mine if self._unfinished(dst, u)]
        self.hint = hint if hint is not None or num_units >= tasks else (
            f"the inputs make {num_units} unit{'s' if num_units != 1 else ''} for {tasks} tasks; a smaller "
            f"--unit-bytes cuts large JSONL and text files into more units")

    def _unfinished(self, dst: Destination, u: int) -> bool:
        try:
            return finished(dst, u) is None
        except (CorruptError, IntegrityError) as exc:      # written again: the unit's contents are the plan's
            self.damaged.append(f"{u} ({exc.message})")
            return True

    def summary(self, what: str = "") -> str:
        head = f"task {self.task} of {self.tasks}"
        if not self.mine:
            return f"{head}: nothing to do ({self.hint})"
        done = len(self.todo)
        text = (f"{head}: units [{self.mine.start}, {self.mine.stop}) of {self.num_units}: {done} written, "
                f"{len(self.mine) - done} finished before{what}")
        if self.damaged:
            text += f"; written again because their records were damaged: {', '.join(self.damaged)}"
        return text + (f" ({self.hint})" if self.hint else "")


def unit_seed(plan: dict[str, Any], u: int) -> bytes:
    """The build seed of unit ``u`` of ``plan``: the plan names everything that decides the
    unit's contents (input files with sizes and times, tokenizer, options, version), so the
    same unit is written with the same build ids by any task, any ``N``, any rerun."""
    what = {k: v for k, v in plan.items() if k not in ("tasks", "digest")}   # the same for any number of tasks
    return json.dumps([what, u], sort_keys=True).encode("utf-8")


def part_build_id(plan: dict[str, Any], u: int, name: str) -> str:
    """The build id of part ``name`` of unit ``u`` written with :func:`unit_seed` (as
    :class:`~zerobatch.writers.tokstream.ShardWriter` derives it from a ``build_seed``)."""
    from zerobatch.writers.tokstream import seeded_build_id
    return seeded_build_id(unit_seed(plan, u), name).hex()


def read_plan(dst: str | Destination) -> dict[str, Any]:
    """The plan in ``dst``, its digest and fields checked, without ``digest``.

    Raises:
        NotFoundError: no plan (no preparation there).
        CorruptError, IntegrityError: a damaged plan, naming the field.
    """
    d = dst if isinstance(dst, Destination) else Destination(dst)
    raw = d.read(_PLAN_KEY, limit=MAX_PLAN_BYTES, field=PLAN_NAME)
    if raw is None:
        raise NotFoundError("plan.json: no preparation here (run the convert tasks with --task/--tasks first)",
                            path=d.name(_PLAN_KEY), field=PLAN_NAME)
    return _check_plan(_unseal(raw, path=d.name(_PLAN_KEY), what=PLAN_NAME), d.name(_PLAN_KEY))


def _unfinished_message(missing: list[int], n: int, tasks: int) -> str:
    owners = sorted({unit_owner(n, u, tasks) for u in missing})

    def listed(xs: list[int]) -> str:
        return ", ".join(map(str, xs[:20])) + (f", ... ({len(xs)} in all)" if len(xs) > 20 else "")
    one = len(owners) == 1
    return (f"commit: {len(missing)} of {n} units are not finished yet (unit{'' if len(missing) == 1 else 's'} "
            f"{listed(missing)}, of task{'' if one else 's'} {listed(owners)} of {tasks}); "
            f"{'that task' if one else 'those tasks'} may still be running: wait for {'it' if one else 'them'}, "
            f"and run {'it' if one else 'one'} again only if it failed; nothing was changed")


@dataclass
class _Prepared:
    """A preparation that passed every check: what commit writes and what it deletes."""

    dest: Destination
    plan: dict[str, Any]
    records: list[dict[str, Any]]
    shards: list[tuple[str, bytes, str]]         # (name, shard.json, where), in unit order
    entries: list[Any]                           # the parsed shard entries, the same order
    abandoned: list[str]                         # part folders proven abandoned attempts


def _check_preparation(d: Destination) -> _Prepared:
    """Every check of commit for the preparation in ``d``, changing nothing.

    Raises:
        ConfigError: a unit is not finished, or there is no document at all.
        NotFoundError: no plan, or a part's ``shard.json`` is missing.
        CorruptError, IntegrityError: a damaged plan or record, or a part that does not belong
            to the plan and unit its name says (build id), or counts that do not add up.
    """
    plan = read_plan(d)
    n, tasks = len(plan["units"]), plan["tasks"]
    digest, derived = _digest(plan), plan.get("build_ids", "derived") == "derived"
    found: list[dict[str, Any] | None] = [None] * n

    def fetch(u: int) -> None:
        found[u] = finished(d, u)
    _parallel(fetch, list(range(n)))
    for u, r in enumerate(found):
        if r is not None and r["plan"] != digest and (r["plan"] is not None or derived):
            raise CorruptError(f"plan: unit {u}'s record names plan {r['plan']}, this preparation's is {digest} (the "
                               f"record belongs to another preparation)", path=d.name(_record_key(u)), field="plan")
    missing = [u for u, r in enumerate(found) if r is None]
    if missing:
        raise ConfigError(_unfinished_message(missing, n, tasks), path=d.shown, field="tasks")
    records = [r for r in found if r is not None]
    names = [name for r in records for name in r["shards"]]
    if not names:
        raise ConfigError("commit: the inputs hold no documents", path=d.shown, field="tasks")
    raws: list[bytes] = [b""] * len(names)

    def shard_json(i: int) -> None:
        key = f"{names[i]}/{T.SHARD_MANIFEST_NAME}"
        raw = d.read(key, limit=T.MAX_MANIFEST_BYTES, field="shard.json")
        if raw is None:
            raise NotFoundError(f"shard {names[i]!r}: its unit is finished but its shard.json is missing",
                                path=d.name(key), field="shards")
        raws[i] = raw
    _parallel(shard_json, list(range(len(names))))
    shards: list[tuple[str, bytes, str]] = []
    entries: list[Any] = []
    i = 0
    for u, r in enumerate(records):
        docs = tokens = 0
        for name, recorded in zip(r["shards"], r["build_ids"], strict=True):
            raw, where = raws[i], d.name(f"{name}/{T.SHARD_MANIFEST_NAME}")
            i += 1
            _, entry = T.parse_shard_manifest(raw, path=where)
            want = part_build_id(plan, u, name) if derived else recorded
            if entry.build_id != want:
                raise CorruptError(f"build_id: part {name} has build id {entry.build_id}, but unit {u} of this "
                                   f"preparation's plan gives it {want}: the part belongs to another preparation "
                                   f"(other inputs, tokenizer or options) or another unit", path=where,
                                   field="build_id")
            if entry.build_id != recorded:
                raise CorruptError(f"build_id: part {name} has build id {entry.build_id}, but unit {u}'s record "
                                   f"says {recorded}", path=where, field="build_id")
            docs += entry.num_documents
            tokens += entry.num_tokens
            shards.append((name, raw, where))
            entries.append(entry)
        if (docs, tokens) != (r["documents"], r["tokens"]):
            raise CorruptError(f"documents: unit {u}'s record counts {r['documents']} documents of {r['tokens']} "
                               f"tokens, its parts hold {docs} of {tokens}", path=d.name(_record_key(u)),
                               field="documents")
    keep = set(names)
    abandoned = []
    for name in d.shards("part-"):
        if name in keep:
            continue
        why = _not_abandoned(d, plan, derived, name, n)
        if why:
            raise CorruptError(f"shards: {name} is not named by any unit record and {why}; commit deletes only "
                               f"what it can prove an abandoned attempt of this preparation: remove it if it is "
                               f"not needed", path=d.name(name), field="shards")
        abandoned.append(name)
    return _Prepared(d, plan, records, shards, entries, abandoned)


def _not_abandoned(d: Destination, plan: dict[str, Any], derived: bool, name: str, n: int) -> str:
    """Why folder ``name`` is not proven an abandoned attempt at a unit of ``plan``; ``""``
    when it is: a ``part-<unit>-<k>`` of a unit of the plan whose ``shard.json`` has the
    build id the plan gives that name."""
    m = _PART.match(name)
    if m is None or int(m.group(1)) >= n:
        return "its name is not that of a part of a unit of this preparation"
    if not derived:
        return "this preparation's build ids are recorded, not derived from its plan"
    where = d.name(f"{name}/{T.SHARD_MANIFEST_NAME}")
    try:
        raw = d.read(f"{name}/{T.SHARD_MANIFEST_NAME}", limit=T.MAX_MANIFEST_BYTES, field="shard.json")
        if raw is None:
            return "it has no shard.json"
        _, entry = T.parse_shard_manifest(raw, path=where)
    except ZerobatchError as exc:
        return f"its shard.json cannot be read ({exc.message})"
    if entry.build_id != part_build_id(plan, int(m.group(1)), name):
        return f"its build id {entry.build_id} is not the one this preparation's plan gives that name"
    return ""


def _check_mask(tokens: _Prepared, mask: _Prepared) -> None:
    """A chat preparation's loss mask is the mask of these tokens: its plan is the tokens'
    (as the chat tasks write it) and every unit and part has the same documents and tokens."""
    from zerobatch.readers.tokstream import LOSS_MASK_DIR
    where = mask.dest.name(_PLAN_KEY)
    mine = {k: v for k, v in mask.plan.items() if k not in ("stream", "vocab_size")}
    theirs = {k: v for k, v in tokens.plan.items() if k != "vocab_size"}
    if mask.plan.get("stream") != LOSS_MASK_DIR or mine != theirs:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)) or ["stream"]
        raise CorruptError(f"{diff[0]}: the loss mask's plan is not that of the tokens' preparation (it differs in "
                           f"{', '.join(diff)})", path=where, field=diff[0])
    for u, (t, m) in enumerate(zip(tokens.records, mask.records, strict=True)):
        if (t["documents"], t["tokens"], len(t["shards"])) != (m["documents"], m["tokens"], len(m["shards"])):
            raise CorruptError(f"documents: unit {u}'s loss mask has {m['documents']} documents of {m['tokens']} "
                               f"tokens in {len(m['shards'])} parts, its tokens {t['documents']} of {t['tokens']} in "
                               f"{len(t['shards'])}", path=mask.dest.name(_record_key(u)), field="documents")
    for (name, _, where), t, m in zip(mask.shards, tokens.entries, mask.entries, strict=True):
        if (t.num_documents, t.num_tokens) != (m.num_documents, m.num_tokens):
            raise CorruptError(f"num_tokens: loss mask part {name} has {m.num_documents} documents of {m.num_tokens} "
                               f"tokens, its tokens {t.num_documents} of {t.num_tokens}", path=where,
                               field="num_tokens")


def _tidy(p: _Prepared) -> None:
    """After the manifest: the proven-abandoned parts deleted."""
    for name in p.abandoned:
        p.dest.remove(name)


def commit(dst: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,
           log: Callable[[str], None] = print) -> T.DatasetManifest:
    """Assemble the dataset the tasks prepared in ``dst`` (a folder or a URL; see the module
    documentation). Every check runs first (a chat preparation's loss mask with its tokens);
    then a chat preparation's mask manifest is written, then ``manifest.json``, the switch
    readers open (at a URL it is put last: readers see no dataset, then the whole dataset);
    then the proven-abandoned parts and ``_parts`` go.

    Raises:
        ConfigError: a unit is not finished (the message names the units and their tasks);
            nothing is changed.
        NotFoundError: no preparation in ``dst``, or a finished unit's part is missing.
        CorruptError, IntegrityError: a damaged plan or record, a part of another preparation
            or unit, counts that do not add up, a ``part-`` folder that no record names and
            that is not provably abandoned (each naming the file and the field); nothing is
            changed.
    """
    from zerobatch.readers.tokstream import LOSS_MASK_DIR
    from zerobatch.writers.tokstream import manifest_of
    d = Destination(dst, storage_options)
    mask = d.child(LOSS_MASK_DIR)
    if d.exists(T.MANIFEST_NAME) and not d.exists(_PLAN_KEY):
        log(f"{d.shown}: committed already")
        raw = d.read(T.MANIFEST_NAME, limit=T.MAX_MANIFEST_BYTES, field="manifest.json")
        if raw is None:
            raise NotFoundError("manifest.json: removed while committing", path=d.name(T.MANIFEST_NAME),
                                field="manifest.json")
        if mask.exists(_PLAN_KEY) and mask.exists(T.MANIFEST_NAME):
            mask.remove(PARTS_DIR)      # a commit stopped between removing the two _parts folders
        return T.parse_manifest(raw, path=d.name(T.MANIFEST_NAME))
    prep = _check_preparation(d)
    # a chat preparation's loss mask (a unit's mask is finished before its tokens), checked
    # with its tokens before anything is written
    masked: _Prepared | None = None
    if mask.exists(_PLAN_KEY):
        masked = _check_preparation(mask)
        _check_mask(prep, masked)
    elif "chat" in prep.plan:
        raise NotFoundError(f"{LOSS_MASK_DIR}: the chat preparation's loss mask has no plan", path=mask.name(_PLAN_KEY),
                            field=LOSS_MASK_DIR)
    # the mask stream first, the tokens last: the dataset's manifest is the switch
    mask_manifest = manifest_of(masked.shards) if masked is not None else None
    # the dataset's manifest names its mask's build id: readers refuse any other mask, or none
    manifest = manifest_of(prep.shards, loss_mask=None if mask_manifest is None else mask_manifest.build_id)
    if masked is not None and mask_manifest is not None:
        mask.write(T.MANIFEST_NAME, json.dumps(mask_manifest.to_dict(), indent=1).encode("utf-8"))
    d.write(T.MANIFEST_NAME, json.dumps(manifest.to_dict(), indent=1).encode("utf-8"))   # the switch
    for p in (prep, masked):
        if p is not None:
            _tidy(p)
    d.remove(PARTS_DIR)
    if masked is not None:
        mask.remove(PARTS_DIR)
        log(f"committed {mask.shown}: the loss mask, {len(masked.shards)} shards")
    n = len(prep.records)
    docs = sum(r["documents"] for r in prep.records)
    log(f"committed {d.shown}: {docs:,} documents, {manifest.num_tokens:,} tokens in {len(prep.shards)} shards from "
        f"{n} units")
    return manifest


def preparation_status(dst: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
                       ) -> dict[str, Any] | None:
    """What ``zerobatch inspect`` says of an uncommitted preparation in ``dst`` (a plan and
    unit records, no ``manifest.json``): its units, how many are finished, the tasks that
    still have units to write; None when ``dst`` holds no uncommitted preparation.

    Raises:
        CorruptError, IntegrityError: a damaged plan or record.
    """
    d = Destination(dst, storage_options)
    if d.exists(T.MANIFEST_NAME) or not d.exists(_PLAN_KEY):
        return None
    plan = read_plan(d)
    n, tasks = len(plan["units"]), plan["tasks"]
    done: list[bool] = [False] * n

    def fetch(u: int) -> None:
        done[u] = finished(d, u) is not None
    _parallel(fetch, list(range(n)))
    missing = [u for u in range(n) if not done[u]]
    return {"format": "uncommitted preparation (convert --task/--tasks)", "path": d.shown, "units": n,
            "finished_units": n - len(missing), "tasks": tasks, "chat": "chat" in plan,
            "unfinished_units": missing, "unfinished_tasks": sorted({unit_owner(n, u, tasks) for u in missing})}
