"""OLMo-core reads TOKSTREAM datasets in place: TokenStreamDocumentSource gives, token for token and
instance for instance, what OLMo-core's own NumpyDocumentSource gives over the same tokens in its
numpy token files, loss masks included; and OLMo-core's own data loader over it resumes from its
own state exactly."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("olmo_core")

from olmo_core.data.collator import DataCollator  # noqa: E402
from olmo_core.data.composable import ComposableDataLoader, ConcatAndChunkInstanceSource  # noqa: E402
from olmo_core.data.composable.numpy_document_source import NumpyDocumentSource  # noqa: E402
from olmo_core.data.tokenizer import TokenizerConfig  # noqa: E402

from zerobatch.adapters.olmo import TokenStreamDocumentSource  # noqa: E402
from zerobatch.formats.errors import ConfigError  # noqa: E402
from zerobatch.writers.tokstream import TokenStreamWriter  # noqa: E402

TOK = TokenizerConfig(vocab_size=5000, eos_token_id=1, pad_token_id=0)


@pytest.fixture(scope="module")
def same_tokens(tmp_path_factory):
    """One corpus (documents ending with EOS, a loss mask beside it) written twice: as a TOKSTREAM
    dataset and as OLMo-core numpy token and label-mask files."""
    tmp = tmp_path_factory.mktemp("olmo")
    rng = np.random.default_rng(4)
    docs, masks = [], []
    for _ in range(150):
        d = np.append(rng.integers(2, 5000, int(rng.integers(1, 60))), TOK.eos_token_id)
        docs.append(d)
        masks.append((rng.random(d.size) < 0.7).astype(np.uint16))
    w = TokenStreamWriter(tmp / "zb", vocab_size=5000, shard_tokens=900)
    m = TokenStreamWriter(tmp / "zb" / "loss_mask", vocab_size=2, shard_tokens=900)
    for d, k in zip(docs, masks, strict=True):
        w.add_document(d)
        m.add_document(k)
    w.close(loss_mask=m.close())
    np.concatenate(docs).astype(np.uint32).tofile(tmp / "part-0.npy")
    np.concatenate(masks).astype(np.bool_).tofile(tmp / "part-0.mask.npy")
    return tmp


def sources(tmp):
    ours = TokenStreamDocumentSource(str(tmp / "zb"), tokenizer=TOK, work_dir=tmp / "work")
    theirs = NumpyDocumentSource(source_paths=[tmp / "part-0.npy"], dtype=np.uint32, tokenizer=TOK,
                                 label_mask_paths=[tmp / "part-0.mask.npy"], work_dir=tmp / "work")
    return ours, theirs


def test_tokens_offsets_and_masks_equal_olmos_own_reader(same_tokens):
    ours, theirs = sources(same_tokens)
    assert ours.num_tokens == theirs.num_tokens
    assert list(ours.get_document_offsets()) == list(theirs.get_document_offsets())
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = int(rng.integers(0, ours.num_tokens - 1))
        b = int(rng.integers(a + 1, min(ours.num_tokens, a + 400) + 1))
        got, want = ours.get_token_range(a, b), theirs.get_token_range(a, b)
        assert np.asarray(got["input_ids"]).tolist() == np.asarray(want["input_ids"]).tolist()
        assert np.asarray(got["label_mask"]).tolist() == np.asarray(want["label_mask"]).tolist()
    with pytest.raises(IndexError):
        ours.get_token_range(0, ours.num_tokens + 1)


def test_instances_equal_olmos_own_reader(same_tokens):
    ours, theirs = sources(same_tokens)
    a = ConcatAndChunkInstanceSource(ours, sequence_length=32, work_dir=same_tokens / "work")
    b = ConcatAndChunkInstanceSource(theirs, sequence_length=32, work_dir=same_tokens / "work")
    assert len(a) == len(b) > 50
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert np.asarray(x["input_ids"]).tolist() == np.asarray(y["input_ids"]).tolist(), i
        assert np.asarray(x["label_mask"]).tolist() == np.asarray(y["label_mask"]).tolist(), i


def _loader(source, tmp):
    instances = ConcatAndChunkInstanceSource(source, sequence_length=32, work_dir=tmp / "work")
    ld = ComposableDataLoader(instances, collator=DataCollator(pad_token_id=TOK.pad_token_id), tokenizer=TOK,
                              work_dir=tmp / "work", global_batch_size=4 * 32, seed=7,
                              display_source_visualization=False)
    return ld


def _ids(batches):
    return [b["input_ids"].tolist() for b in batches]


def test_olmo_loader_resumes_from_its_own_state(same_tokens):
    """OLMo-core's ComposableDataLoader over the zerobatch source: batches equal those over its
    own numpy source, and a new loader given the state after 5 batches continues exactly."""
    ours, theirs = sources(same_tokens)
    full = _loader(ours, same_tokens)
    full.reshuffle(epoch=1)
    want = _ids(full)
    ref = _loader(theirs, same_tokens)
    ref.reshuffle(epoch=1)
    assert _ids(ref) == want and len(want) >= 10
    first = _loader(ours, same_tokens)
    first.reshuffle(epoch=1)
    it = iter(first)
    head = _ids([next(it) for _ in range(5)])
    state = first.state_dict()
    again = _loader(TokenStreamDocumentSource(str(same_tokens / "zb"), tokenizer=TOK,
                                              work_dir=same_tokens / "work"), same_tokens)
    again.load_state_dict(state)
    again.reshuffle(epoch=1)
    assert head + _ids(again) == want


def test_fingerprint_and_refusals(same_tokens):
    ours, _ = sources(same_tokens)
    plain = TokenStreamDocumentSource(str(same_tokens / "zb"), work_dir=same_tokens / "work", label_mask=False)
    assert ours.fingerprint != plain.fingerprint and "label_mask" not in plain.get_token_range(0, 3)
    assert ours.fingerprint == TokenStreamDocumentSource(str(same_tokens / "zb"), tokenizer=TOK,
                                                          work_dir=same_tokens / "work").fingerprint
    with pytest.raises(ConfigError) as e:
        plain.eos_token_id
    assert e.value.field == "tokenizer"
    from zbtest import token_stream
    folder, _ = token_stream(same_tokens / "nomask", n_tokens=500)
    with pytest.raises(ConfigError) as e:
        TokenStreamDocumentSource(folder, work_dir=same_tokens / "work", label_mask=True)
    assert e.value.field == "label_mask"
