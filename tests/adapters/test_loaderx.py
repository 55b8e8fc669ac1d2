"""The loaderx workflow: converter, NPDataset, ARDataset and the threaded DataLoader with its
modes, exact resume, close and typed errors; importable without torch."""

from __future__ import annotations

import time

import numpy as np
import pytest

from zbtest import run_python
from zerobatch.adapters.loaderx import ARDataset, DataLoader, NPDataset, converter
from zerobatch.formats.errors import ConfigError, NotFoundError, StateError


@pytest.fixture
def data(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1000, 3, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.arange(1000, dtype=np.int64) * 7)
    converter(np.load(tmp_path / "x.npy", mmap_mode="r"), tmp_path / "store", progress=False, chunk_size=128)
    return x, tmp_path


def test_importable_without_torch():
    r = run_python("import sys\nsys.modules['torch'] = None\nimport zerobatch.adapters.loaderx\nprint('ok')")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_converter_round_trip(data, tmp_path, capsys):
    x, d = data
    ds = ARDataset(d / "store")
    assert len(ds) == 1000
    np.testing.assert_array_equal(ds[[5, 0, 999]], x[[5, 0, 999]])
    labels = np.arange(10, dtype=np.uint16)
    converter(labels, tmp_path / "labels", compress="flate")        # 1-D rows, a progress bar
    assert "10/10" in capsys.readouterr().err
    np.testing.assert_array_equal(ARDataset(tmp_path / "labels")[np.arange(10)], labels)
    with pytest.raises(ConfigError, match="not empty"):
        converter(x, d / "store", progress=False)
    with pytest.raises(ConfigError):
        converter(np.zeros(3, dtype=object), tmp_path / "obj", progress=False)
    with pytest.raises(ConfigError):
        converter(np.float32(1), tmp_path / "scalar", progress=False)


def test_datasets(data):
    x, d = data
    ny = NPDataset(d / "y.npy")
    assert len(ny) == 1000 and ny[[3, 1]].tolist() == [21, 7]
    with pytest.raises(NotFoundError):
        NPDataset(d / "missing.npy")
    with pytest.raises(ConfigError, match="no field"):
        ARDataset(d / "store", field="nope")


@pytest.mark.parametrize("mode", ["sequential", "global_random"])
def test_epoch_modes_cover_every_record_once(data, mode):
    x, d = data
    loader = DataLoader(ARDataset(d / "store"), NPDataset(d / "y.npy"), batch_size=64, mode=mode, seed=3)
    assert len(loader) == 16
    epochs = []
    for _ in range(2):
        labels = []
        for b in loader:
            np.testing.assert_array_equal(b["data"], x[b["label"] // 7])
            labels.append(b["label"] // 7)
        order = np.concatenate(labels)
        assert sorted(order.tolist()) == list(range(1000))
        epochs.append(order)
    if mode == "sequential":
        assert epochs[0].tolist() == list(range(1000)) == epochs[1].tolist()
    else:
        assert epochs[0].tolist() != epochs[1].tolist()   # a fresh permutation each epoch
    assert loader.epoch == 2
    loader.close()


def test_endless_modes(data):
    x, d = data
    ring = DataLoader(ARDataset(d / "store"), batch_size=300, mode="sliding")
    got = []
    for i, b in enumerate(ring):
        got.append(b["data"])
        if i == 3:
            break
    flat = np.concatenate(got)
    np.testing.assert_array_equal(flat[1000:1200], x[:200])   # wraps at the tail
    assert "label" not in b
    with pytest.raises(TypeError):
        len(ring)
    rnd = DataLoader(NPDataset(d / "y.npy"), batch_size=500, mode="random", seed=1)
    draws = np.concatenate([b["data"] for _, b in zip(range(4), rnd, strict=False)]) // 7
    assert len(np.unique(draws)) < 2000   # with replacement
    ring.close()
    rnd.close()


def test_resume_is_exact_and_counts_delivered_batches(data):
    x, d = data
    kw = dict(batch_size=50, num_workers=3, prefetch_size=6, seed=9)
    full = DataLoader(NPDataset(d / "y.npy"), **kw)
    want = [b["data"].copy() for b in full]
    loader = DataLoader(NPDataset(d / "y.npy"), **kw)
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = loader.state_dict()
    assert state["sampler"]["consumed"] == 7 * 50      # not the prefetched ones
    loader.close()
    again = DataLoader(NPDataset(d / "y.npy"), **kw)
    again.load_state_dict(state)
    rest = [b["data"] for b in again]
    assert [r.tolist() for r in rest] == [w.tolist() for w in want[7:]]
    with pytest.raises(StateError):
        DataLoader(NPDataset(d / "y.npy"), batch_size=10).load_state_dict(state)
    with pytest.raises(StateError):
        again.load_state_dict({"other": 1})


def test_transform_runs_on_the_reader_threads(data):
    x, d = data
    import threading

    names = set()

    def tf(batch):
        names.add(threading.current_thread().name)
        return {"data": batch["data"] * 2, "label": batch["label"]}

    loader = DataLoader(ARDataset(d / "store"), NPDataset(d / "y.npy"), batch_size=100, mode="sequential",
                        transform=tf)
    b = next(iter(loader))
    np.testing.assert_array_equal(b["data"], x[:100] * 2)
    assert names and all(n.startswith("loaderx-reader") for n in names)
    loader.close()


def test_bad_inputs_are_typed_errors(data, tmp_path):
    x, d = data
    with pytest.raises(ConfigError, match="labels for"):
        DataLoader(ARDataset(d / "store"), NPDataset(d / "y.npy").array[:10])
    np.save(tmp_path / "empty.npy", np.zeros((0, 3)))
    with pytest.raises(ConfigError, match="empty"):
        DataLoader(NPDataset(tmp_path / "empty.npy"))
    for kw in (dict(mode="zigzag"), dict(batch_size=0), dict(num_workers=0), dict(prefetch_size=-1),
               dict(transform=3)):
        with pytest.raises(ConfigError):
            DataLoader(NPDataset(d / "y.npy"), **kw)


def test_close_always_returns_and_ends_iteration(data):
    x, d = data

    def slow(batch):
        time.sleep(0.5)
        return batch

    loader = DataLoader(NPDataset(d / "y.npy"), batch_size=10, num_workers=2, prefetch_size=4, transform=slow)
    it = iter(loader)
    next(it)
    t0 = time.monotonic()
    loader.close()
    loader.close()
    assert time.monotonic() - t0 < 0.4   # a waiting close() would take the 0.5 s of the read in flight
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(StateError):
        iter(loader).__next__()
