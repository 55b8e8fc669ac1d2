"""Distributed preparation: ``convert --task I --tasks N`` and ``zerobatch commit``, the
contract any scheduler (a Slurm array, Spark, datatrove, Ray) can drive.

The inputs are cut into **units**, the same for every ``N``: each file whole, except a large
JSONL or line-split text file (cut into byte ranges of about ``unit_bytes``; a line belongs to
the range it starts in) and a Parquet file (one unit per row group). Task ``I`` of ``N`` takes
the contiguous units ``[I * U // N, (I + 1) * U // N)``. For each unit it has not finished, it
tokenizes the unit's documents, writes them as TOKSTREAM shards named ``part-<unit>-<k>``
straight into the destination folder, then records the unit as finished
(``_parts/unit-<unit>.json``, written atomically, naming its shards). A task killed midway and
run again removes its unfinished units' shards and writes them again; finished units are
skipped. Every task writes (or checks) ``_parts/plan.json``: the units, the tokenizer and the
options, so tasks started with different inputs or options are refused.

``commit`` assembles ``manifest.json`` from the finished units' shards in unit order, reading
only their small ``shard.json`` files (no token is read), refuses while any unit is missing
(naming the tasks to run again) and changes nothing then; once it succeeds the ``_parts`` folder
goes and a second commit finds the dataset committed.

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
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from zerobatch.cli.sources import TextSource
from zerobatch.core.io import AtomicFile, read_document
from zerobatch.core.remote import ObjectStore, is_url, redact
from zerobatch.formats import tokstream as T
from zerobatch.formats.errors import ConfigError, CorruptError, NotFoundError

__all__ = ["DEFAULT_UNIT_BYTES", "PARTS_DIR", "Destination", "TaskRun", "Unit", "commit", "plan_units",
           "task_units"]

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
            from zerobatch.cli.sources import _pyarrow_parquet
            try:
                groups = _pyarrow_parquet().ParquetFile(f).metadata.num_row_groups
            except Exception as exc:   # pyarrow's own errors for damaged files
                raise CorruptError(f"parquet: cannot read the file's metadata: {exc}", path=f,
                                   field="parquet") from None
            units += [Unit(f, (g, g + 1)) for g in range(groups)] or [Unit(f)]
            continue
        size = os.path.getsize(f)
        splittable = (part.kind == "jsonl" or (part.kind == "text" and part.split == "line")) and \
            not f.endswith(".gz")
        if splittable and size > unit_bytes:
            units += [Unit(f, (a, min(a + unit_bytes, size))) for a in range(0, size, unit_bytes)]
        else:
            units.append(Unit(f))
    return units


def task_units(num_units: int, task: int, tasks: int) -> range:
    """The units of task ``task`` of ``tasks``: a contiguous run."""
    return range(task * num_units // tasks, (task + 1) * num_units // tasks)


def unit_source(source: TextSource, unit: Unit) -> TextSource:
    """``source`` restricted to ``unit`` (a source of one kind)."""
    sub = copy.copy(source.part_of(unit.file))
    sub.files, sub.span = [unit.file], unit.span
    if sub.kind == "parquet":       # progress in rows
        from zerobatch.cli.sources import _pyarrow_parquet
        meta = _pyarrow_parquet().ParquetFile(unit.file).metadata
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
        self.store = ObjectStore(dst, storage_options) if self.remote else None
        self.root = dst.rstrip("/") if self.remote else os.path.abspath(dst)
        self.shown = redact(self.root)

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
            return sorted({key.partition("/")[0] for key, _ in self.store.list(prefix) if "/" in key})
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
    if len(items) <= 1:
        for it in items:
            fn(it)
        return
    with ThreadPoolExecutor(min(UPLOAD_THREADS, len(items)), thread_name_prefix="zerobatch-task") as pool:
        for f in [pool.submit(fn, it) for it in items]:
            f.result()


def _record_key(u: int) -> str:
    return f"{PARTS_DIR}/unit-{u:06d}.json"


def write_plan(dst: str | Destination, plan: dict[str, Any]) -> None:
    """``_parts/plan.json`` written, or the one there checked to be the same.

    Raises:
        ConfigError: another plan is there (other inputs, tokenizer or options), or the
            dataset is committed already.
    """
    d = dst if isinstance(dst, Destination) else Destination(dst)
    if d.exists(T.MANIFEST_NAME):
        raise ConfigError("destination: the dataset is committed already (manifest.json); prepare into a new folder",
                          path=d.shown, field="destination")
    d.prepare()
    key = f"{PARTS_DIR}/{PLAN_NAME}"
    raw = json.dumps(plan, indent=1, sort_keys=True).encode("utf-8")
    old = d.read(key, limit=64 << 20, field=PLAN_NAME)
    if old is None:
        d.write(key, raw)
        return
    if old != raw:
        try:
            theirs = json.loads(old)
        except ValueError:
            raise CorruptError("plan.json: not JSON", path=d.name(key), field=PLAN_NAME) from None
        diff = sorted(k for k in set(plan) | set(theirs) if plan.get(k) != theirs.get(k))
        raise ConfigError(f"plan.json: the other tasks of this preparation have another {', '.join(diff)} (every "
                          f"task must get the same inputs and options)", path=d.name(key),
                          field=diff[0] if diff else "plan")


def finished(dst: str | Destination, u: int) -> dict[str, Any] | None:
    """Unit ``u``'s record, if it finished."""
    d = dst if isinstance(dst, Destination) else Destination(dst)
    raw = d.read(_record_key(u), limit=1 << 20, field="unit")
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None       # torn by a crash: AtomicFile (and whole-object puts) make that impossible


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
    :class:`~zerobatch.writers.tokstream.ShardWriter`), else they are drawn."""
    from zerobatch.writers.tokstream import TokenStreamWriter
    d = dst if isinstance(dst, Destination) else Destination(dst)
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
        if docs:
            m = w.close()
            names = [e.name for e in m.shards]
            d.install(tmp, names)
        else:
            w.abort()
        record = {"unit": u, "shards": names, "documents": docs, "tokens": tokens}
        d.write(_record_key(u), json.dumps(record).encode("utf-8"))
    finally:
        d.release(tmp)
    return record


class TaskRun:
    """Task ``task`` of ``tasks`` over ``num_units`` units in ``dst``: :attr:`todo`, its units
    not finished yet (a rerun skips the finished ones), and the summary a task logs."""

    def __init__(self, dst: Destination, num_units: int, task: int, tasks: int) -> None:
        self.num_units, self.task, self.tasks = num_units, task, tasks
        self.mine = task_units(num_units, task, tasks)
        self.todo = [u for u in self.mine if finished(dst, u) is None]

    def summary(self, what: str = "") -> str:
        done = len(self.todo)
        return (f"task {self.task} of {self.tasks}: units [{self.mine.start}, {self.mine.stop}) of {self.num_units}: "
                f"{done} written, {len(self.mine) - done} finished before{what}")


def unit_seed(plan: dict[str, Any], u: int) -> bytes:
    """The build seed of unit ``u`` of ``plan``: the plan names everything that decides the
    unit's contents (input files with sizes and times, tokenizer, options, version), so the
    same unit is written with the same build ids by any task, any ``N``, any rerun."""
    what = {k: v for k, v in plan.items() if k != "tasks"}       # the same for any number of tasks
    return json.dumps([what, u], sort_keys=True).encode("utf-8")


def read_plan(dst: str | Destination) -> dict[str, Any]:
    d = dst if isinstance(dst, Destination) else Destination(dst)
    key = f"{PARTS_DIR}/{PLAN_NAME}"
    raw = d.read(key, limit=64 << 20, field=PLAN_NAME)
    if raw is None:
        raise NotFoundError("plan.json: no preparation here (run the convert tasks with --task/--tasks first)",
                            path=d.name(key), field=PLAN_NAME)
    try:
        plan = json.loads(raw)
    except ValueError:
        raise CorruptError("plan.json: not JSON", path=d.name(key), field=PLAN_NAME) from None
    if not isinstance(plan, dict) or not isinstance(plan.get("units"), list) or not isinstance(plan.get("tasks"), int):
        raise CorruptError("plan.json: no units or tasks", path=d.name(key), field=PLAN_NAME)
    return plan


def commit(dst: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,
           log: Callable[[str], None] = print) -> T.DatasetManifest:
    """Assemble the dataset the tasks prepared in ``dst`` (a folder or a URL; see the module
    documentation). At a URL, ``manifest.json`` is put last: readers see no dataset, then
    the whole dataset.

    Raises:
        ConfigError: a unit is not finished (the message names the tasks to run again);
            nothing is changed.
        NotFoundError: no preparation in ``dst``.
    """
    from zerobatch.writers.tokstream import manifest_of
    d = Destination(dst, storage_options)
    if d.exists(T.MANIFEST_NAME) and not d.exists(f"{PARTS_DIR}/{PLAN_NAME}"):
        log(f"{d.shown}: committed already")
        raw = d.read(T.MANIFEST_NAME, limit=T.MAX_MANIFEST_BYTES, field="manifest.json")
        if raw is None:
            raise NotFoundError("manifest.json: removed while committing", path=d.name(T.MANIFEST_NAME),
                                field="manifest.json")
        return T.parse_manifest(raw, path=d.name(T.MANIFEST_NAME))
    plan = read_plan(d)
    n, tasks = len(plan["units"]), plan["tasks"]
    records: list[dict[str, Any] | None] = [None] * n

    def fetch(u: int) -> None:
        records[u] = finished(d, u)
    _parallel(fetch, list(range(n)))
    missing = [u for u, r in enumerate(records) if r is None]
    if missing:
        owners = sorted({t for t in range(tasks) for u in missing if u in task_units(n, t, tasks)})
        shown = ", ".join(map(str, owners[:20])) + (", ..." if len(owners) > 20 else "")
        raise ConfigError(f"commit: {len(missing)} of {n} units are not finished; run these of the {tasks} tasks "
                          f"again: {shown}", path=d.shown, field="tasks")
    names = [name for r in records if r is not None for name in r["shards"]]
    if not names:
        raise ConfigError("commit: the inputs hold no documents", path=d.shown, field="tasks")
    # a chat preparation's loss mask (a unit's mask is finished before its tokens): committed
    # first, so the dataset's manifest, the switch readers open, comes last
    from zerobatch.readers.tokstream import LOSS_MASK_DIR
    mask = d.child(LOSS_MASK_DIR)
    if mask.exists(f"{PARTS_DIR}/{PLAN_NAME}"):
        commit(mask.root, storage_options=storage_options, log=log)
    raws: list[bytes | None] = [None] * len(names)

    def shard_json(i: int) -> None:
        key = f"{names[i]}/{T.SHARD_MANIFEST_NAME}"
        raws[i] = d.read(key, limit=T.MAX_MANIFEST_BYTES, field="shard.json")
        if raws[i] is None:
            raise NotFoundError(f"shard {names[i]!r}: its unit is finished but its shard.json is missing",
                                path=d.name(key), field="shards")
    _parallel(shard_json, list(range(len(names))))
    manifest = manifest_of((name, raw, d.name(f"{name}/{T.SHARD_MANIFEST_NAME}"))
                           for name, raw in zip(names, raws, strict=True) if raw is not None)
    d.write(T.MANIFEST_NAME, json.dumps(manifest.to_dict(), indent=1).encode("utf-8"))   # the switch
    keep = set(names)
    for name in d.shards("part-"):      # what killed attempts left (every unit is finished now)
        if name not in keep:
            d.remove(name)
    d.remove(PARTS_DIR)
    docs = sum(r["documents"] for r in records if r is not None)
    log(f"committed {d.shown}: {docs:,} documents, {manifest.num_tokens:,} tokens in {len(names)} shards from "
        f"{n} units")
    return manifest
