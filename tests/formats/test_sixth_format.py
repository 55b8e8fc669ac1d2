"""A sixth format with no edit to a shared file: ZBTOY (``tests/fixtures/zbtoy``, the template
of ``docs/adding-a-format.md``) is dropped into the packages' folders as its own modules, and
detection, ``convert --to``, ``inspect`` / ``verify`` / ``head`` / ``stats`` / ``bench``, the
registry's lookups and the loaders (with resume) all serve it."""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest

import zerobatch.adapters.sources
import zerobatch.cli.formats
import zerobatch.formats
import zerobatch.readers
import zerobatch.writers
from zerobatch.formats import registry
from zerobatch.formats.errors import CorruptError, IntegrityError, OutOfRangeError, TruncatedError

TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "zbtoy", "zerobatch")
PACKAGES = {
    zerobatch.formats: "formats",
    zerobatch.readers: "readers",
    zerobatch.writers: "writers",
    zerobatch.adapters.sources: "adapters/sources",
    zerobatch.cli.formats: "cli/formats",
}
MODULES = [f"zerobatch.{p.replace('/', '.')}.zbtoy" for p in PACKAGES.values()]


@pytest.fixture
def zbtoy(monkeypatch):
    """The ZBTOY modules in the packages' folders, found by the registry's own discovery."""
    for package, folder in PACKAGES.items():
        monkeypatch.setattr(package, "__path__", [*package.__path__, os.path.join(TEMPLATE, folder)])
    monkeypatch.setattr(registry, "_registered", {})
    monkeypatch.setattr(registry, "_discovered", False)
    yield registry.get("zbtoy")
    for name in MODULES:
        sys.modules.pop(name, None)
    registry._registered.clear()   # the next lookup discovers the shipped formats again


@pytest.fixture
def toy_file(tmp_path, zbtoy):
    from zerobatch.writers.zbtoy import write_toy

    path = str(tmp_path / "train.toy")
    assert write_toy(path, [np.arange(6 * 8, dtype=np.uint32).reshape(6, 8)], 8) == 6
    return path


def test_discovered_and_detected(zbtoy, toy_file):
    from zerobatch.readers.detect import detect

    assert zbtoy in registry.formats() and {"llmbatch", "zrecord"} <= {f.name for f in registry.formats()}
    assert detect(toy_file) is zbtoy
    assert zbtoy.resolve("reader").__name__ == "ToyReader"
    from zerobatch.prepare.pipeline import targets

    assert "zbtoy" in targets()


def test_reader_checks_its_file(toy_file):
    from zerobatch.readers.zbtoy import ToyReader

    with ToyReader(toy_file) as r:
        r.verify()
        out = r.read_into([5, 0], np.empty((2, 8), np.int32))
        assert out.tolist() == [list(range(40, 48)), list(range(8))]
        with pytest.raises(OutOfRangeError):
            r.read_into([6], np.empty((1, 8), np.int64))
    data = bytearray(open(toy_file, "rb").read())
    open(toy_file, "wb").write(data[:-9])
    with pytest.raises(TruncatedError, match="num_records"):
        ToyReader(toy_file)
    data[20] ^= 1
    open(toy_file, "wb").write(data)
    with ToyReader(toy_file) as r, pytest.raises(IntegrityError):
        r.verify()
    open(toy_file, "wb").write(b"ZBTOY001" + bytes(8))
    with pytest.raises(CorruptError, match="seq_len"):
        ToyReader(toy_file)


def test_command_line_serves_it(zbtoy, tmp_path, capsys):
    from zerobatch.cli.main import main

    tokens = np.arange(100, dtype=np.uint16) % 50
    np.save(tmp_path / "tokens.npy", tokens)
    out = str(tmp_path / "out.toy")
    assert main(["convert", str(tmp_path / "tokens.npy"), out, "--to", "zbtoy", "--seq-len", "8", "--quiet"]) == 0
    from zerobatch.readers.zbtoy import ToyReader

    with ToyReader(out) as r:
        got = r.read_into(np.arange(r.num_records), np.empty((12, 8), np.int64))
    assert np.array_equal(got.reshape(-1), tokens[:96])
    capsys.readouterr()
    assert main(["inspect", out]) == 0
    assert "ZBTOY" in capsys.readouterr().out
    assert main(["verify", out]) == 0
    assert main(["formats"]) == 0
    assert "zbtoy" in capsys.readouterr().out
    assert main(["head", out, "-n", "2"]) == 0
    assert main(["stats", out]) == 0
    assert main(["bench", out, "--trials", "1", "--reads", "4", "--batch-size", "2"]) == 0
    data = bytearray(open(out, "rb").read())
    data[40] ^= 4
    open(out, "wb").write(data)
    capsys.readouterr()
    assert main(["verify", out]) != 0


