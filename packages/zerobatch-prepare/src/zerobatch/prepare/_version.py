"""Version of the zerobatch-prepare distribution (all zerobatch distributions move in lock-step)."""

__version__ = "0.1.0"
