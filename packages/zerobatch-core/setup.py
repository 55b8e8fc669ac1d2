"""Build the compiled kernels of zerobatch-core.

Every ``src/zerobatch/core/_<name>.pyx`` is a kernel module (a new one needs no edit here):
each becomes an extension with its full dotted name (letting cythonize infer names in a PEP
420 tree puts the modules in the wrong place), with NumPy's headers on the include path
(building against NumPy 2 headers also runs on NumPy 1.x) and the libraries its own
``# distutils: libraries = ...`` line names (zlib for ZRECORD's deflate). One table of
compiler directives. ``ZEROBATCH_CYTHON_DEBUG=1`` turns bounds, wraparound-free and
initialization checks back on to catch what the wrappers' validation missed. Cython and the C
compiler run on every core (``ZEROBATCH_BUILD_JOBS`` overrides the count): the wheel builds of
the tests and of the benchmark gate take half the time on two cores.
"""

import os
import pathlib

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DEBUG = os.environ.get("ZEROBATCH_CYTHON_DEBUG") == "1"
SRC = "src/zerobatch/core"

KERNELS = sorted(p.stem for p in pathlib.Path(SRC).glob("_*.pyx"))

DIRECTIVES = {
    "language_level": 3,
    "wraparound": False,
    "cdivision": True,
    "boundscheck": DEBUG,
    "initializedcheck": DEBUG,
    "embedsignature": True,
    "freethreading_compatible": False,
}

COMPILE_ARGS = ["-O0", "-g"] if DEBUG else ["-O3"]
JOBS = int(os.environ.get("ZEROBATCH_BUILD_JOBS") or os.cpu_count() or 1)


class ParallelBuildExt(build_ext):
    """``build_ext`` compiling the extensions ``JOBS`` at a time (setuptools compiles one at
    a time unless ``--parallel`` is given, which ``pip`` never passes)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = JOBS

extensions = [
    Extension(
        f"zerobatch.core.{name}",
        [f"{SRC}/{name}.pyx"],
        include_dirs=[SRC, np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=COMPILE_ARGS,
    )
    for name in KERNELS
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=DIRECTIVES,
        include_path=["src"],
        build_dir="build/cython",
        nthreads=JOBS if JOBS > 1 else 0,
    ),
    cmdclass={"build_ext": ParallelBuildExt},
)
