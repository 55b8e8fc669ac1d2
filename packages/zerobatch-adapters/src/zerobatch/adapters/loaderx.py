"""The loaderx workflow on ZRECORD stores: ``converter``, ``NPDataset``, ``ARDataset``, ``DataLoader``.

NumPy only (importing this module never imports torch)::

    import numpy as np
    from zerobatch.adapters.loaderx import ARDataset, DataLoader, NPDataset, converter

    converter(np.load("train_data.npy", mmap_mode="r"), "train_data")   # once
    loader = DataLoader(ARDataset("train_data"), NPDataset("train_label.npy"), batch_size=256)
    for i, batch in enumerate(loader):
        batch["data"], batch["label"]

``DataLoader`` is a face over zerobatch's one loader (``zerobatch.adapters._loader``: its
schedule, read-ahead and state). Its reads run on ``num_workers`` threads of a shared pool
(:func:`zerobatch.core.pool.shared_pool`, threads ``loaderx-reader-*``), ``prefetch_size``
batches ahead; the record gathers
release the GIL, so they overlap the training step. Batches come in order,
whatever thread read them. ``state_dict()`` is the position after the last batch the loop
received (not the last one prefetched), so ``load_state_dict`` resumes exactly there.

Modes (the samplers package's orders):

- ``"sequential"``: every record in order, once per epoch;
- ``"sliding"``: the records as a ring, endlessly (a batch at the tail wraps to the head);
- ``"random"``: uniform draws with replacement, endlessly;
- ``"global_random"`` (default): a fresh permutation each epoch, every record once.

An epoch-based loop (``for batch in loader``) runs the rest of the current epoch and then
moves to the next, so iterating again gives the next epoch's order; ``set_epoch`` picks one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from zerobatch.adapters._loader import BaseLoader
from zerobatch.adapters.sources._base import Source
from zerobatch.formats import zrecord as Z
from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.readers.zrecord import ZRecordStore
from zerobatch.samplers import GlobalRandomOrder, IndexSampler, RandomOrder, SequentialOrder, SlidingOrder
from zerobatch.writers.zrecord import ZRecordWriter

__all__ = ["MODES", "ARDataset", "DataLoader", "NPDataset", "converter"]

#: The sampler modes and the order each one uses.
MODES = {
    "sequential": lambda n, seed: SequentialOrder(n),
    "sliding": lambda n, seed: SlidingOrder(n),
    "random": lambda n, seed: RandomOrder(n, seed=seed),
    "global_random": lambda n, seed: GlobalRandomOrder(n, seed=seed),
}


def converter(array: Any, out_dir: str | os.PathLike[str], *, field: str = "data", compress: str = "raw",
              chunk_size: int = 8192, batch: int = 4096, progress: bool = True, num_writers: int = 2) -> str:
    """Write the rows of ``array`` (a NumPy array or ``np.load(..., mmap_mode="r")``) into a
    new ZRECORD store at ``out_dir``: one fixed-shape field ``field`` of the rows' dtype and
    shape, ``compress`` ``"raw"`` or ``"flate"``. Shows a progress bar (tqdm) unless
    ``progress=False``. Returns the store's path.

    Raises:
        ConfigError: ``array`` is not at least 1-D, has a dtype ZRECORD cannot type, or
            ``out_dir`` exists and is not empty.
    """
    arr = array if isinstance(array, np.ndarray) else np.asarray(array)
    if arr.ndim < 1:
        raise ConfigError("array: a 0-d array has no rows", field="array")
    spec = Z.FieldSpec(field, Z.dtype_name(arr.dtype), tuple(arr.shape[1:]), compress)
    path = os.path.abspath(os.fspath(out_dir))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(arr), unit="rec", desc=f"converter -> {os.path.basename(path)}")
    try:
        with ZRecordWriter(path, [spec], chunk_size=chunk_size, num_writers=num_writers) as w:
            for start in range(0, len(arr), batch):
                block = np.ascontiguousarray(arr[start:start + batch])   # one read of the memmap
                w.extend(iter(block), batch=max(1, batch // (2 * num_writers)))
                if bar is not None:
                    bar.update(len(block))
    finally:
        if bar is not None:
            bar.close()
    return path


class NPDataset:
    """A ``.npy`` file, memory-mapped: ``len()`` rows, ``ds[indices]`` gathers them."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            self.array = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            from zerobatch.formats.errors import NotFoundError

            raise NotFoundError("file: no such .npy file", path=self.path, field="path") from None
        except ValueError as exc:
            from zerobatch.formats.errors import FormatError

            raise FormatError(f"file: not a readable .npy file ({exc})", path=self.path, field="path") from None
        if self.array.ndim < 1:
            raise ConfigError("file: a 0-d array has no rows", path=self.path, field="path")

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, indices: Any) -> np.ndarray:
        return self.array[np.asarray(indices, dtype=np.int64)]

    def __repr__(self) -> str:
        return f"NPDataset({self.path!r}, shape={self.array.shape}, dtype={self.array.dtype})"


