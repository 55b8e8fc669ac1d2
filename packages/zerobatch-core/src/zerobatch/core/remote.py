"""Object storage: the bytes of a dataset that lives at a URL (``s3://``, ``gs://``, ``az://``,
``http(s)://``), read by exact byte ranges and written object by object.

Built on obstore (the Rust ``object_store`` crate: S3 and S3-compatible stores, GCS, Azure
and HTTP behind one API, many ranged requests in flight, the GIL released while they run),
installed by the ``remote`` extra. It is imported here only, and only when a URL is opened, so
local users install and import nothing new.

:func:`open_store` is the one place a URL becomes a store: an :class:`ObjectStore` (obstore's
stores by URL), or the class registered for the URL's scheme (:func:`register_store`; a new
storage scheme is one class, as :class:`DirectoryStore`, a local folder served as an object
store, shows). :class:`ObjectStore` wraps one store and adds what the readers and writers need
of it:

- **Retries**: every request is retried with exponential backoff and full jitter (AWS's
  "exponential backoff and jitter") on throttling (429, 503 SlowDown), server errors,
  connection resets, timeouts and short bodies (a range answered with fewer bytes than asked
  for), up to a budget of attempts and seconds (:class:`RetryPolicy`); then a
  :class:`~zerobatch.formats.errors.ReadError` names the URL and the byte range. obstore's own
  retry loop is turned off so that one policy, with one budget, decides. A missing object
  is not retried (:class:`~zerobatch.formats.errors.NotFoundError`), nor are refused
  credentials.
- **Fork safety**: obstore's Rust runtime does not survive ``fork`` (tokio-rs/tokio#4301):
  a process forked after its parent made a request would hang on its first own request, so it
  gets a :class:`~zerobatch.formats.errors.ConfigError` naming the remedy instead (worker
  processes started with ``forkserver`` or ``spawn``; ``loader.dataloader()`` picks
  ``forkserver`` for datasets at URLs). A store pickled into such a worker makes its client
  there; a process forked before any request works normally.
- **No secret printed**: messages and ``repr`` name the URL without user information or
  query string (Azure SAS tokens, signed URLs), and never the ``storage_options``.
- **Counters**: requests made and bytes fetched (:attr:`ObjectStore.requests`,
  :attr:`ObjectStore.bytes_fetched`), for read-amplification figures.

Credentials and endpoints come from the standard places: the ``AWS_*`` environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``,
``AWS_ENDPOINT_URL`` for S3-compatible stores, ``AWS_PROFILE`` is not read), ``GOOGLE_*`` for
GCS, ``AZURE_*`` for Azure, or a ``storage_options`` mapping of obstore's configuration keys
(``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``, ``session_token``,
``skip_signature``, ``client_options``, ...). A plain-HTTP endpoint (a local S3 server) is
allowed without further options.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from zerobatch.formats.errors import ConfigError, NotFoundError, ReadError, TruncatedError, WriteError, scrub

__all__ = ["S3_GET_RATE", "SCHEMES", "DirectoryStore", "ObjectStore", "RequestBudget", "RequestBudgets", "RetryPolicy",
           "default_request_rate", "hosts_of_job", "prefix_of", "check_url", "is_url", "local_or_none",
           "local_path", "open_store", "redact", "register_store", "split_url"]

#: URL schemes opened through obstore (``file://`` URLs are local paths).
SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss", "adl", "http", "https")

_T = TypeVar("_T")

#: The process in which obstore's runtime was started (``None``: not yet); a process forked
#: from it cannot use obstore.
_RUNTIME_PID: int | None = None
_FORK_LOCK = threading.Lock()


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL (``scheme://...``: an object store's, a registered store's,
    or ``file://``) rather than a local path."""
    if not isinstance(path, str):
        return False
    scheme, sep, _ = path.partition("://")
    return bool(sep) and (scheme.lower() in SCHEMES + ("file",) or scheme.lower() in _STORES)


#: Stores of other schemes than the object stores obstore reaches from a URL: scheme ->
#: class (:func:`register_store`). A new storage scheme is one class, registered here.
_STORES: dict[str, type[ObjectStore]] = {}


