"""The host-to-device hop of the torch Loader (DeviceHop), checked on the CPU with CUDA stubbed
at its call boundary (CudaCopier) by a copier that behaves as a real copy stream does: copies
run in order, later, on another thread, reading the host buffer when they run (not when they
are queued), and the consumer waits on their event. A ring that let a read reuse a buffer
whose copy had not yet run would hand out a later step's tokens: the batches are checked
against a CPU loader's after every later step has run."""

from __future__ import annotations

import pickle
import queue
import random
import threading
import time
import weakref

import numpy as np
import pytest
from zbtest import token_stream

torch = pytest.importorskip("torch")

import zerobatch.adapters.torch as zt  # noqa: E402
from zerobatch.adapters.metrics import format_metrics  # noqa: E402
from zerobatch.adapters.torch import Loader, PackedDocuments, TokenWindows  # noqa: E402
from zerobatch.writers.llmbatch import write_batch_file  # noqa: E402


class _Mark:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.seconds = 0.0


class StreamCopier:
    """CudaCopier's calls, on the CPU: "device" tensors are CPU tensors filled by a copy thread.
    Like a real copy stream it holds no reference to the host buffers it copies from: it
    reads their memory when the copy runs (a buffer the ring reused meanwhile shows up as the
    wrong tokens; one it freed, as an error)."""

    def __init__(self, seed: int = 0, max_delay: float = 0.004) -> None:
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.roots: list[tuple[int, int, weakref.ref]] = []     # page-locked buffers made
        self.allocations = 0
        self.handovers = 0
        self.copies = 0
        self.errors: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def pinned(self, shape, dtype):
        self.allocations += 1
        arr = np.empty(shape, dtype)
        self.roots.append((arr.ctypes.data, arr.ctypes.data + max(arr.nbytes, 1), weakref.ref(arr)))
        return arr

    def _root(self, ptr: int):
        for a, b, ref in reversed(self.roots):
            root = ref()
            if root is not None and a <= ptr < b:
                return root, ref, ptr - a
        return None, None, 0

    def is_pinned(self, t) -> bool:
        return self._root(t.data_ptr())[0] is not None

    def copy(self, hosts, dtypes, after=None):
        jobs = []
        for h, d in zip(hosts, dtypes, strict=True):
            assert h.is_contiguous()
            root, ref, offset = self._root(h.data_ptr())
            assert root is not None, "a copy from memory that is not page-locked"
            jobs.append((ref, offset, h.numel() * h.element_size(), h.shape, h.numpy().dtype,
                         torch.empty(h.shape, dtype=d or h.dtype)))
            del root
        mark = _Mark()
        made = [] if after is None else [torch.empty(shape, dtype=dt) for shape, dt in after.outputs]
        self._queue.put((jobs, after, made, mark, self.rng.uniform(0, self.max_delay)))
        self.copies += 1
        return [j[-1] for j in jobs] + made, mark

    def _run(self) -> None:
        while True:
            jobs, after, made, mark, delay = self._queue.get()
            time.sleep(delay)              # the stream is busy: the host buffer is read only now
            for ref, offset, n, shape, dtype, dev in jobs:
                root = ref()
                if root is None:
                    self.errors.append("a host buffer was freed before its copy ran")
                    continue
                raw = root.reshape(-1).view(np.uint8)[offset:offset + n].copy()
                dev.copy_(torch.from_numpy(raw.view(dtype).reshape(shape)))
                del root
            if after is not None:          # built on the "device", on the stream, after the copies
                for t, got in zip(made, after([j[-1] for j in jobs]), strict=True):
                    assert t.shape == got.shape and t.dtype == got.dtype, (t.shape, got.shape, t.dtype, got.dtype)
                    t.copy_(got)
            mark.seconds = delay
            mark.done.set()

    def ready(self, mark) -> bool:
        return mark.done.is_set()

    def seconds(self, mark) -> float:
        return mark.seconds

    def hand_over(self, mark, tensors) -> None:
        self.handovers += 1
        assert mark.done.wait(10), "a copy never ran"


@pytest.fixture
def cuda_stub(monkeypatch):
    copiers: list[StreamCopier] = []

    def make(device):
        copiers.append(StreamCopier(seed=len(copiers)))
        return copiers[-1]
    monkeypatch.setattr(zt, "_device", lambda device: None if device is None else torch.device("cuda"))
    monkeypatch.setattr(zt, "_copier", make)
    return copiers


