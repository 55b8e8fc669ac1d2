# Feistel permutation of [0, n): gfc's generalized Feistel cipher with Speck64/128 rounds.
#
# Contract (the C kernels are in _feistel.h, which states the construction in full)
#   FeistelPermutation(n, rounds, seed)
#     pre:  0 <= n <= 2**63 - 1, 0 <= rounds <= MAX_ROUNDS, 0 <= seed < 2**64 (checked here).
#     post: p[i] for i in [0, n) is a bijection of [0, n), identical to pygfc's
#           Permutation(n, rounds, seed) wherever gfc itself is a bijection (see _feistel.h);
#           O(1) memory: rounds * 108 bytes of round keys, expanded once.
#   Bulk calls (fill, take, slices) release the GIL for more than _GIL_FREE positions.
#   Kernel status: ZB_E_INDEX when a position is outside [0, n) -> IndexError.
#   random_draws(seed, first, n, out) / epoch_seed(seed, epoch): the counter-mode draws and
#     per-epoch keys of _feistel.h (pure functions of their arguments; never fail once checked).

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t, uint32_t, uint64_t

from zerobatch.core._status cimport ZB_OK

import numpy as np

from zerobatch.core.checks import check_count, check_out, check_position, check_seed, positions_and_out
from zerobatch.core.status import raise_for_status
from zerobatch.formats.errors import ConfigError, OutOfRangeError

__all__ = ["FeistelPermutation", "epoch_seed", "random_draws"]

#: Most Feistel rounds accepted (gfc's README uses 6; cryptographic use needs 8 to 16).
MAX_ROUNDS = 1024
#: Default round count: 6, as gfc's README and the Feistel shuffle write-ups use.
DEFAULT_ROUNDS = 6

cdef uint64_t _GIL_FREE = 256

#: Bulk paths by level (ZB_PATH_* in _feistel.h).
_PATHS = ("portable", "avx2", "avx512")


def available_paths():
    """The bulk paths this CPU runs, narrowest first (``"portable"`` always)."""
    return _PATHS[: zb_feistel_simd_available() + 1]


