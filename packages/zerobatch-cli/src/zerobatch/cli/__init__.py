"""zerobatch.cli: the ``zerobatch`` command (convert, inspect, verify, head, stats, bench, quickstart)."""

from zerobatch.cli._version import __version__
from zerobatch.cli.main import main

__all__ = ["__version__", "main"]
