"""One face over every zerobatch format for ``inspect``, ``verify``, ``head``, ``stats`` and
``bench``: :func:`open_dataset` recognises the format from the bytes (file magic) or the
folder's files, then the format's :class:`Dataset` (``zerobatch.cli.formats.<fmt>``, named by
its registry record) describes, checks, samples and times it through the format's own reader.
A token format's face is its documents reader for preparation
(``zerobatch.prepare.formats.<fmt>``) with the commands' parts added.
"""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from zerobatch.formats.errors import ConfigError, NotFoundError, ZerobatchError
from zerobatch.prepare.formats import PIECE, Documents

__all__ = ["PIECE", "Dataset", "Progress", "dist", "folder_size", "human", "open_dataset", "percentiles", "pyplot",
           "summary", "time_reads"]

Progress = Callable[[int, int], None]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def folder_size(folder: str) -> int:
    """Bytes of every file under ``folder``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs
               if os.path.isfile(os.path.join(d, f)))


class Dataset(Documents):
    """A dataset opened for the commands (its :meth:`lengths` and, for token formats,
    :meth:`token_pieces`: :class:`~zerobatch.prepare.formats.Documents`); :meth:`batch_reader`
    returns the batch read ``bench`` times."""

    #: ``bench`` reads the batches the dataset stores (not batches of its options).
    stored_batches = False

    @abc.abstractmethod
    def info(self) -> list[tuple[str, Any]]:
        """``(name, value)`` rows for ``inspect``."""

    @abc.abstractmethod
    def verify(self, progress: Progress | None) -> tuple[list[str], str]:
        """``(faults, summary)``: each fault names the file and the place."""

    @abc.abstractmethod
    def samples(self, n: int) -> list[np.ndarray]:
        """The first ``n`` samples."""

    def sample_name(self) -> str:
        return "record"

    def sample_masks(self, n: int) -> list[np.ndarray] | None:
        """The loss masks (one 0/1 per token) of the first ``n`` samples of a dataset that has
        one (a chat dataset of ``convert --chat``); None for the others."""
        return None

    def trained_tokens(self) -> tuple[int, int] | None:
        """``(tokens trained on, tokens)`` of a dataset with a loss mask; None for the others."""
        return None

    @abc.abstractmethod
    def batch_reader(self, batch_size: int, seq_len: int, rng: np.random.Generator
                     ) -> tuple[Callable[[], Any], int, int]:
        """``(read, units, tokens_per_read)``: ``read()`` reads one random batch of
        ``batch_size`` samples; ``units`` how many distinct batches there are."""

    def print_value_stats(self, path: str, *, top: int, plot: str | None, as_json: bool = False) -> int:
        """``stats`` of a dataset that holds values rather than tokens (``tokens`` False):
        prints them (``as_json``: as one JSON object); returns the exit status.

        Raises:
            ConfigError: a dataset with no value statistics.
        """
        raise ConfigError(f"stats: a {self.kind} dataset has no value statistics", path=self.path, field="stats")


def summary(a: np.ndarray) -> dict[str, Any]:
    """The figures :func:`dist` prints, for ``stats --json``: ``count``, and when there is
    anything ``mean``, ``min``, ``p50``, ``p90``, ``p99`` (NumPy's linear percentiles), ``max``
    and ``all_equal`` (every value the same: no distribution to draw)."""
    if a.size == 0:
        return {"count": 0}
    p = np.percentile(a, [50, 90, 99])
    lo, hi = int(a.min()), int(a.max())
    return {"count": int(a.size), "mean": float(a.mean()), "min": lo, "p50": float(p[0]), "p90": float(p[1]),
            "p99": float(p[2]), "max": hi, "all_equal": lo == hi}


def dist(name: str, a: np.ndarray) -> str:
    """One line: the count, mean, extremes and percentiles of ``a``."""
    s = summary(a)
    if not s["count"]:
        return f"{name}: none"
    return (f"{name}: {s['count']:,}  mean {s['mean']:,.1f}  min {s['min']:,}  p50 {s['p50']:,.0f}  "
            f"p90 {s['p90']:,.0f}  p99 {s['p99']:,.0f}  max {s['max']:,}")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend.

    Raises:
        ZerobatchError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ZerobatchError("--plot needs matplotlib: pip install 'zerobatch-cli[plot]'", field="plot") from None
    return plt


def open_dataset(path: str, *, field: str | None = None) -> Dataset:
    """The dataset at ``path`` through its format's command-line face (the format recognised
    from the file's magic or the folder's files, :mod:`zerobatch.readers.detect`).

    Raises:
        NotFoundError: nothing at ``path``.
        FormatError: not a zerobatch dataset, or a damaged one.
        ConfigError: a format with no command-line face.
    """
    from zerobatch.core.remote import is_url, local_path
    from zerobatch.readers.detect import detect

    path = local_path(path)
    if is_url(path):
        return detect(path).resolve("cli")(path, field=field)
    if not os.path.lexists(path):
        raise NotFoundError("no such file or folder", path=path, field="path")
    return detect(path).resolve("cli")(path, field=field)


def percentiles(samples: list[float]) -> dict[str, float]:
    a = np.array(samples)
    return {"avg": float(a.mean()), "p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99))}


def time_reads(read: Callable[[], Any], count: int, warmup: int = 8) -> list[float]:
    for _ in range(warmup):
        read()
    out = []
    clock = time.perf_counter
    for _ in range(count):
        t = clock()
        read()
        out.append(clock() - t)
    return out
