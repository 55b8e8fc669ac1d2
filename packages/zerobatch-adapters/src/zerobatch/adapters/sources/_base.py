"""The source interface, the declared output layout of a step, and the helpers every source
shares (NumPy only)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Union

import numpy as np

from zerobatch.adapters._buffers import BufferPool
from zerobatch.core.checks import check_count
from zerobatch.formats.errors import ConfigError, NotFoundError
from zerobatch.readers.base import MAPPED, Access
from zerobatch.samplers import GlobalRandomOrder, IndexOrder, IndexSampler, Schedule, SequentialOrder

__all__ = ["CHUNK_BYTES", "IGNORE_INDEX", "VIEW_STEPS", "Array", "Output", "OutputPlan", "ReadTicket", "Source", "StackedRuns", "Value", "build", "hinted_bytes", "leaves",
           "check_dataset", "how_to_read", "open_reader"]

#: Bytes one read-ahead job fills when steps can be read together (amortizes the hand-off
#: between threads).
CHUNK_BYTES = 1 << 20

#: Steps one read covers when a source hands out views of its files
#: (:meth:`Source.zero_copy`): nothing is copied, so a read is the checking of those steps'
#: data (on the pool) and the loop's share of a read's overhead shrinks with its length
#: (LLMBATCH int32 views, 32 x 512, a second pass: 7.1 us a step with reads of 8 steps, 2.5 us with 64).
VIEW_STEPS = 64

#: Label of tokens that are padding (the ``ignore_index`` of ``torch.nn.functional.cross_entropy``).
IGNORE_INDEX = -100


#: The default seed of every loader and mixture (``Loader``, ``BatchNativeLoader``: the seed
#: document's 42, the JAX loader, ``Mixture``).
DEFAULT_SEED = 42
#: Steps read ahead by default, every loader. Measured on 2 CPUs (an LLMBATCH file of 4,000
#: batches of 64 x 512, ``BatchNativeLoader``): 8 steps read an epoch in 0.09 s, 64 steps in
#: 0.14 s (int64).
DEFAULT_PREFETCH = 8


@dataclasses.dataclass(frozen=True)
class Array:
    """A leaf of a step's output: the read's array ``name`` (with a leading step axis when the
    read is stacked), optionally cut along its last axis (``last=slice(None, -1)``: the inputs
    of next-token pairs, ``slice(1, None)``: their targets; both views of one buffer)."""

    name: str
    last: slice | None = None

    def cut(self, value: Any) -> Any:
        """``value`` (the read's array, NumPy or the framework's) as this leaf hands it out."""
        return value if self.last is None else value[..., self.last]


@dataclasses.dataclass(frozen=True)
class Value:
    """A leaf that is not an array of the read (``max_seqlen``, decoded metadata objects, a
    list of ragged records): handed out as it is."""

    name: str

    def cut(self, value: Any) -> Any:
        return value


#: What a step of a source is: a leaf, or a tuple or dict of outputs.
Output = Union[Array, Value, tuple, dict]


def build(output: Any, leaf: Callable[[Any], Any]) -> Any:
    """The structure ``output`` declares, with each leaf replaced by ``leaf(leaf)``."""
    if isinstance(output, (Array, Value)):
        return leaf(output)
    if isinstance(output, tuple):
        return tuple(build(o, leaf) for o in output)
    return {k: build(o, leaf) for k, o in output.items()}


def leaves(output: Any) -> list[Array | Value]:
    """The leaves of ``output`` in the order :func:`build` visits them."""
    if isinstance(output, (Array, Value)):
        return [output]
    parts = output if isinstance(output, tuple) else output.values()
    return [leaf for o in parts for leaf in leaves(o)]


class OutputPlan:
    """How a declared output is built from a read, with the per-step work of the common
    shapes (one leaf, a tuple or a dict of leaves) done by C loops: a stacked read's arrays
    are cut once for all its steps (:meth:`columns`), and the steps are then ``zip``s of the
    columns. Other shapes go through :func:`build`, with the same result.

    Args:
        output: a source's :attr:`Source.output`.
    """

    def __init__(self, output: Any) -> None:
        self.output = output
        self.leaves = leaves(output)
        if isinstance(output, (Array, Value)):
            self.kind, self.keys = "leaf", None
        elif isinstance(output, tuple) and all(isinstance(o, (Array, Value)) for o in output):
            self.kind, self.keys = "tuple", None
        elif isinstance(output, dict) and all(isinstance(o, (Array, Value)) for o in output.values()):
            self.kind, self.keys = "dict", tuple(output)
        else:
            self.kind, self.keys = "tree", None

    def steps(self, columns: list[list[Any]]) -> list[Any]:
        """The steps of a stacked read: ``columns[j][i]`` is leaf ``j``'s value at step ``i``."""
        if self.kind == "leaf":
            return columns[0]
        if self.kind == "tuple":
            return list(zip(*columns, strict=True))
        if self.kind == "dict":
            keys = self.keys
            return [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]
        slots = {id(leaf): col for leaf, col in zip(self.leaves, columns, strict=True)}
        n = len(columns[0]) if columns else 0
        return [build(self.output, lambda leaf, i=i: slots[id(leaf)][i]) for i in range(n)]

    def one(self, values: dict[str, Any]) -> Any:
        """One step from its values by name (each leaf cut from its value)."""
        if self.kind == "leaf":
            return self.output.cut(values[self.output.name])
        if self.kind == "tuple":
            return tuple(leaf.cut(values[leaf.name]) for leaf in self.output)
        if self.kind == "dict":
            return {k: leaf.cut(values[leaf.name]) for k, leaf in self.output.items()}
        return build(self.output, lambda leaf: leaf.cut(values[leaf.name]))


