"""Version of the zerobatch-core distribution (all zerobatch distributions move in lock-step)."""

__version__ = "0.1.0"
