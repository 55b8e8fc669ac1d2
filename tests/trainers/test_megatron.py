"""Megatron-core's BlendedMegatronDatasetBuilder reads TOKSTREAM datasets in place: its samples are,
sample for sample, those it builds from the same tokens written as Megatron .bin/.idx by Megatron's
own IndexedDatasetBuilder, alone and blended with a Megatron dataset."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: E402
from zbtest import token_stream  # noqa: E402

from zerobatch.adapters.megatron import TokenStreamDocuments, ZerobatchGPTDataset, is_tokstream  # noqa: E402
from zerobatch.formats.errors import ConfigError  # noqa: E402


class Tok:
    """What GPTDataset asks a tokenizer for: the end-of-document and padding ids."""
    eod = 0
    pad = -1
    special_tokens_dict: dict = {}
    vocab_size = 1 << 20
    unique_identifiers = {"class": "Tok"}


def megatron_pair(prefix, docs):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for d in docs:
        builder.add_item(torch.as_tensor(d, dtype=torch.int32))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mg")
    # Megatron's blended dataset builds its indexes on rank 0 of torch.distributed: one process
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0, world_size=1)
    a, docs_a = token_stream(tmp / "a", n_tokens=5000, seed=1)
    b, docs_b = token_stream(tmp / "b", n_tokens=3000, seed=2, offset=7000)
    yield tmp, (a, megatron_pair(tmp / "a_mg", docs_a)), (b, megatron_pair(tmp / "b_mg", docs_b))
    torch.distributed.destroy_process_group()


def build(cls, blend, cache, n=300, seq=32):
    config = GPTDatasetConfig(random_seed=1234, sequence_length=seq, blend=blend, split="100,0,0",
                              path_to_cache=str(cache), tokenizer=Tok(), reset_position_ids=True,
                              reset_attention_mask=False, eod_mask_loss=True, create_attention_mask=False)
    train, _, _ = BlendedMegatronDatasetBuilder(cls, [n, 0, 0], lambda: True, config).build()
    return train


def same(x, y, n):
    assert len(x) == len(y) >= n
    for i in range(len(x)):
        s, t = x[i], y[i]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(s[key], t[key]), (i, key)


def test_samples_equal_megatrons_from_bin_idx(data):
    tmp, (a, a_mg), _ = data
    zb = build(ZerobatchGPTDataset, ([a], None), tmp / "c1")
    assert isinstance(zb.dataset, TokenStreamDocuments)          # read in place, not an export
    same(zb, build(GPTDataset, ([a_mg], None), tmp / "c2"), 300)


def test_blended_with_a_megatron_dataset(data):
    """A zerobatch dataset and a Megatron one in one blend: the samples of the blend of the two
    Megatron exports."""
    tmp, (a, a_mg), (b, b_mg) = data
    mixed = build(ZerobatchGPTDataset, ([a, b_mg], [0.6, 0.4]), tmp / "c3", n=400)
    same(mixed, build(GPTDataset, ([a_mg, b_mg], [0.6, 0.4]), tmp / "c4", n=400), 400)
    assert {int(mixed[i]["tokens"][0]) >= 7000 for i in range(60)} == {True, False}


def test_resume_is_indexed(data):
    """Megatron resumes at its checkpoint's consumed_train_samples by index: a dataset built
    anew (new process, new cache) gives sample k exactly as the first one did."""
    tmp, (a, _), _ = data
    one = build(ZerobatchGPTDataset, ([a], None), tmp / "c5")
    two = build(ZerobatchGPTDataset, ([a], None), tmp / "c6")
    for k in (0, 123, 299):
        assert torch.equal(one[k]["tokens"], two[k]["tokens"])


def test_low_level_dataset(data):
    tmp, (a, a_mg), _ = data
    docs = TokenStreamDocuments(a)
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    ref = IndexedDataset(a_mg)
    assert np.array_equal(docs.sequence_lengths, ref.sequence_lengths) and docs.sequence_lengths.dtype == np.int32
    for idx, off, n in [(0, 0, None), (3, 2, 5), (len(docs) - 1, 0, None), (7, 1, 0)]:
        assert docs.get(idx, off, n).tolist() == ref.get(idx, off, n).tolist()
    with pytest.raises(IndexError):
        docs.get(len(docs))
    with pytest.raises(ConfigError) as e:
        docs.get(0, 0, int(docs.sequence_lengths[0]) + 1)
    assert e.value.field == "length"
    assert is_tokstream(a) and not is_tokstream(a_mg)


# -- found in review: which paths are Megatron's, the index memory, URLs ---------------------------

def test_a_folder_with_a_manifest_is_zerobatchs_even_beside_a_megatron_pair(data, tmp_path):
    """A zerobatch folder wins over a Megatron pair of the same name beside it; a folder that is
    also a Megatron prefix and holds no manifest is Megatron's."""
    _, (a, a_mg), _ = data
    import shutil
    both = tmp_path / "web"
    shutil.copytree(a, both)
    for ext in (".bin", ".idx"):
        shutil.copy(a_mg + ext, str(both) + ext)
    assert is_tokstream(str(both)) and is_tokstream(f"file://{both}")
    bare = tmp_path / "books"
    bare.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(a_mg + ext, str(bare) + ext)
    assert not is_tokstream(str(bare)) and not is_tokstream(a_mg) and not is_tokstream(str(tmp_path / "nothing"))
    # a file:// URL: Megatron's default index cache goes under the folder, not under ./file:/...
    assert TokenStreamDocuments(f"file://{a}").path_prefix == a


