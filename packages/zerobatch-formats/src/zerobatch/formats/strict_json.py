"""Strict JSON for every small zerobatch document (manifests, saved states).

``json.loads`` lets a duplicate key win silently and accepts ``NaN`` and ``Infinity``;
:func:`loads_strict` refuses both, as well as invalid UTF-8 and nesting deep enough to
exhaust the stack, raising the caller's typed error. Callers cap the size before parsing.
"""

from __future__ import annotations

import json
from typing import Any

from zerobatch.formats.errors import ZerobatchError

__all__ = ["loads_strict"]


class _Refused(Exception):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Refused(f"{k}: duplicate key", k)
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise _Refused(f"{name} is not valid JSON", "")


def loads_strict(raw: str | bytes, *, error: type[ZerobatchError], field: str, path: Any = None) -> Any:
    """Parse ``raw`` (UTF-8 bytes or text) strictly.

    Args:
        raw: the document.
        error: the exception class to raise (``CorruptError``, ``StateError``...).
        field: the field named for errors not tied to one key (the document's name).
        path: the file, if any.

    Raises:
        error: invalid UTF-8 or JSON, a duplicate key (naming it), ``NaN`` / ``Infinity``,
            or nesting too deep.
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except _Refused as exc:
        raise error(f"{field}: {exc}", path=path, field=exc.field or field) from None
    except UnicodeDecodeError as exc:
        raise error(f"{field}: invalid UTF-8 ({exc})", path=path, field=field) from None
    except (ValueError, RecursionError) as exc:
        raise error(f"{field}: invalid JSON ({exc})", path=path, field=field) from None
