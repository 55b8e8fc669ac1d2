"""PyTorch adapters: one stateful loader over every zerobatch source.

:class:`Loader` yields the batches of a source (an LLMBATCH file, token-stream windows or
documents, ZRECORD fields, a :class:`~zerobatch.adapters.sources.Mixture` of them) as torch
tensors, for one rank of a job, with compiled GIL-free reads on read-ahead threads inside the
training process and an exact-resume state that follows the ``Stateful`` protocol of
``torch.distributed.checkpoint``. It is also an ``IterableDataset``: inside a
``torch.utils.data.DataLoader`` with worker processes (:meth:`Loader.dataloader`) each
worker reads every ``num_workers``-th step, so the loop sees exactly the batches, in exactly
the order, of the loader alone.

:class:`BatchNativeLoader` (the seed's ``zerobatch.batch_loader.BatchNativeLoader``) is this
loader over an LLMBATCH file in the seed's block-shuffle order.
"""

from __future__ import annotations

import collections
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

try:
    import torch
    import torch.utils.data
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("zerobatch.adapters.torch needs PyTorch: pip install 'zerobatch-adapters[torch]'") from exc

from zerobatch.adapters import sources as _sources
from zerobatch.adapters._buffers import BufferPool
from zerobatch.adapters.metrics import nbytes as _nbytes
from zerobatch.adapters._loader import DEFAULT_PREFETCH, DEFAULT_SEED, WORKER_STATE, BaseLoader, _check_share
from zerobatch.adapters.sources import *  # noqa: F403 - every source, re-exported with the loader
from zerobatch.adapters.sources import LLMBatchSource
from zerobatch.adapters.sources._base import check_dataset
from zerobatch.formats.errors import ConfigError, StateError
from zerobatch.readers import llmbatch as _llmbatch

# a list plus the sources' names, in forms type checkers follow (every source is re-exported)
__all__ = ["BatchFileReader", "BatchNativeLoader", "DatasetLoader", "Loader", "WorkerDataLoader"]
__all__ += _sources.__all__
__all__.sort()

_DTYPES = {torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32)}
# torch dtype (or None) -> 1 for int64, 2 for int32
_TORCH_KINDS: dict[Any, int] = {None: 1, torch.int64: 1, torch.int32: 2}


def _torch_kind(dtype: Any) -> int:
    raise ConfigError(f"read_batch_torch: dtype must be torch.int64 or torch.int32, got {dtype!r}", field="dtype")


class BatchFileReader(_llmbatch.BatchFileReader):
    """The LLMBATCH reader (:class:`zerobatch.readers.llmbatch.BatchFileReader`) with the seed's
    torch read (the readers themselves never import torch)::

        reader = BatchFileReader("dataset.batch")
        t64 = reader.read_batch_torch(0)                       # int64 tensor (one conversion)
        t32 = reader.read_batch_torch(0, dtype=torch.int32)    # shares the file's pages
    """

    def read_batch_torch(self, batch_index: int, dtype: Any = None, out: Any = None) -> Any:
        """Batch ``batch_index`` as a torch tensor ``[batch_size, seq_len]``.

        Args:
            batch_index: in ``[0, num_batches)``.
            dtype: ``torch.int64`` (default; a new tensor, one conversion) or ``torch.int32``
                (shares the mapped file's pages, no copy at all; refused when a token id is
                2**31 or more, which the reader knows from the header's ``max_token``, or for
                files without it by scanning the batch once). In-place writes to an ``int32``
                tensor change this process's private copy of the page (never the file), and
                later reads of that batch in this process see them: clone before writing.
            out: a CPU, contiguous ``int64`` or ``int32`` tensor of ``batch_size * seq_len``
                elements to fill instead; returned.

        Raises:
            IndexError, IntegrityError: as :meth:`read_batch`.
            ConfigError: a bad ``dtype`` or ``out``, or ``int32`` and a token id of 2**31 or
                more.
        """
        if out is None:
            kind = _TORCH_KINDS.get(dtype) or _torch_kind(dtype)
            if kind == 1:
                return torch.from_numpy(self.read_batch_numpy(batch_index))
            return torch.from_numpy(self.read_batch_numpy(batch_index, dtype=np.int32))
        if not isinstance(out, torch.Tensor):
            raise ConfigError(f"read_batch_torch: out must be a torch.Tensor, got {type(out).__name__}", field="out")
        if out.device.type != "cpu" or not out.is_contiguous() or out.requires_grad:
            raise ConfigError("read_batch_torch: out must be a contiguous CPU tensor that does not require grad",
                              field="out")
        if out.dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"read_batch_torch: out must be int64 or int32, got {out.dtype}", field="out")
        self.read_batch_numpy(batch_index, out=out.numpy())
        return out