def test_object_storage_prefixes_are_told_apart_by_the_manifest(data, tmp_path, monkeypatch):
    """s3:// holds Megatron prefixes too (Megatron reads them through its object storage config):
    a HEAD of <url>/manifest.json tells a zerobatch dataset from one. (s3:// is served here by a
    local folder: zerobatch's DirectoryStore registered for the scheme.) A zerobatch URL without
    path_to_cache is refused (Megatron would make its cache in a local folder named after the URL)."""
    pytest.importorskip("obstore")
    from zerobatch.core import remote

    objects = tmp_path / "objects"
    objects.mkdir()

    class FakeS3(remote.DirectoryStore):
        def __init__(self, url, storage_options=None, **kw):
            super().__init__(url, {"root": str(objects)}, **kw)

    monkeypatch.setitem(remote._STORES, "s3", FakeS3)
    monkeypatch.setenv("ZEROBATCH_CACHE_DIR", str(tmp_path / "cache"))
    _, (a, a_mg), _ = data
    import os
    store = remote.open_store("s3://bucket/web")
    for root, _, names in os.walk(a):
        for name in names:
            store.put(os.path.relpath(os.path.join(root, name), a).replace(os.sep, "/"), os.path.join(root, name))
    mg = remote.open_store("s3://bucket")
    for ext in (".bin", ".idx"):
        mg.put("books_text_document" + ext, a_mg + ext)
    assert is_tokstream("s3://bucket/web") and is_tokstream("s3://bucket/web/")
    assert not is_tokstream("s3://bucket/books_text_document")
    assert not is_tokstream("msc://profile/books_text_document")     # Megatron's multi-storage client
    assert is_tokstream("gs://bucket/web")                            # Megatron reads no gs:// prefix
    far, near = TokenStreamDocuments("s3://bucket/web"), TokenStreamDocuments(a)
    assert np.array_equal(far.sequence_lengths, near.sequence_lengths) and far.get(3, 1, 4).tolist() == \
        near.get(3, 1, 4).tolist()
    config = GPTDatasetConfig(random_seed=1, sequence_length=32, blend=(["s3://bucket/web"], None), split="100,0,0",
                              path_to_cache=None, tokenizer=Tok(), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
    with pytest.raises(ConfigError) as e:
        ZerobatchGPTDataset.build_low_level_dataset("s3://bucket/web", config)
    assert e.value.field == "path_to_cache"


def test_the_index_is_read_a_block_at_a_time(data, monkeypatch):
    """sequence_lengths (int32) and the document starts are filled a block of documents at a
    time (no int64 copy of the whole index); document_indices (masked-LM datasets only) is made
    when asked for."""
    from zerobatch.adapters import megatron
    _, (a, a_mg), _ = data
    whole = TokenStreamDocuments(a)
    monkeypatch.setattr(megatron, "SPAN_BLOCK", 7)
    blocks = TokenStreamDocuments(a)
    assert np.array_equal(blocks.sequence_lengths, whole.sequence_lengths) and blocks.sequence_lengths.dtype == np.int32
    assert np.array_equal(blocks.starts, whole.starts) and len(blocks) > 7
    assert "document_indices" not in vars(blocks)
    assert blocks.document_indices.tolist() == list(range(len(blocks) + 1))
