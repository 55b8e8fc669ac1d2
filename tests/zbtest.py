"""Helpers shared by the zerobatch tests (tests/ is on sys.path through pytest's pythonpath)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def seed_layout_bytes(tokens: np.ndarray, batch_size: int, seq_len: int, *, seed: int = 0,
                      total_records: int | None = None) -> bytes:
    """An LLMBATCH file exactly as the seed's spec writes it: header, zeros, padded batches,
    no zerobatch extension. ``tokens`` are the records, already in file order."""
    n = tokens.shape[0] // batch_size
    raw = batch_size * seq_len * 4
    padded = -(-raw // 4096) * 4096
    header = struct.pack("<8sIIIQIII", b"LLMBATCH", 1, batch_size, seq_len, n, 0, seed,
                         tokens.shape[0] if total_records is None else total_records)
    out = bytearray(header.ljust(4096, b"\0"))
    for b in range(n):
        block = tokens[b * batch_size:(b + 1) * batch_size].astype("<u4").tobytes()
        out += block.ljust(padded, b"\0")
    return bytes(out)


class SeedSpecReader:
    """A reader written from the seed's spec alone (offsets from the header, nothing else)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        (_, self.version, self.batch_size, self.seq_len, self.num_batches, self.dtype, self.seed,
         self.total_records) = struct.unpack_from("<8sIIIQIII", data, 0)
        raw = self.batch_size * self.seq_len * 4
        self.padded = -(-raw // 4096) * 4096

    def read_batch(self, i: int) -> np.ndarray:
        offset = 4096 + i * self.padded
        end = offset + self.batch_size * self.seq_len * 4
        return np.frombuffer(self.data[offset:end], dtype=np.uint32).reshape(self.batch_size, self.seq_len)


def records(n: int, seq_len: int, *, seed: int = 0, vocab: int = 50257) -> np.ndarray:
    """Distinct-looking random records: each row starts with its own index."""
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, vocab, size=(n, seq_len), dtype=np.uint32)
    arr[:, 0] = np.arange(n, dtype=np.uint32)
    return arr


def run_python(code: str, *, env: dict[str, str] | None = None, timeout: float = 120,
               cwd: str | None = None, script_dir: str | os.PathLike[str] | None = None
               ) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (same environment), capturing output.

    With ``script_dir`` the code is written to a file there and run as a script, which
    ``spawn`` and ``forkserver`` children need (they import ``__main__`` by path).
    """
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    code = textwrap.dedent(code)
    if script_dir is not None:
        script = Path(script_dir) / "zb_script.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        argv = [sys.executable, "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)


def token_stream(folder, n_tokens=4000, seed=0, metadata=False, offset=0):
    """A TOKSTREAM dataset whose token at global position p is ``p + offset`` (a window's
    first token names it), in documents of random lengths; returns ``(folder, documents)``."""
    from zerobatch.writers.tokstream import TokenStreamWriter
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, n_tokens), size=n_tokens // 60, replace=False))
    docs = np.split(np.arange(n_tokens) + offset, cuts)
    with TokenStreamWriter(folder, vocab_size=1 << 20, metadata=metadata, shard_tokens=900) as w:
        for k, d in enumerate(docs):
            w.add_document(d, {"doc": k} if metadata else None)
    return str(folder), docs


def take(batches, k, key):
    """``key(batch)`` of the first ``k`` batches of ``batches`` (all of them when ``k`` is None),
    stopping the iteration there, as a training loop interrupted at step ``k`` does."""
    out = []
    if k == 0:
        return out
    for batch in batches:
        out.append(key(batch))
        if k is not None and len(out) == k:
            break
    return out
