"""Document packing: the twin of ``_packing.pyx`` (the same plan, written for clarity)."""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
from zerobatch.formats.errors import ConfigError

__all__ = ["PACKING_ALGORITHMS", "flat_layout", "pack_plan", "pack_rows"]

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


def _c_array(a: Any, dtypes: tuple, ndim: int, name: str) -> None:
    if not isinstance(a, np.ndarray) or a.dtype not in dtypes or a.ndim != ndim or not a.flags.c_contiguous \
            or not a.flags.writeable:
        raise ConfigError(f"pack_rows: {name} must be a writable C-contiguous {ndim}-D array of "
                          f"{' or '.join(str(np.dtype(d)) for d in dtypes)}", field=name)


def pack_rows(flat: Any, piece_len: Any, piece_row: Any, seq_len: int, tokens: np.ndarray, segment_ids: np.ndarray,
              position_ids: np.ndarray, mask: np.ndarray, labels: np.ndarray | None = None,
              cu_seqlens: np.ndarray | None = None, pad_id: int = 0, ignore_id: int = -100,
              mask_boundaries: bool = True, label_values: Any = None) -> tuple[np.ndarray, int]:
    """Lay packed rows out (see the compiled twin)."""
    _c_array(tokens, (np.int64, np.int32), 2, "tokens")
    n, cap = tokens.shape
    _c_array(segment_ids, (np.int32,), 2, "segment_ids")
    _c_array(position_ids, (np.int64, np.int32), 2, "position_ids")
    _c_array(mask, (np.bool_, np.uint8), 2, "mask")
    for name, a in (("segment_ids", segment_ids), ("position_ids", position_ids), ("mask", mask)):
        if a.shape != (n, cap):
            raise ConfigError(f"pack_rows: {name} is {a.shape}, not {(n, cap)}", field=name)
    if labels is not None:
        _c_array(labels, (tokens.dtype,), 2, "labels")
        if labels.shape not in ((n, cap - 1), (n, cap)):
            raise ConfigError(f"pack_rows: labels is {labels.shape}, not {(n, cap - 1)} or {(n, cap)}", field="labels")
    f = np.ascontiguousarray(flat, dtype=tokens.dtype).reshape(-1)
    lv = None
    if label_values is not None:
        lv = np.ascontiguousarray(label_values, dtype=tokens.dtype).reshape(-1)
        if lv.size != f.size:
            raise ConfigError(f"pack_rows: label_values holds {lv.size} values, flat {f.size}", field="label_values")
    lens = np.ascontiguousarray(piece_len, dtype=np.int64).reshape(-1)
    rows = np.ascontiguousarray(piece_row, dtype=np.int64).reshape(-1)
    p = lens.size
    if rows.size != p:
        raise ConfigError("pack_rows: piece_len and piece_row differ in length", field="piece_row")
    if p and (lens.min() < 1 or rows.min() < 0 or rows.max() >= n or (np.diff(rows) < 0).any()
              or np.unique(rows).size != n or np.bincount(rows, weights=lens, minlength=n).max() > cap):
        raise ConfigError("pack_rows: the pieces do not lay out as rows (a row empty or over capacity, rows out "
                          "of order, or an empty piece)", field="piece_row")
    if (p == 0) != (n == 0) or int(lens.sum()) != f.size:
        raise ConfigError(f"pack_rows: flat holds {f.size} tokens, the pieces {int(lens.sum())}", field="flat")
    if not 0 <= seq_len <= cap or n * seq_len >= 2 ** 31:
        raise ConfigError(f"pack_rows: seq_len {seq_len} does not fit rows of {cap} (or int32 cu_seqlens)",
                          field="seq_len")
    if tokens.dtype == np.int32 and not (-2**31 <= pad_id < 2**31 and -2**31 <= ignore_id < 2**31):
        raise ConfigError("pack_rows: pad_id or ignore_id does not fit int32", field="pad_id")
    if cu_seqlens is None:
        cu_seqlens = np.empty(p + n + 1, np.int32)
    _c_array(cu_seqlens, (np.int32,), 1, "cu_seqlens")
    if cu_seqlens.size < p + n + 1:
        raise ConfigError(f"pack_rows: cu_seqlens holds {cu_seqlens.size}, needs {p + n + 1}", field="cu_seqlens")
    row_len = np.bincount(rows, weights=lens, minlength=n).astype(np.int64)
    m = np.arange(cap)[None, :] < row_len[:, None]
    tokens[...] = pad_id
    tokens[m] = f
    first = np.ones(p, bool)
    first[1:] = rows[1:] != rows[:-1]
    number = np.arange(p) - np.maximum.accumulate(np.where(first, np.arange(p), 0))
    at = np.cumsum(lens) - lens                                   # each piece's first token in flat
    segment_ids[...] = -1
    segment_ids[m] = np.repeat(number, lens)
    position_ids[...] = 0
    position_ids[m] = np.arange(f.size) - np.repeat(at, lens)
    mask[...] = m
    if labels is not None:
        values = tokens.copy()
        if lv is not None:
            values[m] = lv
        if labels.shape == (n, cap):
            # Hugging Face's layout: each token's own label, none at a piece's first token
            keep = m.copy()
            if mask_boundaries:
                keep[:, 1:] &= segment_ids[:, 1:] == segment_ids[:, :-1]
                keep[:, 0] = False
            labels[...] = np.where(keep, values, ignore_id)
        else:
            keep = m[:, 1:].copy()
            if mask_boundaries:
                keep &= segment_ids[:, 1:] == segment_ids[:, :-1]
            labels[...] = np.where(keep, values[:, 1:], ignore_id)
    # piece starts within their rows, and each row's padding start, inside the inputs
    in_row = at - np.repeat(np.cumsum(row_len) - row_len, np.bincount(rows, minlength=n))
    cuts = [rows[in_row < seq_len] * seq_len + in_row[in_row < seq_len]]
    padded = np.flatnonzero(row_len < seq_len)
    cuts.append(padded * seq_len + row_len[padded])
    cu = np.sort(np.concatenate(cuts + [np.array([n * seq_len])]))
    cu_seqlens[:cu.size] = cu
    return cu_seqlens[:cu.size], int(np.diff(cu).max()) if cu.size > 1 else 0


