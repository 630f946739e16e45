"""Argument checks shared by the runtime, the simulator and the workspace: one wording for
every integer argument."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

# vLLM's words for the common bounds, so handlers and tests matching them keep working.
_WORDS = {0: " (non-negative)", 1: " (at least one)"}


def as_int(name: str, value: Any, *, minimum: int = 0) -> int:
    """`value` as an int >= `minimum`; bools are refused because True passing as 1 hides a
    mix-up, and numpy/torch integer scalars pass through `operator.index`."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got a bool ({value!r})")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if count < minimum:
        raise ValueError(f"{name} must be >= {minimum}{_WORDS.get(minimum, '')}, got {count}")
    return count