def test_loaders_read_and_resume(toy_file):
    torch = pytest.importorskip("torch")
    from zerobatch.adapters.torch import Loader

    ld = Loader(toy_file, batch_size=2, shuffle=False)
    x, y = next(iter(ld))
    assert isinstance(x, torch.Tensor) and x.tolist() == [list(range(7)), list(range(8, 15))]
    assert y.tolist() == [list(range(1, 8)), list(range(9, 16))]

    ld = Loader(toy_file, batch_size=2, seed=3)
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    assert state["kind"] == "zbtoy/global-random" and state["fingerprint"].startswith("zbtoy:")
    rest = [x.tolist() for x, _ in it]
    ld2 = Loader(toy_file, batch_size=2, seed=3)
    ld2.load_state_dict(state)
    assert [x.tolist() for x, _ in ld2] == rest
    ld.source.close()
    ld2.source.close()


def test_other_formats_unaffected_after(zbtoy):
    importlib.import_module("zerobatch.adapters.sources.zbtoy")
    assert registry.get("llmbatch").name == "llmbatch"


def test_read_and_written_at_an_s3_url(zbtoy, toy_file, s3_endpoint, tmp_path, monkeypatch):
    """The template at a URL with no shared edit: written by its record's publish
    (writers.remote.publish: one object, whole), and by ``zerobatch convert`` to a URL (its
    record's url_check and publish), read through the storage layer's whole copy
    (readers.remote.whole_copy: ZBTOY has one checksum over the file), by the reader and the
    loader alike, on a real S3 API server; a damaged object is refused by its own check."""
    torch = pytest.importorskip("torch")
    from s3kit import new_bucket, options

    from zerobatch.adapters.sources.zbtoy import ToyRecords
    from zerobatch.adapters.torch import Loader
    from zerobatch.formats.errors import IntegrityError
    from zerobatch.readers.zbtoy import ToyReader
    from zerobatch.writers.remote import publish

    opts = options(s3_endpoint)
    url = f"s3://{new_bucket(s3_endpoint)}/data/train.toy"
    publish(toy_file, url, storage_options=opts)
    far = ToyReader(url, storage_options=opts, cache_dir=tmp_path / "cache")
    local = ToyReader(toy_file)
    assert far.path == url and far.fingerprint == local.fingerprint and far.num_records == 6
    far.verify()
    got = far.read_into(np.arange(6), np.empty((6, 8), np.int64))
    assert (got == local.read_into(np.arange(6), np.empty((6, 8), np.int64))).all()
    want = [x.tolist() for x, _ in Loader(ToyRecords(local), batch_size=2, seed=3)]
    assert [x.tolist() for x, _ in Loader(ToyRecords(far), batch_size=2, seed=3)] == want

    bad = tmp_path / "bad.toy"
    data = bytearray(open(toy_file, "rb").read())
    data[40] ^= 1
    bad.write_bytes(bytes(data))
    publish(str(bad), url, storage_options=opts, overwrite=True)
    damaged = ToyReader(url, storage_options=opts, cache_dir=tmp_path / "cache")
    with pytest.raises(IntegrityError, match="xxh3") as e:
        damaged.verify()
    assert url in str(e.value)
    for r in (far, local, damaged):
        r.close()

    # zerobatch convert to a URL: the record's url_check refuses nothing new, its publish uploads
    from zerobatch.cli.main import main
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(key, value)
    tokens = np.arange(100, dtype=np.uint16) % 50
    np.save(tmp_path / "tokens.npy", tokens)
    converted = f"{url.rsplit('/', 1)[0]}/converted.toy"
    assert main(["convert", str(tmp_path / "tokens.npy"), converted, "--to", "zbtoy", "--seq-len", "8", "--quiet"]) == 0
    with ToyReader(converted, storage_options=opts, cache_dir=tmp_path / "cache") as r:
        got = r.read_into(np.arange(r.num_records), np.empty((12, 8), np.int64))
    assert np.array_equal(got.reshape(-1), tokens[:96])
