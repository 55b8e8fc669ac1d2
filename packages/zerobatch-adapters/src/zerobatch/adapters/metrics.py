"""What the data path costs a training step, per rank: counters every loader keeps, and their
exporters.

Every loader (the PyTorch :class:`~zerobatch.adapters.torch.Loader`, the JAX loader and the
NumPy :class:`~zerobatch.adapters._loader.BaseLoader`) counts as it delivers steps; its
``metrics()`` returns them as one flat dict of numbers (cheap enough for every step: a few
additions per step are all the loader pays, the dict is built when asked)::

    m = loader.metrics()
    m["wait_seconds_total"] / m["elapsed_seconds"]     # the share of the loop spent waiting
    print(format_metrics(m))                           # one line for a log, TensorBoard, W&B

Fields (counters only grow; the others are gauges):

- ``steps``, ``items``, ``reads``, ``bytes_read``: steps delivered, items in them, reads done
  and the bytes of the arrays they filled.
- ``wait_seconds_total``, ``wait_seconds_last``, ``wait_seconds_max``, ``wait_seconds_p50``,
  ``wait_seconds_p99``: time the training loop spent inside ``next()`` (the last
  :data:`WAIT_WINDOW` steps for the percentiles): read, conversion and the host-to-device
  hand-over included.
- ``elapsed_seconds``: from the loop's first ``next()`` to the last step delivered;
  ``data_share``: ``wait_seconds_total / elapsed_seconds``.
- ``read_ahead``, ``read_ahead_target``: reads queued ahead of the loop now, and how many
  it keeps queued.
- for a dataset at a URL: ``requests``, ``bytes_fetched`` (the byte ranges asked for),
  ``bytes_transferred`` (with the gaps of requests obstore merged), ``retries``,
  ``throttled_seconds`` (waits for the per-prefix request budgets), ``checked_bytes`` (hashed
  to check blocks) and ``cache_hit_bytes`` (found already in the local copy when checked);
  their sums over the sources of a mixture.
- on a CUDA device: ``h2d_copies``, ``h2d_bytes``, ``h2d_seconds`` (copy time measured with
  CUDA events on the copy stream, the copies that have completed), ``pinned_buffers``
  (page-locked buffers allocated: the ring; it stops growing after the first steps).
- ``headspace``: 1 while the loader replays its first batches (the data path is then free).

Exporters: :class:`PrometheusCollector` and :func:`serve_prometheus` (the extra
``zerobatch-adapters[metrics]``: ``prometheus_client``, no dependencies of its own). Prometheus
pulls: the loader's dict is read only when the endpoint is scraped, so an exporter costs a
training step nothing. OpenTelemetry collectors read such endpoints as they are (their
``prometheus`` receiver), which is why this one is the exporter shipped; a script that logs to
TensorBoard or W&B logs ``loader.metrics()`` or :func:`format_metrics`.
"""

from __future__ import annotations

import array
import os
import time
from typing import Any

import numpy as np

__all__ = ["COUNTERS", "DEFAULT_PORT", "WAIT_WINDOW", "LoaderMetrics", "PrometheusCollector", "format_metrics",
           "serve_prometheus", "storage_counters"]

#: Steps the wait percentiles cover (the most recent).
WAIT_WINDOW = 1024

#: Port of the first local rank's endpoint (:func:`serve_prometheus`); rank ``k`` of a host
#: serves on ``DEFAULT_PORT + k``.
DEFAULT_PORT = 9480

#: The fields that only grow (exported as Prometheus counters; the rest are gauges).
COUNTERS = frozenset({"steps", "items", "reads", "bytes_read", "wait_seconds_total", "elapsed_seconds", "requests",
                      "bytes_fetched", "bytes_transferred", "retries", "throttled_seconds", "checked_bytes", "cache_hit_bytes",
                      "h2d_copies", "h2d_bytes", "h2d_seconds"})

_STORAGE = ("requests", "bytes_fetched", "bytes_transferred", "retries", "throttled_seconds", "checked_bytes", "cache_hit_bytes")


