"""PackedDocuments: whole documents packed into rows. Over a whole plan every document token
is in exactly one row, each row's segments are contiguous pieces of one document each, and
labels, position_ids, segment_ids, the attention mask and cu_seqlens / max_seqlen agree with
one another, for every algorithm, with and without next-token pairs; documents longer than a
row are split, never dropped; the loader reads every row once per epoch."""

from __future__ import annotations

import numpy as np
import pytest

from zerobatch.adapters.torch import Loader, PackedDocuments
from zerobatch.formats.errors import ConfigError
import zbtest
from zerobatch.writers.tokstream import TokenStreamWriter

SEQ = 32


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Documents of 1..200 tokens (some several rows long); the token at position p is p."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 200, 400)
    lengths[:3] = [5 * SEQ + 7, SEQ + 1, 1]
    folder = tmp_path_factory.mktemp("packed") / "d"
    with TokenStreamWriter(folder, vocab_size=1 << 20, shard_tokens=3000) as w:
        at = 0
        for n in lengths.tolist():
            w.add_document(np.arange(at, at + n))
            at += n
    return str(folder), lengths


def rows_of(src, dtype=np.int64):
    return src.read(np.arange(src.num_items, dtype=np.int64)[None, :], np.dtype(dtype))[0]


@pytest.mark.parametrize("algorithm", ["best-fit", "first-fit", "concat"])
@pytest.mark.parametrize("next_token", [True, False])
def test_every_token_once_and_the_outputs_agree(dataset, algorithm, next_token):
    folder, lengths = dataset
    src = PackedDocuments(folder, SEQ, next_token=next_token, algorithm=algorithm, buffer=50, seed=3, pad_id=-7)
    cap = SEQ + 1 if next_token else SEQ
    out = rows_of(src)
    tokens, seg, pos, mask = out["tokens"], out["segment_ids"], out["position_ids"], out["mask"]
    assert tokens.shape == (src.num_items, cap)
    real = tokens[mask]
    assert np.array_equal(np.sort(real), np.arange(int(lengths.sum())))       # every token once
    assert (tokens[~mask] == -7).all() and (seg[~mask] == -1).all()
    starts = np.concatenate([[0], np.cumsum(lengths)])
    doc_of = np.searchsorted(starts, real, side="right") - 1
    flat_seg = seg[mask]
    row_of = np.nonzero(mask)[0]
    for r in range(src.num_items):
        n = int(mask[r].sum())
        assert mask[r, :n].all() and not mask[r, n:].any()                 # padding at the end only
        if algorithm == "concat" and r < src.num_items - 1:
            assert n == cap
    # a segment: consecutive tokens of one document, positions from 0
    for r in np.unique(row_of):
        sel = row_of == r
        t, s, d = real[sel], flat_seg[sel], doc_of[sel]
        p = pos[r][mask[r]]
        for k in np.unique(s):
            piece = s == k
            assert np.unique(d[piece]).size == 1
            assert np.array_equal(t[piece], t[piece][0] + np.arange(piece.sum()))
            assert np.array_equal(p[piece], np.arange(piece.sum()))
        assert np.array_equal(np.unique(s), np.arange(s.max() + 1))
    if next_token:
        labels = out["labels"]
        same = (seg[:, 1:] == seg[:, :-1]) & mask[:, 1:]
        assert np.array_equal(labels[same], tokens[:, 1:][same]) and (labels[~same] == -100).all()
    # cu_seqlens: the inputs' segment starts (and padding's) over the flattened batch
    inputs_seg = seg[:, :SEQ]
    cuts = [0]
    for r in range(src.num_items):
        row = inputs_seg[r]
        cuts += [r * SEQ + i for i in range(1, SEQ) if row[i] != row[i - 1]]
        cuts.append((r + 1) * SEQ)
    assert out["cu_seqlens"].dtype == np.int32 and out["cu_seqlens"].tolist() == cuts
    assert out["max_seqlen"] == int(np.diff(cuts).max())
    # a document longer than a row is split into pieces, never dropped
    assert src.split_documents >= 2
    if algorithm != "concat":
        assert np.count_nonzero(doc_of == 0) == lengths[0]


def test_best_fit_pads_less_than_first_fit_and_the_plan_is_deterministic(dataset):
    folder, _ = dataset
    best = PackedDocuments(folder, SEQ, buffer=100)
    first = PackedDocuments(folder, SEQ, algorithm="first-fit", buffer=100)
    assert best.padding < first.padding and best.padding < 0.02
    again = PackedDocuments(folder, SEQ, buffer=100)
    assert np.array_equal(best.row_ptr, again.row_ptr) and np.array_equal(best.piece_start, again.piece_start)
    other = PackedDocuments(folder, SEQ, buffer=100, seed=9)
    assert other.fingerprint != best.fingerprint and not np.array_equal(best.piece_start, other.piece_start)


