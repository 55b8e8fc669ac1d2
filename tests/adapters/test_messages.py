"""The words of the loaders' Python-side errors (issue 30, item 12): a source given a dataset
of another format names that format and the source that reads it; a missing path says it does
not exist; a state saved with another ``seq_len`` (stride, window...) names it; a device that
is not there is refused when the loader is made, not at the first batch."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from zbtest import records, token_stream

from zerobatch.adapters.torch import (BatchNativeLoader, DatasetLoader, FeatureWindows, FlatDocuments,
                                      LLMBatchSource, LLMChunkSource, Loader, NpyTokenWindows,
                                      PackedDocuments, RecordFields, TokenDocuments, TokenWindows)
from zerobatch.formats.errors import ConfigError, NotFoundError, StateError
from zerobatch.readers.tokstream import TokenStreamReader


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """One dataset of every format a source reads, and a file of none."""
    from zerobatch.formats.zrecord import FieldSpec
    from zerobatch.writers.features import write_feature_matrix
    from zerobatch.writers.llmbatch import write_batch_file
    from zerobatch.writers.llmchnk import write_chunk_file
    from zerobatch.writers.zrecord import ZRecordWriter

    d = tmp_path_factory.mktemp("formats")
    write_batch_file(d / "x.batch", records(64, 32), 8, 32, seed=1)
    write_batch_file(d / "short.batch", records(64, 16), 8, 16, seed=1)
    write_chunk_file(d / "x.chnk", [np.arange(1, 10 + k, dtype=np.uint32) for k in range(40)], seq_len=32)
    token_stream(d / "ts", 4000)
    with ZRecordWriter(d / "zr", [FieldSpec("a", "i64", ())], chunk_grow_bytes=1 << 16) as w:
        w.extend({"a": i} for i in range(20))
        w.commit()
    write_feature_matrix(d / "feat", {"k": np.random.default_rng(0).random((100, 3)).astype("float32")})
    (d / "npy").mkdir()
    np.save(d / "npy" / "a.npy", np.arange(1000, dtype=np.uint16))
    (d / "notes.txt").write_text("not a dataset")
    return d


# what each dataset is called, and the call a message suggests for it
FOUND = {
    "x.batch": ("an LLMBATCH file", "LLMBatchSource(path) (or Loader("),
    "x.chnk": ("an LLMCHNK file", "LLMChunkSource(path)"),
    "ts": ("a TOKSTREAM dataset", "TokenWindows(path, seq_len) or TokenDocuments(path, width)"),
    "zr": ("a ZRECORD dataset", "RecordFields(path)"),
    "feat": ("a feature matrix dataset", "FeatureWindows(path)"),
    "npy": ("a folder of .npy token files", "NpyTokenWindows(path, seq_len)"),
}

# each source on a path, what it reads, and the datasets it opens
SOURCES = {
    "TokenWindows": (lambda p: TokenWindows(p, 8), "a TOKSTREAM dataset", {"ts"}),
    "TokenDocuments": (lambda p: TokenDocuments(p, 8), "a TOKSTREAM dataset", {"ts"}),
    "PackedDocuments": (lambda p: PackedDocuments(p, 16), "a TOKSTREAM dataset or an LLMCHNK file",
                        {"ts", "x.chnk"}),
    "FlatDocuments": (lambda p: FlatDocuments(p), "a TOKSTREAM dataset or an LLMCHNK file",
                      {"ts", "x.chnk"}),
    "LLMBatchSource": (LLMBatchSource, "an LLMBATCH file", {"x.batch"}),
    "LLMChunkSource": (LLMChunkSource, "an LLMCHNK file", {"x.chnk"}),
    "RecordFields": (RecordFields, "a ZRECORD dataset", {"zr"}),
    "FeatureWindows": (lambda p: FeatureWindows(p, 4), "a feature matrix dataset", {"feat"}),
    "NpyTokenWindows": (lambda p: NpyTokenWindows(p, 8), "a folder of .npy token files", {"npy"}),
}

MISMATCHES = [(s, k) for s, (_, _, opens) in SOURCES.items() for k in FOUND if k not in opens]


def test_the_reported_case_word_for_word(data):
    path = str(data / "x.batch")
    with pytest.raises(ConfigError) as info:
        TokenWindows(path, 128)
    e = info.value
    assert e.field == "path" and e.path == path
    assert e.message == (f"x.batch is an LLMBATCH file, not a TOKSTREAM dataset: read it with "
                         f"LLMBatchSource(path) (or Loader({path!r}))")
    assert "manifest.json" not in str(e) and str(e).startswith(path)
    # and the suggestion works
    with Loader(path, batch_size=8) as ld:
        assert next(iter(ld)).shape == (8, 32)


@pytest.mark.parametrize(("source", "found"), MISMATCHES)
def test_a_source_given_another_format_names_it_and_the_source_that_reads_it(data, source, found):
    make, expected, _ = SOURCES[source]
    what, call = FOUND[found]
    with pytest.raises(ConfigError) as info:
        make(str(data / found))
    assert info.value.field == "path" and info.value.path == str(data / found)
    message = info.value.message
    assert message.startswith(f"{found} is {what}, not {expected}: read it with {call}"), message


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_source_opens_its_own_formats_by_path_and_pathlike(data, source):
    make, _, opens = SOURCES[source]
    for key in sorted(opens):
        for value in (str(data / key), data / key):
            src = make(value)
            assert src.num_items > 0
            src.close()


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_missing_path_says_it_does_not_exist(data, source):
    make, expected, _ = SOURCES[source]
    missing = str(data / "missing.batch")
    with pytest.raises(NotFoundError) as info:
        make(missing)
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.field == "path" and info.value.path == missing
    assert info.value.message == f"does not exist ({source} reads {expected})"


def test_a_file_where_a_folder_is_read_and_a_folder_where_a_file_is(data):
    notes = str(data / "notes.txt")
    with pytest.raises(ConfigError, match=r"notes.txt is a file, not a TOKSTREAM dataset \(a folder holding "
                                          r"manifest.json\)") as info:
        TokenWindows(notes, 8)
    assert info.value.field == "path"
    with pytest.raises(ConfigError, match=r"notes.txt is a file, not a ZRECORD dataset \(a folder holding "
                                          r"meta.json, commit.zr\)"):
        RecordFields(notes)
    with pytest.raises(ConfigError, match=r"notes.txt is a file, not a folder of .npy token files$"):
        NpyTokenWindows(notes, 8)
    with pytest.raises(ConfigError, match=r"notes.txt is not an LLMCHNK file \(its first bytes are no "
                                          r"zerobatch magic\) and not a TOKSTREAM dataset"):
        PackedDocuments(notes, 8)
    empty = data / "empty"
    empty.mkdir(exist_ok=True)
    with pytest.raises(ConfigError, match=r"empty is a folder, not an LLMBATCH file$"):
        LLMBatchSource(str(empty))
    with pytest.raises(ConfigError, match=r"empty is a folder, not an LLMCHNK file$"):
        LLMChunkSource(str(empty))
    # a file of no format, given to a file source: the reader's own words (its header)
    with pytest.raises(Exception, match="header"):
        LLMBatchSource(notes)
    # a folder of no format, given to a folder source: the reader's own words (its marker)
    with pytest.raises(NotFoundError, match="manifest.json"):
        TokenWindows(str(empty), 8)


def test_file_urls_are_checked_and_open_readers_pass(data):
    with pytest.raises(ConfigError, match="x.batch is an LLMBATCH file, not a TOKSTREAM dataset"):
        TokenWindows(f"file://{data / 'x.batch'}", 8)
    with pytest.raises(NotFoundError, match="does not exist"):
        TokenWindows(f"file://{data / 'nothing'}", 8)
    reader = TokenStreamReader(str(data / "ts"))
    assert TokenWindows(reader, 8).reader is reader
    assert TokenWindows(f"file://{data / 'ts'}", 8).num_items == TokenWindows(str(data / "ts"), 8).num_items


def test_the_loader_and_batch_native_loader_given_a_path(data):
    with pytest.raises(ConfigError, match=r"source: the path does not exist") as info:
        Loader(str(data / "missing.batch"), batch_size=2)
    assert info.value.field == "source"
    with pytest.raises(ConfigError, match=r"source: a TOKSTREAM dataset, which the loader does not open from "
                                          r"a path alone: give it TokenWindows\(path, seq_len\) or "
                                          r"TokenDocuments\(path, width\)"):
        Loader(str(data / "ts"), batch_size=2)
    with pytest.raises(ConfigError, match=r"give it LLMChunkSource\(path\)"):
        Loader(str(data / "x.chnk"), batch_size=2)
    with pytest.raises(ConfigError, match=r"ts is a TOKSTREAM dataset, not an LLMBATCH file: read it with "
                                          r"TokenWindows\(path, seq_len\)"):
        BatchNativeLoader(str(data / "ts"))
    with pytest.raises(NotFoundError, match=r"does not exist \(BatchNativeLoader reads an LLMBATCH file\)"):
        BatchNativeLoader(str(data / "missing.batch"))


# ---------------------------------------------------------------------------------------------
# a state saved with another geometry


def saved_after(source, steps=3, batch_size=4, **kw):
    """The JSON state of a loader over ``source`` after ``steps`` batches."""
    with Loader(source, batch_size, **kw) as ld:
        it = iter(ld)
        for _ in range(steps):
            next(it)
        return json.loads(json.dumps(ld.state_dict()))


def test_resuming_with_another_seq_len_names_seq_len(data):
    ts = str(data / "ts")
    state = saved_after(TokenWindows(ts, 8))
    assert state["source"] == {"kind": "tokstream-windows", "seq_len": 8, "stride": 8, "next_token": True}
    n8, n16 = TokenWindows(ts, 8).num_items, TokenWindows(ts, 16).num_items
    with pytest.raises(StateError) as info:
        Loader(TokenWindows(ts, 16), 4).load_state_dict(state)
    assert info.value.field == "seq_len"
    assert info.value.message == (f"seq_len: the saved state was made with seq_len 8, stride 8 ({n8} "
                                  f"windows) but this loader has seq_len 16, stride 16 ({n16} windows)")
    # only the stride
    with pytest.raises(StateError, match=r"^stride: the saved state was made with stride 8 \(\d+ windows\) "
                                         r"but this loader has stride 4 \(\d+ windows\)$") as info:
        Loader(TokenWindows(ts, 8, stride=4), 4).load_state_dict(state)
    assert info.value.field == "stride"


def test_the_same_geometry_resumes_exactly_and_another_batch_size_still_resumes(data):
    ts = str(data / "ts")
    state = saved_after(TokenWindows(ts, 8))
    with Loader(TokenWindows(ts, 8), 4) as a, Loader(TokenWindows(ts, 8), 4) as b:
        whole = [x[:, 0].tolist() for x, _ in a][3:]
        b.load_state_dict(state)
        assert [x[:, 0].tolist() for x, _ in b] == whole
    with Loader(TokenWindows(ts, 8), 2) as c:                 # another global batch: allowed, as before
        c.load_state_dict(state)
        assert c.state_dict()["consumed"] == state["consumed"]


@pytest.mark.parametrize(("make", "field", "was", "now", "items"), [
    (lambda d, v: PackedDocuments(str(d / "ts"), v), "seq_len", 16, 32, "rows"),
    (lambda d, v: NpyTokenWindows(str(d / "npy"), v), "seq_len", 8, 16, "windows"),
    (lambda d, v: FeatureWindows(str(d / "feat"), v), "window", 4, 8, "windows"),
    (lambda d, v: FlatDocuments(str(d / "ts"), v), "token_budget", 64, 128, "groups of documents"),
])
def test_every_windowed_source_names_what_changed(data, make, field, was, now, items):
    state = saved_after(make(data, was), steps=1, batch_size=2)
    a, b = make(data, was).num_items, make(data, now).num_items
    with pytest.raises(StateError) as info:
        Loader(make(data, now), 2).load_state_dict(state)
    assert info.value.field == field
    assert info.value.message == (f"{field}: the saved state was made with {field} {was} ({a} {items}) but "
                                  f"this loader has {field} {now} ({b} {items})")


def test_an_llmbatch_file_of_another_shape_names_it(data):
    state = saved_after(LLMBatchSource(str(data / "x.batch")), steps=1, batch_size=8)
    with pytest.raises(StateError, match=r"^seq_len: the saved state was made with seq_len 32 \(8 batches\) "
                                         r"but this loader has seq_len 16 \(8 batches\)$"):
        Loader(LLMBatchSource(str(data / "short.batch")), 8).load_state_dict(state)


def test_a_state_without_the_geometry_still_loads_and_its_refusal_names_the_candidates(data):
    ts = str(data / "ts")
    state = saved_after(TokenWindows(ts, 8))
    old = {k: v for k, v in state.items() if k != "source"}       # as saved before the geometry was recorded
    with Loader(TokenWindows(ts, 8), 4) as ld:
        ld.load_state_dict(old)
        assert ld.state_dict() == state
    with pytest.raises(StateError) as info:
        Loader(TokenWindows(ts, 16), 4).load_state_dict(old)
    assert info.value.field == "num_items"
    assert re.fullmatch(r"num_items: the saved state has \d+ windows but this loader has \d+: the same data "
                        r"cut another way, so the state was saved with another seq_len, stride or next_token "
                        r"than this loader's seq_len 16, stride 16, next_token True", info.value.message)


def test_other_refusals_keep_their_words(data):
    ts = str(data / "ts")
    state = saved_after(TokenWindows(ts, 8))
    with pytest.raises(StateError, match="^kind: the saved state has 'tokstream-windows"):
        Loader(TokenDocuments(ts, 8), 4).load_state_dict(state)
    with pytest.raises(StateError, match="^seed: "):
        Loader(TokenWindows(ts, 8), 4, seed=7).load_state_dict(state)
    other = data / "ts2"
    if not other.exists():
        token_stream(other, 4000, seed=5)
    with pytest.raises(StateError, match="^fingerprint: "):                # another dataset, same geometry
        Loader(TokenWindows(str(other), 8), 4).load_state_dict(state)


def test_the_worker_dataloader_state_records_the_geometry(data):
    ts = str(data / "ts")
    with Loader(TokenWindows(ts, 8), 4) as ld:
        dl = ld.dataloader(0)
        it = iter(dl)
        next(it)
        state = dl.state_dict()
        del it
    assert state["source"]["seq_len"] == 8
    with pytest.raises(StateError, match="^seq_len: the saved state was made with seq_len 8"):
        Loader(TokenWindows(ts, 16), 4).load_state_dict(state)


# ---------------------------------------------------------------------------------------------
# devices


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_cuda_is_refused_when_the_loader_is_made(data):
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        with pytest.raises(ConfigError) as info:
            Loader(TokenWindows(str(data / "ts"), 8), 4, device=device)
        assert info.value.field == "device"
        assert info.value.message.startswith(f"device: {device!r} but torch.cuda.is_available() is False")
    with pytest.raises(ConfigError, match=r"torch.cuda.is_available\(\) is False"):
        BatchNativeLoader(str(data / "x.batch"), device="cuda")
    with pytest.raises(ConfigError, match=r"torch.cuda.is_available\(\) is False"):
        DatasetLoader(2, 4, 0, 1, str(data / "npy"), "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_index_past_the_devices_is_refused(data):
    n = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=rf"torch.cuda.device_count\(\) is {n}"):
        Loader(TokenWindows(str(data / "ts"), 8), 4, device=f"cuda:{n}")
    x, _ = next(iter(Loader(TokenWindows(str(data / "ts"), 8), 4, device="cuda")))
    assert x.device.type == "cuda"


def test_a_device_torch_does_not_know_is_refused(data):
    for device in ("gpu", "cuda:x", "", 3.5):
        with pytest.raises(ConfigError, match=r"is not a torch device") as info:
            Loader(TokenWindows(str(data / "ts"), 8), 4, device=device)
        assert info.value.field == "device"
    with pytest.raises(ConfigError, match=r"^device: 'gpu' is not a torch device"):
        DatasetLoader(2, 4, 0, 1, str(data / "npy"), "gpu")


def test_cpu_devices_still_work(data):
    for device in (None, "cpu", torch.device("cpu")):
        x, y = next(iter(Loader(TokenWindows(str(data / "ts"), 8), 4, device=device)))
        assert x.device.type == "cpu" and x.shape == (4, 8)
    x, _ = DatasetLoader(2, 4, 0, 1, str(data / "npy"), "cpu").get_batch()
    assert x.device.type == "cpu"


def test_the_jax_loader_checks_its_device(data):
    jax = pytest.importorskip("jax")
    from zerobatch.adapters.jax import Loader as JaxLoader

    src = TokenWindows(str(data / "ts"), 8)
    x, _ = next(iter(JaxLoader(src, 4, device="cpu:0")))
    assert x.devices() == {jax.local_devices(backend="cpu")[0]}
    assert next(iter(JaxLoader(src, 4, device=jax.devices()[0])))[0].shape == (4, 8)
    n = len(jax.local_devices(backend="cpu"))
    with pytest.raises(ConfigError, match=rf"^device: 'cpu:{n}' but JAX has {n} cpu device\(s\)$"):
        JaxLoader(src, 4, device=f"cpu:{n}")
    with pytest.raises(ConfigError, match=r"must be a jax.Device, a platform name"):
        JaxLoader(src, 4, device=5)
    with pytest.raises(ConfigError, match=r"is not a platform name with a device number"):
        JaxLoader(src, 4, device="cpu:x")
    platforms = {d.platform for d in jax.devices()}
    if "gpu" not in platforms and not os.environ.get("JAX_PLATFORMS", "").count("cuda"):
        with pytest.raises(ConfigError, match=r"^device: 'gpu' but JAX has no gpu backend here") as info:
            JaxLoader(src, 4, device="gpu")
        assert info.value.field == "device"