class LoaderMetrics:
    """The counters of one loader, updated by its delivery loop (one thread) and read by
    :meth:`snapshot` (any thread: a snapshot may be a step behind, never torn badly)."""

    def __init__(self) -> None:
        self.pinned_buffers = 0          # the ring's size: not reset
        self.reset()

    def reset(self) -> None:
        self.steps = self.items = self.reads = self.bytes_read = 0
        self.wait_total = self.wait_max = self.wait_last = 0.0
        # an array.array: a float stored in 30 ns (a NumPy item takes 100), read by NumPy in place
        self._waits = array.array("d", bytes(8 * WAIT_WINDOW))
        self.first_asked: float | None = None
        self.last_delivered: float | None = None
        self.h2d_copies = self.h2d_bytes = 0
        self.h2d_seconds = 0.0

    def asked(self, now: float) -> None:
        """The loop called ``next()`` for the first time."""
        if self.first_asked is None:
            self.first_asked = now

    def read(self, nbytes: int) -> None:
        """A read's result arrived (``nbytes`` in its arrays)."""
        self.reads += 1
        self.bytes_read += nbytes

    def delivered(self, wait: float, now: float, items: int) -> None:
        """A step goes to the loop after it waited ``wait`` seconds inside ``next()``."""
        if self.first_asked is None:     # (reset in the middle of a pass)
            self.first_asked = now - wait
        self._waits[self.steps % WAIT_WINDOW] = wait
        self.steps += 1
        self.items += items
        self.wait_total += wait
        self.wait_last = wait
        if wait > self.wait_max:
            self.wait_max = wait
        self.last_delivered = now

    def snapshot(self) -> dict[str, float]:
        n = min(self.steps, WAIT_WINDOW)
        p50 = p99 = 0.0
        if n:                            # nearest-rank percentiles (np.percentile costs 30 us)
            k50, k99 = (n - 1) // 2, min(n - 1, -(-99 * n // 100) - 1)
            part = np.partition(np.frombuffer(self._waits, np.float64, n), (k50, k99))
            p50, p99 = float(part[k50]), float(part[k99])
        elapsed = 0.0
        if self.first_asked is not None and self.last_delivered is not None:
            elapsed = max(0.0, self.last_delivered - self.first_asked)
        return {"steps": self.steps, "items": self.items, "reads": self.reads, "bytes_read": self.bytes_read,
                "wait_seconds_total": self.wait_total, "wait_seconds_last": self.wait_last,
                "wait_seconds_max": self.wait_max, "wait_seconds_p50": p50, "wait_seconds_p99": p99,
                "elapsed_seconds": elapsed, "data_share": self.wait_total / elapsed if elapsed > 0 else 0.0,
                "h2d_copies": self.h2d_copies, "h2d_bytes": self.h2d_bytes, "h2d_seconds": self.h2d_seconds,
                "pinned_buffers": self.pinned_buffers}


def nbytes(result: Any) -> int:
    """The bytes of the arrays of a read's result (a dict of arrays, a list of them, runs)."""
    if isinstance(result, dict):
        return sum(v.nbytes for v in result.values() if isinstance(v, np.ndarray))
    if isinstance(result, list):
        return sum(nbytes(r) for r in result)
    n = getattr(result, "nbytes", 0)          # a result already on its way to a device
    return n if isinstance(n, int) else 0


def _readers(source: Any) -> list[Any]:
    inner = getattr(source, "sources", None)
    if isinstance(inner, (list, tuple)):
        return [r for s in inner for r in _readers(s)]
    reader = getattr(source, "reader", None)
    return [] if reader is None else [reader]


def storage_counters(source: Any) -> dict[str, float]:
    """What object storage has cost ``source``'s readers in this process (the fields above;
    empty when none reads from a URL)."""
    out: dict[str, float] = {}
    seen: set[int] = set()
    for reader in _readers(source):
        if id(reader) in seen:
            continue
        seen.add(id(reader))
        counters = getattr(reader, "io_counters", None)
        if counters is not None:
            got = counters()
        else:
            store = getattr(reader, "store", None)
            if store is None or not hasattr(store, "requests"):
                continue
            got = {"requests": store.requests, "bytes_fetched": store.bytes_fetched,
                   "bytes_transferred": getattr(store, "bytes_transferred", store.bytes_fetched),
                   "retries": getattr(store, "retries", 0), "throttled_seconds": getattr(store, "throttled_seconds", 0.0)}
        for key, value in got.items():
            out[key] = out.get(key, 0) + value
    if out:
        for key in _STORAGE:
            out.setdefault(key, 0)
    return out


