"""The GIL is released in the gather kernel: N threads against one loop over the same work.

If the kernel held the GIL, two threads would take as long as one loop; released, they take
about half (on two free cores). Compare ``time_threads`` with ``time_one_loop`` per ``threads``.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from zerobatch.readers.llmbatch import BatchFileReader
from zerobatch.writers.llmbatch import write_batch_file

BS, SL, NB = 32, 512, 256
_STATE: dict = {}


class GatherThreads:
    params = [1, 2]
    param_names = ["threads"]

    def setup_cache(self):
        path = os.path.abspath("gil.batch")
        tokens = np.random.default_rng(0).integers(0, 50257, size=(NB * BS, SL), dtype=np.uint32)
        write_batch_file(path, tokens, BS, SL, seed=0)
        return path

    def _state(self, path, threads):
        # Built on first use, not in setup(): asv re-runs setup() before every timed call.
        st = _STATE.get((path, threads))
        if st is None:
            reader = BatchFileReader(path)
            reader.read_batches(np.arange(NB))  # verified once
            work = [np.arange(NB, dtype=np.int64)[k::threads] for k in range(threads)]
            st = _STATE[(path, threads)] = (reader, work, [np.empty((len(w), BS, SL), np.int64) for w in work])
        return st

    def time_one_loop(self, path, threads):
        reader, work, outs = self._state(path, threads)
        for w, o in zip(work, outs):
            reader.read_batches(w, out=o)

    def time_threads(self, path, threads):
        reader, work, outs = self._state(path, threads)
        ts = [threading.Thread(target=reader.read_batches, args=(w,), kwargs={"out": o})
              for w, o in zip(work, outs)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
