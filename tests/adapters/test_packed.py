"""PackedDocuments: whole documents packed into rows. Over a whole plan every document token
is in exactly one row, each row's segments are contiguous pieces of one document each, and
labels, position_ids, segment_ids, the attention mask and cu_seqlens / max_seqlen agree with
one another, for every algorithm, with and without next-token pairs; documents longer than a
row are split, never dropped; the loader reads every row once per epoch."""

from __future__ import annotations

import numpy as np
import pytest

from zerobatch.adapters.torch import FlatDocuments, Loader, PackedDocuments
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


@pytest.mark.parametrize("budget", [None, 100])
@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_flat_documents_read_the_same_on_the_read_ahead_task_and_in_python(dataset, budget, dtype):
    # read-ahead queues each step as one compiled task (tokens, checks, positions and labels);
    # the Python read, the inline loader and the leaner layout without positions agree with it
    import torch
    folder, _ = dataset
    tdt = getattr(torch, dtype)
    ahead = list(Loader(FlatDocuments(folder, budget), batch_size=4 if budget is None else 1, seed=5, dtype=tdt))
    inline = list(Loader(FlatDocuments(folder, budget), batch_size=4 if budget is None else 1, seed=5, dtype=tdt,
                         num_threads=0))
    lean = list(Loader(FlatDocuments(folder, budget, position_ids=False), batch_size=4 if budget is None else 1,
                       seed=5, dtype=tdt))
    assert len(ahead) == len(inline) == len(lean) > 10
    for a, b, c in zip(ahead, inline, lean, strict=True):
        assert a.keys() == b.keys() and set(c) == set(a) - {"position_ids"}
        for k in a:
            assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k
            if k != "position_ids":
                assert torch.equal(a[k], c[k]) if isinstance(a[k], torch.Tensor) else a[k] == c[k], k
        assert a["input_ids"].dtype == tdt and a["position_ids"].dtype == torch.int64
    src = FlatDocuments(folder, budget, next_token=False, position_ids=False)
    step = src.read(np.arange(3)[None, :], np.dtype(dtype))[0]
    assert set(step) == {"tokens", "cu_seqlens", "max_seqlen", "lengths"}


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


@pytest.fixture(scope="module")
def chat_dataset(tmp_path_factory):
    """Conversations of 1..12 messages of 0..30 tokens with a loss mask (every other message
    trained, as an assistant's are); some far longer than a row, some trained stretches too."""
    rng = np.random.default_rng(11)
    folder = tmp_path_factory.mktemp("chatpacked") / "d"
    docs, masks, at = [], [], 0
    for k in range(300):
        turns = rng.integers(0, 31, rng.integers(1, 13)) if k % 50 else np.array([3, 90, 2, 70])
        m = np.concatenate([np.full(n, j % 2, np.uint16) for j, n in enumerate(turns.tolist())] or [[]])
        if m.size == 0:
            continue
        docs.append(np.arange(at, at + m.size))
        masks.append(m)
        at += m.size
    with TokenStreamWriter(folder, vocab_size=1 << 20, shard_tokens=2500) as w:
        for d in docs:
            w.add_document(d)
    with TokenStreamWriter(folder / "loss_mask", vocab_size=2, shard_tokens=2500) as w:
        for m in masks:
            w.add_document(m)
    return str(folder), docs, masks


@pytest.mark.parametrize("seq_len", [7, 16, 40])
@pytest.mark.parametrize("flat", [False, True])
def test_long_conversations_are_cut_where_a_trained_message_ends(chat_dataset, seq_len, flat):
    folder, docs, masks = chat_dataset
    if flat:
        src = FlatDocuments(folder, seq_len, buffer=64, loss_mask=True).groups
        cap = seq_len
    else:
        src = PackedDocuments(folder, seq_len, buffer=64, loss_mask=True)
        cap = seq_len + 1
    assert src.split_at_turns
    starts, lens, _ = src.pieces(np.arange(src.num_items))
    doc_start = np.cumsum([0] + [d.size for d in docs])
    cut_at: dict[int, list[int]] = {}
    for s, n in zip(starts.tolist(), lens.tolist(), strict=True):
        d = int(np.searchsorted(doc_start, s, side="right")) - 1
        cut_at.setdefault(d, []).append(s - int(doc_start[d]))
        assert 1 <= n <= cap
    split = 0
    for d, offsets in cut_at.items():
        n, m = docs[d].size, masks[d]
        offsets.sort()
        edges = offsets + [n]
        assert offsets[0] == 0 and all(b > a for a, b in zip(edges, edges[1:], strict=False))   # every token once
        ends = [p for p in range(1, n) if m[p - 1] == 1 and m[p] == 0]
        for a, b in zip(edges[:-1], edges[1:-1], strict=False):
            reach = [e for e in ends if a < e <= a + cap]
            # a cut is the last turn end a row reaches, or a row's end when it reaches none
            assert b == (reach[-1] if reach else a + cap), (d, a, b)
        split += len(offsets) > 1
    assert set(cut_at) == set(range(len(docs)))
    assert split == src.split_documents > 0
    # the same plan without the turns cuts long conversations at row ends
    plain = (FlatDocuments(folder, seq_len, buffer=64).groups if flat else
             PackedDocuments(folder, seq_len, buffer=64))
    assert not plain.split_at_turns and plain.fingerprint != src.fingerprint