cdef class FeistelPermutation:
    """A pseudorandom permutation of ``range(n)`` computed on the fly in O(1) memory.

    ``p[i]`` is where position ``i`` goes, ``p.inverse(j)`` the position that goes to ``j``.
    The mapping is gfc's (``pygfc.Permutation(n, rounds, seed)``): Black and Rogaway's
    generalized Feistel cipher on an ``a x a`` grid, ``a = ceil(sqrt(n))``, with Speck64/128
    keyed by ``(seed, round)`` as the round function, cycle-walking back into ``[0, n)``.
    Unlike gfc it stays a bijection for every ``n`` up to ``2**63 - 1`` (exact integer
    square root, no 64-bit wrap in the round sum); see ``docs/samplers.md``.

    Args:
        n: size of the range, ``0 <= n <= 2**63 - 1``.
        rounds: Feistel rounds, ``0 <= rounds <= 1024`` (0 is the identity).
        seed: integer in ``[0, 2**64)``.

    Raises:
        ConfigError: an argument that is not an integer (``bool`` and floats included) or is
            out of range.
    """

    cdef zb_feistel f
    cdef readonly object n
    cdef readonly object rounds
    cdef readonly object seed

    def __cinit__(self, *args, **kwargs):
        self.f.keys = NULL

    def __init__(self, n, rounds=DEFAULT_ROUNDS, seed=0):
        n = check_count(n, "n")
        rounds = check_count(rounds, "rounds", maximum=MAX_ROUNDS)
        seed = check_seed(seed)
        cdef uint32_t *keys = <uint32_t *>PyMem_Malloc(max(rounds, 1) * ZB_SPECK_ROUNDS * sizeof(uint32_t))
        if keys == NULL:
            raise MemoryError()
        PyMem_Free(self.f.keys)
        self.f.keys = keys
        zb_feistel_setup(&self.f, n, rounds, seed)
        self.n, self.rounds, self.seed = n, rounds, seed

    def __dealloc__(self):
        PyMem_Free(self.f.keys)
        self.f.keys = NULL

    cdef inline void _ready(self) except *:
        if self.f.keys == NULL:
            raise ConfigError("FeistelPermutation.__init__ was not called", field="n")

    @property
    def side(self):
        """``a = ceil(sqrt(n))``: the Feistel network permutes ``[0, a*a)`` and cycle-walks."""
        return 0 if self.f.n == 0 else self.f.a

    @property
    def path(self):
        """The bulk path in use: ``"avx512"``, ``"avx2"`` or ``"portable"`` (same results)."""
        return _PATHS[self.f.simd]

    @property
    def simd(self):
        """Whether bulk calls take a vector path (AVX2 or AVX-512)."""
        return self.f.simd != 0

    def _use_path(self, name):
        """Choose the bulk path by name (tests compare them); only paths this CPU runs."""
        level = _PATHS.index(name) if name in _PATHS else -1
        if level < 0 or level > zb_feistel_simd_available():
            raise ConfigError(f"bulk path {name!r} is not available on this CPU (best: "
                              f"{_PATHS[zb_feistel_simd_available()]!r})", field="path")
        self.f.simd = level

    def _use_simd(self, flag):
        """The best vector path this CPU has (``True``) or the portable one (``False``)."""
        self.f.simd = zb_feistel_simd_available() if flag else 0

    def __len__(self):
        self._ready()
        return self.f.n

    cdef inline uint64_t _position(self, object i, str name) except? 0:
        if type(i) is int and 0 <= i < self.f.n:       # the common case, no call
            return <uint64_t>i
        return check_position(i, self.f.n, name)

    def __getitem__(self, i):
        """``p[i]``, or ``p[start:stop:step]`` as an ``int64`` array."""
        self._ready()
        if isinstance(i, slice):
            start, stop, step = i.indices(self.f.n)
            if step == 1:
                return self.range(start, max(start, stop))
            return self.take(np.arange(start, stop, step, dtype=np.int64))
        cdef uint64_t m = self._position(i, "position")
        return zb_feistel_encrypt(&self.f, m)

    def inverse(self, j):
        """The position ``i`` with ``p[i] == j``.

        Raises:
            IndexError: ``j`` outside ``[0, n)``.
        """
        self._ready()
        cdef uint64_t c = self._position(j, "value")
        return zb_feistel_decrypt(&self.f, c)

    def range(self, start, stop, *, inverse=False):
        """``p[start:stop]`` (or the inverse) as a new ``int64`` array."""
        self._ready()
        start = check_count(start, "start")
        stop = check_count(stop, "stop")
        if start > stop or stop > self.f.n:
            raise OutOfRangeError(f"range [{start}, {stop}) is not within [0, {self.f.n})")
        out = np.empty(stop - start, dtype=np.int64)
        self.fill(out, start, inverse=inverse)
        return out

    def fill(self, out, start=0, *, inverse=False):
        """Write ``p[start], p[start+1], ...`` (or the inverse) into ``out``, GIL released.

        Args:
            out: writable C-contiguous ``int64`` array; ``len(out)`` values are written.
            start: first position.
            inverse: write ``p.inverse(start + k)`` instead.

        Returns:
            ``out``.

        Raises:
            IndexError: ``start + len(out) > n``.
            ConfigError: ``out`` is not a writable contiguous ``int64`` array.
        """
        self._ready()
        if not isinstance(out, np.ndarray):
            raise ConfigError("out must be a C-contiguous int64 numpy array", field="out")
        check_out(out, out.size)
        cdef uint64_t s = check_count(start, "start")
        cdef uint64_t count = out.size
        if s > self.f.n or count > self.f.n - s:
            raise OutOfRangeError(f"positions [{s}, {s + count}) are not within [0, {self.f.n})")
        if count == 0:
            return out
        cdef int64_t[::1] dst = out.reshape(-1)
        cdef int inv = 1 if inverse else 0
        if count > _GIL_FREE:
            with nogil:
                zb_feistel_fill_range(&self.f, s, count, &dst[0], inv)
        else:
            zb_feistel_fill_range(&self.f, s, count, &dst[0], inv)
        return out

    def take(self, positions, out=None, *, inverse=False):
        """``p[positions]`` (or the inverse) for an integer array of positions, GIL released.

        Args:
            positions: integer array-like; its shape is kept.
            out: optional writable C-contiguous ``int64`` array of the same size (may be
                ``positions`` itself).
            inverse: map values back to positions instead.

        Returns:
            An ``int64`` array shaped like ``positions`` (``out`` when given).

        Raises:
            IndexError: a position outside ``[0, n)``.
            ConfigError: non-integer positions or an unfit ``out``.
        """
        self._ready()
        flat, out = positions_and_out(positions, out)
        cdef const int64_t[::1] pos = flat
        cdef uint64_t count = pos.shape[0]
        if count == 0:
            return out
        cdef int64_t[::1] dst = out.reshape(-1)
        cdef int inv = 1 if inverse else 0
        cdef int status
        if count > _GIL_FREE:
            with nogil:
                status = zb_feistel_map(&self.f, &pos[0], count, &dst[0], inv)
        else:
            status = zb_feistel_map(&self.f, &pos[0], count, &dst[0], inv)
        if status != ZB_OK:
            what = "value" if inverse else "position"
            raise_for_status(status, f"a {what} is outside [0, {self.f.n})", field=what)
        return out

    def __iter__(self):
        self._ready()
        cdef uint64_t start = 0, step = 65536
        buf = np.empty(0, dtype=np.int64)
        while start < self.f.n:
            count = min(step, self.f.n - start)
            buf = self.range(start, start + count)
            yield from buf.tolist()
            start += count

    def __reduce__(self):
        return (type(self), (self.n, self.rounds, self.seed))

    def __eq__(self, other):
        if not isinstance(other, FeistelPermutation):
            return NotImplemented
        return (self.n, self.rounds, self.seed) == (other.n, other.rounds, other.seed)

    def __hash__(self):
        return hash((FeistelPermutation, self.n, self.rounds, self.seed))

    def __repr__(self):
        return f"FeistelPermutation(n={self.n}, rounds={self.rounds}, seed={self.seed})"