class ARDataset:
    """A ZRECORD store's field (default: the store's only field): ``len()`` records,
    ``ds[indices]`` gathers them (one stacked array for a fixed-shape field, a list of
    arrays otherwise)."""

    def __init__(self, path: str | os.PathLike[str], field: str | None = None, *, num_threads: int = 2,
                 verify: bool = True) -> None:
        self.store = ZRecordStore(path, num_threads=num_threads, verify=verify)
        names = self.store.keys()
        if field is None:
            if len(names) != 1:
                raise ConfigError(f"field: the store has fields {names}; name one", path=self.store.path,
                                  field="field")
            field = names[0]
        if field not in names:
            raise ConfigError(f"field: no field {field!r} (fields: {names})", path=self.store.path, field="field")
        self.field = field

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, indices: Any) -> Any:
        batch = self.store.gather(indices, [self.field])
        data = batch[self.field]
        batch.release()
        return data

    def close(self) -> None:
        self.store.close()

    def __repr__(self) -> str:
        return f"ARDataset({self.store.path!r}, field={self.field!r})"


class _Records(Source):
    """The records of a loaderx dataset (and label set) as a source: a step reads
    ``{"data": dataset[indices], "label": labelset[indices]}`` and runs ``transform`` on it,
    on a read-ahead thread. ``kind`` and ``fingerprint`` are empty, as in the states loaderx
    has always saved."""

    stacked = False
    item_name = "records"

    def __init__(self, dataset: Any, labelset: Any, transform: Callable[[dict[str, Any]], Any] | None) -> None:
        super().__init__()
        self.dataset, self.labelset, self.transform = dataset, labelset, transform
        self.num_items = len(dataset)

    def read(self, items: np.ndarray, dtype: np.dtype) -> list[Any]:
        out = []
        for indices in items:
            batch = {"data": self.dataset[indices]}
            if self.labelset is not None:
                batch["label"] = self.labelset[indices]
            out.append(batch if self.transform is None else self.transform(batch))
        return out

    def close(self) -> None:
        """The datasets stay open: they are the caller's."""


class _Loader(BaseLoader):
    """The one loader, with loaderx's threads: every read (the first too) on the
    ``loaderx-reader`` pool, and batches handed out as the source made them."""

    pool_name = "loaderx-reader"
    reads_here = False

    def _convert(self, result: Any, steps: int) -> list[Any]:
        return list(result)


