"""The seed's npy-folder DatasetLoader: its examples, its code where it agrees with its text,
its text where they disagree, bad folders and files, and the saved position."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobatch.adapters.torch import DatasetLoader, Loader, NpyTokenWindows
from zerobatch.formats.errors import ConfigError, CorruptError, FormatError, NotFoundError, StateError


def folder_of(tmp_path, lengths, dtype=np.uint16, start=0):
    """Files whose token at position i is (start + running count) mod 60000."""
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    at = start
    for k, n in enumerate(lengths):
        np.save(d / f"shard_{k:03d}.npy", (np.arange(at, at + n) % 60000).astype(dtype))
        at += n
    return str(d)


class SeedDatasetLoader:
    """The seed's code, as its text prints it (np.load of whole files)."""

    def __init__(self, batch, seq_len, process_rank, num_processes, dataset_dir, device):
        self.batch, self.seq_len = batch, seq_len
        self.process_rank, self.num_processes = process_rank, num_processes
        self.device = device
        self.filepaths = sorted([os.path.join(dataset_dir, p) for p in os.listdir(dataset_dir)])
        self.file_data = np.load(self.filepaths[0])
        self.file_idx = 0
        self.tok_idx = batch * seq_len * process_rank

    def get_batch(self):
        batch = self.file_data[self.tok_idx: self.tok_idx + (self.batch * self.seq_len) + 1]
        x = batch[:-1].reshape(self.batch, self.seq_len)
        y = batch[1:].reshape(self.batch, self.seq_len)
        self.tok_idx += (self.batch * self.seq_len * self.num_processes)
        if self.tok_idx + (self.batch * self.seq_len * self.num_processes) + 1 >= len(self.file_data):
            self.file_idx += 1
            if self.file_idx >= len(self.filepaths):
                self.file_idx = 0
            self.file_data = np.load(self.filepaths[self.file_idx])
            self.tok_idx = self.batch * self.seq_len * self.process_rank
        return (torch.from_numpy(x.astype(np.int32)).long().to(self.device),
                torch.from_numpy(y.astype(np.int32)).long().to(self.device))


def reference(files, b, t, rank, world, steps):
    """The text's rule: every step that fits, in file order, cycling."""
    stride, out = b * t * world, []
    while len(out) < steps:
        for f in files:
            off = 0
            while off + stride + 1 <= len(f) and len(out) < steps:
                piece = f[off + rank * b * t: off + rank * b * t + b * t + 1].astype(np.int64)
                out.append((piece[:-1].reshape(b, t), piece[1:].reshape(b, t)))
                off += stride
    return out


def test_the_seed_example(tmp_path):
    d = folder_of(tmp_path, [50])
    loader = DatasetLoader(batch=2, seq_len=4, process_rank=0, num_processes=1, dataset_dir=d, device="cpu")
    x, y = loader.get_batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2, 4)
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and y.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    assert isinstance(loader.stream._file(), np.memmap)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.int32, np.int64])
@pytest.mark.parametrize("b, t, world", [(2, 4, 1), (3, 5, 2), (1, 7, 4)])
def test_equal_to_the_seed_code_where_it_agrees_with_its_text(tmp_path, dtype, b, t, world):
    # file lengths where no step fits exactly at the end and every file holds two steps
    stride = b * t * world
    lengths = [2 * stride + 3 + k for k in range(3)]
    d = folder_of(tmp_path, lengths, dtype)
    # rank 0 (ranks above 0 leave a file early in the seed's code: next test)
    ours = DatasetLoader(b, t, 0, world, d, "cpu")
    seed = SeedDatasetLoader(b, t, 0, world, d, "cpu")
    for _ in range(20):
        (x1, y1), (x2, y2) = ours.get_batch(), seed.get_batch()
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_the_seed_code_lets_ranks_drift_apart_and_we_keep_them_together(tmp_path):
    """The seed checks the end of a file from each rank's own offset, so rank 1 leaves a file a
    step before rank 0: the ranks drift apart and then read the same tokens. Its text says every
    batch stays aligned, with no duplication across processes: all ranks leave together here."""
    d = folder_of(tmp_path, [63, 63, 63])                 # 2 steps of 30 (+1) tokens per file
    seed = [SeedDatasetLoader(3, 5, r, 2, d, "cpu") for r in range(2)]
    ours = [DatasetLoader(3, 5, r, 2, d, "cpu") for r in range(2)]
    seed_files = [[(s.get_batch(), s.file_idx)[1] for _ in range(4)] for s in seed]
    ours_files = [[(o.get_batch(), o.file_idx)[1] for _ in range(4)] for o in ours]
    assert seed_files[0] != seed_files[1]
    assert ours_files[0] == ours_files[1] == [0, 1, 1, 2]


