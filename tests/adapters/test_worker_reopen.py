"""Readers carried into spawned workers open there on first use (issue 17): a dataset deleted
or replaced after the loader was made reaches the training loop as a typed error, never as
``RuntimeError: DataLoader worker exited unexpectedly``; unpickling itself opens nothing."""

from __future__ import annotations

import pickle
import shutil

import numpy as np
import pytest

from zerobatch.formats.errors import ZerobatchError


def make_tokstream(folder, offset=0):
    from zerobatch.writers.tokstream import TokenStreamWriter

    with TokenStreamWriter(folder, vocab_size=1000, shard_tokens=400) as w:
        for k in range(30):
            w.add_document(np.arange(1, 40) + k + offset)


def make_llmbatch(path, offset=0):
    from zerobatch.writers.llmbatch import write_batch_file

    write_batch_file(path, np.arange(24 * 8, dtype=np.uint32).reshape(24, 8) + offset, 4, 8, seed=1)


def make_llmchnk(path, offset=0):
    from zerobatch.writers.llmchnk import write_chunk_file

    write_chunk_file(path, [np.arange(1, 9 + k % 5) + offset for k in range(20)])


def make_zrecord(folder, offset=0):
    from zerobatch.formats.zrecord import FieldSpec
    from zerobatch.writers.zrecord import ZRecordWriter

    with ZRecordWriter(folder, [FieldSpec("a", "i64", ())], chunk_grow_bytes=1 << 16) as w:
        for i in range(20):
            w.append({"a": i + offset})


READERS = {
    "tokstream": (make_tokstream, "zerobatch.readers.tokstream:TokenStreamReader", lambda r: r.windows([0], 8)),
    "llmbatch": (make_llmbatch, "zerobatch.readers.llmbatch:BatchFileReader", lambda r: r.read_batch(0)),
    "llmchnk": (make_llmchnk, "zerobatch.readers.llmchnk:LLMChunkReader", lambda r: r.read_record(0)),
    "zrecord": (make_zrecord, "zerobatch.readers.zrecord:ZRecordStore", lambda r: r.gather([0])),
}


def _cls(dotted):
    import importlib

    mod, name = dotted.split(":")
    return getattr(importlib.import_module(mod), name)


def _remove(path):
    shutil.rmtree(path) if path.is_dir() else path.unlink()


@pytest.mark.parametrize("fmt", sorted(READERS))
def test_an_unpickled_reader_opens_on_first_use_and_refuses_a_replaced_dataset(tmp_path, fmt):
    make, dotted, use = READERS[fmt]
    path = tmp_path / "data"
    make(path)
    reader = _cls(dotted)(path)
    expected = pickle.loads(pickle.dumps(reader))
    use(expected)                                   # the same dataset: reads
    raw = pickle.dumps(reader)
    reader.close()
    _remove(path)
    clone = pickle.loads(raw)                       # nothing opened: unpickling cannot fail
    with pytest.raises(ZerobatchError):
        use(clone)
    with pytest.raises(ZerobatchError):             # and again: the same typed error, not AttributeError
        use(clone)
    clone.close()
    make(path, offset=1)                            # another dataset at the same path
    with pytest.raises(ZerobatchError):
        use(pickle.loads(raw))
    pickle.loads(raw).close()                       # closing an unopened reader opens nothing


@pytest.mark.parametrize("fmt", ["tokstream", "llmbatch"])
def test_spawned_workers_over_a_deleted_dataset_raise_a_typed_error_in_the_loop(tmp_path, fmt):
    from zerobatch.adapters.torch import LLMBatchSource, Loader, TokenWindows

    path = tmp_path / "data"
    READERS[fmt][0](path)
    source = TokenWindows(path, 16) if fmt == "tokstream" else LLMBatchSource(path)
    loader = Loader(source, batch_size=4, seed=1, num_threads=1)
    _remove(path)
    dl = loader.dataloader(num_workers=2, multiprocessing_context="spawn")
    with pytest.raises(ZerobatchError):
        list(dl)


def test_threads_using_an_unpickled_reader_at_once_wait_for_its_first_open(tmp_path):
    """A reader unpickled in a worker and first used by several threads at once (Grain's worker
    threads, a loader's read-ahead pool): every thread waits for the one open. Before, the
    others saw the attributes the open had set so far (``closed`` was set at unpickling) and
    read a half-open reader: ``OutOfRangeError: the dataset holds no tokens`` in 29 of 40
    rounds here."""
    import threading

    from zerobatch.readers.tokstream import TokenStreamReader
    make_tokstream(tmp_path / "d")
    blob = pickle.dumps(TokenStreamReader(tmp_path / "d"))
    want = TokenStreamReader(tmp_path / "d").windows(np.arange(5) * 100, 50).tolist()
    for _ in range(15):
        r = pickle.loads(blob)
        got, go = [], threading.Barrier(16)

        def read():
            go.wait()
            try:
                got.append(r.windows(np.arange(5) * 100, 50).tolist())
            except Exception as exc:        # noqa: BLE001 - collected for the assertion
                got.append(repr(exc))

        threads = [threading.Thread(target=read) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == [want] * 16
