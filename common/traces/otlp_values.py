"""OTLP/JSON's field encodings, read into plain Python values: trace and span ids (hex or base64, as protobuf JSON
writes bytes), ``*TimeUnixNano`` (a string or an int), ``AnyValue`` and attribute lists (camelCase or snake_case
keys). What is malformed is kept as it came, or dropped: one producer's odd field loses no span."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

_HEX = re.compile(r"[0-9a-fA-F]+")


def normalise_id(value: Any, nbytes: int) -> str | None:
    """A trace (16 bytes) or span (8 bytes) id as lowercase hex; hex or base64 in; None if empty/zero."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        out = bytes(value).hex()
    else:
        text = str(value).strip()
        if not text:
            return None
        if _HEX.fullmatch(text) and len(text) == 2 * nbytes:
            out = text.lower()
        else:
            out = None
            for decode in (base64.b64decode, base64.urlsafe_b64decode):
                try:
                    raw = decode(text + "=" * (-len(text) % 4))
                except (binascii.Error, ValueError):
                    continue
                if len(raw) == nbytes:
                    out = raw.hex()
                    break
            if out is None:
                # Odd lengths (a producer that strips leading zeros): keep it usable, never crash.
                out = text.lower().zfill(2 * nbytes) if _HEX.fullmatch(text) and len(text) < 2 * nbytes \
                    else text.lower()
    return None if set(out) == {"0"} else out


def parse_nanos(value: Any) -> int:
    """A ``*TimeUnixNano`` field: a string or an int (or absent: 0)."""
    if value is None or value == "":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        try:
            return int(float(value))
        except (TypeError, ValueError, OverflowError):
            return 0


def _list(v: Any) -> list:
    return v if isinstance(v, list) else []


def _dict(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


def _pick(obj: dict, camel: str, snake: str | None = None, default: Any = None) -> Any:
    if not isinstance(obj, dict):
        return default
    if camel in obj:
        return obj[camel]
    if snake is not None and snake in obj:
        return obj[snake]
    return default


def parse_any_value(value: Any) -> Any:
    """An OTLP ``AnyValue`` as a Python value (protobuf JSON; camelCase or snake_case keys)."""
    if not isinstance(value, dict):
        return value
    for camel, snake in (("stringValue", "string_value"),):
        if camel in value or snake in value:
            return _pick(value, camel, snake)
    if "boolValue" in value or "bool_value" in value:
        v = _pick(value, "boolValue", "bool_value")
        return v if isinstance(v, bool) else str(v).lower() == "true"
    if "intValue" in value or "int_value" in value:
        v = _pick(value, "intValue", "int_value")
        try:
            return int(v)
        except (TypeError, ValueError):
            return v
    if "doubleValue" in value or "double_value" in value:
        v = _pick(value, "doubleValue", "double_value")
        try:
            return float(v)  # also "NaN", "Infinity", "-Infinity"
        except (TypeError, ValueError):
            return v
    if "arrayValue" in value or "array_value" in value:
        arr = _dict(_pick(value, "arrayValue", "array_value"))
        return [parse_any_value(v) for v in _list(arr.get("values"))]
    if "kvlistValue" in value or "kvlist_value" in value:
        kv = _dict(_pick(value, "kvlistValue", "kvlist_value"))
        return parse_attributes(_list(kv.get("values")))
    if "bytesValue" in value or "bytes_value" in value:
        v = _pick(value, "bytesValue", "bytes_value")
        try:
            return base64.b64decode(v).hex()
        except (binascii.Error, ValueError, TypeError):
            return v
    return None


def parse_attributes(items: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(items, dict):  # not OTLP, but a plain map: take it as is
        return {str(k): parse_any_value(v) for k, v in items.items()}
    for kv in _list(items):
        if isinstance(kv, dict) and "key" in kv:
            out[str(kv["key"])] = parse_any_value(kv.get("value"))
    return out
