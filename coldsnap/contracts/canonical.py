"""Canonical JSON and its SHA-256: the byte form every digest in coldsnap is computed over.

Rules (shared with the golden corpus ``tests/fixtures/cross-language-v1.json``):

- UTF-8, no insignificant whitespace (``,`` and ``:`` separators only);
- object keys sorted by their UTF-16 code units (RFC 8785 order, so a Go or JavaScript
  implementation agrees even for keys outside the Basic Multilingual Plane);
- strings escaped minimally: ``"`` ``\\`` and control characters below U+0020 only, the latter as
  ``\\b \\f \\n \\r \\t`` or ``\\u00xx``; everything else is written as itself;
- integers only, within the signed 64-bit range (Go's int64; Unix nanoseconds need more than 2**53).
  Floats are refused:
  contracts carry durations in integer nanoseconds and sizes in bytes, and float formatting is the
  usual source of cross-language digest drift.
- duplicate keys cannot occur (Python dicts), and ``NaN``/``Infinity`` are refused.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["CanonicalJsonError", "canonical_json", "canonical_sha256", "parse_strict_json", "INT64_MIN", "INT64_MAX"]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


class CanonicalJsonError(ValueError):
    """A value has no canonical JSON form (a float, a non-string key, an unsafe integer...)."""


def _escape(text: str) -> str:
    out = []
    for ch in text:
        escaped = _SHORT_ESCAPES.get(ch)
        if escaped is not None:
            out.append(escaped)
        elif ch < " ":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _utf16_key(key: str) -> bytes:
    return key.encode("utf-16-be", "surrogatepass")


def _encode(value: Any, path: str, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise CanonicalJsonError(f"{path}: integer {value} is outside the signed 64-bit range")
        out.append(str(int(value)))
    elif isinstance(value, float):
        raise CanonicalJsonError(f"{path}: floats have no canonical form here; use integers")
    elif isinstance(value, str):
        out.append(_escape(value))
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for index, item in enumerate(value):
            if index:
                out.append(",")
            _encode(item, f"{path}[{index}]", out)
        out.append("]")
    elif isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise CanonicalJsonError(f"{path}: object key {key!r} is not a string")
        out.append("{")
        for index, key in enumerate(sorted(value, key=_utf16_key)):
            if index:
                out.append(",")
            out.append(_escape(key))
            out.append(":")
            _encode(value[key], f"{path}.{key}", out)
        out.append("}")
    else:
        raise CanonicalJsonError(f"{path}: {type(value).__name__} is not a JSON value")


def canonical_json(value: Any) -> bytes:
    """The canonical UTF-8 bytes of a JSON value (see the module docstring for the rules)."""
    out: list[str] = []
    _encode(value, "$", out)
    try:
        return "".join(out).encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate has no UTF-8 form
        raise CanonicalJsonError(f"string holds an unpaired surrogate at {exc.start}") from None


def canonical_sha256(value: Any) -> str:
    """Lower-case hex SHA-256 of :func:`canonical_json` of ``value``."""
    return hashlib.sha256(canonical_json(value)).hexdigest()


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def parse_strict_json(data: bytes | str) -> Any:
    """Parse JSON refusing duplicate keys and NaN/Infinity. Raises ValueError with a readable reason.

    Standard library only, like the rest of this module: a restore reads its artifact with it before
    pydantic is imported (:mod:`coldsnap.activation.early_restore`)."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(data, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