def _device(device: Any) -> torch.device | None:
    """``device`` as a ``torch.device``, checked now rather than at the first batch (where
    torch would raise an ``AssertionError`` from deep inside a copy); ``None`` for none.

    Raises:
        ConfigError: not a device torch knows, a device type whose backend says it is not
            available (``torch.cuda.is_available()`` is False), or an index past its count.
    """
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"device: {device!r} is not a torch device ({exc}); give 'cuda', 'cuda:1', 'cpu', "
                          f"a torch.device or None", field="device") from None
    if dev.type in ("cpu", "meta"):
        return dev
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if callable(available) and not available():
        why = ""
        if dev.type == "cuda":
            why = (" (this torch is a build without CUDA: torch.version.cuda is None)"
                   if torch.version.cuda is None
                   else " (no CUDA device is visible: check the driver and CUDA_VISIBLE_DEVICES)")
        raise ConfigError(f"device: {device!r} but torch.{dev.type}.is_available() is False{why}; pass "
                          f"device=None (or 'cpu') to keep batches on the CPU", field="device")
    count = getattr(backend, "device_count", None)
    if dev.index is not None and callable(count) and dev.index >= count():
        raise ConfigError(f"device: {device!r} but torch.{dev.type}.device_count() is {count()}",
                          field="device")
    return dev


#: The arrays of a read that carry the loader's dtype (token ids and labels, every source's
#: names for them): on a CUDA device they cross the bus as int32 and become int64 there when
#: the loader's dtype is int64 (half the bytes over PCIe or NVLink).
TOKEN_ARRAYS = frozenset({"tokens", "labels"})


class CudaCopier:
    """The CUDA calls of the host-to-device hop, and the only ones a :class:`Loader` makes:
    page-locked buffers, copies on a dedicated stream, events, hand-over to the consumer's
    stream. (The tests replace this class at exactly this boundary to check the ring's logic
    on machines without a GPU.)"""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def pinned(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A page-locked host array (allocated once per buffer of the ring, then reused)."""
        return torch.empty(shape, dtype=_torch_dtype(dtype), pin_memory=True).numpy()

    def is_pinned(self, t: torch.Tensor) -> bool:
        return bool(t.is_pinned())

    def copy(self, hosts: list[torch.Tensor], dtypes: list[Any],
             after: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None) -> tuple[list[torch.Tensor], Any]:
        """``hosts`` copied to the device on the copy stream (each then cast to its
        ``dtypes`` entry, when not ``None``, there), then ``after(copies)`` run on the same
        stream (its tensors, as ``after.outputs`` lists their shapes and dtypes, appended),
        and the mark of their completion."""
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        out = []
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            for host, dtype in zip(hosts, dtypes, strict=True):
                dev = host.to(self.device, non_blocking=True)
                out.append(dev if dtype is None or dev.dtype == dtype else dev.to(dtype))
            if after is not None:
                out += after(out)
            done.record(self.stream)
        return out, (start, done)

    def ready(self, mark: Any) -> bool:
        """Whether the copies of ``mark`` are done (their host buffers may be written again)."""
        return bool(mark[1].query())

    def seconds(self, mark: Any) -> float:
        """How long the copies of a ready ``mark`` took on the copy stream."""
        return float(mark[0].elapsed_time(mark[1])) / 1e3

    def hand_over(self, mark: Any, tensors: list[torch.Tensor]) -> None:
        """The consumer's current stream waits for the copies of ``mark`` (it does not block
        the host), and the caching allocator keeps ``tensors`` (made on the copy stream) until
        the consumer's work queued on them is done (``record_stream``)."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(mark[1])
        for t in tensors:
            t.record_stream(current)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def _narrowable(source: Any) -> bool:
    """Whether ``source`` fills only its :data:`TOKEN_ARRAYS` with the loader's dtype and its
    ids fit int32 (every source of a mixture)."""
    inner = getattr(source, "sources", None)
    if isinstance(inner, (list, tuple)):
        return bool(inner) and all(_narrowable(s) for s in inner)
    vocab = getattr(getattr(source, "reader", None), "vocab_size", None)
    return bool(getattr(source, "token_arrays_only", False)) and isinstance(vocab, int) and 0 < vocab <= 2**31


