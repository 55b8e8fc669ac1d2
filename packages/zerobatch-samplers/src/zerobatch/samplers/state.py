"""Loader and sampler state for an exact resume: small, explicit, JSON-able, validated.

A state is a plain ``dict`` of JSON types. It records the order (its kind, seed, the size of
the index space and the file's fingerprint) and the position (epoch, global positions
consumed in the epoch). Loading checks every field and raises
:class:`~zerobatch.formats.errors.StateError` naming the first one that does not fit: a state
from another dataset, another seed, another version or with a position out of range never
silently restarts from step 0.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from zerobatch.formats.errors import StateError
from zerobatch.formats.strict_json import loads_strict

__all__ = ["STATE_VERSION", "OrderState", "state_from_json", "state_to_json"]

#: Version of the state layout; a state of another version is refused.
STATE_VERSION = 2
#: Largest serialized state accepted (a state is a few hundred bytes).
MAX_STATE_BYTES = 1 << 16


def _int_field(d: dict[str, Any], name: str, *, minimum: int = 0, maximum: int = 2**64 - 1) -> int:
    if name not in d:
        raise StateError(f"{name}: missing from the saved state", field=name)
    v = d[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise StateError(f"{name}: must be an integer, got {v!r}", field=name)
    if not minimum <= v <= maximum:
        raise StateError(f"{name}: must be between {minimum} and {maximum}, got {v}", field=name)
    return v


@dataclasses.dataclass(frozen=True)
class OrderState:
    """Where a loader stands in a deterministic order.

    Attributes:
        kind: the order and source family (``"llmbatch/block-shuffle"``...).
        seed: the order's seed.
        epoch: the current epoch.
        consumed: global positions of the epoch delivered to the training loop (all ranks).
        num_items: size of the index space the order permutes.
        global_batch_size: positions consumed per step over all ranks (``world_size`` x the
            per-rank batch) when the state was saved.
        fingerprint: identity of the data (a file's build id), or ``""``.
        params: other parameters the order depends on (block size, shuffle, drop_last...),
            all of which must match on load.
    """

    kind: str
    seed: int
    epoch: int
    consumed: int
    num_items: int
    fingerprint: str = ""
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    global_batch_size: int = 1

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dictionary."""
        return {
            "zerobatch_state": STATE_VERSION,
            "kind": self.kind,
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "num_items": self.num_items,
            "global_batch_size": self.global_batch_size,
            "fingerprint": self.fingerprint,
            "params": dict(self.params),
        }

    @classmethod
    def from_dict(cls, d: Any) -> OrderState:
        """Parse and type-check a state dictionary (structure only; see :meth:`check_fits`).

        Raises:
            StateError: not a dict, another version, a missing field or a wrong type.
        """
        if not isinstance(d, dict):
            raise StateError(f"state: expected a dict, got {type(d).__name__}", field="state")
        version = d.get("zerobatch_state")
        if isinstance(version, bool) or version != STATE_VERSION:
            raise StateError(
                f"zerobatch_state: unsupported state version {version!r} (this release reads "
                f"{STATE_VERSION})", field="zerobatch_state")
        kind = d.get("kind")
        if not isinstance(kind, str):
            raise StateError(f"kind: must be a string, got {kind!r}", field="kind")
        fingerprint = d.get("fingerprint", "")
        if not isinstance(fingerprint, str):
            raise StateError(f"fingerprint: must be a string, got {fingerprint!r}", field="fingerprint")
        params = d.get("params", {})
        if not isinstance(params, dict):
            raise StateError(f"params: must be a dict, got {params!r}", field="params")
        return cls(
            kind=kind,
            seed=_int_field(d, "seed"),
            epoch=_int_field(d, "epoch", maximum=2**63 - 1),
            consumed=_int_field(d, "consumed", maximum=2**63 - 1),
            num_items=_int_field(d, "num_items", maximum=2**63 - 1),
            global_batch_size=_int_field(d, "global_batch_size", minimum=1, maximum=2**63 - 1),
            fingerprint=fingerprint,
            params=params,
        )

    def check_fits(self, expected: OrderState, *, max_consumed: int) -> None:
        """Check this (loaded) state against the sampler's own order: the same order, seed,
        number of items, data and parameters (the global batch may differ: see
        :mod:`zerobatch.samplers.schedule`).

        Args:
            expected: the sampler's state (its position is ignored).
            max_consumed: largest valid ``consumed``.

        Raises:
            StateError: naming the first field that differs or is out of range.
        """
        for name in ("kind", "seed", "num_items", "fingerprint"):
            got, want = getattr(self, name), getattr(expected, name)
            if got != want:
                raise StateError(
                    f"{name}: the saved state has {got!r} but this loader has {want!r}; it was "
                    f"saved for another order or dataset", field=name)
        for name, want in expected.params.items():
            got = self.params.get(name, None)
            if got != want or type(got) is not type(want):
                raise StateError(
                    f"{name}: the saved state has {got!r} but this loader has {want!r}",
                    field=name)
        extra = sorted(set(self.params) - set(expected.params))
        if extra:
            raise StateError(f"{extra[0]}: unknown parameter in the saved state", field=extra[0])
        if self.consumed > max_consumed:
            raise StateError(
                f"consumed: the saved state has consumed {self.consumed} positions but the "
                f"epoch holds {max_consumed}: a step beyond the epoch", field="consumed")


def state_to_json(state: dict[str, Any]) -> str:
    """Serialize a state dict (strict JSON: no NaN or infinity)."""
    return json.dumps(state, allow_nan=False, sort_keys=True)


def state_from_json(text: str | bytes) -> dict[str, Any]:
    """Parse a serialized state: size-capped, duplicate keys, ``NaN`` and ``Infinity`` refused.

    Raises:
        StateError: too large, invalid UTF-8 or JSON, duplicate keys, non-finite numbers.
    """
    if len(text) > MAX_STATE_BYTES:
        raise StateError(f"state: {len(text)} bytes exceeds the limit of {MAX_STATE_BYTES}", field="state")
    value = loads_strict(text, error=StateError, field="state")
    if not isinstance(value, dict):
        raise StateError("state: expected a JSON object", field="state")
    return value
