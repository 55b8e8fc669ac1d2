"""Grain adapter: zerobatch data in Grain pipelines, both ways round (tested with grain 0.2.18).

- :class:`DataSource` is a Grain random-access data source (the ``RandomAccessDataSource``
  protocol: ``__len__`` and ``__getitem__``, plus the batched ``_getitems`` of
  ``SupportsBatchedReadRandomAccessDataSource``, a stable ``__repr__`` for the ``DataLoader``'s
  checkpoint check, and pickling as paths for Grain's worker processes) over any zerobatch
  source: record ``i`` is item ``i`` of the source (a TOKSTREAM window, a document padded to a
  width, a ZRECORD record...), as the source hands out a step of that one item, without the
  batch axis. :class:`Documents` is one over whole documents of a TOKSTREAM dataset, each its
  own length (what Grain's packing transforms take). Grain's own samplers, ``MapDataset``
  transforms (shuffle, batch, packing), worker processes and checkpoints (the iterator's
  ``get_state`` / ``set_state``, ``grain.checkpoint.CheckpointHandler``) do the rest: a record
  is a pure function of its index, so Grain's index-based state resumes exactly.
- :class:`LoaderDataset` is the other way round: zerobatch's own order (a Feistel shuffle of
  all items each epoch), rank sharding and O(1) elastic resume as a Grain ``IterDataset``. Its
  iterator's ``get_state`` is the zerobatch loader's state, so a Grain checkpoint of it resumes
  on any number of processes (the same global batch continues in exactly the uninterrupted
  order), and its ``start_prefetch`` is the loader's: the first batch is read on the loader's
  read-ahead threads while the trainer restores its model.

Why these hooks: the data-source protocol (``__len__`` / ``__getitem__``) is the one Grain
documents for custom sources and has kept since its first release, and ``IterDataset`` /
``DatasetIterator`` (``__next__``, ``get_state``, ``set_state``, ``start_prefetch``, ``close``)
is the iterator contract every Grain transform, ``mp_prefetch`` and the Orbax
``grain.checkpoint`` handler call. ``_getitems`` is Grain's batched read (used by its batch
push-down when enabled); nothing else of Grain's private API is used.

Example::

    import grain
    from zerobatch.adapters.grain import DataSource
    from zerobatch.adapters.sources import TokenWindows

    ds = (grain.MapDataset.source(DataSource(TokenWindows("corpus", seq_len=2048)))
          .shuffle(seed=1).batch(8).to_iter_dataset())
    it = iter(ds)                       # (x, y): int32 (8, 2048) each; it.get_state(): {"next_index": k}

Importing this module imports ``grain``; :mod:`zerobatch.adapters` itself never does.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

try:
    import grain
except ImportError as exc:  # pragma: no cover - exercised only without grain
    raise ImportError("zerobatch.adapters.grain needs grain: pip install 'zerobatch-adapters[grain]'") from exc

from zerobatch.adapters._loader import BaseLoader
from zerobatch.adapters.sources import Source, open_source
from zerobatch.adapters.sources._base import (Array, OutputPlan, StackedRuns, check_dataset, check_token_dtype,
                                              open_reader)
from zerobatch.core.checks import check_count
from zerobatch.formats.errors import ConfigError, OutOfRangeError, StateError

__all__ = ["DataSource", "Documents", "LoaderDataset", "LoaderIterator", "die_with_parent"]

#: The key of the zerobatch loader's state inside a :class:`LoaderIterator` state.
STATE_KEY = "zerobatch"

_END = object()


def _check_index(index: Any, n: int) -> int:
    if isinstance(index, bool) or not hasattr(index, "__index__"):
        raise ConfigError(f"index must be an integer, got {index!r}", field="index")
    i = index.__index__()
    if not 0 <= i < n:
        raise OutOfRangeError(f"index {i} is outside [0, {n})", field="index")
    return i


class DataSource:
    """A Grain random-access data source over a zerobatch source.

    Record ``i`` is item ``i`` of ``source`` as a loader step of that one item hands it out,
    without the batch axis: for ``TokenWindows(folder, seq_len)`` the pair ``(x, y)`` of
    ``seq_len`` tokens each (views of one window of ``seq_len + 1``; ``next_token=False``: the
    window alone); for ``TokenDocuments`` the dict ``input_ids``, ``labels``,
    ``attention_mask`` of one padded row; for ``RecordFields`` the record's fields; with
    ``TokenWindows(..., boundaries=True)`` the row's ``position_ids``, ``segment_ids`` and its
    own ``cu_seqlens`` / ``max_seqlen``. Grain's ``batch`` stacks records into batches. An
    LLMBATCH file's item is a whole pre-formed batch, so its record keeps its batch axis.

    Args:
        source: a zerobatch source (``TokenWindows``, ``TokenDocuments``, ``PackedDocuments``,
            ``RecordFields``, ``LLMBatchSource``...) or a ``.batch`` path. A ``Mixture`` or
            ``Curriculum`` is refused: its items are drawn by a schedule, not numbered (use
            Grain's ``MapDataset.mix`` over one data source per dataset).
        dtype: ``int32`` (default: JAX's integer, half the bytes) or ``int64`` token ids.

    Reads are the source's compiled, GIL-releasing gathers, safe from Grain's threads; the
    source pickles as its arguments and reopens its files in Grain's worker processes.

    Raises:
        ConfigError: a mixture or curriculum, or a bad ``dtype``.
    """

    def __init__(self, source: Any, *, dtype: Any = np.int32) -> None:
        src = open_source(source)
        if src.batch_schedule is not None or src.kind in ("mixture", "curriculum"):
            raise ConfigError("source: a Mixture or Curriculum has no numbered items for a random-access data source; "
                              "make one DataSource per dataset and mix them with grain.MapDataset.mix",
                              field="source")
        self.source: Source = src
        self.dtype = check_token_dtype(dtype)
        self._plan = OutputPlan(src.output)
        # a record-store field handed out unpadded is a list of records per step
        self._lists = {leaf.name for leaf in self._plan.leaves if not isinstance(leaf, Array)} \
            if src.kind == "zrecord" else set()

    def __len__(self) -> int:
        return int(self.source.num_items)

    def __getitem__(self, index: int) -> Any:
        """Record ``index`` (see the class documentation).

        Raises:
            OutOfRangeError: ``index`` outside ``[0, len(self))`` (an ``IndexError``).
            ConfigError: a non-integer index.
        """
        return self._read([_check_index(index, len(self))])[0]

    def _getitems(self, indices: Sequence[int]) -> list[Any]:
        """Records ``indices`` in one read of the source (Grain's batched read)."""
        n = len(self)
        return self._read([_check_index(i, n) for i in indices])

    def _read(self, indices: list[int]) -> list[Any]:
        if not indices:
            return []
        # one step per record: a step's step-level outputs (cu_seqlens, max_seqlen) are then
        # the record's own
        items = np.asarray(indices, dtype=np.int64).reshape(-1, 1)
        result = self.source.read(items, self.dtype)
        row = self.source.rows_per_item == 1
        if isinstance(result, dict):
            result = StackedRuns([result])
        if isinstance(result, StackedRuns):
            out: list[Any] = []
            for run in result:
                for s in range(next(iter(run.values())).shape[0]):
                    out.append(self._plan.one({k: (v[s][0] if row else v[s]) for k, v in run.items()}))
            return out
        return [self._plan.one({k: self._unbatch(k, v, row) for k, v in step.items()}) for step in result]

    def _unbatch(self, name: str, value: Any, row: bool) -> Any:
        """A per-step value of a one-item step without its batch axis (arrays whose first
        axis holds the one row; a step-level array such as ``cu_seqlens`` has two entries at
        least and is kept)."""
        if name in self._lists:
            return value[0]
        if row and isinstance(value, np.ndarray) and value.ndim >= 1 and value.shape[0] == 1:
            return value[0]
        return value

    def __repr__(self) -> str:
        # stable across processes and runs (Grain's DataLoader checks it when it restores)
        geometry = "".join(f", {k}={v!r}" for k, v in self.source.geometry().items())
        return (f"zerobatch.adapters.grain.DataSource({self.source.kind}{geometry}, {len(self)} "
                f"{self.source.item_name}, data {self.source.fingerprint!r}, dtype={self.dtype.name})")

    def close(self) -> None:
        """Release the source's files."""
        self.source.close()


class Documents:
    """A Grain random-access data source over the whole documents of a TOKSTREAM dataset:
    record ``i`` is document ``i``'s tokens, a 1-D array of its own length (what Grain's
    packing transforms, ``grain.experimental.FirstFitPackIterDataset`` and friends, pack).

    Args:
        dataset: the dataset folder (or URL) or an open
            :class:`~zerobatch.readers.tokstream.TokenStreamReader`.
        dtype: ``int32`` (default) or ``int64``.
        max_length: cut longer documents to their first ``max_length`` tokens.
        verify: check chunk checksums on first read.

    Raises:
        ConfigError, NotFoundError: a path of another format, or none.
    """

    def __init__(self, dataset: Any, *, dtype: Any = np.int32, max_length: int | None = None,
                 verify: bool = True) -> None:
        from zerobatch.readers.tokstream import TokenStreamReader
        check_dataset(dataset, "Documents", ("tokstream",))
        self.reader = open_reader(dataset, TokenStreamReader, verify=verify)
        self.dtype = check_token_dtype(dtype)
        self.max_length = None if max_length is None else check_count(max_length, "max_length", minimum=1)
        self.num_documents = int(self.reader.num_documents)
        self.fingerprint = self.reader.manifest.build_id

    def __len__(self) -> int:
        return self.num_documents

    def __getitem__(self, index: int) -> np.ndarray:
        """Document ``index``'s tokens.

        Raises:
            OutOfRangeError: ``index`` outside ``[0, len(self))``.
        """
        return self._getitems([index])[0]

    def _getitems(self, indices: Sequence[int]) -> list[np.ndarray]:
        """Documents ``indices``: one compiled gather of exactly their tokens, split."""
        n = len(self)
        idx = np.asarray([_check_index(i, n) for i in indices], dtype=np.int64)
        if idx.size == 0:
            return []
        starts, stops = self.reader.document_spans(idx)
        if self.max_length is not None:
            stops = np.minimum(stops, starts + self.max_length)
        flat = self.reader.ranges(starts, stops, dtype=self.dtype)
        return np.split(flat, np.cumsum(stops - starts)[:-1])

    def __repr__(self) -> str:
        cut = "" if self.max_length is None else f", max_length={self.max_length}"
        return (f"zerobatch.adapters.grain.Documents({len(self)} documents, data {self.fingerprint!r}, "
                f"dtype={self.dtype.name}{cut})")

    def close(self) -> None:
        """Release the dataset's files."""
        self.reader.close()


class LoaderDataset(grain.IterDataset):
    """zerobatch's own order as a Grain ``IterDataset``: each element is one step's batch for
    this rank, exactly as a zerobatch loader yields it (NumPy arrays by default).

    Each ``iter()`` makes its own loader over the shared ``source``; its iterator
    (:class:`LoaderIterator`) saves and restores the loader's state through Grain's
    ``get_state`` / ``set_state`` (and so through ``grain.checkpoint.CheckpointHandler`` and
    Orbax), which resumes on any world size by zerobatch's rule.

    Args:
        source: a zerobatch source (``TokenWindows(folder, seq_len)``, a ``Mixture``...).
        batch_size, global_batch_size, shuffle, seed, drop_last, tail, order, rank,
            world_size, prefetch, num_threads, dtype, and any other argument of the loader:
            as for :class:`zerobatch.adapters.torch.Loader` (``dtype`` defaults to ``int32``;
            ``rank`` / ``world_size`` default to ``torch.distributed`` when initialized, else
            ``RANK`` / ``WORLD_SIZE``: pass ``jax.process_index()`` / ``jax.process_count()``
            in a JAX job, or ``loader_class=zerobatch.adapters.jax.Loader``).
        num_epochs: iteration ends after epoch ``num_epochs - 1`` (counted from epoch 0, so a
            resumed iterator ends where the uninterrupted one does); ``None``: epoch after
            epoch, endlessly. An endless source (a mixture) never ends.
        loader_class: the loader to build (default the NumPy loader shared by the torch and
            JAX ones; ``zerobatch.adapters.jax.Loader`` yields ``jax.Array`` s).

    Raises:
        ConfigError: the loader's (checked here, when the dataset is made).
    """

    def __init__(self, source: Any, batch_size: int | None = None, *, num_epochs: int | None = 1,
                 loader_class: Callable[..., BaseLoader] | None = None, **loader_args: Any) -> None:
        super().__init__()
        self.source = open_source(source)
        self.num_epochs = None if num_epochs is None else check_count(num_epochs, "num_epochs", minimum=1)
        self.loader_class = BaseLoader if loader_class is None else loader_class
        loader_args.setdefault("dtype", np.int32)
        self.loader_args = {"batch_size": batch_size, **loader_args}
        self._make_loader()                 # checks the arguments now

    def _make_loader(self) -> BaseLoader:
        return self.loader_class(self.source, **self.loader_args)

    def __iter__(self) -> LoaderIterator:
        return LoaderIterator(self._make_loader(), num_epochs=self.num_epochs)

    def __str__(self) -> str:
        return f"LoaderDataset({self.source.kind}, {self.loader_args})"


class LoaderIterator(grain.DatasetIterator):
    """The iterator of a :class:`LoaderDataset`: a zerobatch loader's batches, epoch after
    epoch, with the loader's state as Grain's.

    ``get_state()`` is ``{"zerobatch": loader.state_dict()}``: the position after the last
    batch this iterator returned (batches read ahead are not counted), the same on every rank.
    ``set_state`` loads such a state (or a bare loader state) saved on any world size.
    ``start_prefetch()`` is the loader's own (:meth:`~zerobatch.adapters._loader.BaseLoader.start_prefetch`):
    the first reads are queued on its read-ahead threads at once, so the first batch is read
    while the trainer restores its model (Grain's checkpoint handler calls it right after
    ``set_state``).

    Args:
        loader: the zerobatch loader to iterate (the iterator drives its epochs).
        num_epochs: as for :class:`LoaderDataset`.
    """

    def __init__(self, loader: BaseLoader, *, num_epochs: int | None = 1) -> None:
        super().__init__()
        self.loader = loader
        self.num_epochs = num_epochs
        self._batches: Any = None                        # the loader's pass being iterated
        self._prefetching = False                        # a pass started by start_prefetch

    def __next__(self) -> Any:
        self._assert_not_closed()
        while True:
            if self._batches is None:
                self._batches = iter(self.loader)       # continues the pass start_prefetch started
                self._prefetching = False
            batch = next(self._batches, _END)
            if batch is not _END:
                return batch
            self._batches = None
            if not self._next_epoch():
                raise StopIteration

    def _next_epoch(self) -> bool:
        if self.loader.endless:
            return False
        epoch = self.loader.epoch + 1
        if self.num_epochs is not None and epoch >= self.num_epochs:
            return False
        self.loader.set_epoch(epoch)
        return True

    def start_prefetch(self) -> None:
        """Start reading the next batches now, on the loader's read-ahead threads (idempotent;
        nothing to do while a pass is being iterated: it reads ahead already)."""
        if self._closed or self._batches is not None or self._prefetching:
            return
        self.loader.start_prefetch()
        self._prefetching = True

    def get_state(self) -> dict[str, Any]:
        return {STATE_KEY: self.loader.state_dict()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue after the last batch of the run that saved ``state`` (any world size).

        Raises:
            StateError: not a loader state, or one the loader refuses (another dataset,
                order, seed...).
        """
        if not isinstance(state, dict):
            raise StateError(f"a Grain state of a zerobatch loader is a dict, got {type(state).__name__}",
                             field="state")
        inner = state.get(STATE_KEY, state)
        self._stop()
        self.loader.load_state_dict(inner)

    def _stop(self) -> None:
        """Drop the pass being iterated or started by start_prefetch."""
        batches, self._batches, self._prefetching = self._batches, None, False
        if batches is not None:
            batches.close()

    def close(self) -> None:
        """Stop the loader's read-ahead (idempotent); the source stays open for other iterators."""
        if self._closed:
            return
        self._stop()
        self.loader._close_active()
        super().close()

    def __str__(self) -> str:
        return f"LoaderIterator(rank {self.loader.rank} of {self.loader.world_size}, epoch {self.loader.epoch})"


def die_with_parent(worker_index: int = 0, worker_count: int = 1) -> None:
    """A ``worker_init_fn`` for Grain's ``mp_prefetch``: the worker process is killed when
    the training process dies, SIGKILL included (Linux; elsewhere it does nothing).

    Grain's worker processes outlive a training process killed with SIGKILL (grain 0.2.18:
    nothing in them watches their parent), holding their memory, the shared-memory buffers
    and the job's output pipes. Pass it as
    ``ds.mp_prefetch(options, worker_init_fn=die_with_parent)``; it must be called by the
    worker itself, and the process that iterates must be the one that started the workers
    (the kernel signals when the thread that started them ends).
    """
    del worker_index, worker_count
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import multiprocessing

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:    # the parent died before prctl
        os._exit(1)