def _packed_step(run: dict[str, Any]) -> bool:
    """Whether ``run`` is one packed step whose boundaries can be built on the device."""
    mask, cu = run.get("mask"), run.get("cu_seqlens")
    if not (isinstance(mask, np.ndarray) and mask.ndim == 2 and mask.dtype == np.bool_ and isinstance(cu, np.ndarray)
            and cu.ndim == 1 and cu.size >= 1 and mask.shape[0] > 0):
        return False
    rows, width = mask.shape
    # the offsets cover each row (Hugging Face's layout) or its inputs (next-token rows hold
    # one more column, the last target, which no output hands out)
    return (int(cu[-1]) in (rows * width, rows * (width - 1))
            and all(isinstance(run.get(k), np.ndarray) and run[k].shape == mask.shape for k in BUILT_ON_DEVICE))


def _copier(device: torch.device) -> Any:
    """The :class:`CudaCopier` of ``device`` (the one place a loader makes one)."""
    return CudaCopier(device)


#: The arrays of a packed step (PackedDocuments) built on the device from ``cu_seqlens`` and
#: each row's fill instead of crossing the bus: 13 of the 21 bytes a position (int64
#: positions, int32 segments, a bool mask) become a few bytes a row.
BUILT_ON_DEVICE = ("position_ids", "segment_ids", "mask")


def packed_boundaries(cu: torch.Tensor, fill: torch.Tensor, rows: int, width: int, position_dtype: torch.dtype,
                      segment_dtype: torch.dtype) -> list[torch.Tensor]:
    """``[position_ids, segment_ids, mask]`` of ``rows`` packed rows of ``width``, as
    ``pack_rows`` lays them out, from ``cu`` (the pieces' offsets in the flattened rows, a
    row's padding its last piece) and ``fill`` (each row's real tokens, padding after them):
    positions count from 0 in each piece (0 on padding), segments number a row's pieces
    from 0 (-1 on padding), the mask is False on padding. Torch operations on ``cu``'s
    device; no host synchronization (the output sizes are known)."""
    dev = cu.device
    total = rows * width
    starts = cu[:-1].long()
    lengths = cu[1:].long() - starts
    piece = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), lengths, output_size=total)
    flat = torch.arange(total, device=dev)
    row = flat // width
    first = torch.searchsorted(starts, torch.arange(rows, device=dev) * width)     # each row's first piece
    real = (flat - row * width) < fill.long()[row]
    pos = torch.where(real, flat - starts[piece], 0).to(position_dtype).view(rows, width)
    seg = torch.where(real, piece - first[row], -1).to(segment_dtype).view(rows, width)
    return [pos, seg, real.view(rows, width)]


class _Staged:
    """A read's result on its way to the device: its structure with device tensors in place
    of its arrays, the mark of their copies, and the bytes of the arrays read."""

    __slots__ = ("result", "mark", "tensors", "nbytes")

    def __init__(self, result: Any, mark: Any, tensors: list[torch.Tensor], nbytes: int) -> None:
        self.result, self.mark, self.tensors, self.nbytes = result, mark, tensors, nbytes


