"""Pure-Python twins of the compiled kernels, one module per kernel module (see ``zerobatch.core._kernels``)."""