def flat_layout(tokens: Any, lengths: Any, position_ids: np.ndarray | None, labels: np.ndarray | None = None,
                ignore_id: int = -100) -> np.ndarray | None:
    """Positions and next-token labels of documents laid back to back (see the compiled twin)."""
    if not isinstance(tokens, np.ndarray) or tokens.dtype not in (np.int64, np.int32) or tokens.ndim != 1 \
            or not tokens.flags.c_contiguous:
        raise ConfigError("flat_layout: tokens must be a C-contiguous 1-D int64 or int32 array", field="tokens")
    if position_ids is not None:
        _c_array(position_ids, (np.int64, np.int32), 1, "position_ids")
        if position_ids.size != tokens.size:
            raise ConfigError(f"flat_layout: position_ids holds {position_ids.size}, not {tokens.size}",
                              field="position_ids")
    if labels is not None:
        _c_array(labels, (tokens.dtype,), 1, "labels")
        if labels.size != tokens.size:
            raise ConfigError(f"flat_layout: labels holds {labels.size}, not {tokens.size}", field="labels")
    if tokens.dtype == np.int32 and not -2**31 <= ignore_id < 2**31:
        raise ConfigError("flat_layout: ignore_id does not fit int32", field="ignore_id")
    lens = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
    if (lens.size and int(lens.min()) < 0) or int(lens.sum()) != tokens.size:
        raise ConfigError(f"flat_layout: lengths add up to {int(lens.sum())}, not the {tokens.size} tokens",
                          field="lengths")
    starts = np.cumsum(lens) - lens
    if position_ids is not None:
        position_ids[...] = np.arange(tokens.size) - np.repeat(starts, lens)
    if labels is not None:
        labels[:-1] = tokens[1:]
        ends = (starts + lens)[lens > 0]
        labels[ends - 1] = ignore_id
    return position_ids