class DeviceHop:
    """Reads copied to a CUDA device without a ``pin_memory()`` per batch.

    Reads gather into page-locked buffers of the sources' pools (allocated once each, reused;
    :meth:`~zerobatch.adapters.sources.Source.use_allocator`); an array that is not in one (a
    view of a mapped file) is first copied into a page-locked staging buffer. Right after a
    read, on the read-ahead thread that made it, its arrays are copied on the copy stream;
    the host buffers stay referenced (so no read can reuse them) until the copy's event has
    completed. When the loop takes the step, its current stream waits on that event and the
    device tensors are recorded on it. Ids cross as int32 and become int64 on the device
    when the loader's dtype is int64 (:data:`TOKEN_ARRAYS`).
    """

    def __init__(self, copier: Any, metrics: Any, widen: torch.dtype | None, build_boundaries: bool = True) -> None:
        self.copier, self.metrics, self.widen = copier, metrics, widen
        self.build_boundaries = build_boundaries
        self._flight: collections.deque[tuple[Any, list[torch.Tensor], int]] = collections.deque()
        self._lock = threading.Lock()
        self._staging: dict[int, BufferPool] = {}
        self._pid = os.getpid()

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The sources' allocator: page-locked arrays (counted: the ring's size); in a forked
        child (a DataLoader worker), plain ones."""
        if os.getpid() != self._pid:
            return np.empty(shape, dtype)
        with self._lock:
            self.metrics.pinned_buffers += 1
        return self.copier.pinned(shape, dtype)

    def _host(self, value: np.ndarray) -> torch.Tensor:
        if value.flags.writeable:
            t = torch.from_numpy(value)
            if self.copier.is_pinned(t):
                return t
        # staged through page-locked byte buffers of power-of-two sizes (a few serve arrays of
        # any shape: a step's offsets change length from step to step)
        size = max(4096, 1 << (max(value.nbytes, 1) - 1).bit_length())
        with self._lock:
            pool = self._staging.get(size)
            if pool is None:
                pool = self._staging[size] = BufferPool((size,), np.dtype(np.uint8), max_buffers=16,
                                                        allocate=self.allocate)
        buf = pool.acquire()[:value.nbytes].view(value.dtype).reshape(value.shape)
        np.copyto(buf, value)
        return torch.from_numpy(buf)

    def settle(self) -> None:
        """Let go of the host buffers whose copies are done (in stream order), counting them."""
        m = self.metrics
        with self._lock:
            while self._flight and self.copier.ready(self._flight[0][0]):
                mark, _, n = self._flight.popleft()
                m.h2d_copies += 1
                m.h2d_bytes += n
                m.h2d_seconds += self.copier.seconds(mark)

    def stage(self, result: Any) -> Any:
        """On the read-ahead thread: ``result``'s arrays on their way to the device."""
        if result is None:
            return None
        self.settle()
        hosts: list[torch.Tensor] = []
        dtypes: list[Any] = []
        slots: list[tuple[dict[str, Any], str] | None] = []   # where each copy goes (None: a row fill)
        builds: list[tuple[dict[str, Any], int, int, int, int, Any, Any]] = []
        runs = [result] if isinstance(result, dict) else list(result)
        mapped = [dict(run) for run in runs]
        for run in mapped:
            derive = self.build_boundaries and _packed_step(run)
            for name, value in run.items():
                if isinstance(value, np.ndarray) and not (derive and name in BUILT_ON_DEVICE):
                    if derive and name == "cu_seqlens":
                        cu_at = len(hosts)
                    hosts.append(self._host(value))
                    widen = self.widen is not None and name in TOKEN_ARRAYS and value.dtype == np.int32
                    dtypes.append(self.widen if widen else None)
                    slots.append((run, name))
            if derive:
                mask = run["mask"]
                rows, width = mask.shape
                covered = int(run["cu_seqlens"][-1]) // rows
                hosts.append(self._host(np.count_nonzero(mask[:, :covered], axis=1).astype(np.int32)))
                dtypes.append(None)
                slots.append(None)
                builds.append((run, cu_at, len(hosts) - 1, rows, width, _torch_dtype(run["position_ids"].dtype),
                               _torch_dtype(run["segment_ids"].dtype)))

        run_cu_end = {id(run): int(run["cu_seqlens"][-1]) for run, *_ in builds}

        def after(devs: list[torch.Tensor]) -> list[torch.Tensor]:
            out: list[torch.Tensor] = []
            for run, cu_at, fill_at, rows, width, pos_dtype, seg_dtype in builds:
                covered = int(run_cu_end[id(run)]) // rows
                made = packed_boundaries(devs[cu_at], devs[fill_at], rows, covered, pos_dtype, seg_dtype)
                if covered < width:      # the next-token rows' last column: never handed out
                    made = [torch.nn.functional.pad(t, (0, width - covered)) for t in made]
                out += made
            return out
        # what it makes, known before it runs (shape, dtype): [positions, segments, mask] a build
        after.outputs = [((rows, width), dt) for _, _, _, rows, width, pos_dtype, seg_dtype in builds  # type: ignore[attr-defined]
                         for dt in (pos_dtype, seg_dtype, torch.bool)]
        nbytes = sum(h.numel() * h.element_size() for h in hosts)
        with self._lock:                 # enqueued in the order of the flight record
            devs, mark = self.copier.copy(hosts, dtypes, after if builds else None)
            self._flight.append((mark, hosts, nbytes))
        for slot, dev in zip(slots, devs, strict=False):
            if slot is not None:
                slot[0][slot[1]] = dev
        extra = iter(devs[len(hosts):])
        for run, *_ in builds:
            for name in BUILT_ON_DEVICE:
                run[name] = next(extra)
        out: Any = mapped[0] if isinstance(result, dict) else type(result)(mapped)
        return _Staged(out, mark, devs, _nbytes(result))        # (the bytes read, not those copied)

    def hand_over(self, staged: _Staged) -> Any:
        """On the loop's thread: the consumer's stream waits for the copies; the result."""
        self.copier.hand_over(staged.mark, staged.tensors)
        if self._lock.acquire(blocking=False):     # (never waits behind a read thread's copy)
            self._lock.release()
            self.settle()
        return staged.result


def _accelerator_available() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