def test_the_loader_reads_every_row_once_per_epoch(dataset):
    folder, lengths = dataset
    src = PackedDocuments(folder, SEQ, buffer=64)
    seen = []
    for batch in Loader(src, batch_size=8, tail="keep", seed=1):
        assert set(batch) == {"input_ids", "labels", "position_ids", "segment_ids", "attention_mask", "cu_seqlens",
                              "max_seqlen"}
        assert batch["input_ids"].shape[1] == SEQ and batch["labels"].shape == batch["input_ids"].shape
        assert batch["cu_seqlens"][-1] == batch["input_ids"].numel()
        seen += batch["input_ids"][:, 0].tolist()
    assert sorted(seen) == sorted(rows_of(src)["tokens"][:, 0].tolist())


def test_bad_arguments_are_refused(dataset, tmp_path):
    folder, _ = dataset
    with pytest.raises(ConfigError, match="algorithm"):
        PackedDocuments(folder, SEQ, algorithm="next-fit")
    with pytest.raises(ConfigError, match="buffer"):
        PackedDocuments(folder, SEQ, buffer=0)
    with pytest.raises(ConfigError, match="seed"):
        PackedDocuments(folder, SEQ, seed=-1)


@pytest.mark.parametrize("budget", [None, 100, 500])
def test_flat_documents_hand_out_every_token_once_with_consistent_boundaries(dataset, budget):
    from zerobatch.adapters.torch import FlatDocuments
    folder, lengths = dataset
    src = FlatDocuments(folder, budget, buffer=64, seed=4)
    seen = []
    for b in Loader(src, batch_size=3 if budget is None else 1, tail="keep", seed=2):
        x, y, pos, cu = b["input_ids"], b["labels"], b["position_ids"], b["cu_seqlens"]
        assert x.shape[0] == 1 and x.shape == y.shape == pos.shape
        t = x[0].numpy()
        cu = cu.numpy()
        assert cu[0] == 0 and cu[-1] == t.size and (b["lengths"].numpy() == np.diff(cu)).all()
        if budget is not None:
            assert t.size <= budget
        assert b["max_seqlen"] == int(np.diff(cu).max())
        for a, e in zip(cu[:-1], cu[1:], strict=True):
            piece = t[a:e]
            assert np.array_equal(piece, piece[0] + np.arange(e - a))            # one document's run
            assert np.array_equal(pos[0, a:e].numpy(), np.arange(e - a))
            assert np.array_equal(y[0, a:e - 1].numpy(), piece[1:]) and int(y[0, e - 1]) == -100
        seen.append(t)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(int(lengths.sum())))


def test_a_pickled_source_plans_again_to_the_same_rows(dataset):
    import pickle
    folder, _ = dataset
    src = PackedDocuments(folder, SEQ, buffer=40, seed=6)
    raw = pickle.dumps(src)
    assert len(raw) < 4096                                   # the plan does not travel
    again = pickle.loads(raw)
    assert np.array_equal(again.row_ptr, src.row_ptr) and np.array_equal(again.piece_start, src.piece_start)
    rows = np.arange(10, dtype=np.int64)[None, :]
    a, b = src.read(rows, np.dtype(np.int64))[0], again.read(rows, np.dtype(np.int64))[0]
    assert all(np.array_equal(a[k], b[k]) for k in ("tokens", "labels", "segment_ids", "cu_seqlens"))


def test_packed_rows_without_cu_seqlens_go_into_a_weighted_mixture(dataset, tmp_path):
    """cu_seqlens=False: every step has one shape, reads are stacked, and two packed sources
    mix by weight (each row packed from one source); the rows equal the step-by-step reads
    and a resumed mixture continues exactly."""
    from zerobatch.adapters.torch import Mixture
    folder, lengths = dataset
    other = tmp_path / "other"
    with TokenStreamWriter(other, vocab_size=1 << 21, shard_tokens=3000) as w:
        at = 1 << 20
        for n in lengths[:150].tolist():
            w.add_document(np.arange(at, at + n))
            at += n
    plain = PackedDocuments(folder, SEQ, buffer=50, cu_seqlens=False)
    assert plain.stacked and "cu_seqlens" not in plain.output
    rows = np.arange(6, dtype=np.int64).reshape(2, 3)
    stacked = plain.read(rows, np.dtype(np.int64))
    each = PackedDocuments(folder, SEQ, buffer=50).read(rows, np.dtype(np.int64))
    for s in range(2):
        for key in ("tokens", "labels", "position_ids", "segment_ids", "mask"):
            assert np.array_equal(stacked[key][s], each[s][key])

    def make():
        mix = Mixture([("a", PackedDocuments(folder, SEQ, buffer=50, cu_seqlens=False), 3.0),
                       ("b", PackedDocuments(str(other), SEQ, buffer=50, cu_seqlens=False), 1.0)], seed=2)
        return Loader(mix, batch_size=8)

    def firsts(batch):
        return batch["input_ids"][:, 0].tolist()

    ref = zbtest.take(make(), 12, firsts)
    from_b = sum(v >= 1 << 20 for step in ref for v in step)
    assert from_b == 24                                        # a quarter of 96 rows, exactly
    ld = make()
    head = zbtest.take(ld, 5, firsts)
    again = make()
    again.load_state_dict(ld.state_dict())
    assert head + zbtest.take(again, 7, firsts) == ref
