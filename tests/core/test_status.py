"""The status table: _status.h, its Cython declaration and the Python map agree, and every
error code becomes its exception."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import zerobatch.core
from zerobatch.core.status import STATUS_CODES, STATUS_EXCEPTIONS, raise_for_status
from zerobatch.formats.errors import ReadError, ZerobatchError

CORE = Path(zerobatch.core.__file__).parent
SRC = Path(__file__).resolve().parents[2] / "packages" / "zerobatch-core" / "src" / "zerobatch" / "core"


def test_the_header_the_declaration_and_the_map_agree():
    header = (SRC / "_status.h").read_text()
    defined = {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define (ZB_[A-Z_]+) (\d+)", header, re.M)}
    defined.pop("ZB_STATUS_H", None)
    assert defined == STATUS_CODES
    declared = re.findall(r"^\s+(ZB_[A-Z_]+)\s*$", (SRC / "_status.pxd").read_text(), re.M)
    assert sorted(declared) == sorted(STATUS_CODES)


def test_only_the_status_header_defines_status_codes():
    """No kernel keeps a copy of the table (a C header of its own, a Python constant)."""
    for f in SRC.iterdir():
        if f.name.startswith("_status") or f.name == "status.py" or f.suffix not in (".h", ".pyx", ".pxd", ".py"):
            continue
        text = f.read_text()
        assert not re.search(r"#define\s+Z[BR]_(\w+_)?(E_[A-Z]+|OK|RETRY|STALE|NEED_\w+)\s+\d", text), f.name
        assert not re.search(r"^_TRUNCATED\b|^\s*(ZB_E_\w+|ZR_\w+)\s*=\s*\d", text, re.M), f.name


@pytest.mark.parametrize("code", sorted(STATUS_EXCEPTIONS))
def test_every_error_code_raises_its_exception(code):
    cls = STATUS_EXCEPTIONS[code]
    with pytest.raises(cls) as info:
        raise_for_status(code, "what went wrong", path="/data/x", field="f", errno=5)
    if issubclass(cls, ZerobatchError):
        assert info.value.path == "/data/x" and info.value.field == "f"
        assert str(info.value) == "/data/x: what went wrong"
    if cls is ReadError:
        assert info.value.errno == 5


def test_signals_and_unknown_codes_are_never_silent():
    for code in (0, 100, 101, 102, 103, 999):
        with pytest.raises(ZerobatchError, match="unknown status"):
            raise_for_status(code, "x")