class Loader(BaseLoader, torch.utils.data.IterableDataset):
    """Batches of a zerobatch source for this rank, as torch tensors.

    Args:
        source: a :class:`~zerobatch.adapters.sources.Source` (``LLMBatchSource``,
            ``TokenWindows``, ``TokenDocuments``, ``RecordFields``, ``Mixture``) or the
            path of a ``.batch`` file.
        batch_size: rows per batch on this rank (for an LLMBATCH file, a multiple of its
            batch size; default one file batch). Or give ``global_batch_size``.
        shuffle: shuffle the items (a Feistel permutation per epoch; the seed's block
            shuffle for LLMBATCH files); ``False`` reads in order.
        seed: integer in ``[0, 2**64)`` (default 42, every loader's).
        drop_last: drop the items of a last step that does not fill every rank (default);
            ``False`` keeps a short last step (a rank left without items yields nothing
            for it). ``tail="pad"`` instead fills it with items from the start of the epoch,
            so every rank takes the same number of steps.
        order: an explicit :class:`~zerobatch.samplers.IndexOrder` over the source's items.
        rank, world_size: this process's place (default: ``torch.distributed`` when it is
            initialized, else ``RANK`` / ``WORLD_SIZE``, else one process).
        epoch: the starting epoch.
        prefetch: batches read ahead of the training loop (default 8, every loader's).
        num_threads: read-ahead threads (default: one fewer than the CPUs, at least 1;
            0 reads on the calling thread).
        dtype: ``torch.int64`` (default) or ``torch.int32`` (zero-copy views where the
            source allows: an LLMBATCH file read one file batch per step).
        pin_memory: without a device, copy each batch into page-locked memory (ignored, with
            a warning, on a machine without an accelerator). A CUDA ``device`` needs no pin:
            its reads gather into a ring of page-locked buffers.
        device: where batches go; checked when the loader is made: a device torch does not
            know, or one whose backend is not available (``"cuda"`` where
            ``torch.cuda.is_available()`` is False), raises a :class:`ConfigError` (field
            ``device``). On a CUDA device (:class:`DeviceHop`) read-ahead gathers into
            page-locked buffers allocated once and reused, copies each read on a dedicated
            stream right after it is read, and hands the tensors over with an event the
            loop's current stream waits on (and ``record_stream``); int64 token ids cross the bus
            as int32 and are widened on the device. Other devices: ``.to(device)`` per batch.
        headspace: replay the first ``headspace`` batches from memory instead of reading
            (the position does not move): the loop's step time as if data were free, to set
            against a normal run's (``metrics()``). Default ``$ZEROBATCH_HEADSPACE`` or off.
        num_workers: refused with a :class:`ConfigError` that says where worker processes
            live (:meth:`dataloader`); the loader itself uses threads.

    Each step is what the source hands out: a tensor, an ``(x, y)`` pair of views of one
    buffer (next-token windows), or a dict (documents, boundaries, metadata, several fields).

    Example::

        source = TokenWindows("data/tokens", seq_len=2048)
        loader = Loader(source, batch_size=8, seed=1234, device="cuda", pin_memory=True)
        for epoch in range(loader.epoch, num_epochs):
            loader.set_epoch(epoch)
            for x, y in loader:
                ...
                checkpoint["loader"] = loader.state_dict()
    """

    #: a run card's NumPy dtype is not passed on: ``dtype`` here is a torch dtype
    numpy_dtype_argument = False

    def __init__(self, source: Any, batch_size: int | None = None, *, global_batch_size: int | None = None,
                 shuffle: bool = True, seed: int = DEFAULT_SEED, drop_last: bool = True, tail: str | None = None,
                 order: Any = None, rank: int | None = None, world_size: int | None = None, epoch: int = 0,
                 prefetch: int = DEFAULT_PREFETCH, num_threads: int | None = None, dtype: Any = torch.int64,
                 pin_memory: bool = False, device: Any = None, num_workers: int | None = None,
                 headspace: int | None = None) -> None:
        if num_workers is not None:
            raise ConfigError(f"Loader(num_workers={num_workers!r}): the loader reads on num_threads threads inside "
                              f"the training process; worker processes live in loader.dataloader(num_workers=...), "
                              f"a torch DataLoader over this loader (or use the loader as the dataset of a "
                              f"StatefulDataLoader)", field="num_workers")
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype must be torch.int64 or torch.int32, got {dtype!r}", field="dtype")
        super().__init__(source, batch_size, global_batch_size=global_batch_size, shuffle=shuffle, seed=seed,
                         drop_last=drop_last, tail=tail, order=order, rank=rank, world_size=world_size, epoch=epoch,
                         prefetch=prefetch, num_threads=num_threads, dtype=_DTYPES[dtype], headspace=headspace)
        self.torch_dtype = dtype
        self.pin_memory = bool(pin_memory)
        self.device = _device(device)
        if self.device is not None and self.device.type == "cpu":
            self.device = None
        self._hop: DeviceHop | None = None
        # the ring is made when the loader is first iterated, on the device current then
        # ("cuda" without an index: a DDP script may call set_device after making the loader)
        self._ring_pending = self.device is not None and self.device.type == "cuda"
        if self._ring_pending:
            pass
        elif self.pin_memory and not _accelerator_available():
            warnings.warn("pin_memory=True but no accelerator is available: batches are not pinned",
                          RuntimeWarning, stacklevel=2)
            self.pin_memory = False

    def _ring(self) -> None:
        """Make the ring (first iteration): on ``self.device``, or the current CUDA device."""
        if not self.__dict__.get("_ring_pending") or self._in_worker():
            return
        self._ring_pending = False
        device = self.device
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = self.device = torch.device("cuda", torch.cuda.current_device())
        self._use_copier(_copier(device))

    def _use_copier(self, copier: Any) -> None:
        """Copy reads to the device through ``copier`` (:class:`CudaCopier`): the ring."""
        # ids cross as int32 and are widened on the device only for sources that say which
        # arrays hold them and whose ids all fit (a vocabulary of at most 2**31)
        widen = torch.int64 if self.torch_dtype == torch.int64 and _narrowable(self.source) else None
        self._hop = DeviceHop(copier, self._metrics, widen)
        self._stage = self._hop.stage
        if widen is not None:
            self._read_dtype = np.dtype(np.int32)     # ids cross as int32, widened on the device
        self.source.use_allocator(self._hop.allocate)

    def start_prefetch(self) -> None:
        self._ring()
        super().start_prefetch()

    def __iter__(self) -> Iterator[Any]:
        self._ring()
        return self._iter()

    def _worker_split(self) -> tuple[int, int]:
        info = torch.utils.data.get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def _in_worker(self) -> bool:
        return torch.utils.data.get_worker_info() is not None

    def __getstate__(self) -> dict[str, Any]:
        # a copy in a DataLoader worker process reads on the host: the ring, its CUDA stream
        # and the device's events are this process's
        d = super().__getstate__()
        d["_hop"] = None
        d.pop("_stage", None)
        d.pop("_read_dtype", None)
        return d

    def _convert(self, result: Any, steps: int) -> list[Any]:
        if isinstance(result, _Staged):
            result = self._hop.hand_over(result)    # type: ignore[union-attr]
        return super()._convert(result, steps)

    def _to_framework(self, value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):         # already on the device (DeviceHop)
            return value
        t = torch.from_numpy(value) if value.flags.writeable else torch.from_numpy(value.copy())
        if self.pin_memory:
            t = t.pin_memory()
        if self.device is not None:
            t = t.to(self.device, non_blocking=self.pin_memory)
        return t

    def _unstack(self, value: torch.Tensor) -> list[torch.Tensor]:
        return list(value.unbind(0))

    def _unwrap_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The position a torchdata ``StatefulDataLoader`` state stands at (any other state as
        it is): torchdata's state handling lives here, with torch."""
        if "_snapshot" not in state and "_num_yielded" not in state:
            return state
        if "_num_yielded" in state:                 # no worker processes: the loader's own state
            inner = state.get("dataset_state")
            if not isinstance(inner, dict) or inner.get("kind") == WORKER_STATE:
                raise StateError("a StatefulDataLoader state without this loader's state (dataset_state)",
                                 field="dataset_state")
            return inner
        try:
            snap = state["_snapshot"]
            k = snap["_main_snapshot"]["_num_workers"]
            shares = [_check_share(snap["_worker_snapshots"][f"worker_{w}"]["dataset_state"]) for w in range(k)]
            extra = state.get("_steps_since_snapshot", 0)
        except (KeyError, TypeError) as exc:
            raise StateError(f"not a StatefulDataLoader state of this loader: {exc!r} is missing",
                             field="_snapshot") from None
        if not shares or not isinstance(extra, int) or extra < 0:
            raise StateError("a StatefulDataLoader state without workers or with a negative step count",
                             field="_snapshot")
        for w, share in enumerate(shares):
            if (share["worker"], share["num_workers"]) != (w, k) or share["start"] != shares[0]["start"]:
                raise StateError(f"the StatefulDataLoader state's worker {w} holds the share of worker "
                                 f"{share['worker']} of {share['num_workers']} or another pass",
                                 field="_worker_snapshots")
        done = sum(s["delivered"] for s in shares)
        if any(s["delivered"] != len(range(w, done, k)) for w, s in enumerate(shares)):
            raise StateError(f"the workers delivered {[s['delivered'] for s in shares]} steps, not the first {done} "
                             f"of the pass (in_order=False): restore this state into a StatefulDataLoader with "
                             f"the same {k} workers", field="_worker_snapshots")
        return self.schedule.advanced(done + extra, shares[0]["start"])

    def _wrapped_schedule_state(self, state: dict[str, Any]) -> dict[str, Any] | None:
        if "_num_yielded" in state:
            return state["dataset_state"]
        if "_snapshot" in state:
            return state["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"]["start"]
        return None

    def dataloader(self, num_workers: int = 2, **kwargs: Any) -> WorkerDataLoader:
        """A ``torch.utils.data.DataLoader`` over this loader with ``num_workers`` worker
        processes (``multiprocessing_context`` and the other DataLoader options pass through;
        for a dataset at a URL it defaults to ``"forkserver"``, since the object-storage
        client cannot run in a forked process), whose ``state_dict`` counts the batches it
        delivered."""
        return WorkerDataLoader(self, num_workers=num_workers, **kwargs)


