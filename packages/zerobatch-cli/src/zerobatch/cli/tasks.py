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
goes and a second commit finds the dataset committed. The dataset is the same for any ``N``,
byte for byte (shard names and contents depend on units, not tasks; each shard's build id
derives from the plan and the unit, see :func:`unit_seed`), and holds the documents of a one-process ``convert`` in the same
order.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerobatch.cli.sources import TextSource
from zerobatch.core.io import AtomicFile, read_document
from zerobatch.formats import tokstream as T
from zerobatch.formats.errors import ConfigError, CorruptError, NotFoundError

__all__ = ["DEFAULT_UNIT_BYTES", "PARTS_DIR", "Unit", "commit", "plan_units", "task_units"]

#: Bytes of a large JSONL or line-split text file per unit.
DEFAULT_UNIT_BYTES = 64 << 20
#: The folder of the plan and the finished units' records, inside the destination.
PARTS_DIR = "_parts"
PLAN_NAME = "plan.json"
_UNIT_RECORD = re.compile(r"^unit-(\d{6,})\.json$")


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


def _parts(dst: str) -> str:
    return os.path.join(dst, PARTS_DIR)


def _unit_record(dst: str, u: int) -> str:
    return os.path.join(_parts(dst), f"unit-{u:06d}.json")


def write_plan(dst: str, plan: dict[str, Any]) -> None:
    """``_parts/plan.json`` written, or the one there checked to be the same.

    Raises:
        ConfigError: another plan is there (other inputs, tokenizer or options), or the
            dataset is committed already.
    """
    if os.path.lexists(os.path.join(dst, T.MANIFEST_NAME)):
        raise ConfigError("destination: the dataset is committed already (manifest.json); prepare into a new folder",
                          path=dst, field="destination")
    os.makedirs(_parts(dst), exist_ok=True)
    path = os.path.join(_parts(dst), PLAN_NAME)
    raw = json.dumps(plan, indent=1, sort_keys=True).encode("utf-8")
    try:
        old = read_document(path, limit=64 << 20, field=PLAN_NAME)
    except NotFoundError:
        with AtomicFile(path) as f:
            f.write(raw)
        return
    if old != raw:
        try:
            theirs = json.loads(old)
        except ValueError:
            raise CorruptError("plan.json: not JSON", path=path, field=PLAN_NAME) from None
        diff = sorted(k for k in set(plan) | set(theirs) if plan.get(k) != theirs.get(k))
        raise ConfigError(f"plan.json: the other tasks of this preparation have another {', '.join(diff)} (every "
                          f"task must get the same inputs and options)", path=path, field=diff[0] if diff else "plan")


def finished(dst: str, u: int) -> dict[str, Any] | None:
    """Unit ``u``'s record, if it finished."""
    try:
        return json.loads(read_document(_unit_record(dst, u), limit=1 << 20, field="unit"))
    except NotFoundError:
        return None
    except ValueError:
        return None       # torn by a crash: AtomicFile makes that impossible, treated as unfinished


def clear_unit(dst: str, u: int) -> None:
    """What an unfinished attempt at unit ``u`` left: its shards and its temporary folder."""
    prefix = f"part-{u:06d}-"
    for e in os.scandir(dst):
        if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path)
    shutil.rmtree(os.path.join(_parts(dst), f"unit-{u:06d}.tmp"), ignore_errors=True)


