"""LLMCHNK: a batch gather of random records into a preallocated int64 [batch, 512] buffer
(the batch size chosen at read time), beside LLMBATCH reads of the same tokens (a file per
batch size, a random pre-formed batch into the same kind of buffer). Public API only."""

from __future__ import annotations

import os

import numpy as np

from zerobatch.readers.llmbatch import BatchFileReader
from zerobatch.readers.llmchnk import LLMChunkReader
from zerobatch.writers.llmbatch import write_batch_file
from zerobatch.writers.llmchnk import write_chunk_file

SL = 512
RECORDS = 8192                      # 16 MiB of uint32 tokens
BATCHES = [8, 32, 128]


class Gather:
    params = BATCHES
    param_names = ["batch"]

    def setup_cache(self):
        tokens = np.random.default_rng(0).integers(0, 50257, size=(RECORDS, SL), dtype=np.uint32)
        chunk = os.path.abspath("records.chunk")
        write_chunk_file(chunk, tokens, seq_len=SL)
        batches = {}
        for b in BATCHES:
            batches[b] = os.path.abspath(f"records_{b}.batch")
            write_batch_file(batches[b], tokens, b, SL, seed=0)
        return chunk, batches

    def setup(self, files, batch):
        chunk, batches = files
        self.chunk = LLMChunkReader(chunk)
        self.chunk.verify()                                  # steady state: checksums known good
        self.batch = BatchFileReader(batches[batch])
        self.batch.verify()
        rng = np.random.default_rng(1)
        self.idx = [rng.integers(0, RECORDS, batch) for _ in range(64)]
        self.bidx = rng.integers(0, self.batch.num_batches, 64)
        self.out = np.empty((batch, SL), np.int64)
        self.k = 0

    def teardown(self, files, batch):
        self.chunk.close()
        self.batch.close()

    def time_llmchnk_gather(self, files, batch):
        self.k = (self.k + 1) & 63
        self.chunk.gather(self.idx[self.k], out=self.out)

    def time_llmbatch_read(self, files, batch):
        self.k = (self.k + 1) & 63
        self.batch.read_batch_numpy(int(self.bidx[self.k]), out=self.out)


class FeatureWindowsBatch:
    """Flat feature matrix: a batch of 64 random windows of 32 rows x 64 float32 features
    (one compiled locate and one compiled gather), from a 32 MiB matrix of 16 keys."""

    def setup_cache(self):
        from zerobatch.writers.features import write_feature_matrix
        rng = np.random.default_rng(0)
        folder = os.path.abspath("features")
        write_feature_matrix(folder, {f"k{i}": rng.normal(size=(8192, 64)) for i in range(16)})
        return folder

    def setup(self, folder):
        from zerobatch.readers.features import FeatureMatrix
        self.fm = FeatureMatrix(folder, 32)
        self.fm.verify()
        rng = np.random.default_rng(1)
        self.idx = [rng.integers(0, len(self.fm), 64) for _ in range(64)]
        self.out = np.empty((64, 32, 64), np.float32)
        self.k = 0

    def time_windows(self, folder):
        self.k = (self.k + 1) & 63
        self.fm.windows(self.idx[self.k], out=self.out)

    def time_window_view(self, folder):
        self.k = (self.k + 1) & 63
        self.fm.window_at(int(self.idx[self.k][0]))