def test_turn_cuts_without_a_loss_mask_or_with_concat_are_refused(dataset):
    from zerobatch.formats.errors import NotFoundError
    with pytest.raises(NotFoundError, match="loss_mask"):
        PackedDocuments(dataset[0], SEQ, split_at_turns=True)
    with pytest.raises(ConfigError, match="split_at_turns"):
        PackedDocuments(dataset[0], SEQ, split_at_turns=True, algorithm="concat")


@pytest.fixture(scope="module")
def chunk_file(dataset, tmp_path_factory):
    """The documents of ``dataset`` as the records of an LLMCHNK file."""
    from zerobatch.writers.llmchnk import LLMChunkWriter
    path = tmp_path_factory.mktemp("packedchnk") / "docs.chunk"
    at = 0
    with LLMChunkWriter(path, seq_len=0) as w:
        for n in dataset[1].tolist():
            w.add(np.arange(at, at + n, dtype=np.uint32))
            at += n
    return str(path)


@pytest.mark.parametrize("algorithm", ["best-fit", "concat"])
def test_llmchnk_records_pack_like_the_same_documents_in_tokstream(dataset, chunk_file, algorithm):
    import pickle

    from zerobatch.readers.llmchnk import LLMChunkReader
    want = PackedDocuments(dataset[0], SEQ, algorithm=algorithm, buffer=50)
    for source in (chunk_file, LLMChunkReader(chunk_file)):
        got = PackedDocuments(source, SEQ, algorithm=algorithm, buffer=50)
        assert got.num_items == want.num_items and got.padding == want.padding
        assert got.split_documents == want.split_documents
        assert got.fingerprint.startswith("llmchnk:") and got.fingerprint != want.fingerprint
        for dtype in (np.int64, np.int32):
            a, b = rows_of(want, dtype), rows_of(got, dtype)
            assert a.keys() == b.keys()
            for k in a:
                assert np.array_equal(a[k], b[k]), k
        again = pickle.loads(pickle.dumps(got))           # a worker process re-indexes and plans
        assert np.array_equal(rows_of(again)["tokens"], rows_of(want)["tokens"])
    # whole documents flat, per document and by token budget
    for budget in (None, 100):
        a, b = FlatDocuments(dataset[0], budget), FlatDocuments(chunk_file, budget)
        assert a.num_items == b.num_items
        items = np.arange(a.num_items)[:, None]
        for x, y in zip(a.read(items, np.dtype(np.int64)), b.read(items, np.dtype(np.int64)), strict=True):
            assert np.array_equal(x["tokens"], y["tokens"]) and np.array_equal(x["labels"], y["labels"])
    # through the loader, shuffled: every row once
    src = PackedDocuments(chunk_file, SEQ, algorithm=algorithm)
    seen = [b["input_ids"] for b in Loader(src, batch_size=8, tail="keep", seed=3)]
    assert sum(x.shape[0] for x in seen) == src.num_items
    with pytest.raises(ConfigError, match="loss_mask"):
        PackedDocuments(chunk_file, SEQ, loss_mask=True)
    with pytest.raises(ConfigError, match="split_at_turns"):
        FlatDocuments(chunk_file, 64, split_at_turns=True)


def test_llmchnk_records_pack_from_an_s3_store(dataset, chunk_file, s3_endpoint, tmp_path):
    from s3kit import new_bucket, options

    from zerobatch.core.remote import ObjectStore
    from zerobatch.readers.llmchnk import LLMChunkReader
    url = f"s3://{new_bucket(s3_endpoint)}/docs.chunk"
    ObjectStore(url.rsplit("/", 1)[0], options(s3_endpoint)).put("docs.chunk", chunk_file)
    far = LLMChunkReader(url, storage_options=options(s3_endpoint), cache_dir=tmp_path / "cache")
    local = list(Loader(PackedDocuments(chunk_file, SEQ), batch_size=4, seed=9, tail="keep"))
    remote = list(Loader(PackedDocuments(far, SEQ), batch_size=4, seed=9, tail="keep"))
    assert len(local) == len(remote) > 5
    for a, b in zip(local, remote, strict=True):
        assert all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in ("input_ids", "labels", "position_ids"))


# -- the loss mask, read in the same compiled call as the tokens -------------------------------

def _two_reads(mask, starts, stops, dtype=np.int32):
    """The old second read of the loss mask: its values over the ranges, back to back."""
    return mask.ranges(starts, stops, dtype=dtype)


