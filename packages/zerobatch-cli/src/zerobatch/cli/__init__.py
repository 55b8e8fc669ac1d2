"""zerobatch.cli: the ``zerobatch`` command (inspect, verify, bench)."""

from zerobatch.cli._version import __version__
from zerobatch.cli.main import main

__all__ = ["__version__", "main"]
