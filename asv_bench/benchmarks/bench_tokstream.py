"""TOKSTREAM: random windows (int64 / int32, with and without next-token pairs; on one thread
and split over two), windows of a chat dataset with their labels masked by its loss mask,
windows with metadata, document-boundary outputs, documents, both backends, and beside them
the same workload through a plain ``np.memmap`` with per-sample slicing and ``torch.stack``
and a bare NumPy ``uint32 -> int64`` conversion of as many tokens. Public API only.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from zerobatch.readers.tokstream import TokenStreamReader
from zerobatch.writers.tokstream import TokenStreamWriter

TOKENS = 1 << 24
CHAT_TOKENS = 1 << 22
SHAPES = {"32x512": (32, 512), "8x2048": (8, 2048)}


def _build(metadata: bool) -> str:
    """A dataset of 2**24 uint16 tokens in 8 shards, documents of 1-4096 tokens; with
    metadata, each document carries a JSON object and its first 8 tokens a span object."""
    folder = os.path.abspath("tokstream_meta" if metadata else "tokstream_plain")
    if os.path.exists(os.path.join(folder, "manifest.json")):
        return folder
    rng = np.random.default_rng(0)
    data = rng.integers(0, 50257, TOKENS).astype(np.uint16)
    cuts = np.cumsum(rng.integers(1, 4097, TOKENS // 2048 + 2))
    cuts = np.concatenate([[0], cuts[cuts < TOKENS], [TOKENS]])
    with TokenStreamWriter(folder, vocab_size=50257, metadata=metadata, shard_tokens=TOKENS // 8) as w:
        for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
            if metadata:
                w.add_document(data[a:b], {"doc": k, "source": "bench"}, spans=[(0, min(8, b - a), {"span": k})])
            else:
                w.add_document(data[a:b])
    return folder


def _build_chat() -> str:
    """A chat dataset of 2**22 uint16 tokens in 8 shards, documents of 1-4096 tokens, and its
    loss mask (``loss_mask/``, written beside it and named by its manifest): turns of 1-512
    tokens, alternately masked (0) and trained (1)."""
    folder = os.path.abspath("tokstream_chat")
    if os.path.exists(os.path.join(folder, "manifest.json")):
        return folder
    rng = np.random.default_rng(0)
    data = rng.integers(0, 50257, CHAT_TOKENS).astype(np.uint16)
    turns = rng.integers(1, 513, CHAT_TOKENS // 256 + 2)
    keep = np.repeat(np.arange(turns.size) % 2, turns)[:CHAT_TOKENS].astype(np.uint16)
    cuts = np.cumsum(rng.integers(1, 4097, CHAT_TOKENS // 2048 + 2))
    cuts = np.concatenate([[0], cuts[cuts < CHAT_TOKENS], [CHAT_TOKENS]])
    w = TokenStreamWriter(folder, vocab_size=50257, shard_tokens=CHAT_TOKENS // 8)
    m = TokenStreamWriter(os.path.join(folder, "loss_mask"), vocab_size=2, shard_tokens=CHAT_TOKENS // 8)
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        w.add_document(data[a:b])
        m.add_document(keep[a:b])
    w.close(loss_mask=m.close())
    return folder


_READERS: dict[tuple[str, str], TokenStreamReader] = {}


def _reader(folder: str, backend: str = "mmap") -> TokenStreamReader:
    """One open reader per dataset and backend per benchmark process."""
    key = (folder, backend)
    if key not in _READERS:
        _READERS[key] = TokenStreamReader(folder, backend=backend)
    return _READERS[key]


def _threaded_reader(folder: str, threads: int) -> TokenStreamReader:
    """One open reader per dataset and thread count per benchmark process."""
    key = (folder, f"threads={threads}")
    if key not in _READERS:
        _READERS[key] = TokenStreamReader(folder, num_threads=threads)
    return _READERS[key]


def _warm(read, starts_list) -> None:
    """Touch every window a benchmark will read once in setup, so the timings measure the
    steady state rather than first-touch page faults of a freshly mapped file."""
    for starts in starts_list:
        read(starts)


def _starts(reader: TokenStreamReader, count: int, length: int, k: int) -> np.ndarray:
    return np.random.default_rng(k).integers(0, reader.num_tokens - length, count)


class Windows:
    """One batch of random windows into a reused buffer."""

    params = (list(SHAPES), ["int64", "int32"], [True, False])
    param_names = ["shape", "dtype", "pairs"]

    def setup_cache(self):
        return _build(metadata=False)

    def setup(self, folder, shape, dtype, pairs):
        self.reader = _reader(folder)
        b, L = SHAPES[shape]
        self.length = L + 1 if pairs else L
        self.out = np.empty((b, self.length), dtype=dtype)
        self.starts = [_starts(self.reader, b, self.length, k) for k in range(64)]
        self.k = 0
        _warm(lambda st: self.reader.windows(st, self.length, out=self.out), self.starts)

    def time_windows(self, folder, shape, dtype, pairs):
        self.k = (self.k + 1) & 63
        self.reader.windows(self.starts[self.k], self.length, out=self.out)


class WindowsThreads:
    """One batch of random next-token windows (int64) on one thread and split over two (the
    calling thread and a pool worker): a batch below the size worth splitting (32 x 513, which
    stays on the calling thread) and one above it (256 x 513)."""

    params = (["32x513", "256x513"], [1, 2])
    param_names = ["shape", "threads"]

    def setup_cache(self):
        return _build(metadata=False)

    def setup(self, folder, shape, threads):
        self.reader = _threaded_reader(folder, threads)
        b, L = (int(x) for x in shape.split("x"))
        self.length = L
        self.out = np.empty((b, L), dtype=np.int64)
        self.starts = [_starts(self.reader, b, L, k) for k in range(64)]
        self.k = 0
        _warm(lambda st: self.reader.windows(st, L, out=self.out), self.starts)

    def time_windows(self, folder, shape, threads):
        self.k = (self.k + 1) & 63
        self.reader.windows(self.starts[self.k], self.length, out=self.out)


class MaskedLabels:
    """One batch of 32 random next-token windows of 2049 int32 tokens of a chat dataset, alone
    and with their 2048 labels masked by the dataset's loss mask (read in the same compiled
    pass as the tokens): with the labels, about 2.5-3x the time of the tokens alone (two reads
    and a NumPy merge, the way before, cost about 10x)."""

    params = ["tokens", "tokens+labels"]
    param_names = ["read"]

    def setup_cache(self):
        return _build_chat()

    def setup(self, folder, read):
        self.reader = _reader(folder)
        self.out = np.empty((32, 2049), dtype=np.int32)
        self.kw = {}
        if read == "tokens+labels":
            self.kw = {"labels": np.empty((32, 2048), dtype=np.int32), "label_mask": "loss_mask"}
        self.starts = [_starts(self.reader, 32, 2049, k) for k in range(64)]
        self.k = 0
        _warm(lambda st: self.reader.windows(st, 2049, out=self.out, **self.kw), self.starts)

    def time_windows(self, folder, read):
        self.k = (self.k + 1) & 63
        self.reader.windows(self.starts[self.k], 2049, out=self.out, **self.kw)


class Baselines:
    """The same int64 next-token pairs the usual way, and a bare conversion of as many tokens."""

    params = list(SHAPES)
    param_names = ["shape"]

    def setup_cache(self):
        return _build(metadata=False)

    def setup(self, folder, shape):
        reader = _reader(folder)
        self.b, self.L = SHAPES[shape]
        entry = reader.manifest.shards[0]
        self.mm = np.memmap(os.path.join(reader.folder, entry.name, "tokens.bin"), dtype=np.uint16, mode="r",
                            shape=(entry.num_tokens,))
        self.starts = [np.random.default_rng(k).integers(0, entry.num_tokens - self.L - 1, self.b) for k in range(64)]
        self.src = np.random.default_rng(0).integers(0, 50257, self.b * (self.L + 1)).astype(np.uint32)
        self.k = 0
        _warm(lambda st: [self.mm[s:s + self.L + 1].sum() for s in st], self.starts)

    def time_memmap_per_sample_torch_stack(self, folder, shape):
        self.k = (self.k + 1) & 63
        L, mm = self.L, self.mm
        xs = [torch.from_numpy(mm[s:s + L].astype(np.int64)) for s in self.starts[self.k]]
        ys = [torch.from_numpy(mm[s + 1:s + L + 1].astype(np.int64)) for s in self.starts[self.k]]
        torch.stack(xs), torch.stack(ys)

    def time_bare_astype_int64(self, folder, shape):
        self.src.astype(np.int64)


class Backends:
    """32 x 513 int64 windows through each backend."""

    params = ["mmap", "pread"]
    param_names = ["backend"]

    def setup_cache(self):
        return _build(metadata=False)

    def setup(self, folder, backend):
        self.reader = _reader(folder, backend)
        self.out = np.empty((32, 513), dtype=np.int64)
        self.starts = [_starts(self.reader, 32, 513, k) for k in range(64)]
        self.k = 0
        _warm(lambda st: self.reader.windows(st, 513, out=self.out), self.starts)

    def time_windows(self, folder, backend):
        self.k = (self.k + 1) & 63
        self.reader.windows(self.starts[self.k], 513, out=self.out)


class Extras:
    """Metadata (8 windows one by one; 32 as one batch, beside plain windows of the same
    dataset), document boundaries and documents (32) for a 32 x 512 batch, on the dataset with
    metadata."""

    def setup_cache(self):
        return _build(metadata=True)

    def setup(self, folder):
        self.reader = _reader(folder)
        self.starts = _starts(self.reader, 32, 513, 1)
        self.pos = np.empty((32, 512), dtype=np.int64)
        self.pos32 = np.empty((32, 512), dtype=np.int32)
        self.seg = np.empty((32, 512), dtype=np.int32)
        self.cu = np.empty(32 * 512 + 1, dtype=np.int32)
        self.docs = np.random.default_rng(2).integers(0, self.reader.num_documents, 32)
        self.out = np.empty((32, 513), dtype=np.int64)
        self.ids = np.empty((32, 513), dtype=np.int32)
        self.reader.windows(self.starts, 513)
        self.reader.windows_metadata(self.starts, 513, ids=self.ids, out=self.out)
        self.reader.documents(self.docs)

    def time_boundaries(self, folder):
        self.reader.boundaries(self.starts, 512, position_ids=self.pos, segment_ids=self.seg, cu_seqlens=self.cu)

    def time_windows_with_boundaries(self, folder):
        # tokens and the boundary outputs of the inputs in one pass
        self.reader.windows_with_boundaries(self.starts, 513, out=self.out, position_ids=self.pos,
                                            segment_ids=self.seg, cu_seqlens=self.cu)

    def time_windows_with_boundaries_lean(self, folder):
        self.reader.windows_with_boundaries(self.starts, 513, out=self.out, position_ids=self.pos32,
                                            cu_seqlens=self.cu, segments=False)

    def time_boundaries_lean(self, folder):
        self.reader.boundaries(self.starts, 512, position_ids=self.pos32, cu_seqlens=self.cu, segments=False)

    def time_window_metadata_raw(self, folder):
        for s in self.starts[:8].tolist():
            self.reader.window_metadata(s, 513, decode=False)

    def time_window_metadata_decoded(self, folder):
        for s in self.starts[:8].tolist():
            list(self.reader.window_metadata(s, 513).objects)

    def time_windows_with_metadata(self, folder):
        # the whole batch: tokens and numbered metadata ids in one pass, blobs located
        self.reader.windows_metadata(self.starts, 513, ids=self.ids, out=self.out)

    def time_windows_plain_same_dataset(self, folder):
        self.reader.windows(self.starts, 513, out=self.out)

    def time_documents_flat(self, folder):
        self.reader.documents(self.docs)

    def time_documents_padded(self, folder):
        self.reader.documents(self.docs, pad_to=2048)
