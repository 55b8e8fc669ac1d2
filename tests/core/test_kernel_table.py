"""The kernel table (zerobatch.core._kernels): every compiled module has a twin exporting the
same names, and zerobatch.core exports exactly the table's names."""

from __future__ import annotations

import zerobatch.core as core
from zerobatch.core import _kernels


def test_every_compiled_module_exports_what_its_twin_exports():
    names = _kernels.kernel_names()
    assert {"hash", "header", "gather", "pool", "tokstream", "zrecord", "llmchnk", "features"} <= set(names)
    for name in names:
        assert sorted(_kernels.compiled(name).__all__) == sorted(_kernels.twin(name).__all__), name


def test_the_package_exports_the_table():
    table = _kernels.exports()
    for n, obj in table.items():
        assert getattr(core, n) is obj
        assert n in core.__all__