@pytest.mark.parametrize("b, t, world", [(2, 4, 1), (2, 3, 2), (1, 5, 3)])
def test_the_text_rule_with_exact_fits_and_short_files(tmp_path, b, t, world):
    stride = b * t * world
    lengths = [stride + 1, 3 * stride + 1, stride // 2, 2 * stride + 5, stride]   # exact, exact, short, loose, short
    d = folder_of(tmp_path, lengths)
    files = [np.load(os.path.join(d, n)) for n in sorted(os.listdir(d))]
    seen = []
    for rank in range(world):
        loader = DatasetLoader(b, t, rank, world, d, "cpu")
        ref = reference(files, b, t, rank, world, 15)
        got = [loader.get_batch() for _ in range(15)]
        for (x, y), (rx, ry) in zip(got, ref, strict=True):
            assert (x.numpy() == rx).all() and (y.numpy() == ry).all()
        seen.append([x[:, 0].tolist() for x, _ in got])
    # ranks never share an input row start within a step
    for step in zip(*seen, strict=True):
        flat = [v for r in step for v in r]
        assert len(flat) == len(set(flat))


def test_the_seed_code_skips_an_exact_fit_and_we_do_not(tmp_path):
    d = folder_of(tmp_path, [2 * 8 + 1, 100])          # two steps of 8 tokens fit exactly in file 0
    ours = DatasetLoader(2, 4, 0, 1, d, "cpu")
    seed = SeedDatasetLoader(2, 4, 0, 1, d, "cpu")
    assert [ours.get_batch()[0][0, 0].item() for _ in range(3)] == [0, 8, 17]
    assert [seed.get_batch()[0][0, 0].item() for _ in range(3)] == [0, 17, 25]


def test_folders_and_files_that_cannot_serve(tmp_path):
    with pytest.raises(NotFoundError):
        DatasetLoader(2, 4, 0, 1, tmp_path / "none", "cpu")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(NotFoundError):
        DatasetLoader(2, 4, 0, 1, tmp_path / "empty", "cpu")
    d = folder_of(tmp_path, [5, 8])                     # no file holds 2*4+1 tokens
    with pytest.raises(ConfigError, match="no file holds one step"):
        DatasetLoader(2, 4, 0, 1, d, "cpu")
    (tmp_path / "data" / "z.txt").write_text("ignored")
    for name, arr in [("bad_shape.npy", np.zeros((4, 4), np.uint16)), ("bad_dtype.npy", np.zeros(40, np.float32))]:
        np.save(tmp_path / "data" / name, arr)
        with pytest.raises(FormatError, match=name) as info:
            DatasetLoader(1, 2, 0, 1, d, "cpu")
        assert info.value.field in ("shape", "dtype")
        os.remove(tmp_path / "data" / name)
    (tmp_path / "data" / "broken.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(FormatError, match="broken.npy"):
        DatasetLoader(1, 2, 0, 1, d, "cpu")
    os.remove(tmp_path / "data" / "broken.npy")
    np.save(tmp_path / "data" / "neg.npy", np.array([1, 2, -3, 4, 5, 6], np.int32))
    loader = DatasetLoader(1, 2, 0, 1, d, "cpu")
    with pytest.raises(CorruptError):
        for _ in range(10):
            loader.get_batch()
    for kw in ({"batch": 0}, {"seq_len": -1}, {"process_rank": 2}, {"num_processes": 0}):
        args = {"batch": 1, "seq_len": 2, "process_rank": 0, "num_processes": 2, "dataset_dir": d} | kw
        with pytest.raises(ConfigError):
            DatasetLoader(**args, device="cpu")


def test_position_saved_and_restored(tmp_path):
    d = folder_of(tmp_path, [41, 60, 17, 33])
    loader = DatasetLoader(2, 3, 1, 2, d, "cpu")
    for _ in range(5):
        loader.get_batch()
    state = loader.state_dict()
    expected = [loader.get_batch() for _ in range(12)]
    again = DatasetLoader(2, 3, 1, 2, d, "cpu")
    again.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(expected, [again.get_batch() for _ in range(12)], strict=True))
    # another number of processes continues at the same token offset
    solo = DatasetLoader(2, 3, 0, 1, d, "cpu")
    solo.load_state_dict(state)
    assert (solo.file_idx, solo.tok_idx) == (state["file_idx"], state["offset"])
    for bad in ({**state, "files": []}, {**state, "file_idx": 9}, {**state, "offset": -1}, {}, "x"):
        with pytest.raises(StateError):
            again.load_state_dict(bad)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 90), min_size=1, max_size=5), st.integers(1, 3), st.integers(1, 5), st.integers(1, 3))
def test_property_every_rank_matches_the_text_rule(tmp_path_factory, lengths, b, t, world):
    stride = b * t * world
    if not any(n >= stride + 1 for n in lengths):
        return
    d = folder_of(tmp_path_factory.mktemp("p"), lengths)
    files = [np.load(os.path.join(d, n)) for n in sorted(os.listdir(d))]
    for rank in range(world):
        loader = DatasetLoader(b, t, rank, world, d, "cpu")
        for (x, y), (rx, ry) in zip([loader.get_batch() for _ in range(12)], reference(files, b, t, rank, world, 12),
                                    strict=True):
            assert (x.numpy() == rx).all() and (y.numpy() == ry).all()


def test_npy_windows_serve_the_loader(tmp_path):
    d = folder_of(tmp_path, [100, 7, 64, 33])
    src = NpyTokenWindows(d, 8)
    files = [np.load(os.path.join(d, n)) for n in sorted(os.listdir(d))]
    windows = [f[k * 8:k * 8 + 9] for f in files for k in range(max(0, (len(f) - 9) // 8 + 1))]
    assert src.num_items == len(windows)
    seen = []
    for x, y in Loader(src, batch_size=4, seed=3, drop_last=False):
        assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
        for row, nxt in zip(x.numpy(), y.numpy(), strict=True):
            full = np.r_[row, nxt[-1]]
            hits = [i for i, w in enumerate(windows) if np.array_equal(w, full)]
            assert len(hits) == 1                          # a real window of one file
            seen.append(hits[0])
    assert sorted(seen) == list(range(len(windows)))
    plain = next(iter(Loader(NpyTokenWindows(d, 8, next_token=False), batch_size=2, shuffle=False)))
    assert plain.tolist() == [list(range(0, 8)), list(range(8, 16))]
