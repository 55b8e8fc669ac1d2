"""The Feistel permutation, epoch seeds and counter-mode draws: the twin of ``_feistel.pyx``,
in exact Python integers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from zerobatch.core.checks import (
    check_count,
    check_out,
    check_position,
    check_seed,
    positions_and_out,
)
from zerobatch.formats.errors import ConfigError, OutOfRangeError

__all__ = ["FeistelPermutation", "epoch_seed", "random_draws"]


# --------------------------------------------------------------------------------------
# Feistel permutation (twin of _feistel.pyx / _feistel.h), in exact Python integers.

_M32 = 0xFFFFFFFF
SPECK_ROUNDS = 27
FEISTEL_MAX_ROUNDS = 1024
FEISTEL_DEFAULT_ROUNDS = 6


def _ror32(x: int, r: int) -> int:
    return ((x >> r) | (x << (32 - r))) & _M32


def _rol32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _M32


def speck_expand(key_lo: int, key_hi: int) -> list[int]:
    """Speck64/128 round keys of the 128-bit key ``(key_lo, key_hi)`` (gfc's speck_expand)."""
    k = [key_lo & _M32, key_lo >> 32, key_hi & _M32, key_hi >> 32]
    b, a = k[0], k[1:]
    keys = [b]
    for i in range(SPECK_ROUNDS - 1):
        x = (_ror32(a[i % 3], 8) + b) & _M32
        x ^= i
        a[i % 3] = x
        b = _rol32(b, 3) ^ x
        keys.append(b)
    return keys


def speck_encrypt(keys: list[int], block: int) -> int:
    """Speck64/128 encryption of a 64-bit block (low word first)."""
    y, x = block & _M32, block >> 32
    for k in keys:
        x = ((_ror32(x, 8) + y) & _M32) ^ k
        y = _rol32(y, 3) ^ x
    return y | (x << 32)


def ceil_sqrt(n: int) -> int:
    """The least ``a >= 0`` with ``a * a >= n`` (exact, no floating point)."""
    r = math.isqrt(n)
    return r if r * r == n else r + 1


class FeistelPermutation:
    """Twin of :class:`zerobatch.core._feistel.FeistelPermutation` (see ``_feistel.h``)."""

    def __init__(self, n: Any, rounds: Any = FEISTEL_DEFAULT_ROUNDS, seed: Any = 0) -> None:
        self.n = check_count(n, "n")
        self.rounds = check_count(rounds, "rounds", maximum=FEISTEL_MAX_ROUNDS)
        self.seed = check_seed(seed)
        self._a = max(ceil_sqrt(self.n), 1)
        self._keys = [speck_expand(self.seed, j) for j in range(self.rounds)]

    @property
    def side(self) -> int:
        return 0 if self.n == 0 else self._a

    @property
    def path(self) -> str:
        return "portable"

    @property
    def simd(self) -> bool:
        return False

    def _use_path(self, name: str) -> None:
        if name != "portable":
            raise ConfigError(f"bulk path {name!r} is not available in the pure-Python twin", field="path")

    def _use_simd(self, flag: bool) -> None:
        pass

    def _fe(self, m: int) -> int:
        a = self._a
        left, right = m % a, m // a
        for keys in self._keys:
            left, right = right, (left + speck_encrypt(keys, right)) % a
        return a * left + right if self.rounds & 1 else a * right + left

    def _fe_inv(self, c: int) -> int:
        a = self._a
        if self.rounds & 1:
            left, right = c // a, c % a
        else:
            left, right = c % a, c // a
        for keys in reversed(self._keys):
            right, left = left, (right - speck_encrypt(keys, left)) % a
        return a * right + left

    def _encrypt(self, m: int) -> int:
        c = self._fe(m)
        while c >= self.n:
            c = self._fe(c)
        return c

    def _decrypt(self, c: int) -> int:
        m = self._fe_inv(c)
        while m >= self.n:
            m = self._fe_inv(m)
        return m

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(self.n)
            return self.take(np.arange(start, stop, step, dtype=np.int64))
        return self._encrypt(check_position(i, self.n, "position"))

    def inverse(self, j: Any) -> int:
        return self._decrypt(check_position(j, self.n, "value"))

    def range(self, start: Any, stop: Any, *, inverse: bool = False) -> np.ndarray:
        start = check_count(start, "start")
        stop = check_count(stop, "stop")
        if start > stop or stop > self.n:
            raise OutOfRangeError(f"range [{start}, {stop}) is not within [0, {self.n})")
        return self.fill(np.empty(stop - start, dtype=np.int64), start, inverse=inverse)

    def fill(self, out: Any, start: Any = 0, *, inverse: bool = False) -> np.ndarray:
        if not isinstance(out, np.ndarray):
            raise ConfigError("out must be a C-contiguous int64 numpy array", field="out")
        check_out(out, out.size)
        s = check_count(start, "start")
        if s + out.size > self.n:
            raise OutOfRangeError(f"positions [{s}, {s + out.size}) are not within [0, {self.n})")
        f = self._decrypt if inverse else self._encrypt
        flat = out.reshape(-1)
        for k in range(out.size):
            flat[k] = f(s + k)
        return out

    def take(self, positions: Any, out: Any = None, *, inverse: bool = False) -> np.ndarray:
        pos, out = positions_and_out(positions, out)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            what = "value" if inverse else "position"
            raise OutOfRangeError(f"a {what} is outside [0, {self.n})")
        f = self._decrypt if inverse else self._encrypt
        vals = [f(int(p)) for p in pos]
        out.reshape(-1)[:] = vals
        return out

    def __iter__(self) -> Any:
        return (self._encrypt(i) for i in range(self.n))

    def __reduce__(self) -> Any:
        return (type(self), (self.n, self.rounds, self.seed))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FeistelPermutation):
            return NotImplemented
        return (self.n, self.rounds, self.seed) == (other.n, other.rounds, other.seed)

    def __hash__(self) -> int:
        return hash((FeistelPermutation, self.n, self.rounds, self.seed))

    def __repr__(self) -> str:
        return f"FeistelPermutation(n={self.n}, rounds={self.rounds}, seed={self.seed})"


_DOMAIN_EPOCH = 0x7A62657063680000
_DOMAIN_DRAW_HI = 0x7A62647261770001
_DOMAIN_DRAW_LO = 0x7A62647261770002


def epoch_seed(seed: Any, epoch: Any) -> int:
    """Twin of :func:`zerobatch.core._feistel.epoch_seed`."""
    s = check_seed(seed)
    e = check_count(epoch, "epoch")
    return speck_encrypt(speck_expand(s, _DOMAIN_EPOCH), e)


def random_draws(seed: Any, counters: Any, n: Any, out: Any = None) -> np.ndarray:
    """Twin of :func:`zerobatch.core._feistel.random_draws`."""
    s = check_seed(seed)
    nn = check_count(n, "n", minimum=1)
    ctr, out = positions_and_out(counters, out, "counters")
    if ctr.size and ctr.min() < 0:
        raise OutOfRangeError("counters: a draw counter is negative")
    k0, k1 = speck_expand(s, _DOMAIN_DRAW_HI), speck_expand(s, _DOMAIN_DRAW_LO)
    vals = []
    for c in ctr.tolist():
        x = (speck_encrypt(k0, c) << 64) | speck_encrypt(k1, c)
        vals.append((x * nn) >> 128)
    out.reshape(-1)[:] = vals
    return out
