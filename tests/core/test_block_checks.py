"""The first-read checks of TOKSTREAM token blocks inside the window kernels: ``BlockChecks``,
``WindowGather(checks=)`` and ``WindowGather.gather_async``, compiled against the twin.

Each block a read touches and nobody checked before is hashed and compared with its digest in
the same GIL-free call that copies it (no Python per window or per block), a block that does
not match is an ``IntegrityError`` naming the file, the block and its byte range (and stays
unchecked), and a shard's digest list is checked against the manifest's checksum before its
first digest is used.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from zerobatch.core import _kernels
from zerobatch.core import xxh3_64
from zerobatch.core.pool import TaskPool
from zerobatch.formats.errors import ConfigError, CorruptError, IntegrityError, OutOfRangeError

BLOCK = 512
TWIN = _kernels.twin("tokstream")
MODS = [pytest.param(_kernels.load("tokstream"), id="selected"), pytest.param(TWIN, id="twin")]


def _digests(data: np.ndarray, block: int = BLOCK) -> np.ndarray:
    raw = data.view(np.uint8)
    n = max(1, -(-raw.size // block))
    return np.array([xxh3_64(raw[k * block:(k + 1) * block].tobytes()) for k in range(n)], dtype="<u8")


class Dataset:
    """Shards of uint16 tokens held in memory, their block digests and a gatherer over them."""

    def __init__(self, mod, sizes, *, seed=0, vocab=50000, block=BLOCK, itemsize=2):
        rng = np.random.default_rng(seed)
        self.mod, self.block, self.vocab = mod, block, vocab
        self.shards = [rng.integers(0, vocab, n, dtype=np.uint16) for n in sizes]
        self.cum = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.digests = [_digests(s, block) for s in self.shards]
        self.paths = [f"/data/shard-{k}/tokens.bin" for k in range(len(sizes))]

    def checks(self):
        c = self.mod.BlockChecks([d.size for d in self.digests], self.block)
        for k, d in enumerate(self.digests):
            c.set_digests(k, d, xxh3_64(d.tobytes()))
        return c

    def gather(self, checks):
        bases = np.array([s.ctypes.data for s in self.shards], dtype=np.uint64)
        return self.mod.WindowGather(bases, self.cum, 2, 2, self.vocab, self.paths, checks=checks)

    def window(self, pos, length):
        flat = np.concatenate(self.shards)
        return flat[pos:pos + length].astype(np.int64)


def _marks(checks, ds):
    return [[checks.checked(k, b) for b in range(d.size)] for k, d in enumerate(ds.digests)]


@pytest.mark.parametrize("mod", MODS)
def test_block_checks_count_marks_and_resets(mod):
    c = mod.BlockChecks([3, 5, 0], 1024)
    assert (c.num_shards, c.block_bytes, c.pending, c.ready) == (3, 1024, 8, False)
    assert c.mark(1, 1, 3) == 3 and c.pending == 5
    assert c.mark(1, 0, 2) == 1 and c.pending == 4           # block 1 was marked already
    assert [c.checked(1, b) for b in range(5)] == [True, True, True, True, False]
    assert c.mark_shard(0) == 3 and c.pending == 1
    c.reset(1)
    assert c.pending == 5 and not c.checked(1, 1)
    assert c.addresses.dtype == np.uint64 and c.addresses.size == 3
    for bad in [(3, 0, 1), (-1, 0, 1), (1, 4, 2), (1, -1, 1)]:
        with pytest.raises(ConfigError):
            c.mark(*bad)
    with pytest.raises(ConfigError):
        mod.BlockChecks([1], 1000)                            # not a power of two
    with pytest.raises(ConfigError):
        mod.BlockChecks([True], 1024)
    with pytest.raises(ConfigError):
        c.set_digests(0, np.zeros(2, "<u8"), 0)              # 3 blocks, 2 digests
    with pytest.raises(ConfigError):
        c.set_digests(0, np.zeros(3, np.int64), 0)
    with pytest.raises(ConfigError):
        c.set_digests(0, np.zeros(3, "<u8"), -1)


@pytest.mark.parametrize("mod", MODS)
def test_claims_let_one_fetcher_take_each_block(mod):
    # the remote path: blocks listed, claimed (another claimant gets none of them), marked, released
    c = mod.BlockChecks([4, 3], 1024)
    pairs = np.array([[0, 1], [1, 2], [0, 3]])
    assert c.claim(pairs).tolist() == [True, True, True]
    assert c.claim(np.array([[0, 1], [0, 2]])).tolist() == [False, True]   # (0, 1) is held
    assert c.mark_pairs(pairs) == 3 and c.pending == 4
    c.release(pairs)
    assert c.claim(pairs).tolist() == [False, False, False]               # checked: nothing to fetch
    assert c.claim(np.zeros((0, 2), np.int64)).size == 0
    with pytest.raises(ConfigError):
        c.claim([[1, 3]])
    with pytest.raises(ConfigError):
        c.mark_pairs([[2, 0]])
    with c.lock:                                                           # a condition for the waiters
        c.lock.notify_all()


@pytest.mark.parametrize("mod", MODS)
def test_a_gatherer_needs_the_digests_of_every_shard(mod):
    ds = Dataset(mod, [1000, 700])
    c = mod.BlockChecks([d.size for d in ds.digests], BLOCK)
    c.set_digests(0, ds.digests[0], xxh3_64(ds.digests[0].tobytes()))
    with pytest.raises(ConfigError, match="checks"):
        ds.gather(c)
    with pytest.raises(ConfigError, match="checks"):
        ds.gather(mod.BlockChecks([4], BLOCK))


@pytest.mark.compiled
@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_checks_match_the_twin(seed):
    # random shards, windows and ranges (some across shards); one block damaged in half the
    # seeds: outputs, errors and the marks left behind are the twin's
    compiled = _kernels.compiled("tokstream")
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 3000, rng.integers(1, 5)).tolist()
    made = []
    for mod in (compiled, TWIN):
        ds = Dataset(mod, sizes, seed=seed)
        if seed % 2:
            k = int(rng.integers(0, len(sizes))) if mod is compiled else made[0][0][0]
            at = int(rng.integers(0, ds.shards[k].size)) if mod is compiled else made[0][0][1]
            ds.shards[k][at] ^= 1                   # a flipped bit the vocabulary check cannot see
            made.append(((k, at), ds))
        else:
            made.append(((None, None), ds))
    total = int(np.sum(sizes))
    plans = []
    for _ in range(20):
        length = int(rng.integers(1, min(total, 900) + 1))
        plans.append((rng.integers(0, total - length + 1, int(rng.integers(1, 9))), length))
    results = []
    for (_, ds) in made:
        checks = ds.checks()
        g = ds.gather(checks)
        got = []
        for starts, length in plans:
            out = np.empty((starts.size, length), np.int64)
            try:
                g.gather(starts, length, out)
                got.append(out.copy())
            except IntegrityError as exc:
                got.append((type(exc), str(exc), exc.field))
            flat = np.empty(int(starts.size * 3), np.int32)
            try:
                g.gather_ranges(starts, starts + 3, flat)
                got.append(flat.copy())
            except IntegrityError as exc:
                got.append((type(exc), str(exc), exc.field))
        results.append((got, _marks(checks, ds), checks.pending))
    (a, marks_a, pend_a), (b, marks_b, pend_b) = results
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and (x == y).all()
        else:
            assert x == y
    assert marks_a == marks_b and pend_a == pend_b
    if seed % 2 == 0:
        ds = made[0][1]
        for (starts, length), x in zip(plans, a[::2], strict=True):
            assert (x == np.stack([ds.window(int(p), length) for p in starts])).all()


@pytest.mark.parametrize("mod", MODS)
def test_a_bad_block_is_named_and_stays_unchecked(mod):
    ds = Dataset(mod, [2000, 1500])
    ds.shards[1][300] ^= 4                              # byte 600 of shard 1: its block 1
    checks = ds.checks()
    g = ds.gather(checks)
    before = checks.pending
    out = np.empty((1, 50), np.int64)
    g.gather([2000 + 100], 50, out)                     # block 0 of shard 1: fine
    assert checks.checked(1, 0) and checks.pending == before - 1
    for _ in range(2):                                   # every read that touches it fails
        with pytest.raises(IntegrityError) as info:
            g.gather([2000 + 280], 50, out)
        assert info.value.path == "/data/shard-1/tokens.bin" and info.value.field == "xxh3"
        assert "block 1 (bytes [512, 1024))" in str(info.value)
    assert not checks.checked(1, 1) and checks.pending == before - 1
    g.gather([2000 + 600], 50, out)                     # other blocks of the shard still read
    assert (out[0] == ds.window(2600, 50)).all()
    # the short last block of a shard names its real end
    ds.shards[1][-1] ^= 1
    with pytest.raises(IntegrityError, match=r"block 5 \(bytes \[2560, 3000\)\)"):
        g.gather([3500 - 3], 3, np.empty((1, 3), np.int64))


@pytest.mark.parametrize("mod", MODS)
def test_a_digest_list_that_does_not_match_the_manifest_is_refused(mod):
    ds = Dataset(mod, [1000, 1000])
    checks = mod.BlockChecks([d.size for d in ds.digests], BLOCK)
    checks.set_digests(0, ds.digests[0], xxh3_64(ds.digests[0].tobytes()))
    checks.set_digests(1, ds.digests[1], xxh3_64(ds.digests[1].tobytes()) ^ 1)
    g = ds.gather(checks)
    g.gather([10], 20, np.empty((1, 20), np.int64))
    with pytest.raises(IntegrityError) as info:
        g.gather([1500], 20, np.empty((1, 20), np.int64))
    assert info.value.field == "tokens.bin.xxh3" and info.value.path == "/data/shard-1/checksums.bin"
    assert "the chunk digests of tokens.bin hash to" in str(info.value)


@pytest.mark.parametrize("mod", MODS)
def test_checked_blocks_are_never_hashed_again(mod):
    # a block marked checked is trusted from then on (the bytes of a published file never
    # change): a flip in it afterwards is not seen, which is how the marks are known to be used
    ds = Dataset(mod, [4000])
    checks = ds.checks()
    g = ds.gather(checks)
    out = np.empty((1, 4000), np.int64)
    g.gather([0], 4000, out)
    assert checks.pending == 0
    ds.shards[0][10] ^= 1
    g.gather([0], 20, np.empty((1, 20), np.int64))


@pytest.mark.compiled
def test_threads_sharing_the_checks_read_right_and_count_each_block_once():
    mod = _kernels.compiled("tokstream")
    ds = Dataset(mod, [50000, 30000, 20000], seed=3)
    ds.shards[2][5000] ^= 2                             # block 19 of shard 2
    bad = (2, 5000 * 2 // BLOCK)
    checks = ds.checks()
    g = ds.gather(checks)
    flat = np.concatenate(ds.shards).astype(np.int64)
    errors, wrong = [], []

    def work(seed):
        rng = np.random.default_rng(seed)
        out = np.empty((16, 257), np.int64)
        for _ in range(300):
            starts = rng.integers(0, flat.size - 257, 16)
            try:
                g.gather(starts, 257, out)
            except IntegrityError:
                errors.append(starts)
                continue
            want = flat[starts[:, None] + np.arange(257)[None, :]]
            if not (out == want).all():
                wrong.append(starts)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    lo, hi = 50000 + 30000 + bad[1] * BLOCK // 2, 50000 + 30000 + (bad[1] + 1) * BLOCK // 2
    for starts in errors:                                # each failed batch touches the bad block
        assert ((starts < hi) & (starts + 257 > lo)).any()
    marks = _marks(checks, ds)
    assert not marks[bad[0]][bad[1]]
    assert checks.pending == sum(not m for shard in marks for m in shard)


@pytest.mark.parametrize("mod", MODS)
def test_a_queued_gather_equals_the_gather_and_raises_from_wait(mod):
    ds = Dataset(mod, [3000, 2000], seed=5)
    pool = TaskPool(2) if mod is not TWIN else _kernels.twin("pool").TaskPool(2)
    try:
        g = ds.gather(ds.checks())
        rng = np.random.default_rng(0)
        tickets = []
        for _ in range(8):
            starts = rng.integers(0, 5000 - 65, 12)
            out = np.empty((12, 65), np.int32)
            tickets.append((starts, out, g.gather_async(pool, starts, 65, out)))
        for starts, out, t in tickets:
            assert t.wait() is out
            assert (out == np.stack([ds.window(int(p), 65) for p in starts])).all()
        empty = np.empty((0, 65), np.int64)
        assert g.gather_async(pool, np.zeros(0, np.int64), 65, empty).wait() is empty
        with pytest.raises(OutOfRangeError):
            g.gather_async(pool, [4990], 65, np.empty((1, 65), np.int64)).wait()
        ds.shards[0][7] ^= 1
        fresh = ds.gather(ds.checks())
        with pytest.raises(IntegrityError):
            fresh.gather_async(pool, [0], 65, np.empty((1, 65), np.int64)).wait()
        with pytest.raises(ConfigError):
            g.gather_async(pool, [0], 65, np.empty((2, 65), np.int64))
        ds.shards[1][0] = 60000
        with pytest.raises(CorruptError, match="vocabulary"):
            ds.gather(None).gather_async(pool, [3000], 4, np.empty((1, 4), np.int64)).wait()
        t = g.gather_async(pool, [0], 65, np.empty((1, 65), np.int64))
        t.cancel()
    finally:
        pool.stop()


@pytest.mark.parametrize("mod", MODS)
def test_document_spans_across_shards(mod):
    # documents numbered across shards (one shard without documents), from the indexes
    ds = Dataset(mod, [10, 0, 7, 5])
    docs = [np.array([0, 4, 10], np.uint64), np.array([0], np.uint64), np.array([0, 7], np.uint64),
            np.array([0, 1, 2, 5], np.uint64)]
    bases = np.array([s.ctypes.data for s in ds.shards], dtype=np.uint64)
    g = mod.WindowGather(bases, ds.cum, 2, 2, ds.vocab, ds.paths, docs)
    assert g.num_documents == 6
    a, b = g.document_spans([5, 0, 2, 1, 3, 4])
    assert a.tolist() == [19, 0, 10, 4, 17, 18] and b.tolist() == [22, 4, 17, 10, 18, 19]
    assert [x.size for x in g.document_spans(np.zeros(0, np.int64))] == [0, 0]
    out_a, out_b = np.empty(2, np.int64), np.empty(2, np.int64)
    assert g.document_spans([1, 2], out_a, out_b)[0] is out_a and out_b.tolist() == [10, 17]
    for bad in ([6], [-1], [0, 2**40]):
        with pytest.raises(OutOfRangeError, match="document index"):
            g.document_spans(bad)
    with pytest.raises(ConfigError):
        g.document_spans([1, 2], np.empty(3, np.int64), out_b)
    with pytest.raises(ConfigError, match="document indexes"):
        ds.gather(None).document_spans([0])
    # an index entry past its shard (an index the open-time checks did not cover in full)
    docs[3][2] = 9
    g = mod.WindowGather(bases, ds.cum, 2, 2, ds.vocab, ds.paths, docs)
    g.document_spans([3])
    with pytest.raises(CorruptError) as info:
        g.document_spans([4])
    assert info.value.field == "documents.index" and info.value.path == "/data/shard-3/documents.index"


@pytest.mark.parametrize("mod", MODS)
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_ranges_with_positions_and_labels_in_one_pass(mod, dtype):
    ds = Dataset(mod, [300, 200, 500], seed=2)
    rng = np.random.default_rng(1)
    starts = rng.integers(0, 900, 12)
    stops = np.minimum(starts + rng.integers(0, 150, 12), 1000)
    stops[3] = starts[3]                                  # an empty range
    total = int((stops - starts).sum())
    flat = np.concatenate(ds.shards).astype(np.int64)
    want = np.concatenate([flat[a:b] for a, b in zip(starts, stops, strict=True)])
    lens = stops - starts
    pos_want = np.concatenate([np.arange(n) for n in lens])
    lab_want = np.concatenate([np.append(flat[a + 1:b], -100) if b > a else flat[:0]
                               for a, b in zip(starts, stops, strict=True)])
    g = ds.gather(ds.checks())
    for pdt in (np.int64, np.int32):
        out, pos, lab = np.empty(total, dtype), np.empty(total, pdt), np.empty(total, dtype)
        assert g.gather_ranges(starts, stops, out, position_ids=pos, labels=lab, ignore_id=-100) is out
        assert (out == want).all() and (pos == pos_want).all() and (lab == lab_want).all()
    out = np.empty(total, dtype)
    g.gather_ranges(starts, stops, out, labels=np.empty(total, dtype))
    assert (out == want).all()
    pool = TaskPool(1) if mod is not TWIN else _kernels.twin("pool").TaskPool(1)
    try:
        out, pos, lab = np.empty(total, dtype), np.empty(total, np.int64), np.empty(total, dtype)
        assert g.gather_ranges_async(pool, starts, stops, out, position_ids=pos, labels=lab).wait() is out
        assert (out == want).all() and (pos == pos_want).all() and (lab == lab_want).all()
        with pytest.raises(OutOfRangeError):
            g.gather_ranges_async(pool, [990], [1001], np.empty(11, dtype))
        with pytest.raises(ConfigError):
            g.gather_ranges_async(pool, starts, stops, out, labels=np.empty(total + 1, dtype))
        ds.shards[2][100] ^= 1
        fresh = ds.gather(ds.checks())
        with pytest.raises(IntegrityError):
            fresh.gather_ranges_async(pool, [590], [620], np.empty(30, dtype)).wait()
    finally:
        pool.stop()
    with pytest.raises(ConfigError):
        g.gather_ranges(starts, stops, np.empty(total, dtype), labels=np.empty(total, np.int16))
    if dtype is np.int32:
        with pytest.raises(ConfigError, match="ignore_id"):
            g.gather_ranges(starts, stops, np.empty(total, dtype), labels=np.empty(total, dtype), ignore_id=2**31)


class MaskedDataset(Dataset):
    """A :class:`Dataset` with a 0/1 stream beside it (a loss mask: its own shards, digests and
    checks, the same token counts)."""

    def __init__(self, mod, sizes, *, seed=0, **kw):
        super().__init__(mod, sizes, seed=seed, **kw)
        rng = np.random.default_rng(seed + 100)
        self.masks = [rng.integers(0, 2, n, dtype=np.uint16) for n in sizes]
        self.mask_digests = [_digests(m, self.block) for m in self.masks]
        self.mask_paths = [f"/data/loss_mask/shard-{k}/tokens.bin" for k in range(len(sizes))]

    def mask_checks(self):
        c = self.mod.BlockChecks([d.size for d in self.mask_digests], self.block)
        for k, d in enumerate(self.mask_digests):
            c.set_digests(k, d, xxh3_64(d.tobytes()))
        return c

    def mask_gather(self, checks):
        bases = np.array([m.ctypes.data for m in self.masks], dtype=np.uint64)
        return self.mod.WindowGather(bases, self.cum, 2, 2, 2, self.mask_paths, checks=checks)

    def labels(self, pos, length, shift):
        flat, keep = np.concatenate(self.shards).astype(np.int64), np.concatenate(self.masks)
        return np.where(keep[pos + shift:pos + length] != 0, flat[pos + shift:pos + length], -100)


@pytest.mark.compiled
@pytest.mark.parametrize("seed", range(6))
def test_masked_labels_in_the_token_pass_match_the_twin(seed):
    # random shards and a mask beside them; windows (some across shards, on the calling thread
    # and split over a pool), ranges and the queued variants; a damaged token block in some
    # seeds, a damaged mask block or a mask value of 2 in others: outputs, errors and the marks
    # left behind in both checks are the twin's, and the labels the NumPy merge of two reads
    compiled = _kernels.compiled("tokstream")
    twin_pool = _kernels.twin("pool").TaskPool(2)
    pool = TaskPool(2)
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 3000, rng.integers(1, 5)).tolist()
    total = int(np.sum(sizes))
    damage = [None, "tokens", "mask", "value"][seed % 4]
    k = int(rng.integers(0, len(sizes)))
    at = int(rng.integers(0, sizes[k]))
    plans = []
    for _ in range(12):
        length = int(rng.integers(1, min(total, 900) + 1))
        starts = rng.integers(0, total - length + 1, int(rng.integers(1, 40)))
        stops = np.minimum(starts + rng.integers(0, 60, starts.size), total)     # ranges, some empty
        plans.append((starts, length, int(rng.integers(0, 2)), (np.int64, np.int32)[int(rng.integers(0, 2))],
                      stops))
    results = []
    try:
        for mod, p in ((compiled, pool), (TWIN, twin_pool)):
            ds = MaskedDataset(mod, sizes, seed=seed)
            if damage == "tokens":
                ds.shards[k][at] ^= 1
            elif damage == "mask":
                ds.masks[k][at] ^= 1                     # a flipped bit: only the mask's checksum sees it
            elif damage == "value":
                ds.masks[k][at] = 2
                ds.mask_digests = [_digests(m, ds.block) for m in ds.masks]   # a value the digests agree with
            checks, mchecks = ds.checks(), ds.mask_checks()
            g, m = ds.gather(checks), ds.mask_gather(mchecks)
            got = []
            for starts, length, shift, dt, stops in plans:
                for split in (None, p):
                    out, lab = np.empty((starts.size, length), dt), np.empty((starts.size, length - shift), dt)
                    try:
                        g.gather(starts, length, out, split, labels=lab, mask=m, label_shift=shift)
                        got.append((out.copy(), lab.copy()))
                    except (IntegrityError, CorruptError) as exc:
                        got.append((type(exc), str(exc), exc.field, exc.path))
                n = int((stops - starts).sum())
                out, lab = np.empty(n, dt), np.empty(n, dt)
                try:
                    g.gather_ranges(starts, stops, out, labels=lab, mask=m, label_shift=shift, ignore_id=-100)
                    got.append((out.copy(), lab.copy()))
                except (IntegrityError, CorruptError) as exc:
                    got.append((type(exc), str(exc), exc.field, exc.path))
                out2, lab2 = np.empty((starts.size, length), dt), np.empty((starts.size, length - shift), dt)
                try:
                    g.gather_async(p, starts, length, out2, labels=lab2, mask=m, label_shift=shift).wait()
                    got.append((out2.copy(), lab2.copy()))
                except (IntegrityError, CorruptError) as exc:
                    got.append((type(exc), str(exc), exc.field, exc.path))
            mask_marks = [[mchecks.checked(j, x) for x in range(d.size)] for j, d in enumerate(ds.mask_digests)]
            results.append((got, _marks(checks, ds), mask_marks, checks.pending, mchecks.pending, ds))
    finally:
        pool.stop()
        twin_pool.stop()
    (a, ma, mma, pa, mpa, ds), (b, mb, mmb, pb, mpb, _) = results
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x[0], np.ndarray):
            assert isinstance(y[0], np.ndarray) and (x[0] == y[0]).all() and (x[1] == y[1]).all()
        else:
            assert x == y
    assert ma == mb and mma == mmb and pa == pb and mpa == mpb
    if damage is None:
        for (starts, length, shift, _, _), (_, lab) in zip(plans, a[::4], strict=True):
            assert (lab == np.stack([ds.labels(int(s), length, shift) for s in starts])).all()
    else:
        named = {"tokens": "/data/shard-", "mask": "/data/loss_mask/", "value": "/data/loss_mask/"}[damage]
        errors = [x for x in a if not isinstance(x[0], np.ndarray)]
        assert errors and all(e[3].startswith(named) for e in errors)
        if damage == "value":
            assert all(e[0] is CorruptError and "vocabulary size 2" in e[1] for e in errors)



@pytest.mark.parametrize("mod", MODS)
def test_a_mask_of_other_shards_or_labels_that_do_not_fit_are_refused(mod):
    ds = MaskedDataset(mod, [300, 200])
    g = ds.gather(ds.checks())
    m = ds.mask_gather(ds.mask_checks())
    out = np.empty((2, 10), np.int64)
    other = MaskedDataset(mod, [200, 300]).mask_gather(None)
    with pytest.raises(ConfigError, match="mask"):
        g.gather([0, 5], 10, out, labels=np.empty((2, 9), np.int64), mask=other)
    with pytest.raises(ConfigError, match="labels"):
        g.gather([0, 5], 10, out, mask=m)
    with pytest.raises(ConfigError, match="labels"):
        g.gather([0, 5], 10, out, labels=np.empty((2, 10), np.int64), mask=m)
    with pytest.raises(ConfigError, match="labels"):
        g.gather([0, 5], 10, out, labels=np.empty((2, 9), np.int32), mask=m)
    with pytest.raises(ConfigError, match="label_shift"):
        g.gather([0, 5], 10, out, labels=np.empty((2, 8), np.int64), mask=m, label_shift=2)
    with pytest.raises(ConfigError, match="ignore_id"):
        g.gather([0, 5], 10, np.empty((2, 10), np.int32), labels=np.empty((2, 9), np.int32), mask=m,
                 ignore_id=2**31)
    with pytest.raises(ConfigError, match="mask_fds"):
        g.gather([0, 5], 10, out, labels=np.empty((2, 9), np.int64),
                 mask=mod.WindowGather(None, ds.cum, 2, 2, 2, num_shards=2))
    lab = np.empty((2, 9), np.int64)
    g.gather([0, 295], 10, out, labels=lab, mask=m)         # across the shards
    assert (lab == np.stack([ds.labels(0, 10, 1), ds.labels(295, 10, 1)])).all()