class WorkerDataLoader(torch.utils.data.DataLoader):
    """A ``torch.utils.data.DataLoader`` with worker processes over a :class:`Loader`.

    Worker ``w`` of ``k`` reads steps ``w, w + k, w + 2k...`` of the rank's steps and the
    DataLoader hands them out in step order, so the loop receives exactly what the loader
    alone would give. The position is counted here, in the training process: ``state_dict``
    is the loader's state after the batches delivered, ``load_state_dict`` (before iterating)
    resumes there. Workers are started for each pass (``persistent_workers`` would not see a
    new epoch or position, so it is refused).
    """

    def __init__(self, loader: Loader, num_workers: int = 2, **kwargs: Any) -> None:
        if kwargs.pop("persistent_workers", False):
            raise ConfigError("persistent_workers: the workers must see each pass's epoch and position",
                              field="persistent_workers")
        for key in ("batch_size", "shuffle", "sampler", "batch_sampler", "collate_fn", "drop_last"):
            if key in kwargs:
                raise ConfigError(f"{key}: the zerobatch loader batches, orders and shards itself", field=key)
        if num_workers and kwargs.get("multiprocessing_context") is None and not loader.source.access.fork_safe:
            # storage whose runtime does not survive a fork (obstore's): workers start from a
            # fresh interpreter (forkserver: cheap after the first)
            kwargs["multiprocessing_context"] = "forkserver"
        super().__init__(loader, batch_size=None, num_workers=num_workers, **kwargs)
        self.zb = loader
        self._start: dict[str, Any] | None = None
        self._delivered = 0

    def __len__(self) -> int:
        return len(self.zb)

    def set_epoch(self, epoch: int) -> None:
        self._settle()
        self.zb.set_epoch(epoch)

    def _settle(self) -> None:
        """Move the loader to the position the last pass reached."""
        if self._start is not None:
            state = self.state_dict()
            self._start, self._delivered = None, 0
            self.zb.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._settle()
        schedule = self.zb.schedule
        schedule.begin()
        self._start = schedule.state_dict()
        self._delivered = 0
        steps = schedule.steps_left()
        for batch in super().__iter__():
            self._delivered += 1
            yield batch
        if steps is not None and self._delivered >= steps:
            self._settle()
            schedule.finish()

    def state_dict(self) -> dict[str, Any]:
        if self._start is None:
            return self.zb.state_dict()
        return self.zb._schedule_state(self.zb.schedule.advanced(self._delivered, self._start))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start, self._delivered = None, 0
        self.zb.load_state_dict(state)


