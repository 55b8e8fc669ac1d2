"""Several hosts on one machine, for the fleet tests: Linux network namespaces the test makes
itself, wired to a bridge.

- a **bridge namespace** holds a Linux bridge at ``10.N.0.1/24`` (the object store listens
  there);
- each **host namespace** has one end of a veth pair as ``eth0`` at ``10.N.0.(10 + k)``, the
  other end on the bridge;
- the test's own (root) namespace gets a leg on the bridge too, at ``10.N.0.2``, where the
  counting proxy listens and from where the test uploads (the route exists only while the
  fleet does; ``N`` is drawn so that two fleets never share a subnet).

Processes run in a namespace through ``ip netns exec``. Every address is private and lives
only in namespaces and links the fixture made; :meth:`Fleet.close` deletes them all. Needs
root and ``ip`` (iproute2): :func:`fleet_or_skip` says why not where it cannot run.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
from typing import Any


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def fleet_or_skip() -> str | None:
    """Why a fleet cannot be made here (``None``: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    name = f"zbprobe{os.getpid()}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class Fleet:
    """A bridge namespace and host namespaces (see the module documentation).

    Args:
        hosts: host namespaces made now (:meth:`add_host` adds more).
    """

    def __init__(self, hosts: int) -> None:
        self.tag = f"{os.getpid() % 100000}{random.randrange(100):02d}"
        used = _ip("route").stdout
        for _ in range(100):
            n = random.randint(64, 250)
            if f"10.{n}.0." not in used:
                break
        self.net = f"10.{n}.0"
        self.bridge = f"zb{self.tag}b"
        self.hosts: list[str] = []
        self._links: list[str] = []
        self._procs: list[subprocess.Popen] = []
        try:
            _ip("netns", "add", self.bridge)
            _ip("-n", self.bridge, "link", "set", "lo", "up")
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "addr", "add", f"{self.net}.1/24", "dev", "br0")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            # the root namespace's leg
            root = f"zb{self.tag}r"
            _ip("link", "add", root, "type", "veth", "peer", "name", f"zb{self.tag}R")
            self._links.append(root)
            _ip("link", "set", f"zb{self.tag}R", "netns", self.bridge)
            _ip("-n", self.bridge, "link", "set", f"zb{self.tag}R", "master", "br0", "up")
            _ip("addr", "add", f"{self.net}.2/24", "dev", root)
            _ip("link", "set", root, "up")
            for _ in range(hosts):
                self.add_host()
        except BaseException:
            self.close()
            raise

    @property
    def server_address(self) -> str:
        """The bridge namespace's address (where the store listens)."""
        return f"{self.net}.1"

    @property
    def root_address(self) -> str:
        """The test's own address on the bridge (the proxy's)."""
        return f"{self.net}.2"

    def address(self, k: int) -> str:
        """Host ``k``'s address."""
        return f"{self.net}.{10 + k}"

    def add_host(self) -> int:
        """A new host namespace on the bridge; its number."""
        k = len(self.hosts)
        ns = f"zb{self.tag}h{k}"
        _ip("netns", "add", ns)
        self.hosts.append(ns)
        a, b = f"zb{self.tag}v{k}", f"zb{self.tag}p{k}"
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        _ip("link", "set", a, "netns", ns)
        _ip("link", "set", b, "netns", self.bridge)
        _ip("-n", ns, "link", "set", a, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.bridge, "link", "set", b, "master", "br0", "up")
        return k

    def wrap(self, ns: str) -> tuple[str, ...]:
        """The argv prefix that runs a command in namespace ``ns``."""
        return ("ip", "netns", "exec", ns)

    def run(self, k: int, argv: list[str], **kw: Any) -> subprocess.Popen:
        """Start ``argv`` on host ``k`` (its own process group: :meth:`kill` takes it whole)."""
        p = subprocess.Popen([*self.wrap(self.hosts[k]), *argv], start_new_session=True, **kw)
        self._procs.append(p)
        return p

    @staticmethod
    def kill(p: subprocess.Popen) -> None:
        """SIGKILL ``p`` and every process it started (a host lost at once)."""
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(30)

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                self.kill(p)
        for ns in [*self.hosts, self.bridge]:
            # processes left in a namespace (none should be) go with it
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        for link in self._links:
            _ip("link", "del", link, check=False)
        self.hosts = []
