"""The resume matrix inside torchdata's ``StatefulDataLoader``: the loader as its dataset
(``batch_size=None``) with 0-3 worker processes, ``in_order`` on and off, restored from a cut
inside the epoch, and a state saved under one worker count restored under another."""

from __future__ import annotations

import pytest
import zbtest
from zbtest import token_stream

from zerobatch.adapters.torch import Loader, TokenWindows
from zerobatch.formats.errors import StateError

sdl = pytest.importorskip("torchdata.stateful_dataloader")
pytestmark = pytest.mark.filterwarnings("ignore:.*(worker processes in total|set_vital).*:UserWarning")

SEQ = 16


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder, _ = token_stream(tmp_path_factory.mktemp("td") / "d", n_tokens=3300)
    return TokenWindows(folder, SEQ)


def make(source):
    return Loader(source, batch_size=4, seed=5, num_threads=1)


def ids(batch) -> tuple[int, ...]:
    return tuple((batch[0][:, 0] // SEQ).tolist())


def dataloader(loader, workers, in_order=True):
    kw = {} if workers == 0 else {"multiprocessing_context": "fork", "in_order": in_order}
    return sdl.StatefulDataLoader(loader, batch_size=None, num_workers=workers, **kw)


def take(dl, k=None):
    return zbtest.take(dl, k, ids)


@pytest.fixture(scope="module")
def reference(source):
    return take(make(source))


@pytest.mark.filterwarnings("ignore:.*in_order=False.*")
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_restore_under_the_same_worker_count(source, reference, workers, in_order):
    if workers == 0 and not in_order:
        pytest.skip("in_order concerns worker processes only")
    assert len(reference) == len(make(source)) == 51
    for k in (5, 26):
        dl = dataloader(make(source), workers, in_order)
        head = take(dl, k)
        state = dl.state_dict()
        del dl
        if not in_order and state["_steps_since_snapshot"]:
            # torchdata's snapshot lags behind a batch that arrived out of order, and its restore
            # then drops whichever batches come first: no dataset can resume that exactly, and
            # the loader refuses the state rather than guess (torchdata: "no guarantees")
            shares = state["_snapshot"]["_worker_snapshots"]
            counts = [shares[f"worker_{w}"]["dataset_state"]["delivered"] for w in range(workers)]
            if counts != [len(range(w, sum(counts), workers)) for w in range(workers)]:
                with pytest.raises(StateError, match="in_order"):
                    make(source).load_state_dict(state)
            continue
        dl2 = dataloader(make(source), workers, in_order)
        dl2.load_state_dict(state)
        rest = take(dl2)
        if in_order:
            assert head + rest == reference, (workers, k)
        else:               # batches arrive as workers finish them: each one exactly once
            assert sorted(head + rest) == sorted(reference), (workers, k)


@pytest.mark.parametrize("w_from, w_to", [(2, 3), (3, 1), (1, 0), (0, 2)])
def test_restore_under_another_worker_count(source, reference, w_from, w_to):
    """torchdata restores a state only under the worker count that saved it; the loader reads
    the position out of it, and a fresh StatefulDataLoader over that loader continues."""
    dl = dataloader(make(source), w_from)
    head = take(dl, 17)
    state = dl.state_dict()
    loader = make(source)
    loader.load_state_dict(state)
    assert head + take(dataloader(loader, w_to)) == reference


def test_a_state_of_out_of_order_delivery_needs_its_worker_count(source, reference):
    """With in_order=False the delivered batches need not be the first n; such a state has no
    single position, so it is refused rather than repeating or skipping batches."""
    state = {"_snapshot": {"_snapshot_step": 3, "_last_yielded_worker_id": 0,
                           "_main_snapshot": {"_num_workers": 2},
                           "_worker_snapshots": {}}, "_steps_since_snapshot": 0}
    loader = make(source)
    good = loader.state_dict()
    dl = dataloader(make(source), 2)
    take(dl, 4)
    real = dl.state_dict()
    for w in real["_snapshot"]["_worker_snapshots"].values():
        assert w["dataset_state"]["delivered"] == 2
    skewed = real
    skewed["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]["delivered"] = 3
    with pytest.raises(StateError, match="in_order"):
        loader.load_state_dict(skewed)
    with pytest.raises(StateError):
        loader.load_state_dict(state)
    assert loader.state_dict() == good


def test_worker_state_restores_only_into_its_own_worker(source):
    dl = dataloader(make(source), 2)
    take(dl, 4)
    worker_state = dl.state_dict()["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]
    loader = make(source)
    with pytest.raises(StateError, match="one DataLoader worker's share"):
        loader.load_state_dict(worker_state)