class BatchNativeLoader(Loader):
    """Iterate over the batches of an LLMBATCH file as ``[batch_size, seq_len]`` tensors.

    :class:`Loader` over :class:`~zerobatch.adapters.sources.LLMBatchSource`, one file batch
    per rank per step, with the seed's signature. Block-shuffle order, exactly as the seed
    describes it: the file's batches are cut into super-blocks of ``block_size`` consecutive
    batches, each epoch visits the blocks in the order
    ``numpy.random.default_rng(seed ^ epoch).permutation(num_blocks)`` and the batches of a
    block in ascending order (see :class:`zerobatch.samplers.BlockShuffleOrder`).

    With ``world_size`` ranks, global step ``s`` gives rank ``r`` the batch at position
    ``s * world_size + r`` of that order: every rank gets ``len(loader)`` batches per epoch,
    the ranks' batches are disjoint, and no rank talks to another. The tail that does not
    fill a step on every rank is dropped (``drop_last=True``) or padded by wrapping to the
    start of the epoch. A state resumes on any world size.

    Args:
        path: the ``.batch`` file, or an open :class:`BatchFileReader`.
        block_size: batches per super-block (default 256, as the seed).
        shuffle: shuffle the block order (``False``: the file's order).
        seed: integer in ``[0, 2**64)`` for the block order.
        epoch: the starting epoch.
        rank, world_size, num_threads, prefetch, pin_memory, device: as for :class:`Loader`.
        drop_last: drop the tail of fewer than ``world_size`` batches (else pad it).
        dtype: ``torch.int64`` (default, as the seed) or ``torch.int32`` (views of the mapped
            file: no copy, no threads; refused when a token id is 2**31 or more).
        verify: check each batch's checksum the first time it is read.

    Example::

        loader = BatchNativeLoader("data/dataset.batch", seed=42)
        for epoch in range(num_epochs):
            loader.set_epoch(epoch)
            for batch in loader:          # torch.int64, (batch_size, seq_len)
                ...
            state = loader.state_dict()   # JSON-able; load_state_dict(state) resumes exactly
    """

    def __init__(self, path: str | os.PathLike[str] | BatchFileReader, block_size: int = 256,
                 shuffle: bool = True, seed: int = DEFAULT_SEED, epoch: int = 0, *, rank: int | None = None,
                 world_size: int | None = None, drop_last: bool = True, dtype: Any = torch.int64,
                 num_threads: int | None = None, prefetch: int = DEFAULT_PREFETCH, verify: bool = True,
                 pin_memory: bool = False, device: Any = None) -> None:
        if not isinstance(path, _llmbatch.BatchFileReader):
            check_dataset(path, "BatchNativeLoader", ("llmbatch",))
            path = BatchFileReader(path, verify=verify)
        source = LLMBatchSource(path, block_size=block_size, verify=verify)
        super().__init__(source, None, shuffle=shuffle, seed=seed, tail="drop" if drop_last else "pad",
                         rank=rank, world_size=world_size, epoch=epoch, prefetch=prefetch,
                         num_threads=num_threads, dtype=dtype, pin_memory=pin_memory, device=device)
        self.reader = source.reader

    @property
    def block_size(self) -> int:
        """Batches per super-block."""
        return self.source.block_size  # type: ignore[attr-defined]



