"""The exception hierarchy: classes, messages naming file and field, pickling."""

from __future__ import annotations

import errno
import pickle

import pytest

from zerobatch.formats import errors as E


def test_hierarchy_keeps_standard_exceptions_catchable():
    assert issubclass(E.FormatError, E.ZerobatchError) and issubclass(E.FormatError, ValueError)
    for cls in (E.TruncatedError, E.CorruptError, E.UnsupportedVersionError, E.LimitExceededError):
        assert issubclass(cls, E.FormatError)
    assert issubclass(E.IntegrityError, E.CorruptError)
    assert issubclass(E.ConfigError, ValueError) and issubclass(E.StateError, ValueError)
    assert issubclass(E.WriteError, OSError) and issubclass(E.ReadError, OSError)
    assert issubclass(E.NotFoundError, FileNotFoundError)


def test_message_names_file_and_field():
    e = E.TruncatedError("num_batches: header claims 8 batches but the file holds 5",
                         path="dataset.batch", field="num_batches")
    assert str(e) == "dataset.batch: num_batches: header claims 8 batches but the file holds 5"
    assert e.path == "dataset.batch" and e.field == "num_batches"
    assert str(E.ConfigError("seq_len must be between 1 and 2**31-1, got 0")).startswith("seq_len")


@pytest.mark.parametrize("cls", [E.ZerobatchError, E.FormatError, E.TruncatedError, E.CorruptError,
                                 E.IntegrityError, E.UnsupportedVersionError, E.LimitExceededError,
                                 E.ConfigError, E.StateError, E.NotFoundError])
def test_errors_pickle_with_path_and_field(cls):
    e = cls("field: bad", path="/x/y.batch", field="field")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and str(back) == str(e) and back.field == "field" and back.path == "/x/y.batch"


def test_write_error_keeps_errno_and_operation():
    e = E.WriteError("fsync failed", errno=errno.EIO, path="a.batch", operation="fsync")
    assert e.errno == errno.EIO and e.operation == "fsync" and e.filename == "a.batch"
    assert str(e) == "a.batch: fsync failed"
    back = pickle.loads(pickle.dumps(e))
    assert back.errno == errno.EIO and back.operation == "fsync" and str(back) == str(e)
    r = pickle.loads(pickle.dumps(E.ReadError("file: cannot open", errno=errno.EACCES, path="p")))
    assert r.errno == errno.EACCES and str(r) == "p: file: cannot open"
