"""Build the compiled kernels of zerobatch-core.

One table of extensions with their full dotted names (letting cythonize infer names in a
PEP 420 tree puts the modules in the wrong place) and one table of compiler directives.
``ZEROBATCH_CYTHON_DEBUG=1`` turns bounds, wraparound-free and initialization checks back on
to catch what the wrappers' validation missed.
"""

import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("ZEROBATCH_CYTHON_DEBUG") == "1"
SRC = "src/zerobatch/core"

KERNELS = ["_hash", "_header", "_pool", "_gather", "_offsets", "_feistel", "_tokstream", "_mapping", "_zrecord",
           "_llmchnk", "_features"]
#: System libraries a kernel links (zlib: the raw deflate of ZRECORD's flate records).
LIBRARIES = {"_zrecord": ["z"]}
#: Kernels that use NumPy's C API (building against NumPy 2 headers also runs on NumPy 1.x).
NUMPY_C_API = {"_zrecord"}

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

extensions = [
    Extension(
        f"zerobatch.core.{name}",
        [f"{SRC}/{name}.pyx"],
        include_dirs=[SRC, np.get_include()] if name in NUMPY_C_API else [SRC],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")] if name in NUMPY_C_API else [],
        extra_compile_args=COMPILE_ARGS,
        libraries=LIBRARIES.get(name, []),
    )
    for name in KERNELS
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=DIRECTIVES,
        include_path=["src"],
        build_dir="build/cython",
    ),
)