def array_names(output: Any) -> set[str]:
    """The names of the arrays the output's leaves read."""
    if isinstance(output, Array):
        return {output.name}
    if isinstance(output, Value):
        return set()
    parts = output if isinstance(output, tuple) else output.values()
    return set().union(*(array_names(o) for o in parts)) if parts else set()


def check_token_dtype(dtype: Any) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in (np.int64, np.int32):
        raise ConfigError(f"dtype must be int64 or int32, got {dt}", field="dtype")
    return dt


def check_pad_id(value: Any) -> int:
    """A padding id: an integer that fits the int32 batches as well as the int64 ones."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not -2**31 <= int(value) < 2**31:
        raise ConfigError(f"pad_id must be an integer in [-2**31, 2**31), got {value!r}", field="pad_id")
    return int(value)


def check_position_dtype(value: Any) -> np.dtype:
    """The dtype of position ids: ``int64`` or ``int32``."""
    try:
        dt = np.dtype(value)
    except TypeError:
        dt = None
    if dt not in (np.dtype(np.int64), np.dtype(np.int32)):
        raise ConfigError(f"position_dtype must be int64 or int32, got {value!r}", field="position_dtype")
    return dt


def open_reader(value: Any, cls: type, **kwargs: Any) -> Any:
    """``value`` if it is already a ``cls`` reader, else ``cls(value, **kwargs)``."""
    return value if isinstance(value, cls) else cls(value, **kwargs)


def _article(words: str) -> str:
    """``words`` after "a" or "an" ("an LLMBATCH file", "a TOKSTREAM dataset", "a folder")."""
    first = words[:1]
    vowel = first in "aeiou" if first.islower() else first in "AEFHILMNORSX"   # letters said with a vowel
    return f"{'an' if vowel else 'a'} {words}"


def _what(fmt: Any) -> str:
    """How a message names a dataset of the format ``fmt``: "an LLMBATCH file", "a TOKSTREAM dataset"."""
    return _article(f"{fmt.title} {'file' if fmt.layout == 'file' else 'dataset'}")


def _call(target: str) -> str:
    """How to call the source that ``target`` (``"module:Class"``) names on a path, with its
    other required arguments by name: ``TokenWindows(path, seq_len)``."""
    name = target.rpartition(":")[2]
    try:
        module, _, attr = target.partition(":")
        target_obj = getattr(importlib.import_module(module), attr)
        params = list(inspect.signature(target_obj).parameters.values())[1:]
    except (ImportError, AttributeError, TypeError, ValueError):
        return f"{name}(path, ...)"
    required = [p.name for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return f"{name}({', '.join(['path', *required])})"


def how_to_read(fmt: Any, path: str) -> str:
    """The sources that read a dataset of the format ``fmt`` (and the loader, when a path alone
    opens it): "LLMBatchSource(path) (or Loader('x.batch'))"."""
    calls = " or ".join(_call(t) for t in fmt.sources) or "its reader"
    if fmt.default_source:
        calls += f" (or Loader({path!r}))"
    return calls


def check_dataset(value: Any, source: str, accepts: tuple[str, ...], expected: str | None = None) -> None:
    """Before the source ``source`` opens ``value`` (when it is a local path): refuse a path
    that does not exist, or that holds a dataset of another format than ``accepts`` (the
    registry's format names), naming the format found and the source that reads it, rather
    than let the reader fail on a file it was never meant to open
    (``x.batch/manifest.json: cannot open: Not a directory``). An open reader, a URL (found
    out by the reader, not with requests made here) and a path of no known format (the
    reader says what is wrong with it) pass.

    Args:
        value: what the source was given.
        source: the source's name, for the message.
        accepts: the formats the source reads.
        expected: how the message names what the source reads (default: from ``accepts``).

    Raises:
        NotFoundError: nothing at the path (field ``path``).
        ConfigError: a dataset of another format, or a file where the source reads folders or
            a folder where it reads files (field ``path``).
    """
    from zerobatch.core.remote import local_or_none
    from zerobatch.formats.registry import get
    from zerobatch.readers.detect import find

    path = local_or_none(value)
    if path is None:                        # an object in storage: its reader checks it
        return
    raw = os.fspath(value)
    formats = [get(name) for name in accepts]
    if expected is None:
        expected = " or ".join(_what(f) for f in formats)
    if not os.path.lexists(path):
        raise NotFoundError(f"does not exist ({source} reads {expected})", path=path, field="path")
    fmt = find(path)
    name = os.path.basename(os.path.normpath(path)) or path
    if fmt is not None and fmt.name not in accepts:
        raise ConfigError(f"{name} is {_what(fmt)}, not {expected}: read it with {how_to_read(fmt, raw)}",
                          path=path, field="path")
    if fmt is not None or not os.path.exists(path):
        return
    layouts = {f.layout for f in formats}
    if os.path.isdir(path):
        try:
            npy = any(n.endswith(".npy") for n in os.listdir(path))
        except OSError:
            npy = False                     # unreadable: the reader says so
        if formats and npy:                 # a source of a registered format given NpyTokenWindows' data
            raise ConfigError(f"{name} is a folder of .npy token files, not {expected}: read it with "
                              f"NpyTokenWindows(path, seq_len)", path=path, field="path")
        if layouts == {"file"}:
            raise ConfigError(f"{name} is a folder, not {expected}", path=path, field="path")
    elif "folder" in layouts or not formats:
        folders = " or ".join(f"{_what(f)} (a folder holding {', '.join(f.markers)})"
                              for f in formats if f.layout == "folder") or expected
        if "file" in layouts:
            files = " or ".join(_what(f) for f in formats if f.layout == "file")
            raise ConfigError(f"{name} is not {files} (its first bytes are no zerobatch magic) and not "
                              f"{folders}", path=path, field="path")
        raise ConfigError(f"{name} is a file, not {folders}", path=path, field="path")


class Source(ABC):
    """Items a loader can read: a view of one reader (see :mod:`zerobatch.adapters.sources`).

    Attributes:
        kind: the source family, recorded in a loader's state.
        num_items: items in the source.
        fingerprint: identity of the data (a build id), checked when a state is loaded.
        rows_per_item: rows of the batch dimension one item fills (a pre-formed LLMBATCH
            batch fills ``batch_size`` rows, everything else one).
        stacked: every read returns one dict of arrays with a leading step axis (else a list
            of per-step dicts).
        output: what a step is handed out as (:class:`Array` / :class:`Value` leaves in
            tuples and dicts); the loaders build it from a read with one generic function.
        item_name: what an item is called in messages (``"windows"``, ``"documents"``).
        batch_schedule: ``[(step, global batch), ...]`` when the source sets each step's batch
            itself (a mixture's or curriculum's ramp; the loader is then given no batch
            size), else ``None``.
    """

    kind: str = ""
    num_items: int = 0
    fingerprint: str = ""
    rows_per_item: int = 1
    stacked: bool = True
    output: Any = Array("tokens")
    item_name: str = "items"
    batch_schedule: list[tuple[int, int]] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # every source remembers the arguments it was made with (the outermost constructor's:
        # a Curriculum's, not the Mixture's it calls), so a run card can describe it and
        # rebuild it (:meth:`spec`)
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return
        signature = inspect.signature(init)

        @functools.wraps(init)
        def remembering(self: Source, *args: Any, **kw: Any) -> None:
            if "_made_with" not in self.__dict__:
                bound = signature.bind(self, *args, **kw)
                self.__dict__["_made_with"] = (type(self).__name__, dict(list(bound.arguments.items())[1:]))
            init(self, *args, **kw)

        cls.__init__ = remembering  # type: ignore[method-assign]

    def spec(self) -> dict[str, Any]:
        """What this source is, as JSON: its class and the arguments it was made with (an
        open reader given as its path; :func:`spec_value`), for a run card
        (:func:`zerobatch.adapters.provenance.run_card`);
        :func:`~zerobatch.adapters.provenance.source_from_spec` makes the same source again.

        Raises:
            ConfigError: an argument with no JSON form (an object other than a reader, a
                source or a weight schedule).
        """
        made = self.__dict__.get("_made_with")
        if made is None:
            raise ConfigError(f"a {type(self).__name__} made without its constructor cannot be described",
                              field="source")
        name, args = made
        return {"zerobatch_source": name, **{k: spec_value(v, k) for k, v in args.items()}}

    # -- provenance: which tokens an item holds, and which items hold given tokens -----------
    # Token positions are global positions in the source's dataset; documents are numbered
    # by :meth:`units` (a TOKSTREAM reader's documents, or an LLMBATCH file's rows).

    def units(self) -> Any:
        """What numbers this source's documents: an object with ``num_documents``,
        ``documents_at(positions)``, ``document_spans(documents)`` and
        ``windows_metadata(starts, 1)`` (a TOKSTREAM reader).

        Raises:
            ConfigError: a source whose items cannot be traced to documents.
        """
        raise ConfigError(f"a {type(self).__name__} source cannot be traced to documents", field="source")

    def token_spans(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(which, starts, stops)``: the spans of tokens ``items`` (1-D) hold, item after
        item and in the order each item's row holds them (``which``: the item's index in
        ``items``; an item of several rows, an LLMBATCH batch, gives one span a row)."""
        raise ConfigError(f"a {type(self).__name__} source cannot be traced to documents", field="source")

    def items_at(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(items, which)``: every item holding a token of the ranges ``[starts, stops)``
        (``which``: the range), the inverse of :meth:`token_spans`."""
        raise ConfigError(f"a {type(self).__name__} source cannot be traced to documents", field="source")

    def geometry(self) -> dict[str, Any]:
        """The arguments that decide how this source cuts its data into items, beyond the
        data's identity (the fingerprint): ``{"seq_len": 2048, "stride": 2048}`` for token
        windows. JSON-able; a loader records them in its state, so a state that does not fit
        names the one that changed rather than only the item count it changes. Empty (the
        default) when the items are the data's own (documents, records)."""
        return {}

    def __init__(self) -> None:
        self._pools: dict[tuple[Any, ...], BufferPool] = {}
        self._pools_lock = threading.Lock()

    def default_order(self, shuffle: bool, seed: int) -> IndexOrder:
        """The order a loader uses unless given one: a Feistel shuffle, or ascending."""
        return GlobalRandomOrder(self.num_items, seed=seed) if shuffle else SequentialOrder(self.num_items)

    def schedule(self, batch_size: int, *, rank: int, world_size: int, shuffle: bool = True, seed: int = 0,
                 tail: str = "drop", order: IndexOrder | None = None, epoch: int = 0) -> Schedule:
        """The schedule a loader reads this source in: an
        :class:`~zerobatch.samplers.IndexSampler` of ``batch_size`` items per step on this
        rank over ``order`` (default :meth:`default_order`), with the source's fingerprint and
        kind checked when a state is loaded. An endless order keeps every step (no tail).

        Raises:
            ConfigError: an order over another number of items, or an argument out of range.
        """
        if order is None:
            order = self.default_order(shuffle, seed)
        elif not isinstance(order, IndexOrder) or order.num_items != self.num_items:
            raise ConfigError(f"order must be an IndexOrder over the source's {self.num_items} items", field="order")
        if not order.has_epochs:
            tail = "keep"
        return IndexSampler(order, batch_size, rank=rank, world_size=world_size, tail=tail, epoch=epoch,
                            fingerprint=self.fingerprint, label=self.kind)

    def chunk_steps(self, items_per_step: int) -> int:
        """Steps one read covers (1 for sources that read step by step)."""
        return 1

    def inline(self, dtype: np.dtype, items_per_step: int) -> bool:
        """True when a read costs nothing worth a thread."""
        return False

    def zero_copy(self, dtype: np.dtype, items_per_step: int) -> bool:
        """True when reads hand out views of the files (no output buffer): a read then covers
        :data:`VIEW_STEPS` steps, more than the loader's ``prefetch`` (what runs ahead is their
        checking, which holds no memory)."""
        return False

    @property
    def access(self) -> Access:
        """What reaching the source's bytes costs, as its reader declares it
        (:class:`~zerobatch.readers.base.Access`): the loader plans read-ahead by it. A source
        over a reader returns the reader's; this default is local files'."""
        return MAPPED

    @property
    def remote(self) -> bool:
        """Whether the source's bytes are fetched from object storage (``access.fetched``)."""
        return self.access.fetched

    def prepare(self, items: np.ndarray) -> int | None:  # noqa: B027 - optional hook, no-op by default
        """Called in order as reads are planned (read-ahead hints). Returns the bytes it
        asked to fetch ahead, when known (the loader keeps at most ``Access.hint_bytes`` of
        them ahead of its reads), or ``None``."""
        return None

    #: Whether the loader's ``dtype`` sets the element type of the arrays ``tokens`` and
    #: ``labels`` only (a loader copying to a device may then read int32 ids and widen them
    #: there; see ``zerobatch.adapters.torch.TOKEN_ARRAYS``).
    token_arrays_only = False

    #: ``read_async(pool, items, dtype)``: the read queued on a
    #: :class:`~zerobatch.core.pool.TaskPool` as one compiled task, returning a ticket with
    #: ``wait()`` (the result) and ``cancel()`` (a :class:`ReadTicket`), or ``None`` when this
    #: read has no such path; sources without it are read as Python calls.
    read_async: Any = None

    @abstractmethod
    def read(self, items: np.ndarray, dtype: np.dtype) -> dict[str, Any] | list[dict[str, Any]]:
        """Read ``items`` (``int64 (steps, items_per_step)``), on a worker thread: a dict of
        arrays with a leading step axis (``stacked``), or a list of per-step dicts."""

    def _buffer(self, shape: tuple[int, ...], dtype: np.dtype, count: int = 24) -> np.ndarray:
        """A reusable output array (never one the training loop still holds)."""
        key = (shape, dtype.str)
        with self._pools_lock:
            pool = self._pools.get(key)
            if pool is None:
                if len(self._pools) > 16:
                    self._pools.clear()
                pool = self._pools[key] = BufferPool(shape, dtype, max_buffers=count,
                                                     allocate=self.__dict__.get("_allocate"))
        return pool.acquire()

    def use_allocator(self, allocate: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None) -> None:
        """Make the output arrays of later reads with ``allocate(shape, dtype)`` (``None``:
        ``numpy.empty``): a loader that copies to a CUDA device has reads gather straight into
        page-locked memory, allocated once per buffer of the pools and reused. The sources of
        a mixture are told too."""
        with self._pools_lock:
            self._allocate = allocate
            self._pools = {}
        for inner in getattr(self, "sources", None) or ():
            if isinstance(inner, Source):
                inner.use_allocator(allocate)

    def _flat(self, n: int, dtype: np.dtype) -> np.ndarray:
        """A reusable 1-D output of ``n`` elements whose size changes from step to step (whole
        documents): the first ``n`` of a pooled buffer of the next power of two (at least 64 Ki
        elements), so a handful of buffers serve every step. A view keeps its buffer from
        being handed out again while the training loop holds it."""
        size = max(1 << 16, 1 << (max(n, 1) - 1).bit_length())
        return self._buffer((size,), dtype, count=8)[:n]

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release the files."""

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_pools"] = {}
        d.pop("_pools_lock", None)
        d.pop("_allocate", None)          # page-locked memory is this process's
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._pools_lock = threading.Lock()


def spec_value(value: Any, field: str) -> Any:
    """``value`` (a source's constructor argument) as JSON: a source as its spec, an open
    reader as its path, a dtype as its name, a weight schedule as its points.

    Raises:
        ConfigError: a value with no JSON form.
    """
    from zerobatch.samplers import WeightSchedule
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, Source):
        return value.spec()
    if isinstance(value, WeightSchedule):
        return {"zerobatch_weight_schedule": {"points": [[s, spec_value(w, field)] for s, w in
                                                         zip(value.steps, value.raw, strict=True)],
                                              "interpolation": value.interpolation}}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (tuple, list)):
        return [spec_value(v, field) for v in value]
    if isinstance(value, dict):
        return {str(k): spec_value(v, field) for k, v in value.items()}
    if isinstance(value, (np.dtype, type)):
        try:
            return np.dtype(value).name
        except TypeError:
            pass
    for attr in ("folder", "path"):         # an open reader: the dataset it reads
        where = getattr(value, attr, None)
        if isinstance(where, str) and hasattr(value, "close"):
            return where
    raise ConfigError(f"{field}: a {type(value).__name__} has no run card form (give sources paths, numbers and "
                      f"names)", field=field)


class StackedRuns(list):
    """A read's result in runs: each a dict of arrays with a leading step axis (as a stacked
    read's), the runs' steps in order (views of a file whose steps are evenly spaced within a
    run: each run costs one conversion, not one per step)."""


class ReadTicket:
    """A compiled read queued on a task pool (its ``ticket``), and the result it fills."""

    __slots__ = ("ticket", "result")

    def __init__(self, ticket: Any, result: Any) -> None:
        self.ticket, self.result = ticket, result

    def wait(self) -> Any:
        self.ticket.wait()
        return self.result

    def cancel(self, wait: bool = True) -> None:
        self.ticket.cancel() if wait else self.ticket.cancel(False)


def hinted_bytes(reader: Any, tokens: int) -> int | None:
    """The bytes of ``tokens`` tokens of ``reader`` (its ``itemsize`` a token), for a
    :meth:`Source.prepare` to return; ``None`` for a reader that does not say."""
    itemsize = getattr(reader, "itemsize", None)
    return tokens * itemsize if isinstance(itemsize, int) else None


def next_token_pair(name: str = "tokens") -> tuple[Array, Array]:
    """``(x, y)``: the inputs and targets of next-token windows, two views of one buffer."""
    return Array(name, slice(None, -1)), Array(name, slice(1, None))


def check_seq_len(value: Any, name: str = "seq_len") -> int:
    return check_count(value, name, minimum=1)