def register_store(scheme: str, cls: type[ObjectStore]) -> None:
    """Serve URLs ``scheme://bucket/prefix`` with ``cls`` (an :class:`ObjectStore` whose
    ``_make_client`` returns another obstore store): every reader, writer and command that
    takes a URL then reads and writes there, through the one fetch and check path."""
    _STORES[scheme.lower()] = cls


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> ObjectStore:
    """The store of ``url``: the class registered for its scheme, else :class:`ObjectStore`
    (S3, GCS, Azure, HTTP through obstore). The one place a URL becomes a store.

    Raises:
        ConfigError: not a URL, user information in it, bad ``storage_options``.
    """
    scheme = str(url).partition("://")[0].lower()
    return _STORES.get(scheme, ObjectStore)(url, storage_options)


def local_path(path: Any) -> Any:
    """``file:///x`` as ``/x`` (percent-decoded); anything else unchanged."""
    if isinstance(path, str) and path[:7].lower() == "file://":
        authority = _authority(path)
        if authority not in ("", "localhost"):
            # the authority is not printed: it may be user information
            raise ConfigError("file URL: only local files (file:///path) are supported, not a host or user "
                              "information before the path", path="file://", field="path")
        return urllib.parse.unquote(urllib.parse.urlsplit(path).path)
    return path


def local_or_none(path: Any) -> str | None:
    """The local path ``path`` names (a path, or a ``file://`` URL), or ``None`` where it names
    an object in storage (read there by the reader, which checks it) or is not a path at all:
    the storage layer's one answer to "is there a local file to look at first"."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    raw = os.fspath(path)
    if isinstance(raw, bytes) or (is_url(raw) and raw[:7].lower() != "file://"):
        return None
    return str(local_path(raw))


def _authority(url: str) -> str:
    """What follows ``scheme://`` up to the first ``/``, ``?`` or ``#`` (``urlsplit``'s netloc),
    without ``urlsplit``'s port parsing: its error would quote the text after ``:``, which in
    ``s3://KEY:SECRET@bucket`` is a secret."""
    rest = url.partition("://")[2]
    return re.split(r"[/?#]", rest, maxsplit=1)[0]


#: What may stand between ``scheme://`` and the path: a bucket (S3, GCS), a container with an
#: optional ``@account`` (Azure's ``abfss://filesystem@account...``), or ``host[:port]``.
_BUCKET = re.compile(r"[A-Za-z0-9._\-]+\Z")
_CONTAINER = re.compile(r"[A-Za-z0-9._\-]+(@[A-Za-z0-9._\-]+)?\Z")
_HOST = re.compile(r"([A-Za-z0-9._~%\-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?\Z")
_AZURE = ("az", "azure", "abfs", "abfss", "adl")


def check_url(url: str, *, field: str = "path", what: str = "a dataset URL") -> None:
    """Refuse a URL whose part before the path is not a bucket, container or ``host[:port]``:
    above all user information (``s3://KEY:SECRET@bucket``, ``http://user:pw@host``), which
    obstore would take as a host or port (and quote in its errors). Credentials go in the
    environment or ``storage_options``. The message quotes no part of the refused text.

    Raises:
        ConfigError: naming ``field`` and the URL's scheme only.
    """
    scheme = url.partition("://")[0].lower()
    if scheme == "file":
        local_path(url)
        return
    authority = _authority(url)
    pattern = _HOST if scheme in ("http", "https") else _CONTAINER if scheme in _AZURE else _BUCKET
    if pattern.match(authority):
        return
    if "@" in url.split("?", 1)[0] or ":" in authority:
        why = ("holds user information (a name or secret before '@'): credentials in a URL are refused; give "
               "them in the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ...) or storage_options")
    else:
        why = "has no valid bucket or host[:port] after the scheme"
    raise ConfigError(f"{field}: {what} {why} (no part of it is printed)", path=f"{scheme}://", field=field)


def redact(url: str) -> str:
    """``url`` without user information, query string or fragment (they may hold secrets)."""
    if "://" not in url:
        return url            # a local path
    scheme, _, rest = scrub(url).partition("://")
    return f"{scheme}://{re.split(r'[?#]', rest.removeprefix('***@'), maxsplit=1)[0]}"


