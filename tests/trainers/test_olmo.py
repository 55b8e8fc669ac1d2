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


@pytest.mark.timeout(600)
def test_olmo_trainer_on_2_processes_killed_resumes_exactly_on_1(tmp_path):
    """OLMo-core's own Trainer (its BasicTrainModule and CheckpointerCallback, DCP checkpoints with
    the data loader's state) over TokenStreamDocumentSource: 8 steps on 1 process; 4 steps on 2
    processes (gloo, 2 micro-batches each per step) killed with SIGKILL after the checkpoint of
    step 4, resumed from it on 1 process (4 micro-batches per step): every row the model received
    is the uninterrupted run's, in order."""
    from trainerkit import HERE, assert_resumed_exactly, merge_ranks, recorded, rows, run
    from zbtest import token_stream
    data, _ = token_stream(tmp_path / "data", n_tokens=3000)
    script = [str(HERE / "olmo_train.py"), data]
    full, kill, res = tmp_path / "full", tmp_path / "kill", tmp_path / "res"
    run(script + [str(tmp_path / "a"), "--steps", "8"], record=full)
    run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *script, str(tmp_path / "b"),
         "--steps", "8", "--die-at", "4"], record=kill, expect_killed=True)
    run(script + [str(tmp_path / "b"), "--steps", "8"], record=res)
    before = merge_ranks([[rows(recorded(kill, 0))], [rows(recorded(kill, 1))]])[0]
    assert len(recorded(full)) == 32 and len(recorded(kill, 0)) == 8      # micro-batches of 2 rows
    assert_resumed_exactly(rows(recorded(full)), before, rows(recorded(res)), 32)


def test_eos_is_the_datasets_end_of_document_id(tmp_path):
    """The end-of-document id the dataset recorded (convert records the one it appended) is the
    source's eos_token_id without a tokenizer; a tokenizer whose eos_token_id is another id is
    refused (OLMo-core's generate_doc_lengths would look for document ends that are not there)."""
    with TokenStreamWriter(tmp_path / "zb", vocab_size=5000, shard_tokens=900, eod_token=3) as w:
        for d in ([5, 6, 3], [7, 3], [8, 9, 10, 3]):
            w.add_document(np.array(d))
    src = TokenStreamDocumentSource(str(tmp_path / "zb"), work_dir=tmp_path / "work")
    assert src.eos_token_id == 3 and src.bos_token_id is None
    assert TokenStreamDocumentSource(str(tmp_path / "zb"), work_dir=tmp_path / "work",
                                     tokenizer=TokenizerConfig(vocab_size=5000, eos_token_id=3, pad_token_id=0)
                                     ).fingerprint == src.fingerprint
    with pytest.raises(ConfigError) as e:
        TokenStreamDocumentSource(str(tmp_path / "zb"), work_dir=tmp_path / "work", tokenizer=TOK)
    assert e.value.field == "tokenizer" and "eod_token" in str(e.value)
