"""Every pure-Python twin in one namespace (``zerobatch.core._twins.*``): the oracle the tests
compare the compiled kernels with (``from zerobatch.core import _reference as ref``). Holds
each twin's exported names and its public helpers (``speck_expand``...)."""

from zerobatch.core._kernels import kernel_names as _kernel_names
from zerobatch.core._kernels import twin as _twin

for _k in _kernel_names():
    _mod = _twin(_k)
    globals().update({_n: _v for _n, _v in vars(_mod).items() if not _n.startswith("_")})
__all__ = sorted(_n for _k in _kernel_names() for _n in _twin(_k).__all__)
del _k, _mod