def split_url(url: str) -> tuple[str, str]:
    """``(root, key)``: the store's root URL (``s3://bucket``) and the path under it.

    Raises:
        ConfigError: user information or no valid bucket or host (:func:`check_url`).
    """
    check_url(url)
    p = urllib.parse.urlsplit(url)
    if p.scheme.lower() in ("http", "https"):
        return urllib.parse.urlunsplit((p.scheme, p.netloc, "", "", "")), p.path.strip("/")
    return f"{p.scheme}://{p.netloc}", p.path.strip("/")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How requests are retried: up to ``attempts`` tries in all, the ``k``-th retry after a
    delay drawn uniformly from ``[0, min(max_delay, base_delay * 2**k)]`` (full jitter), and
    none started after ``deadline`` seconds from the first try."""

    attempts: int = 10
    base_delay: float = 0.05
    max_delay: float = 5.0
    deadline: float = 120.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ConfigError(f"attempts must be a positive integer, got {self.attempts!r}", field="attempts")
        for name in ("base_delay", "max_delay", "deadline"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ConfigError(f"{name} must be a non-negative number of seconds, got {v!r}", field=name)

    def delay(self, retry: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.max_delay, self.base_delay * (2 ** min(retry, 30))))


#: S3's published request rate per partitioned prefix: GET and HEAD requests per second
#: ("at least 3,500 PUT/COPY/POST/DELETE or 5,500 GET/HEAD requests per second per
#: partitioned Amazon S3 prefix", AWS's S3 performance guidelines). Above it S3 answers
#: 503 SlowDown while it partitions.
S3_GET_RATE = 5500.0


def hosts_of_job() -> int:
    """The hosts of the job this process belongs to: ``WORLD_SIZE // LOCAL_WORLD_SIZE`` under
    torchrun (or any launcher that sets both), ``$SLURM_JOB_NUM_NODES`` under Slurm, else 1."""
    try:
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
        if world >= local >= 1:
            return max(1, world // local)
    except (KeyError, ValueError):
        pass
    try:
        return max(1, int(os.environ["SLURM_JOB_NUM_NODES"]))
    except (KeyError, ValueError):
        return 1


def default_request_rate() -> float | None:
    """Requests per second per prefix that one host may send: ``$ZEROBATCH_REQUEST_RATE``
    (``0``: no limit), else S3's published rate shared by the job's hosts
    (:data:`S3_GET_RATE` / :func:`hosts_of_job`), so a whole fleet stays under what one prefix
    serves."""
    value = os.environ.get("ZEROBATCH_REQUEST_RATE")
    if value is not None and value.strip():
        try:
            rate = float(value)
        except ValueError:
            raise ConfigError(f"ZEROBATCH_REQUEST_RATE must be a number of requests per second, got {value!r}",
                              field="ZEROBATCH_REQUEST_RATE") from None
        if not rate >= 0:
            raise ConfigError(f"ZEROBATCH_REQUEST_RATE must be >= 0, got {value!r}", field="ZEROBATCH_REQUEST_RATE")
        return rate or None
    return S3_GET_RATE / hosts_of_job()


class RequestBudget:
    """A token bucket of requests per second for one prefix of a store, shared by every
    process that opens the same state file (the processes of a host: it lives in their cache
    folder): ``rate`` requests a second on average, at most ``burst`` at once after a pause.

    A request takes its token before it is sent; when none is left, the token is reserved
    and the request waits for it (the bucket goes negative: waiting requests queue in order
    and the host's rate never exceeds ``rate``). With each host's ``rate`` its share of a
    prefix's limit (:func:`default_request_rate`) and ``burst`` one second of it, a whole
    fleet started or restarted at once sends at most the prefix's limit in any second, and
    its first requests are spread: a process that finds the bucket idle when it first takes
    from it starts it at a random level in ``[0, burst]`` when the job has several hosts. A
    throttled answer (503 SlowDown, 429) empties the bucket to ``-burst``: the whole host
    backs off, not only the request that was refused.

    The state (two doubles: level and time, on the system-wide monotonic clock) is updated
    under ``flock``; a process that cannot open the file keeps a bucket of its own. A process
    takes tokens from it 10 ms of ``rate`` at a time (at least one) and spends them locally,
    so a busy reader locks the file about once per hundred requests, not once per request.

    Args:
        path: the state file (created).
        rate: requests per second (> 0).
        burst: the bucket's size (default: one second of ``rate``, at least 1).
    """

    def __init__(self, path: str | None, rate: float, burst: float | None = None) -> None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ConfigError(f"rate must be a positive number of requests per second, got {rate!r}", field="rate")
        self.path, self.rate = path, float(rate)
        self.burst = max(1.0, float(self.rate if burst is None else burst))
        self.waited = 0.0                   # seconds this process's requests waited
        self._lock = threading.Lock()
        self._fd = -1
        self._pid = -1
        self._local = [self.burst, time.monotonic()]
        self._jitter = hosts_of_job() > 1
        self._lease = 0.0                   # tokens taken from the shared bucket, not spent yet
        self._chunk = max(1.0, self.rate / 100)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "rate": self.rate, "burst": self.burst}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["rate"], state["burst"])

    def _open(self) -> int:
        if self._pid != os.getpid():
            self._fd, self._pid = -1, os.getpid()
            if self.path is not None:
                try:
                    os.makedirs(os.path.dirname(self.path), exist_ok=True)
                    self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                except OSError:
                    self._fd = -1
        return self._fd

    def _update(self, change: Callable[[float, float], float]) -> float:
        """Apply ``change(level refilled to now, now) -> new level`` under the locks; the new
        level."""
        import fcntl
        import struct
        with self._lock:
            fd = self._open()
            now = time.monotonic()
            if fd < 0:
                level, stamp = self._local
                level = min(self.burst, level + (now - stamp) * self.rate)
                self._local = [change(level, now), now]
                return self._local[0]
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(fd, 16, 0)
                if len(raw) == 16:
                    level, stamp = struct.unpack("<dd", raw)
                    level = min(self.burst, level + max(0.0, now - stamp) * self.rate)
                else:
                    level = self.burst
                if self._jitter and level >= self.burst:    # this process's first take, idle bucket
                    level = self.burst * random.random()
                self._jitter = False
                level = change(level, now)
                os.pwrite(fd, struct.pack("<dd", level, now), 0)
                return level
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def take(self, n: int = 1) -> float:
        """Take ``n`` tokens, waiting for them when the bucket is short; the seconds waited."""
        with self._lock:
            if self._lease >= n:
                self._lease -= n
                return 0.0
            want = max(float(n), self._chunk) - self._lease
            self._lease = max(float(n), self._chunk) - n
        level = self._update(lambda level, now: level - want)
        if level >= 0:
            return 0.0
        wait = -level / self.rate
        time.sleep(wait)
        with self._lock:
            self.waited += wait
        return wait

    def penalize(self) -> None:
        """A throttled answer: the host backs off (the bucket emptied to ``-burst``, this
        process's unspent tokens dropped)."""
        with self._lock:
            self._lease = 0.0
        self._update(lambda level, now: min(level, -self.burst))


#: A shard name spread over prefixes starts with its tag: 1-4 hex digits and ``_``
#: (``TokenStreamWriter(spread=...)``); its objects count against that prefix's budget.
SPREAD_TAG = re.compile(r"^([0-9a-f]{1,4})_")


def prefix_of(key: str) -> str:
    """The prefix whose request budget object ``key`` (relative to a dataset's root) counts
    against: its spread tag (``3a`` for ``3a_shard-00001/tokens.bin``), else ``""`` (the
    dataset's root)."""
    m = SPREAD_TAG.match(key)
    return m.group(1) if m else ""


class RequestBudgets:
    """The :class:`RequestBudget` of each prefix of one store (:func:`prefix_of`), their
    state files in ``folder`` (a cache folder: shared by the processes of a host).

    Args:
        folder: where the state files live (``None``: each process its own buckets).
        root: the store's root URL (the files are named by it and the prefix).
        rate, burst: as for :class:`RequestBudget`.
    """

    def __init__(self, folder: str | None, root: str, rate: float, burst: float | None = None) -> None:
        self.folder, self.root, self.rate, self.burst = folder, root, float(rate), burst
        self._buckets: dict[str, RequestBudget] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "root": self.root, "rate": self.rate, "burst": self.burst}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"], state["root"], state["rate"], state["burst"])

    def bucket(self, key: str) -> RequestBudget:
        prefix = prefix_of(key)
        with self._lock:
            b = self._buckets.get(prefix)
            if b is None:
                path = None
                if self.folder is not None:
                    import hashlib
                    name = hashlib.sha1(f"{self.root}\n{prefix}".encode()).hexdigest()[:20]
                    path = os.path.join(self.folder, "budget", name)
                b = self._buckets[prefix] = RequestBudget(path, self.rate, self.burst)
            return b

    @property
    def waited(self) -> float:
        """Seconds this process's requests waited for their tokens."""
        with self._lock:
            buckets = list(self._buckets.values())
        return sum(b.waited for b in buckets)


class _ShortBody(Exception):
    """A body with fewer bytes than asked for (retried)."""

    def __init__(self, got: int = 0, want: int = 0) -> None:
        super().__init__(f"short body: {got} of {want} bytes")
        self.got, self.want = got, want


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise ConfigError("reading or writing a URL needs obstore: pip install 'zerobatch-readers[remote]' "
                          "(or 'obstore'; from a zerobatch checkout: pip install -c constraints.txt '.[remote]')",
                          field="path") from None
    return obstore


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    # obstore names the request's URI; drop any query string (a signature)
    out = []
    for word in line.split(" "):
        if "://" in word and "?" in word:
            word = word.split("?", 1)[0]
        out.append(word)
    return " ".join(out)[:400]


def _fatal(exc: BaseException) -> bool:
    """Errors a retry cannot heal: a missing object, refused credentials, bad configuration."""
    name = type(exc).__name__
    return isinstance(exc, (FileNotFoundError, PermissionError, ValueError, TypeError)) or name in (
        "PanicException", "PermissionDeniedError", "UnauthenticatedError", "UnknownConfigurationKeyError",
        "InvalidPathError", "NotSupportedError", "PreconditionError", "AlreadyExistsError", "NotFoundError")


def _throttled(exc: BaseException) -> bool:
    """A throttling answer: 503 SlowDown or 429 Too Many Requests."""
    text = str(exc)
    return any(w in text for w in ("SlowDown", "503", "429", "TooManyRequests", "Too Many Requests"))


def _check_endpoints(options: dict[str, Any]) -> None:
    """Refuse an endpoint URL with user information (``AWS_ENDPOINT_URL=http://KEY:SECRET@host``)
    at once: obstore would panic on every request, and each of the retries would print a
    backtrace."""
    named = [(f"storage_options[{k!r}]", v) for k, v in options.items() if isinstance(v, str) and "://" in v]
    named += [(k, v) for k, v in os.environ.items()
              if k.startswith(("AWS_", "AZURE_", "GOOGLE_", "OBJECT_STORE_")) and "ENDPOINT" in k and "://" in v]
    for name, value in named:
        scheme = value.partition("://")[0].lower()
        if scheme in ("http", "https") and not _HOST.match(_authority(value)):
            check_url(value, field=name, what="an endpoint URL")


class ObjectStore:
    """A folder of objects at a URL (see the module documentation).

    Args:
        url: ``s3://bucket/prefix``, ``gs://...``, ``az://...``, ``https://host/path``.
        storage_options: obstore configuration (credentials, ``endpoint``, ``region``,
            ``client_options``, ...); the environment is read as well.
        retry: the retry policy (default :class:`RetryPolicy`).

    Raises:
        ConfigError: not a URL, or obstore is missing.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 retry: RetryPolicy | None = None) -> None:
        if not is_url(url) or url[:7].lower() == "file://":
            raise ConfigError(f"not an object-store URL: {redact(str(url))!r}", field="path")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError("storage_options must be a dict of obstore configuration keys", field="storage_options")
        check_url(url)
        _check_endpoints(storage_options or {})
        self.root = url.rstrip("/")
        self.url = redact(self.root)
        self._options = dict(storage_options or {})
        self.retry = retry or RetryPolicy()
        self._client: Any = None
        self._pid = -1
        self._lock = threading.Lock()
        self._stats = [0, 0, 0, 0]   # requests, bytes fetched, retries, bytes transferred
        self._rng = random.Random()
        self.budgets: RequestBudgets | None = None
        _obstore()

    def limit(self, folder: str | None, rate: float | None = -1.0, burst: float | None = None) -> None:
        """Send requests within a budget per prefix (:class:`RequestBudgets`), shared with
        the processes whose ``folder`` is the same (a host's cache folder). ``rate``: requests
        per second per prefix for this host (default :func:`default_request_rate`; ``None`` or
        0: no limit)."""
        if rate is not None and rate < 0:
            rate = default_request_rate()
        self.budgets = RequestBudgets(folder, self.root, rate, burst) if rate else None

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        # pickled into spawned workers: the options travel (they are needed there), the
        # client does not
        return {"root": self.root, "options": self._options, "retry": self.retry, "budgets": self.budgets}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["root"], state["options"], retry=state["retry"])
        self.budgets = state.get("budgets")

    # -- the client -----------------------------------------------------------------------

    def _make_client(self) -> Any:
        from obstore.store import from_url
        opts = dict(self._options)
        client = dict(opts.pop("client_options", None) or {})
        endpoint = opts.get("endpoint") or (os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
                                            if self.root.lower().startswith(("s3://", "s3a://")) else None)
        if (endpoint and str(endpoint).startswith("http://")) or self.root.lower().startswith("http://"):
            client.setdefault("allow_http", True)
        # one retry policy (ours) decides; obstore's own loop would multiply the attempts
        opts.setdefault("retry_config", {"max_retries": 0})
        try:
            return from_url(self.root, client_options=client or None, **opts)
        except BaseException as exc:  # pyo3 raises PanicException (a BaseException) on bad keys
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            keys = sorted(self._options)
            raise ConfigError(f"cannot open the store: {_first_line(exc)} (storage_options keys: {keys})",
                              path=self.url, field="storage_options") from None

    @property
    def client(self) -> Any:
        """The obstore store, made in this process.

        Raises:
            ConfigError: this process was forked from one that had used obstore: its Rust
                runtime's threads did not survive the fork, and any request would hang
                forever (tokio-rs/tokio#4301). Start such workers with ``spawn`` or
                ``forkserver`` (``loader.dataloader()`` does).
        """
        global _RUNTIME_PID
        pid = os.getpid()
        if self._client is None or self._pid != pid:
            with _FORK_LOCK:
                if _RUNTIME_PID is not None and _RUNTIME_PID != pid:
                    raise ConfigError(
                        "this process was forked after the object-storage client had run in its parent; "
                        "obstore's runtime does not survive fork (a request would hang): start worker "
                        "processes with multiprocessing_context='forkserver' or 'spawn' (zerobatch's "
                        "loader.dataloader() does so for datasets at URLs)", path=self.url,
                        field="multiprocessing_context")
                if self._client is None or self._pid != pid:
                    self._client = self._make_client()
                    self._pid = pid
                    _RUNTIME_PID = pid
        return self._client

    def name(self, key: str) -> str:
        """The URL of ``key`` (for messages)."""
        return f"{self.url}/{key}" if key else self.url

    @property
    def requests(self) -> int:
        """Requests made (retries included)."""
        return self._stats[0]

    @property
    def bytes_fetched(self) -> int:
        """Bytes of the objects and ranges asked for and received (see
        :attr:`bytes_transferred` for the gaps of merged requests)."""
        return self._stats[1]

    @property
    def retries(self) -> int:
        """Attempts made again after a failed one (a throttled, reset or short answer)."""
        return self._stats[2]

    @property
    def throttled_seconds(self) -> float:
        """Seconds this process's requests waited for the per-prefix request budgets."""
        return 0.0 if self.budgets is None else self.budgets.waited

    @property
    def bytes_transferred(self) -> int:
        """Bytes that crossed the network: :attr:`bytes_fetched` and the gaps between ranges
        that obstore merged into one request (``coalesce``), fetched and dropped."""
        return self._stats[3]

    def _count(self, requests: int, nbytes: int, transferred: int | None = None) -> None:
        with self._lock:
            self._stats[0] += requests
            self._stats[1] += nbytes
            self._stats[3] += nbytes if transferred is None else transferred

    # -- the retry loop -------------------------------------------------------------------

    def _call(self, what: str, key: str, field: str, fn: Callable[[], _T], *, write: bool = False,
              cost: int = 1) -> _T:
        policy = self.retry
        t0 = time.monotonic()
        last: BaseException | None = None
        tries = 0
        budget = None if self.budgets is None or write else self.budgets.bucket(key)
        for attempt in range(policy.attempts):
            if attempt:
                time.sleep(policy.delay(attempt - 1, self._rng))
                if time.monotonic() - t0 > policy.deadline:
                    break
                with self._lock:
                    self._stats[2] += 1
            tries += 1
            if budget is not None:
                budget.take(cost)
            try:
                return fn()
            except _ShortBody as exc:
                last = exc
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, SystemExit, ConfigError, MemoryError, _TooLarge)):
                    raise
                if isinstance(exc, FileNotFoundError):
                    raise NotFoundError(f"{what}: no such object", path=self.name(key), field=field) from None
                if _fatal(exc):
                    cls = WriteError if write else ReadError
                    raise cls(f"{what}: {_first_line(exc)}", path=self.name(key), field=field) from None
                if budget is not None and _throttled(exc):
                    budget.penalize()
                last = exc
        if isinstance(last, _ShortBody) and not write:
            raise TruncatedError(f"{what}: the object ended early on every one of {tries} tries ({last.got} of "
                                 f"{last.want} bytes): it is shorter than its dataset says", path=self.name(key),
                                 field=field) from None
        cls = WriteError if write else ReadError
        raise cls(f"{what}: failed after {tries} tries in {time.monotonic() - t0:.1f} s: {_first_line(last)}",
                  path=self.name(key), field=field) from None

    # -- reads ----------------------------------------------------------------------------

    def get(self, key: str, *, limit: int, field: str = "object") -> bytes:
        """The whole object ``key`` (at most ``limit`` bytes).

        Raises:
            NotFoundError: no such object.
            LimitExceededError-like ReadError: larger than ``limit``.
            ReadError: the request failed after the retry budget.
        """
        obs = _obstore()

        def once() -> bytes:
            result = obs.get(self.client, key)
            size = int(result.meta["size"])
            if size > limit:
                raise _TooLarge(size)
            data = bytes(result.bytes())
            self._count(1, len(data))
            if len(data) != size:
                raise _ShortBody(len(data), size)
            return data
        try:
            return self._call("GET", key, field, once)
        except _TooLarge as exc:
            from zerobatch.formats.errors import LimitExceededError
            raise LimitExceededError(f"{field}: {exc.size} bytes exceeds the limit of {limit}", path=self.name(key),
                                     field=field) from None

    def get_ranges(self, key: str, starts: Sequence[int], stops: Sequence[int], *,
                   field: str = "bytes", coalesce: int | None = None) -> list[memoryview]:
        """Bytes ``[starts[i], stops[i])`` of object ``key``, each exactly (many requests in
        flight; ranges at most ``coalesce`` bytes apart, default :data:`COALESCE_BYTES`, are
        fetched by one request, the gap fetched and dropped).

        Raises:
            TruncatedError: the object ends before a range does (it is shorter than its
                manifest says).
            ReadError: a request failed after the retry budget (naming the byte range).
        """
        if not len(starts):
            return []
        obs = _obstore()
        starts, stops = [int(a) for a in starts], [int(b) for b in stops]
        want = sum(b - a for a, b in zip(starts, stops, strict=True))
        span = f"bytes [{min(starts)}, {max(stops)})"
        gap = COALESCE_BYTES if coalesce is None else int(coalesce)

        def once() -> list[memoryview]:
            parts = obs.get_ranges(self.client, key, starts=starts, ends=stops, coalesce=gap)
            out = [memoryview(p) for p in parts]
            got = sum(len(p) for p in out)
            requests, sent = _spans(starts, stops, gap)
            # the ranges' bytes; and what crossed the network: the merged requests' gaps too
            self._count(requests, got, sent if got == want else got)
            if got != want or any(len(p) != b - a for p, a, b in zip(out, starts, stops, strict=True)):
                raise _ShortBody(got, want)
            return out
        return self._call("GET", key, span, once, cost=_requests(starts, stops, gap))

    def get_range(self, key: str, start: int, stop: int) -> memoryview:
        """Bytes ``[start, stop)`` of object ``key`` (see :meth:`get_ranges`)."""
        return self.get_ranges(key, [start], [stop])[0]

    def head(self, key: str) -> int | None:
        """The size of object ``key``, or ``None`` when there is none."""
        obs = _obstore()

        def once() -> int:
            self._count(1, 0)
            return int(obs.head(self.client, key)["size"])
        try:
            return self._call("HEAD", key, "object", once)
        except NotFoundError:
            return None

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        """``(key, size)`` of every object under ``prefix`` (keys relative to the store)."""
        obs = _obstore()

        def once() -> list[tuple[str, int]]:
            out = []
            for batch in obs.list(self.client, prefix or None):
                self._count(1, 0)
                out += [(o["path"], int(o["size"])) for o in batch]
            return out
        return self._call("LIST", prefix, "prefix", once)

    # -- writes ---------------------------------------------------------------------------

    def put(self, key: str, data: Any, *, size: int | None = None) -> None:
        """Write object ``key`` from bytes or a local file path (large files go up in
        parts, obstore's multipart upload); the object appears whole or not at all.
        ``size``: a file's first ``size`` bytes only (a file grown in sparse steps)."""
        obs = _obstore()

        def prefix(f: Any, n: int) -> Iterator[bytes]:
            while n > 0:
                piece = f.read(min(n, PART_BYTES))
                if not piece:
                    raise _ShortBody(0, n)      # the file is shorter than said
                n -= len(piece)
                yield piece

        def once() -> None:
            if isinstance(data, (str, os.PathLike)):
                with open(data, "rb") as f:
                    body = f if size is None else prefix(f, size)
                    obs.put(self.client, key, body, chunk_size=PART_BYTES, max_concurrency=8)
            else:
                obs.put(self.client, key, bytes(data) if not isinstance(data, bytes) else data)
            self._count(1, 0)
        self._call("PUT", key, "object", once, write=True)

    def delete(self, key: str) -> None:
        """Remove object ``key`` (nothing when there is none)."""
        obs = _obstore()

        def once() -> None:
            self._count(1, 0)
            try:
                obs.delete(self.client, key)
            except FileNotFoundError:
                pass
        self._call("DELETE", key, "object", once, write=True)


class DirectoryStore(ObjectStore):
    """A local folder served as an object store: ``dir://bucket/prefix`` with
    ``storage_options={"root": folder}`` holds its objects under ``folder/bucket/prefix``
    (obstore's ``LocalStore``). Readers treat it as any object store (sparse copies in the
    cache, ranges checked against the dataset's digests, the retry budget and counters), so
    it is a storage backend without a server: a test double for the remote paths, and a way
    to read a dataset on a mounted filesystem as if it were remote.

    Args:
        url: ``dir://bucket/prefix``.
        storage_options: ``{"root": folder}`` (required).
    """

    scheme = "dir"

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 retry: RetryPolicy | None = None) -> None:
        root = (storage_options or {}).get("root") if isinstance(storage_options, dict) else None
        if not isinstance(root, (str, os.PathLike)) or not os.path.isdir(root):
            raise ConfigError("storage_options['root']: a dir:// store needs the folder that holds its buckets",
                              path=redact(str(url)), field="storage_options")
        super().__init__(url, storage_options, retry=retry)

    def __repr__(self) -> str:
        return f"DirectoryStore({self.url!r})"

    def _make_client(self) -> Any:
        from obstore.store import LocalStore
        bucket, _, prefix = self.root.partition("://")[2].partition("/")
        folder = os.path.join(os.fspath(self._options["root"]), bucket, *[p for p in prefix.split("/") if p])
        return LocalStore(folder, mkdir=True)

    @property
    def client(self) -> Any:
        # a local folder has no runtime to lose in a fork: a client per process, always
        pid = os.getpid()
        if self._client is None or self._pid != pid:
            self._client, self._pid = self._make_client(), pid
        return self._client


