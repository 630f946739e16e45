"""JSON-safe values for every report the project writes: JSON has no inf or nan, so a
non-finite float becomes null (the report says why elsewhere, e.g. in a note)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["finite_or_none", "json_safe"]


def finite_or_none(x: float | None) -> float | None:
    """`x` when it is a finite number, else None."""
    return None if x is None or not math.isfinite(x) else x


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float, in dicts, lists and tuples too, replaced by None
    (tuples become lists, as JSON has only arrays)."""
    if isinstance(value, float):
        return finite_or_none(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
