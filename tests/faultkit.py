"""A structure-aware fault harness for every format (issue 17), written from the specs.

For a canonical dataset of a format it produces mutants: each file (and folder) replaced by
each kind of thing that is not what the spec says (a folder, a FIFO, a socket, an empty file,
a symlink loop, a link to ``/dev/zero``, a dangling link), each file swapped for the same
file of another dataset of the same layout, and header / manifest fields set to their
boundary values (re-hashed, so only the value lies). Each mutant is run through the
format's reader (open, read everything, verify) and, where the format has one, the
writer's open path, under a SIGALRM watchdog: a hang is an outcome like any other.

Outcomes: ``typed`` (a ``ZerobatchError``), ``identical`` (everything read equals the
pristine dataset), or anything else, recorded with its repr (``other`` and ``hang``), which
a test requires to be empty.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerobatch.formats.errors import ZerobatchError

__all__ = ["KINDS", "Outcomes", "mutate", "run_case", "swapped"]

#: Seconds a case may take before it counts as a hang.
WATCHDOG = 10


class _Hang(BaseException):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang()


@contextlib.contextmanager
def _chdir(path: str) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _make_socket(p: str) -> None:
    # AF_UNIX paths are limited to ~108 bytes: bind the bare name from inside the folder
    with _chdir(os.path.dirname(p)):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(os.path.basename(p))
        s.close()


#: What a file or folder can be replaced by.
KINDS: dict[str, Callable[[str], None]] = {
    "folder": os.mkdir,
    "fifo": os.mkfifo,
    "socket": _make_socket,
    "empty file": lambda p: open(p, "wb").close(),
    "symlink loop": lambda p: os.symlink(os.path.basename(p), p),
    "link to /dev/zero": lambda p: os.symlink("/dev/zero", p),
    "dangling link": lambda p: os.symlink(p + ".nowhere", p),
}


@contextlib.contextmanager
def _replaced(path: Path, make: Callable[[str], None]) -> Iterator[None]:
    """``path`` moved aside and ``make(path)`` put in its place for the block, then the
    original moved back."""
    p = str(path)
    aside = p + ".faultkit-orig"
    os.rename(p, aside)
    try:
        make(p)
        yield
    finally:
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)
        os.rename(aside, p)


def mutate(path: Path, kind: str) -> contextlib.AbstractContextManager[None]:
    """Replace ``path`` (a file or folder) by ``kind`` for the duration of the block."""
    return _replaced(path, KINDS[kind])


def swapped(path: Path, other: Path) -> contextlib.AbstractContextManager[None]:
    """``path`` replaced by a copy of ``other`` (the same file of another dataset)."""
    return _replaced(path, lambda p: shutil.copytree(other, p) if os.path.isdir(other) else shutil.copy2(other, p))


@dataclass
class Outcomes:
    """The outcome counts of one format's mutants."""

    typed: int = 0
    identical: int = 0
    other: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.typed + self.identical + len(self.other)

    def line(self, name: str) -> str:
        return f"{name}: {self.total} cases, {self.typed} typed, {self.identical} identical, {len(self.other)} other"


def run_case(out: Outcomes, label: str, action: Callable[[], Any], pristine: Any = None,
             compare: bool = True) -> None:
    """Run ``action`` under the watchdog and count its outcome against ``pristine``."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(WATCHDOG)
    try:
        got = action()
    except ZerobatchError:
        out.typed += 1
        return
    except _Hang:
        out.other.append(f"{label}: hang (more than {WATCHDOG} s)")
        return
    except Exception as exc:  # noqa: BLE001 - what the harness is here to catch
        out.other.append(f"{label}: {type(exc).__name__}: {exc}")
        return
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if not compare or got == pristine:
        out.identical += 1
    else:
        out.other.append(f"{label}: read different data without an error")