register_store(DirectoryStore.scheme, DirectoryStore)


class _TooLarge(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


#: Ranges of one object less than this far apart are fetched by one request (the gap's bytes
#: are fetched and dropped). 64 KiB cost 1.90 bytes fetched per byte delivered on shuffled
#: 4 KiB windows, 16 KiB 1.48, 4 KiB 1.40 with one request more per step
#: (tools/bench_remote_peers.py). A caller with small ranges spread over an object (pages of
#: digests) passes a smaller gap (``get_ranges(coalesce=)``).
COALESCE_BYTES = 16 << 10
#: Part size of multipart uploads.
PART_BYTES = 16 << 20


def _requests(starts: list[int], stops: list[int], coalesce: int = COALESCE_BYTES) -> int:
    """The requests obstore makes for these ranges (those at most ``coalesce`` bytes apart
    are merged)."""
    return _spans(starts, stops, coalesce)[0]


def _spans(starts: list[int], stops: list[int], coalesce: int = COALESCE_BYTES) -> tuple[int, int]:
    """``(requests, bytes)`` obstore asks the store for, for these ranges: those at most
    ``coalesce`` bytes apart are merged into one request, their gaps fetched too."""
    pairs = sorted(zip(starts, stops, strict=True))
    n, total, first, end = 0, 0, 0, -1 - coalesce
    for a, b in pairs:
        if a - end > coalesce:
            if n:
                total += end - first
            n += 1
            first = a
            end = b
        else:
            end = max(end, b)
    if n:
        total += end - first
    return n, total