class DataLoader:
    """Batches ``{"data": ..., "label": ...}`` from a dataset (and a label set of the same
    length), read on threads ahead of the loop: a face over zerobatch's one loader (its
    schedule, read-ahead and state), keeping loaderx's arguments and state. See the module
    docstring.

    Args:
        dataset: anything with ``len()`` and ``ds[int64 indices]`` (``ARDataset``, ``NPDataset``).
        labelset: the same, or None (batches then have no ``"label"``).
        batch_size: records per batch.
        num_workers: reader threads.
        prefetch_size: batches read ahead of the loop (at least ``num_workers`` keeps
            every thread busy).
        mode: ``"sequential"``, ``"sliding"``, ``"random"`` or ``"global_random"``.
        seed: the order's seed.
        transform: called on each batch dict on a reader thread; returns the batch to yield.
        drop_last: drop an epoch's last, short batch.

    Raises:
        ConfigError: an empty dataset, a label set of another length, a bad argument.
    """

    def __init__(self, dataset: Any, labelset: Any = None, batch_size: int = 256, num_workers: int = 2,
                 prefetch_size: int = 4, mode: str = "global_random", seed: int = 0,
                 transform: Callable[[dict[str, Any]], Any] | None = None, *, drop_last: bool = False) -> None:
        n = len(dataset)
        if n == 0:
            raise ConfigError("dataset: it is empty", field="dataset")
        if labelset is not None and len(labelset) != n:
            raise ConfigError(f"labelset: {len(labelset)} labels for {n} records", field="labelset")
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {sorted(MODES)}, got {mode!r}", field="mode")
        for name, v, lo in (("batch_size", batch_size, 1), ("num_workers", num_workers, 1),
                            ("prefetch_size", prefetch_size, 1)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}", field=name)
        if transform is not None and not callable(transform):
            raise ConfigError("transform must be callable", field="transform")
        self.dataset = dataset
        self.labelset = labelset
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.prefetch_size = int(prefetch_size)
        self.mode = mode
        self.seed = seed
        self.transform = transform
        tail = "drop" if drop_last and mode in ("sequential", "global_random") else "keep"
        self.loader = _Loader(_Records(dataset, labelset, transform), self.batch_size, order=MODES[mode](n, seed),
                              tail=tail, rank=0, world_size=1, prefetch=self.prefetch_size,
                              num_threads=self.num_workers)
        self._closed = False

    @property
    def sampler(self) -> IndexSampler:
        """The schedule (an :class:`~zerobatch.samplers.IndexSampler` over the mode's order)."""
        return self.loader.schedule      # type: ignore[return-value]

    def __len__(self) -> int:
        """Batches per epoch.

        Raises:
            TypeError: the mode is endless (``sliding``, ``random``).
        """
        steps = self.sampler.steps_per_epoch
        if steps is None:
            raise TypeError(f"a {self.mode!r} loader is endless and has no length")
        return steps

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise StateError("the loader is closed", field="loader")
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        loader = self.loader
        if loader.schedule.steps_left() == 0:          # a finished epoch: on to the next
            loader.set_epoch(loader.epoch + 1)
        epoch = loader.epoch
        yield from loader
        if not self._closed and loader.epoch == epoch and not loader.endless:
            loader.set_epoch(epoch + 1)                # the epoch ran to its end: the next one follows

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch delivered to the loop (JSON-able)."""
        return {"loaderx": 1, "mode": self.mode, "batch_size": self.batch_size, "sampler": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` stopped.

        Raises:
            StateError: a state from another mode, batch size or dataset.
        """
        if not isinstance(state, dict) or state.get("loaderx") != 1:
            raise StateError("state: not a loaderx DataLoader state", field="state")
        if state.get("mode") != self.mode or state.get("batch_size") != self.batch_size:
            raise StateError(f"state: saved with mode {state.get('mode')!r} and batch_size "
                             f"{state.get('batch_size')!r}, this loader has {self.mode!r} and {self.batch_size}",
                             field="state")
        self.loader.load_state_dict(state["sampler"])

    def close(self) -> None:
        """Stop reading ahead: iteration ends at the next batch, queued reads are dropped and a
        read in flight finishes on its own (nothing waits for it). Always returns; idempotent."""
        self._closed = True
        self.loader._close_active(wait=False)

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