def format_metrics(m: dict[str, float]) -> str:
    """One line for a training log: ``steps 120 | data 0.4% of 12.1 s, wait p50 0.02 ms p99
    0.9 ms max 31 ms | read-ahead 7/8 | 48.3 MB read | store 51 requests, 0 retries, 12.0 MB
    | h2d 0.10 ms a copy``."""
    def ms(s: float) -> str:
        return f"{s * 1e3:.2f} ms" if s < 0.1 else f"{s * 1e3:.0f} ms"
    parts = [f"steps {int(m.get('steps', 0))}"]
    if m.get("headspace"):
        parts[0] += " (headspace: replayed batches)"
    parts.append(f"data {100 * m.get('data_share', 0.0):.1f}% of {m.get('elapsed_seconds', 0.0):.1f} s, wait p50 "
                 f"{ms(m.get('wait_seconds_p50', 0.0))} p99 {ms(m.get('wait_seconds_p99', 0.0))} max "
                 f"{ms(m.get('wait_seconds_max', 0.0))}")
    if "read_ahead" in m:
        parts.append(f"read-ahead {int(m['read_ahead'])}/{int(m.get('read_ahead_target', 0))}")
    parts.append(f"{m.get('bytes_read', 0) / 1e6:.1f} MB read")
    if "requests" in m:
        parts.append(f"store {int(m['requests'])} requests, {int(m.get('retries', 0))} retries, "
                     f"{m.get('bytes_transferred', m.get('bytes_fetched', 0)) / 1e6:.1f} MB")
    if m.get("h2d_copies"):
        parts.append(f"h2d {ms(m['h2d_seconds'] / m['h2d_copies'])} a copy")
    return " | ".join(parts)


class PrometheusCollector:
    """A ``prometheus_client`` collector of a loader's :meth:`metrics` (read at each scrape,
    never per step): ``zerobatch_loader_<field>`` with the labels given (default the rank).

    Args:
        loader: any zerobatch loader.
        labels: constant labels (default ``{"rank": str(loader.rank)}``).
        prefix: the metric names' prefix.
    """

    def __init__(self, loader: Any, labels: dict[str, str] | None = None, prefix: str = "zerobatch_loader") -> None:
        self.loader = loader
        self.labels = dict(labels) if labels is not None else {"rank": str(getattr(loader, "rank", 0))}
        self.prefix = prefix

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        names, values = list(self.labels), list(self.labels.values())
        for key, value in self.loader.metrics().items():
            name = f"{self.prefix}_{key}"
            if key in COUNTERS:
                family: Any = CounterMetricFamily(name, f"zerobatch loader: {key}", labels=names)
            else:
                family = GaugeMetricFamily(name, f"zerobatch loader: {key}", labels=names)
            family.add_metric(values, float(value))
            yield family

    def describe(self) -> list[Any]:
        return []        # collected at each scrape (the fields depend on the source)


def serve_prometheus(loader: Any, port: int | None = None, addr: str = "0.0.0.0", *, registry: Any = None,
                     labels: dict[str, str] | None = None) -> Any:
    """Publish ``loader.metrics()`` on an HTTP endpoint Prometheus scrapes (``/metrics``):
    port ``DEFAULT_PORT + LOCAL_RANK`` unless given (one endpoint per process of a host).
    Returns the registry it serves (a new one unless given).

    Raises:
        ImportError: without ``prometheus_client`` (``pip install 'zerobatch-adapters[metrics]'``).
    """
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:
        raise ImportError("serve_prometheus needs prometheus_client: pip install 'zerobatch-adapters[metrics]'") from exc
    if port is None:
        port = DEFAULT_PORT + int(os.environ.get("LOCAL_RANK", "0") or 0)
    registry = CollectorRegistry() if registry is None else registry
    registry.register(PrometheusCollector(loader, labels))
    start_http_server(port, addr=addr, registry=registry)
    return registry


#: The clock the loaders time steps with.
clock = time.perf_counter