def plain(batch):
    if isinstance(batch, dict):
        return {k: plain(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(plain(v) for v in batch)
    return batch.clone() if isinstance(batch, torch.Tensor) else batch


def same(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    else:
        assert a == b


@pytest.mark.parametrize("kind", ["windows", "packed", "batchfile"])
def test_batches_through_the_ring_equal_the_cpu_loaders_after_every_later_step(cuda_stub, tmp_path, kind):
    folder, _ = token_stream(tmp_path / "ds", n_tokens=30_000)
    if kind == "windows":
        make = lambda: TokenWindows(folder, 64)             # noqa: E731
    elif kind == "packed":
        make = lambda: PackedDocuments(folder, 96)          # noqa: E731
    else:
        path = tmp_path / "x.batch"
        write_batch_file(path, np.arange(8 * 32 * 40, dtype=np.uint32).reshape(-1, 32) % 50_000, 8, 32, seed=0)
        make = lambda: str(path)                            # noqa: E731
    kw = dict(batch_size=8, seed=3, prefetch=6, num_threads=2)
    expected = [plain(b) for b in Loader(make(), **kw)]
    loader = Loader(make(), device="cuda", **kw)
    held = list(loader)                        # every batch held until the end
    copier = cuda_stub[-1]                     # (made at the first iteration)
    assert len(held) == len(expected) > 20
    for got, want in zip(held, expected, strict=True):
        same(got, want)
    assert copier.errors == []
    m = loader.metrics()
    assert m["h2d_copies"] + 0 <= copier.copies and copier.handovers == m["reads"] == copier.copies
    assert m["steps"] == len(expected)


def test_the_ring_is_allocated_once_and_ids_cross_as_int32(cuda_stub, tmp_path):
    folder, _ = token_stream(tmp_path / "ds", n_tokens=200_000)
    loader = Loader(TokenWindows(folder, 64), batch_size=8, seed=3, prefetch=4, num_threads=2, device="cuda")
    it = iter(loader)
    for _ in range(40):
        x, y = next(it)
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    allocated = loader.metrics()["pinned_buffers"]
    assert allocated == cuda_stub[-1].allocations > 0
    for _ in range(300):
        x, y = next(it)                        # the loop lets each step go: buffers come back
    m = loader.metrics()
    assert m["pinned_buffers"] == allocated, "the ring grew after warming up"
    it.close()
    time.sleep(0.05)
    loader._hop.settle()
    m = loader.metrics()
    # windows of 65 ids crossed as int32: 4 bytes an id, not 8 (every read crossed once:
    # those read ahead of the last step delivered too)
    assert m["h2d_bytes"] >= m["bytes_read"] >= 4 * 65 * 8 * m["steps"]
    assert m["bytes_read"] < 8 * 65 * 8 * m["steps"] and m["bytes_read"] % (4 * 65) == 0
    assert m["h2d_copies"] == cuda_stub[-1].copies


def test_resume_through_the_ring_is_exact_and_the_loader_pickles_without_it(cuda_stub, tmp_path):
    folder, _ = token_stream(tmp_path / "ds", n_tokens=30_000)
    kw = dict(batch_size=4, seed=11, prefetch=4, num_threads=2)
    expected = [plain(b) for b in Loader(TokenWindows(folder, 32), **kw)]
    first = Loader(TokenWindows(folder, 32), device="cuda", **kw)
    it = iter(first)
    got = [plain(next(it)) for _ in range(17)]
    state = first.state_dict()
    it.close()
    second = Loader(TokenWindows(folder, 32), device="cuda", **kw)
    second.load_state_dict(state)
    got += [plain(b) for b in second]
    same(got, expected)
    copy = pickle.loads(pickle.dumps(second))            # as a DataLoader worker gets it
    assert copy._hop is None and "_stage" not in copy.__dict__ and "_allocate" not in copy.source.__dict__


def test_metrics_count_what_the_loop_waited_for(tmp_path):
    folder, _ = token_stream(tmp_path / "ds", n_tokens=30_000)
    loader = Loader(TokenWindows(folder, 32), batch_size=4, seed=1, num_threads=2)
    before = loader.metrics()
    assert before["steps"] == 0 and before["wait_seconds_total"] == 0
    it = iter(loader)
    for _ in range(30):
        next(it)
        time.sleep(0.002)                      # the "model": read-ahead catches up meanwhile
    m = loader.metrics()
    assert m["steps"] == 30 and m["items"] == 120
    assert m["reads"] >= 1 and m["bytes_read"] >= 30 * 4 * 33 * 8
    assert 0 < m["wait_seconds_p50"] <= m["wait_seconds_p99"] <= m["wait_seconds_max"] <= m["wait_seconds_total"]
    assert m["elapsed_seconds"] >= 29 * 0.002 and 0 < m["data_share"] < 1
    assert m["read_ahead_target"] >= 2
    assert format_metrics(m).startswith("steps 30 | data ")


def test_headspace_replays_the_first_batches_without_moving(tmp_path, monkeypatch):
    folder, _ = token_stream(tmp_path / "ds", n_tokens=30_000)
    kw = dict(batch_size=4, seed=5, num_threads=2)
    normal = [plain(b) for b in Loader(TokenWindows(folder, 32), **kw)]
    monkeypatch.setenv("ZEROBATCH_HEADSPACE", "3")
    loader = Loader(TokenWindows(folder, 32), **kw)
    assert loader.headspace == 3
    start = loader.state_dict()
    got = [plain(b) for b in loader]
    assert len(got) == len(normal)
    for k, b in enumerate(got):
        same(b, normal[k % 3])
    assert loader.state_dict() == start
    m = loader.metrics()
    assert m["headspace"] == 1 and m["steps"] == len(normal)
    monkeypatch.setenv("ZEROBATCH_HEADSPACE", "x")
    with pytest.raises(zt.ConfigError):
        Loader(TokenWindows(folder, 32), **kw)


@pytest.mark.parametrize("kw", [{}, {"layout": "hf"}, {"position_dtype": np.int32, "seq_len": 50},
                                {"next_token": False, "seq_len": 300}])
def test_packed_boundaries_built_on_the_device_equal_the_hosts_and_move_fewer_bytes(cuda_stub, tmp_path, kw):
    folder, _ = token_stream(tmp_path / "ds", n_tokens=30_000)
    kw = {"seq_len": 128, **kw}
    seq = kw.pop("seq_len")
    opts = dict(batch_size=6, seed=7, prefetch=4, num_threads=2)
    expected = [plain(b) for b in Loader(PackedDocuments(folder, seq, **kw), **opts)]
    loader = Loader(PackedDocuments(folder, seq, **kw), device="cuda", **opts)
    held = list(loader)
    assert len(held) == len(expected) > 5
    pads = 0
    for got, want in zip(held, expected, strict=True):
        same(got, want)
        pads += int((want["position_ids"] == 0).sum()) if "position_ids" in want else 0
    assert pads > len(held) * 6             # rows of several pieces, and padding
    assert cuda_stub[-1].errors == []
    m = loader.metrics()
    # positions, segments and mask did not cross: the bytes that did are the tokens, labels,
    # offsets and a fill count a row, at most half the host's arrays
    loader._hop.settle()
    assert m["reads"] == cuda_stub[-1].copies
    assert 0 < loader.metrics()["h2d_bytes"] < 0.5 * m["bytes_read"]


def test_headspace_after_a_resume_replays_the_steps_left_and_metrics_reset_mid_pass(tmp_path):
    folder, _ = token_stream(tmp_path / "ds", n_tokens=30_000)
    kw = dict(batch_size=4, seed=5, num_threads=2)
    first = Loader(TokenWindows(folder, 32), **kw)
    it = iter(first)
    for _ in range(10):
        next(it)
    state = first.state_dict()
    it.close()
    replay = Loader(TokenWindows(folder, 32), headspace=2, **kw)
    replay.load_state_dict(state)
    assert len(list(replay)) == len(first) - 10
    assert replay.state_dict() == state
    loader = Loader(TokenWindows(folder, 32), **kw)
    it = iter(loader)
    for _ in range(5):
        next(it)
    loader.reset_metrics()
    for _ in range(5):
        next(it)
        time.sleep(0.001)
    m = loader.metrics()
    assert m["steps"] == 5 and m["elapsed_seconds"] >= 0.004 and 0 <= m["data_share"] < 1
