"""TOKSTREAM datasets read from a real S3 API server (moto on 127.0.0.1), through the
fault-injecting proxy where faults are wanted: the same bytes as the local copy, every batch of
a shuffled epoch; opening costs one request; blocks fetched once, checked, cached within a
bound; a damaged cache or a byte flipped in flight is fetched again."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from s3kit import FaultProxy, new_bucket, options, upload  # noqa: E402

from zerobatch.core.remote import ObjectStore, RetryPolicy  # noqa: E402
from zerobatch.formats import tokstream as T  # noqa: E402
from zerobatch.formats.errors import IntegrityError, NotFoundError  # noqa: E402
from zerobatch.readers.tokstream import TokenStreamReader  # noqa: E402
from zerobatch.samplers import GlobalRandomOrder, IndexSampler  # noqa: E402
from zerobatch.writers.tokstream import TokenStreamWriter  # noqa: E402


@pytest.fixture(scope="module")
def endpoint(s3_endpoint):
    return s3_endpoint


def build(folder, *, n_docs=400, shard_tokens=15_000, metadata=True, seed=0):
    rng = np.random.default_rng(seed)
    with TokenStreamWriter(folder, vocab_size=50257, metadata=metadata, shard_tokens=shard_tokens, eod_token=0) as w:
        for k in range(n_docs):
            t = rng.integers(1, 50257, int(rng.integers(1, 600)))
            w.add_document(t, {"doc": k} if metadata and k % 3 else None,
                           spans=[(0, 1, {"first": k})] if metadata and k % 5 == 0 else None)
    return folder


@pytest.fixture(scope="module")
def dataset(endpoint, tmp_path_factory):
    """(local folder, url, storage_options) of one dataset with metadata, 8+ shards."""
    folder = build(tmp_path_factory.mktemp("remote") / "ds")
    bucket = new_bucket(endpoint)
    url = f"s3://{bucket}/corpora/ds"
    upload(folder, url, options(endpoint))
    return folder, url, options(endpoint)


def open_remote(url, opts, tmp_path, **kw):
    return TokenStreamReader(url, storage_options=opts, cache_dir=tmp_path / "cache", **kw)


def test_every_batch_of_a_shuffled_epoch_equals_the_local_copy(dataset, tmp_path):
    folder, url, opts = dataset
    local = TokenStreamReader(folder)
    with open_remote(url, opts, tmp_path) as r:
        assert len(r.manifest.shards) >= 8 and r.remote and not local.remote
        assert r.num_tokens == local.num_tokens and r.manifest.build_id == local.manifest.build_id
        L = 129
        sampler = IndexSampler(GlobalRandomOrder(r.num_windows(L), seed=3), 16)
        for items in sampler:
            starts = r.window_starts(items, L)
            assert np.array_equal(r.windows(starts, L), local.windows(starts, L))
            got, want = r.boundaries(starts, L - 1), local.boundaries(starts, L - 1)
            assert all(np.array_equal(a, b) for a, b in zip(got[:3], want[:3], strict=False)) and got[3] == want[3]
        starts = r.window_starts(items, L)
        m1, m2 = r.windows_metadata(starts, L), local.windows_metadata(starts, L)
        assert np.array_equal(m1.ids, m2.ids) and list(m1.objects) == list(m2.objects)
        w1 = r.windows_with_boundaries(starts, L)
        w2 = local.windows_with_boundaries(starts, L)
        assert all(np.array_equal(a, b) for a, b in zip(w1[:4], w2[:4], strict=False))
        docs = [0, 7, r.num_documents - 1, 123]
        assert all(np.array_equal(a, b) for a, b in zip(r.documents(docs), local.documents(docs), strict=False))
        assert r.verify().ok


def test_opening_costs_one_request_and_a_read_fetches_only_its_shards(dataset, tmp_path):
    folder, url, opts = dataset
    with open_remote(url, opts, tmp_path) as r:
        assert r.store.requests == 1                      # manifest.json; nothing listed
        n = len(r.manifest.shards)
        r.windows([5], 100)                               # one shard: its digests, then its blocks
        first = r.store.requests
        assert first - 1 == 2 and len(r._shards.opened()) == 1
        before = r.store.bytes_fetched
        r.windows([5], 100)                               # held: no request
        assert r.store.requests == first and r.store.bytes_fetched == before
        # a window's blocks, not its shard: about the window plus a block on either side
        start = int(r.cum_tokens[3]) + 2000
        b0 = r.store.bytes_fetched
        r.windows([start], 1000)
        # ... and of the shard's digests the top level and the page(s) under the window
        block = r.manifest.block
        _, top = T.digest_sizes(r.manifest.shards[3].files, True, block, True)
        fetched = r.store.bytes_fetched - b0
        assert 1000 * r.itemsize <= fetched <= 1000 * r.itemsize + 2 * block + top + 2 * block
        assert len(r._shards.opened()) == 2 < n
        # the document and metadata indexes only when a read needs them: one request each
        before = r.store.requests
        r.boundaries([start], 1000)
        assert r.store.requests - before == 2
        r.boundaries([start + 10], 500)                   # held now: nothing more
        assert r.store.requests - before == 2


def test_a_second_reader_reuses_the_cache_and_a_damaged_entry_is_fetched_again(dataset, tmp_path):
    folder, url, opts = dataset
    local = TokenStreamReader(folder)
    starts = np.arange(0, local.num_tokens - 300, 997)
    with open_remote(url, opts, tmp_path) as r:
        r.windows(starts, 300)
        r.boundaries(starts, 300)
        cached = r._shards[0].path
        cold = r.store.requests
    with open_remote(url, opts, tmp_path) as r:
        assert np.array_equal(r.windows(starts, 300), local.windows(starts, 300))
        warm = r.store.requests
    assert warm < cold / 2                               # the indexes and blocks came from the cache
    # damage the cache: a flipped byte in a held block, a truncated index file
    tokens = os.path.join(cached, "tokens.bin")
    with open(tokens, "r+b") as f:
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 1]))
    with open(os.path.join(cached, "documents.index"), "r+b") as f:
        f.truncate(8)
    with open_remote(url, opts, tmp_path) as r:
        assert np.array_equal(r.windows(starts, 300), local.windows(starts, 300))
        assert np.array_equal(r.boundaries(starts, 300)[2], local.boundaries(starts, 300)[2])


def test_the_cache_stays_under_its_limit(endpoint, tmp_path):
    folder = build(tmp_path / "big", n_docs=6000, shard_tokens=60_000, metadata=False, seed=4)
    url = f"s3://{new_bucket(endpoint)}/big"
    upload(folder, url, options(endpoint))
    local = TokenStreamReader(folder)
    limit = 1 << 20
    assert local.num_tokens * 2 > 3 * limit
    cache = tmp_path / "cache"
    with TokenStreamReader(url, storage_options=options(endpoint), cache_dir=cache, cache_limit=limit) as r:
        for a in range(0, r.num_tokens - 5000, 5000):
            assert np.array_equal(r.windows([a], 5000), local.windows([a], 5000))
        used = sum(p.stat().st_blocks * 512 for p in cache.rglob("*") if p.is_file())
        assert used <= limit
        # evicted shards come back: read everything once more
        starts = np.arange(0, r.num_tokens - 700, 6007)
        assert np.array_equal(r.windows(starts, 700), local.windows(starts, 700))
    # a read over more shards than descriptors is read piece by piece inside the outer read's
    # hold on the copies: its inner reads neither wait for that hold nor evict under it (an
    # inner read used to evict at its end, waiting for the outer read's shared hold: a hang)
    with TokenStreamReader(url, storage_options=options(endpoint), cache_dir=tmp_path / "cache2",
                           cache_limit=limit, max_open_files=2) as r:
        width = int(r.cum_tokens[3] - r.cum_tokens[0]) + 10        # every window touches 4 shards
        for a in range(0, r.num_tokens - width, width // 2):
            got = r.windows_with_boundaries([a], width)
            want = local.windows_with_boundaries([a], width)
            assert all(np.array_equal(x, y) for x, y in zip(got[:4], want[:4], strict=True)), a


def test_a_byte_flipped_in_flight_is_fetched_again_and_a_wrong_object_is_refused(dataset, endpoint, tmp_path):
    folder, url, _ = dataset
    local = TokenStreamReader(folder)
    proxy = FaultProxy(endpoint)
    try:
        opts = options(proxy.url)
        with open_remote(url, opts, tmp_path) as r:
            r.windows([0], 10)                                   # shard 0's indexes
            proxy.add("corrupt", 1, path="tokens.bin")
            assert np.array_equal(r.windows([3000], 500), local.windows([3000], 500))
            assert proxy.injected == {"corrupt": 1}
            for kind in ("503", "reset", "short", "429"):
                proxy.add(kind, 1, path="tokens.bin")
            starts = [int(r.cum_tokens[1]) + 50, int(r.cum_tokens[2]) + 60]
            assert np.array_equal(r.windows(starts, 400), local.windows(starts, 400))
    finally:
        proxy.close()
    # an object replaced by one of another content: its blocks never match: refused by name
    bucket = url.split("/")[2]
    shard = local.manifest.shards[1].name
    store = ObjectStore(f"s3://{bucket}/corpora/ds", options(endpoint))
    raw = bytearray((folder / shard / "tokens.bin").read_bytes())
    raw[100] ^= 0xFF
    url2 = f"s3://{bucket}/corpora/ds2"
    upload(folder, url2, options(endpoint))
    ObjectStore(url2, options(endpoint)).put(f"{shard}/tokens.bin", bytes(raw))
    with TokenStreamReader(url2, storage_options=options(endpoint), cache_dir=tmp_path / "c2") as r:
        with pytest.raises(IntegrityError) as info:
            r.windows([int(r.cum_tokens[1]) + 40], 30)
        assert info.value.path == f"{url2}/{shard}/tokens.bin" and "bytes [0, 1024)" in info.value.message
    assert store.head("manifest.json")


def test_a_missing_dataset_or_shard_is_named(dataset, endpoint, tmp_path):
    _, url, opts = dataset
    with pytest.raises(NotFoundError) as info:
        open_remote(url + "-nothing", opts, tmp_path)
    assert info.value.path == f"{url}-nothing/manifest.json"
    folder = build(tmp_path / "m", n_docs=50, shard_tokens=3000, metadata=False)
    url3 = f"s3://{new_bucket(endpoint)}/m"
    upload(folder, url3, opts)
    name = TokenStreamReader(folder).manifest.shards[1].name
    ObjectStore(url3, opts).delete(f"{name}/documents.index")
    name2 = TokenStreamReader(folder).manifest.shards[2].name
    ObjectStore(url3, opts).delete(f"{name2}/checksums.bin")
    with open_remote(url3, opts, tmp_path) as r:
        r.windows([0], 10)
        assert len(r.windows([int(r.cum_tokens[1])], 10)[0]) == 10       # windows need no document index
        with pytest.raises(NotFoundError) as info:
            r.boundaries([int(r.cum_tokens[1])], 10)
        assert info.value.path == f"{url3}/{name}/documents.index"
        with pytest.raises(NotFoundError) as info:
            r.windows([int(r.cum_tokens[2])], 10)
        assert info.value.path == f"{url3}/{name2}/checksums.bin"


def test_pickled_readers_reopen_the_same_dataset(dataset, tmp_path):
    folder, url, opts = dataset
    with open_remote(url, opts, tmp_path) as r:
        clone = pickle.loads(pickle.dumps(r))
        assert "testing" not in repr(clone) and clone.folder == url
        assert np.array_equal(clone.windows([100, 9000], 50), TokenStreamReader(folder).windows([100, 9000], 50))
        clone.close()


def test_retry_budget_then_a_typed_error(dataset, endpoint, tmp_path):
    _, url, _ = dataset
    proxy = FaultProxy(endpoint)
    try:
        r = TokenStreamReader(url, storage_options=options(proxy.url), cache_dir=tmp_path / "cache")
        r._store.retry = RetryPolicy(attempts=2, base_delay=0.01)
        proxy.add("500", 2, path="checksums.bin")
        with pytest.raises(Exception) as info:
            r.windows([0], 10)
        assert "checksums.bin" in str(info.value) and "2 tries" in str(info.value)
        assert np.array_equal(r.windows([0], 10), TokenStreamReader(dataset[0]).windows([0], 10))
        r.close()
    finally:
        proxy.close()


def test_documents_fetch_their_index_entries_not_whole_indexes(dataset, tmp_path):
    folder, url, opts = dataset
    local = TokenStreamReader(folder)
    with open_remote(url, opts, tmp_path) as r:
        ids = np.random.default_rng(7).choice(r.num_documents, 40, replace=False)
        a, b = r.document_spans(ids)
        la, lb = local.document_spans(ids)
        np.testing.assert_array_equal(a, la)
        np.testing.assert_array_equal(b, lb)
        shards = np.unique(np.searchsorted(r.cum_documents, ids, side="right") - 1)
        whole = sum(r.manifest.shards[k].files["documents.index"].size for k in shards)
        before = r.store.bytes_fetched
        flat, offsets = r.documents(ids)
        lflat, loffsets = local.documents(ids)
        np.testing.assert_array_equal(flat, lflat)
        np.testing.assert_array_equal(offsets, loffsets)
        # no shard's document index was fetched whole: a block of entries per document
        assert not any(r._shards[k].indexes_loaded for k in shards.tolist())
        assert r.store.bytes_fetched - before <= int((lb - la).sum()) * r.itemsize + 2 * len(ids) * r.manifest.block
        assert whole > 0
        # later reads that need whole indexes still get them
        np.testing.assert_array_equal(r.boundaries([int(a[0])], 50)[0], local.boundaries([int(la[0])], 50)[0])


# -- a chat dataset's loss mask, fetched and read with the tokens -------------------------------

@pytest.fixture(scope="module")
def chat(endpoint, tmp_path_factory):
    """(local folder, url, storage_options) of tokens and a loss mask beside them, 8+ shards."""
    rng = np.random.default_rng(9)
    folder = tmp_path_factory.mktemp("remotechat") / "chat"
    w = TokenStreamWriter(folder, vocab_size=50257, shard_tokens=4000)
    m = TokenStreamWriter(folder / "loss_mask", vocab_size=2, shard_tokens=4000)
    for _ in range(150):
        n = int(rng.integers(1, 500))
        w.add_document(rng.integers(0, 50257, n))
        m.add_document(np.repeat(rng.integers(0, 2, n), rng.integers(1, 30, n))[:n])
    w.close(loss_mask=m.close())
    url = f"s3://{new_bucket(endpoint)}/corpora/chat"
    upload(folder, url, options(endpoint))
    return folder, url, options(endpoint)


class Rounds:
    """Every request of every store, timed, each made 0.15 s slow (a store far away): the
    round trips a read waits for are the longest chain of requests each started after the one
    before it ended (requests in flight together are one round)."""

    def __init__(self, monkeypatch):
        import threading
        import time
        self.spans: list[tuple[float, float]] = []
        lock = threading.Lock()
        call = ObjectStore._call

        def slow(store, *args, **kw):
            t0 = time.monotonic()
            time.sleep(0.15)
            try:
                return call(store, *args, **kw)
            finally:
                with lock:
                    self.spans.append((t0, time.monotonic()))
        monkeypatch.setattr(ObjectStore, "_call", slow)

    def take(self) -> tuple[int, int]:
        """``(rounds, requests)`` since the last call."""
        spans, self.spans = sorted(self.spans), []
        depth = []
        for i, (a, _) in enumerate(spans):
            depth.append(1 + max([depth[j] for j in range(i) if spans[j][1] <= a], default=0))
        return max(depth, default=0), len(spans)


def test_labels_masked_at_a_url_fetch_the_mask_in_the_tokens_round(chat, tmp_path, monkeypatch):
    folder, url, opts = chat
    rounds = Rounds(monkeypatch)
    local = TokenStreamReader(folder)
    mask = local.stream("loss_mask")
    L = 257
    starts = np.array([5, 9000, int(local.cum_tokens[3]) - 100, local.num_tokens - L])   # one across shards
    docs = np.array([0, 40, 149])
    a, b = local.document_spans(docs)
    for dtype in (np.int64, np.int32):
        want = local.windows(starts, L, dtype=dtype)
        keep = mask.windows(starts, L, dtype=np.int32)[:, 1:]
        want_labels = np.where(keep != 0, want[:, 1:], -100)
        flat = local.ranges(a, b, dtype=dtype)
        want_own = np.where(mask.ranges(a, b, dtype=np.int32) != 0, flat, -100)
        got = {}
        for what in ("tokens", "labelled", "two reads"):
            with open_remote(url, opts, tmp_path / what / str(np.dtype(dtype)), fetch_threads=64) as r:
                r.stream("loss_mask")                   # opened (its manifest) before the reads counted
                rounds.take()
                labels = np.empty((starts.size, L - 1), dtype)
                own = np.empty(flat.size, dtype)
                if what == "tokens":
                    r.windows(starts, L, dtype=dtype)
                    r.ranges(a, b, dtype=dtype)
                elif what == "labelled":
                    out = r.windows(starts, L, dtype=dtype, labels=labels, label_mask="loss_mask")
                    assert (out == want).all() and (labels == want_labels).all()
                    assert (r.ranges(a, b, dtype=dtype, labels=own, label_mask="loss_mask",
                                     label_shift=0) == flat).all()
                    assert (own == want_own).all()
                else:                                   # the old way: the mask's read after the tokens'
                    r.windows(starts, L, dtype=dtype)
                    r.stream("loss_mask").windows(starts, L, dtype=np.int32)
                    r.ranges(a, b, dtype=dtype)
                    r.stream("loss_mask").ranges(a, b, dtype=np.int32)
                got[what] = rounds.take()
                # held now: the same read again costs no request
                r.windows(starts, L, dtype=dtype, labels=labels, label_mask="loss_mask")
                assert rounds.take() == (0, 0) or what == "tokens"
        # the mask's blocks come in the tokens' round trips: no more rounds than the tokens alone
        assert got["labelled"][0] == got["tokens"][0] < got["two reads"][0], got
        assert got["labelled"][1] > got["tokens"][1]                      # (its requests are there)


def test_masked_sources_at_a_url_equal_the_local_copy(chat, tmp_path):
    # each document read exactly (no overrun) at a URL, its labels masked in the same read
    from zerobatch.adapters.sources import FlatDocuments, PackedDocuments, TokenDocuments, TokenWindows
    folder, url, opts = chat
    items = np.array([[3, 0, 149, 77]])
    with open_remote(url, opts, tmp_path) as r, TokenStreamReader(folder) as local:
        for make in (lambda d: TokenDocuments(d, 300, loss_mask=True),
                     lambda d: TokenWindows(d, 200, loss_mask=True, boundaries=True),
                     lambda d: PackedDocuments(d, 256, loss_mask=True, buffer=32, layout="next-token"),
                     lambda d: FlatDocuments(d, 512, loss_mask=True, buffer=32, layout="hf")):
            far, near = make(r), make(local)
            mine = items % far.num_items
            a, b = far.read(mine, np.dtype(np.int32)), near.read(mine, np.dtype(np.int32))
            a, b = (a[0], b[0]) if isinstance(a, list) else (a, b)
            assert a.keys() == b.keys() and (np.asarray(a["labels"]) == -100).any()
            for k in a:
                assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k


def test_threads_fetch_different_pages_of_digests_of_a_shard_at_once_and_a_page_once(endpoint, tmp_path):
    """Pages of digests of one shard: two threads needing different pages are in their
    requests at the same time (a sequential read keeps several runs of blocks, each with its
    own page, in flight: one page at a time held it to a round trip per run); threads needing
    the same page make one request, the others wait for it; every page checks."""
    import threading
    import time

    rng = np.random.default_rng(5)
    folder = tmp_path / "ds"
    with TokenStreamWriter(folder, vocab_size=50257, shard_tokens=1 << 22) as w:
        for _ in range(40):
            w.add_document(rng.integers(1, 50257, 25_000))       # 1M tokens, 2 MB: 16 pages of digests
    url = f"s3://{new_bucket(endpoint)}/ds"
    upload(folder, url, options(endpoint))
    with open_remote(url, options(endpoint), tmp_path) as r:
        sh = r._shards[0]
        assert sh.top_bytes and sh._page_ok.size >= 12 and not sh._page_ok[1:].any()
        store = r._shards.store
        real = store.get_ranges
        together = threading.Barrier(2, timeout=30)
        calls: list[tuple[int, ...]] = []

        def get_ranges(key, starts, stops, *a, **kw):
            if key.endswith("checksums.bin"):
                calls.append(tuple(s // r.manifest.block for s in starts))
                if mode == "together":
                    together.wait()           # both threads in a request at once, or a timeout
                else:
                    time.sleep(0.2)           # the others come while the first is fetching
            return real(key, starts, stops, *a, **kw)
        store.get_ranges = get_ranges
        errors: list[BaseException] = []

        def run(p):
            try:
                sh._fetch_pages(p, p + 1)
            except BaseException as exc:       # noqa: BLE001 - reported below
                errors.append(exc)
        mode = "together"
        threads = [threading.Thread(target=run, args=(p,)) for p in (3, 7)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors and sorted(calls) == [(3,), (7,)]
        mode, calls[:] = "same", []
        threads = [threading.Thread(target=run, args=(10,)) for _ in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors and calls == [(10,)]
        assert sh._page_ok[[3, 7, 10]].all()
        local = TokenStreamReader(folder)
        n = -(-r.manifest.shards[0].files["tokens.bin"].size // r.manifest.block)
        assert np.array_equal(sh._digests_of("tokens.bin", 0, n), local._shards[0].digests("tokens.bin"))
