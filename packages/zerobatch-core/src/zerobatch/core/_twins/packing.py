"""Document packing: the twin of ``_packing.pyx`` (the same plan, written for clarity)."""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
from zerobatch.formats.errors import ConfigError

__all__ = ["PACKING_ALGORITHMS", "pack_plan"]

PACKING_ALGORITHMS = ("concat", "first-fit", "best-fit")


def pack_plan(lengths: Any, capacity: int, buffer: int = 1024,
              algorithm: str = "best-fit") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows of ``capacity`` tokens filled with documents (see the compiled twin)."""
    if algorithm not in PACKING_ALGORITHMS:
        raise ConfigError(f"algorithm must be one of {PACKING_ALGORITHMS}, got {algorithm!r}", field="algorithm")
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or not 1 <= capacity <= 1 << 40:
        raise ConfigError(f"capacity must be a positive integer, got {capacity!r}", field="capacity")
    if isinstance(buffer, bool) or not isinstance(buffer, (int, np.integer)) or buffer < 1:
        raise ConfigError(f"buffer must be a positive integer, got {buffer!r}", field="buffer")
    lens = [int(x) for x in np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)]
    if any(x < 0 for x in lens):
        raise ConfigError("lengths: a document has a negative length", field="lengths")
    cap = int(capacity)
    rows: list[list[tuple[int, int, int]]] = []        # each row: (doc, offset, length) pieces
    if algorithm == "concat":
        row: list[tuple[int, int, int]] = []
        fill = 0
        for d, n in enumerate(lens):
            off = 0
            while off < n:
                take = min(n - off, cap - fill)
                row.append((d, off, take))
                off += take
                fill += take
                if fill == cap:
                    rows.append(row)
                    row, fill = [], 0
        if row:
            rows.append(row)
    else:
        for w0 in range(0, len(lens), int(buffer)):
            window = range(w0, min(len(lens), w0 + int(buffer)))
            rests = []
            for d in window:
                k = lens[d] // cap
                rows += [[(d, j * cap, cap)] for j in range(k)]
                if lens[d] - k * cap:
                    rests.append((d, k * cap, lens[d] - k * cap))
            if algorithm == "best-fit":
                rests.sort(key=lambda piece: -piece[2])            # stable: ties in document order
            bins: list[list[tuple[int, int, int]]] = []
            room: list[int] = []
            stacks: dict[int, list[int]] = {}                      # best-fit: bins by room, last in first
            rooms: list[int] = []                                  # the rooms with bins, sorted
            for piece in rests:
                n = piece[2]
                if algorithm == "first-fit":
                    b = next((i for i, r in enumerate(room) if r >= n), -1)
                else:
                    at = bisect.bisect_left(rooms, n)
                    b = -1
                    if at < len(rooms):
                        r = rooms[at]
                        b = stacks[r].pop()
                        if not stacks[r]:
                            del stacks[r]
                            rooms.pop(at)
                if b < 0:
                    b = len(bins)
                    bins.append([])
                    room.append(cap)
                bins[b].append(piece)
                room[b] -= n
                if algorithm == "best-fit" and room[b] > 0:
                    if room[b] not in stacks:
                        stacks[room[b]] = []
                        bisect.insort(rooms, room[b])
                    stacks[room[b]].append(b)
            rows += bins
    row_ptr = np.zeros(len(rows) + 1, np.int64)
    row_ptr[1:] = np.cumsum([len(r) for r in rows]) if rows else []
    flat = [piece for r in rows for piece in r]
    cols = np.array(flat, np.int64).reshape(-1, 3)
    return row_ptr, cols[:, 0].copy(), cols[:, 1].copy(), cols[:, 2].copy()