def write_unit(dst: str, u: int, documents: Any = (), *, vocab_size: int, eod: int | None, shard_tokens: int,
               checksum_block: int = T.DEFAULT_CHECKSUM_BLOCK, metas: Any = None, chunks: Any = None,
               build_seed: bytes | None = None) -> dict[str, Any]:
    """Unit ``u``'s ``documents`` (arrays of token ids; ``metas``: their metadata, in order) or
    ``chunks`` (``(tokens, lengths)`` of many documents each, without metadata: written in a
    few calls) as shards ``part-<u>-<k>`` in ``dst``, then its record; returns the record.
    ``build_seed``: the shards' build ids derive from it (see :class:`ShardWriter`), else
    they are drawn."""
    from zerobatch.writers.tokstream import TokenStreamWriter
    clear_unit(dst, u)
    tmp = os.path.join(_parts(dst), f"unit-{u:06d}.tmp")
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
        for name in names:
            os.rename(os.path.join(tmp, name), os.path.join(dst, name))
    else:
        w.abort()
    record = {"unit": u, "shards": names, "documents": docs, "tokens": tokens}
    with AtomicFile(_unit_record(dst, u)) as f:
        f.write(json.dumps(record).encode("utf-8"))
    shutil.rmtree(tmp, ignore_errors=True)
    return record


def unit_seed(plan: dict[str, Any], u: int) -> bytes:
    """The build seed of unit ``u`` of ``plan``: the plan names everything that decides the
    unit's contents (input files with sizes and times, tokenizer, options, version), so the
    same unit is written with the same build ids by any task, any ``N``, any rerun."""
    what = {k: v for k, v in plan.items() if k != "tasks"}       # the same for any number of tasks
    return json.dumps([what, u], sort_keys=True).encode("utf-8")


def read_plan(dst: str) -> dict[str, Any]:
    path = os.path.join(_parts(dst), PLAN_NAME)
    try:
        plan = json.loads(read_document(path, limit=64 << 20, field=PLAN_NAME))
    except NotFoundError:
        raise NotFoundError("plan.json: no preparation here (run the convert tasks with --task/--tasks first)",
                            path=path, field=PLAN_NAME) from None
    except ValueError:
        raise CorruptError("plan.json: not JSON", path=path, field=PLAN_NAME) from None
    if not isinstance(plan, dict) or not isinstance(plan.get("units"), list) or not isinstance(plan.get("tasks"), int):
        raise CorruptError("plan.json: no units or tasks", path=path, field=PLAN_NAME)
    return plan


def commit(dst: str, *, log: Callable[[str], None] = print) -> T.DatasetManifest:
    """Assemble the dataset the tasks prepared in ``dst`` (see the module documentation).

    Raises:
        ConfigError: a unit is not finished (the message names the tasks to run again);
            nothing is changed.
        NotFoundError: no preparation in ``dst``.
    """
    from zerobatch.writers.tokstream import assemble
    dst = os.path.abspath(os.fspath(dst))
    manifest_path = os.path.join(dst, T.MANIFEST_NAME)
    if os.path.lexists(manifest_path) and not os.path.isdir(_parts(dst)):
        log(f"{dst}: committed already")
        return T.parse_manifest(read_document(manifest_path, limit=T.MAX_MANIFEST_BYTES, field="manifest.json"),
                                path=manifest_path)
    plan = read_plan(dst)
    n, tasks = len(plan["units"]), plan["tasks"]
    records = [finished(dst, u) for u in range(n)]
    missing = [u for u, r in enumerate(records) if r is None]
    if missing:
        owners = sorted({t for t in range(tasks) for u in missing if u in task_units(n, t, tasks)})
        shown = ", ".join(map(str, owners[:20])) + (", ..." if len(owners) > 20 else "")
        raise ConfigError(f"commit: {len(missing)} of {n} units are not finished; run these of the {tasks} tasks "
                          f"again: {shown}", path=dst, field="tasks")
    names = [name for r in records if r is not None for name in r["shards"]]
    if not names:
        raise ConfigError("commit: the inputs hold no documents", path=dst, field="tasks")
    manifest = assemble(dst, names)
    keep = set(names)
    for e in os.scandir(dst):        # what killed attempts left (every unit is finished now)
        if e.name.startswith("part-") and e.name not in keep and e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path)
    shutil.rmtree(_parts(dst), ignore_errors=True)
    docs = sum(r["documents"] for r in records if r is not None)
    log(f"committed {dst}: {docs:,} documents, {manifest.num_tokens:,} tokens in {len(names)} shards from {n} units")
    return manifest
