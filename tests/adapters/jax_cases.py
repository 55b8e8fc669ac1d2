"""zerobatch.adapters.jax: the same loader, yielding jax.Array or NumPy, with the same state.

Run by test_jax_loader.py in a process of its own: JAX starts threads at import, and a
process that has imported it must not fork (the rest of the suite forks a lot)."""

from __future__ import annotations

import numpy as np
import pytest
from zbtest import token_stream

jax = pytest.importorskip("jax")

from zerobatch.adapters.jax import Loader, TokenWindows  # noqa: E402
from zerobatch.formats.errors import ConfigError  # noqa: E402

SEQ = 16


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder, _ = token_stream(tmp_path_factory.mktemp("jx") / "d", n_tokens=2000)
    return TokenWindows(folder, SEQ)


def ids(batch):
    return (np.asarray(batch[0])[:, 0] // SEQ).tolist()


def test_jax_arrays_match_the_numpy_output_and_torch_order(source):
    from zerobatch.adapters.torch import Loader as TorchLoader
    jl = Loader(source, batch_size=4, seed=3, rank=0, world_size=1)
    nl = Loader(source, batch_size=4, seed=3, rank=0, world_size=1, output="numpy")
    tl = TorchLoader(source, batch_size=4, seed=3, rank=0, world_size=1)
    for (jx, jy), (nx, ny), (tx, _) in zip(jl, nl, tl, strict=True):
        assert isinstance(jx, jax.Array) and jx.dtype == np.int32 and jx.shape == (4, SEQ)
        assert isinstance(nx, np.ndarray)
        assert (np.asarray(jx) == nx).all() and (np.asarray(jy) == ny).all()
        assert (nx == tx.numpy()).all()
        assert (np.asarray(jx)[:, 1:] == np.asarray(jy)[:, :-1]).all()


def test_process_sharding_and_resume(source, monkeypatch):
    assert Loader(source, batch_size=4).world_size == jax.process_count() == 1
    full = [ids(b) for b in Loader(source, batch_size=4, seed=5, rank=0, world_size=1, output="numpy")]
    ranks = [[ids(b) for b in Loader(source, batch_size=2, seed=5, rank=r, world_size=2)] for r in range(2)]
    assert [sorted(a + b) for a, b in zip(*ranks, strict=True)] == [sorted(x) for x in full]
    ld = Loader(source, batch_size=4, seed=5, rank=0, world_size=1)
    it = iter(ld)
    head = [ids(next(it)) for _ in range(7)]
    again = Loader(source, batch_size=4, seed=5, rank=0, world_size=1)
    again.load_state_dict(ld.state_dict())
    assert head + [ids(b) for b in again] == full


def test_global_arrays_over_a_sharding(source):
    from jax.sharding import NamedSharding, PartitionSpec
    mesh = jax.make_mesh((1,), ("data",))
    ld = Loader(source, batch_size=4, seed=1, sharding=NamedSharding(mesh, PartitionSpec("data")))
    x, _ = next(iter(ld))
    assert x.shape == (4, SEQ) and x.sharding.spec == PartitionSpec("data")


def test_arguments(source):
    with pytest.raises(ConfigError):
        Loader(source, batch_size=4, output="torch")
    if not jax.config.jax_enable_x64:
        with pytest.raises(ConfigError, match="x64"):
            Loader(source, batch_size=4, dtype=np.int64)
    assert Loader(source, batch_size=4, dtype=np.int64, output="numpy").dtype == np.int64
