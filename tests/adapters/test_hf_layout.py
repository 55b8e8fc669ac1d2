"""Hugging Face's label convention (``layout="hf"``): FlatDocuments hands out exactly what
``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` makes of the same
documents (unshifted labels, HF's key names), so ``model(**batch)`` gives the loss it gives
on HF's own batch; packed rows follow the same convention; next-token labels stay the
default, and leaving the layout unsaid while transformers is loaded warns."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from zerobatch.adapters.torch import FlatDocuments, Loader, PackedDocuments  # noqa: E402
from zerobatch.formats.errors import ConfigError  # noqa: E402
from zerobatch.writers.tokstream import TokenStreamWriter  # noqa: E402


def _dataset(folder, docs, masks=None):
    w = TokenStreamWriter(folder, vocab_size=128, shard_tokens=300)
    m = TokenStreamWriter(folder / "loss_mask", vocab_size=2, shard_tokens=300) if masks is not None else None
    for i, d in enumerate(docs):
        w.add_document(d)
        if m is not None:
            m.add_document(masks[i])
    w.close(loss_mask=m.close() if m is not None else None)
    return str(folder)


def _plain(batch):
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in batch.items()}


def test_the_reproduction_from_the_issue(tmp_path):
    path = _dataset(tmp_path / "d", [[11, 12, 13, 14], [21, 22, 23]])
    step = next(iter(Loader(FlatDocuments(path, seed=None, layout="next-token"), batch_size=2, shuffle=False)))
    assert step["labels"].tolist() == [[12, 13, 14, -100, 22, 23, -100]]
    step = next(iter(Loader(FlatDocuments(path, seed=None, layout="hf"), batch_size=2, shuffle=False)))
    assert step["labels"].tolist() == [[-100, 12, 13, 14, -100, 22, 23]]


@pytest.mark.parametrize("with_mask", [False, True])
def test_flat_documents_equal_data_collator_with_flattening(tmp_path, with_mask):
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 128, int(n)) for n in rng.integers(1, 90, 40)]
    masks = [rng.integers(0, 2, d.size) for d in docs]
    path = _dataset(tmp_path / "d", docs, masks if with_mask else None)
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    loader = Loader(FlatDocuments(path, seed=None, layout="hf", loss_mask=with_mask), batch_size=5, shuffle=False)
    for k, step in enumerate(loader):
        feats = []
        for i in range(5 * k, 5 * k + 5):
            f = {"input_ids": docs[i].tolist()}
            if with_mask:
                f["labels"] = np.where(masks[i] == 1, docs[i], -100).tolist()
            feats.append(f)
        want = collate(feats)
        assert set(step) == set(want)
        for key, value in want.items():
            got = step[key]
            if isinstance(value, torch.Tensor):
                assert isinstance(got, torch.Tensor) and got.dtype == value.dtype, key
                assert torch.equal(got, value), key
            else:
                assert type(got) is type(value) and got == value, key


def test_a_hugging_face_model_gets_the_loss_of_its_own_collator(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    rng = np.random.default_rng(2)
    docs = [rng.integers(1, 128, int(n)) for n in rng.integers(2, 60, 8)]
    path = _dataset(tmp_path / "d", docs)
    ours = next(iter(Loader(FlatDocuments(path, seed=None, layout="hf"), batch_size=8, shuffle=False)))
    want = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d.tolist()} for d in docs])
    shifted = next(iter(Loader(FlatDocuments(path, seed=None, layout="next-token"), batch_size=8, shuffle=False)))
    with torch.no_grad():
        a = model(**ours).loss
        b = model(**want).loss
        wrong = model(input_ids=shifted["input_ids"], labels=shifted["labels"],
                      position_ids=shifted["position_ids"]).loss
    assert torch.allclose(a, b)
    assert not torch.allclose(a, wrong)        # the mistake the layout exists for


def test_packed_rows_in_the_hf_layout(tmp_path):
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 128, int(n)) for n in rng.integers(1, 40, 60)]
    masks = [rng.integers(0, 2, d.size) for d in docs]
    path = _dataset(tmp_path / "d", docs, masks)
    src = PackedDocuments(path, 64, layout="hf", loss_mask=True, seed=None)
    ref = PackedDocuments(path, 64, next_token=False, loss_mask=False, seed=None, layout="next-token")
    assert set(src.output) == {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                               "max_length_q", "max_length_k"}
    # rows of seq_len tokens, packed as rows without labels are
    assert src.num_items == ref.num_items
    flat = np.concatenate(docs)
    starts = np.concatenate([[0], np.cumsum([d.size for d in docs])])
    trained = np.concatenate(masks)
    for step, plain in zip(Loader(src, batch_size=2, shuffle=False), Loader(ref, batch_size=2, shuffle=False)):
        ids, labels, pos = step["input_ids"].numpy(), step["labels"].numpy(), step["position_ids"].numpy()
        assert ids.shape == (2, 64) and np.array_equal(ids, plain["input_ids"].numpy())
        assert np.array_equal(pos, plain["position_ids"].numpy())
        assert torch.equal(step["cu_seq_lens_q"], plain["cu_seqlens"])
        assert step["max_length_q"] == step["max_length_k"] == plain["max_seqlen"]
        pad = ~plain["attention_mask"].numpy()
        first = pos == 0
        assert (labels[pad | first] == -100).all()
        # elsewhere: the token itself where the loss mask trains it
        rest = ~(pad | first)
        assert np.array_equal(labels[rest] != -100, _trained(ids, pos, rest, flat, starts, trained))
        assert (labels[rest][labels[rest] != -100] == ids[rest][labels[rest] != -100]).all()


def _trained(ids, pos, where, flat, starts, trained):
    """Whether each token at ``where`` is trained, by finding its document from its run."""
    out = []
    for r, c in zip(*np.nonzero(where)):
        run = ids[r, c - pos[r, c]:c + 1]
        # the document whose tokens contain this run (documents are random: unique enough)
        for d in range(starts.size - 1):
            doc = flat[starts[d]:starts[d + 1]]
            for off in range(doc.size - run.size + 1):
                if np.array_equal(doc[off:off + run.size], run):
                    out.append(bool(trained[starts[d] + off + run.size - 1]))
                    break
            else:
                continue
            break
    return np.asarray(out)


def test_leaving_the_layout_unsaid_while_transformers_is_loaded_warns(tmp_path):
    path = _dataset(tmp_path / "d", [[1, 2, 3], [4, 5]])
    with pytest.warns(UserWarning, match="layout='hf'"):
        FlatDocuments(path)
    with pytest.warns(UserWarning, match="layout='hf'"):
        PackedDocuments(path, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FlatDocuments(path, layout="next-token")
        FlatDocuments(path, layout="hf")
        FlatDocuments(path, next_token=False)
        PackedDocuments(path, 8, layout="next-token")
    with pytest.raises(ConfigError, match="layout"):
        FlatDocuments(path, layout="huggingface")
    with pytest.raises(ConfigError, match="next_token"):
        PackedDocuments(path, 8, layout="hf", next_token=False)