def _masked_sources(reader, seq_len):
    """Every source with the loss mask beside the same source without it (the second read and
    the NumPy merge of the old code are redone in the test from ``reader.stream("loss_mask")``)."""
    from zerobatch.adapters.torch import TokenDocuments, TokenWindows
    out = []
    for mb in (True, False):
        for layout in ("next-token", "hf"):
            kw = dict(buffer=16, seed=3, mask_boundaries=mb, layout=layout, split_at_turns=True)
            out.append((f"packed-{layout}-{mb}", PackedDocuments(reader, seq_len, loss_mask=True, **kw),
                        PackedDocuments(reader, seq_len, loss_mask=False, **kw)))
    for budget in (None, 3 * seq_len):
        for layout in ("next-token", "hf"):
            kw = dict(buffer=16, seed=3, layout=layout, split_at_turns=True if budget else None)
            out.append((f"flat-{layout}-{budget}", FlatDocuments(reader, budget, loss_mask=True, **kw),
                        FlatDocuments(reader, budget, loss_mask=False, **kw)))
    for boundaries in (False, True):
        out.append((f"windows-{boundaries}", TokenWindows(reader, seq_len, loss_mask=True, boundaries=boundaries),
                    TokenWindows(reader, seq_len, boundaries=boundaries)))
    out.append(("documents", TokenDocuments(reader, seq_len, loss_mask=True), TokenDocuments(reader, seq_len)))
    return out


def _old_labels(name, plain, mask, items, got, want):
    """The labels of ``plain``'s step ``want`` merged with the mask as the sources did before."""
    if name.startswith("packed"):
        starts, lens, _ = plain.pieces(items)
        keep = np.zeros(want["mask"].shape, np.int32)
        keep[want["mask"]] = _two_reads(mask, starts, starts + lens)
        labels = want["labels"].copy()
        labels[(keep if name.startswith("packed-hf") else keep[:, 1:]) == 0] = -100
        return labels
    if name.startswith("flat"):
        starts, lens = plain._pieces(items)
        keep = _two_reads(mask, starts, starts + lens)
        labels = want["labels"].copy()
        if name.startswith("flat-hf"):
            labels[0, 1:][keep[1:] == 0] = -100         # HF's labels are the next-token ones one place on
        else:
            labels[0, :-1][keep[1:] == 0] = -100
        return labels
    if name.startswith("windows"):
        st = items * plain.stride
        keep = mask.windows(st, plain.length, dtype=np.int32)[:, 1:]
        tokens = want["tokens"] if isinstance(want, dict) else want
        labels = tokens[:, 1:].copy()
        labels[keep == 0] = -100
        return labels
    starts, stops = plain.reader.document_spans(items)
    lengths = np.minimum(stops - starts, plain.width)
    keep = np.zeros(want["labels"].shape[-2:], np.int32)
    keep[np.arange(plain.width)[None, :] < lengths[:, None]] = _two_reads(mask, starts, starts + lengths)
    labels = want["labels"].reshape(keep.shape).copy()
    labels[keep == 0] = -100
    return labels


@pytest.mark.parametrize("dtype", ["int64", "int32"])
@pytest.mark.parametrize("backend", ["mmap", "pread", "pread-piecewise"])
def test_masked_labels_come_from_the_token_read_and_equal_the_two_read_merge(chat_dataset, dtype, backend):
    # every source, both label layouts, with and without document boundaries; on the mapped
    # files, through descriptors, and over more shards than descriptors (the piecewise
    # fallback): the one compiled read gives the labels the second mask read and the NumPy
    # merge gave, bit for bit, and the same tokens and other outputs
    from zerobatch.readers.tokstream import TokenStreamReader
    folder, docs, masks = chat_dataset
    opts = {"backend": "mmap"} if backend == "mmap" else {"backend": "pread",
                                                           "max_open_files": 2 if backend == "pread-piecewise" else 64}
    dt = np.dtype(dtype)
    with TokenStreamReader(folder, **opts) as reader:
        mask = reader.stream("loss_mask")
        assert mask.backend == reader.backend
        rng = np.random.default_rng(5)
        for name, src, plain in _masked_sources(reader, 24):
            n = src.num_items
            for _ in range(3):
                items = rng.integers(0, n, 6)
                items[0] = n - 1                                   # the last item: the stream's end
                got = src.read(items[None, :], dt)
                want = plain.read(items[None, :], dt)
                got = got[0] if isinstance(got, list) else {k: v[0] for k, v in got.items()}
                want = want[0] if isinstance(want, list) else {k: v[0] for k, v in want.items()}
                old = _old_labels(name, plain, mask, items, got, want)
                labels = got["labels"].reshape(old.shape)
                assert labels.dtype == dt and np.array_equal(labels, old), name
                assert (labels == -100).any() and (labels != -100).any(), name
                for key, value in (want.items() if isinstance(want, dict) else [("tokens", want)]):
                    if key != "labels" and isinstance(value, np.ndarray):
                        assert np.array_equal(got[key], value), (name, key)
                if name.startswith("flat"):
                    # the read-ahead task (mapped files: the mask read in the same compiled task)
                    from zerobatch.core.pool import TaskPool
                    pool = TaskPool(1)
                    try:
                        ahead = src.read_async(pool, items[None, :], dt).wait()[0]
                        assert all(np.array_equal(ahead[k], got[k]) for k in got
                                   if isinstance(got[k], np.ndarray)), name
                    finally:
                        pool.stop()