class DatasetLoader:
    """The seed's npy-folder loader: ``get_batch()`` returns ``(x, y)`` long tensors on ``device``.

    A folder of ``.npy`` token files, memory-mapped, read in sorted order (see
    :mod:`zerobatch.adapters.npy_folder` for the exact positions and where the seed's code and
    text disagree). Rank ``process_rank`` starts at ``batch * seq_len * process_rank`` and every
    call advances by ``batch * seq_len * num_processes``; at the end of a file the loader moves to
    the next one and after the last back to the first. ``x`` and ``y`` are views of one
    ``int64`` buffer of ``batch * seq_len + 1`` tokens, shifted by one.

    Example (the seed's)::

        loader = DatasetLoader(batch=2, seq_len=4, process_rank=0, num_processes=1,
                               dataset_dir="data", device="cpu")
        x, y = loader.get_batch()

    ``state_dict()`` / ``load_state_dict()`` save and restore the position.
    """

    def __init__(self, batch: int, seq_len: int, process_rank: int, num_processes: int,
                 dataset_dir: str | os.PathLike[str], device: Any = "cpu") -> None:
        from zerobatch.adapters.npy_folder import NpyTokenFolder
        resolved = _device(device)
        self.stream = NpyTokenFolder(dataset_dir, batch, seq_len, process_rank, num_processes)
        self.batch, self.seq_len = self.stream.batch, self.stream.seq_len
        self.process_rank, self.num_processes = self.stream.rank, self.stream.world_size
        self.device = torch.device("cpu") if resolved is None else resolved
        self.filepaths = list(self.stream.paths)

    @property
    def file_idx(self) -> int:
        """Index of the current file in :attr:`filepaths`."""
        return self.stream.file_idx

    @property
    def tok_idx(self) -> int:
        """Where this rank's next batch starts in the current file."""
        return self.stream.offset + self.process_rank * self.stream.per_rank

    def get_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(x, y)``: ``int64`` ``[batch, seq_len]`` each, ``y`` shifted by one token."""
        flat = torch.from_numpy(self.stream.next_tokens())
        if self.device.type != "cpu":
            flat = flat.to(self.device, non_blocking=True)
        b, t = self.batch, self.seq_len
        return flat[:-1].view(b, t), flat[1:].view(b, t)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.get_batch()

    def state_dict(self) -> dict[str, Any]:
        """The position of the next batch (JSON-able, the same on every rank)."""
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``'s position."""
        self.stream.load_state_dict(state)