def epoch_seed(seed, epoch):
    """The Feistel seed of ``epoch`` in a run seeded ``seed``: Speck64/128 of the epoch under
    the key ``(seed, "zbepch")``. Distinct epochs of one run always get distinct seeds.

    Raises:
        ConfigError: ``seed`` not in ``[0, 2**64)`` or ``epoch`` not in ``[0, 2**63)``.
    """
    cdef uint64_t s = check_seed(seed)
    cdef uint64_t e = check_count(epoch, "epoch")
    cdef uint32_t keys[27]
    zb_speck_expand(s, ZB_DOMAIN_EPOCH, keys)
    return zb_epoch_seed(keys, e)


def random_draws(seed, counters, n, out=None):
    """Draws number ``counters[i]`` of the uniform stream on ``[0, n)`` keyed by ``seed``.

    Draw ``c`` depends only on ``(seed, c, n)``: a 128-bit Speck64/128 counter-mode value
    scaled to ``[0, n)`` (bias below ``2**-65``), so any step of a sampler is computable
    without the steps before it. The GIL is released for large inputs.

    Args:
        seed: integer in ``[0, 2**64)``.
        counters: non-negative integer array-like (its shape is kept).
        n: size of the range, at least 1.
        out: optional writable C-contiguous ``int64`` array of the same size (may be
            ``counters``).

    Raises:
        ConfigError: ``n < 1``, a bad ``seed``, non-integer counters or an unfit ``out``.
        IndexError: a negative counter.
    """
    cdef uint64_t s = check_seed(seed)
    cdef uint64_t nn = check_count(n, "n", minimum=1)
    flat, out = positions_and_out(counters, out, "counters")
    cdef const int64_t[::1] ctr = flat
    cdef uint64_t count = ctr.shape[0]
    if count == 0:
        return out
    if np.min(ctr) < 0:
        raise OutOfRangeError("counters: a draw counter is negative")
    cdef int64_t[::1] dst = out.reshape(-1)
    cdef uint32_t k0[27]
    cdef uint32_t k1[27]
    zb_speck_expand(s, ZB_DOMAIN_DRAW_HI, k0)
    zb_speck_expand(s, ZB_DOMAIN_DRAW_LO, k1)
    if count > _GIL_FREE:
        with nogil:
            zb_random_draws(k0, k1, &ctr[0], count, nn, &dst[0])
    else:
        zb_random_draws(k0, k1, &ctr[0], count, nn, &dst[0])
    return out
