"""Argument checks shared by the split modules: every refusal names the argument and what it
got, before any work (a bare assert would name neither)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dbo.checks import as_int

__all__ = [
    "as_bool",
    "as_count",
    "as_int_array",
    "as_num_scheduled_tokens",
    "as_num_ubatches",
    "as_query_start_loc",
    "brief",
]


def as_count(name: str, value: Any) -> int:
    return as_int(name, value, minimum=0)


def as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def as_num_ubatches(value: Any) -> int:
    n = as_count("num_ubatches", value)
    if n < 2:
        raise ValueError(f"num_ubatches must be >= 2 to split, got {n}")
    return n


def as_int_array(name: str, values: Any) -> list[int]:
    """A 1-D integer sequence as Python ints (one host copy, so a device tensor syncs once)."""
    if isinstance(values, torch.Tensor):
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {values.dtype}")
        arr = values.detach().cpu().numpy()
    else:
        arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return [int(v) for v in arr.tolist()]


def as_query_start_loc(query_start_loc: Any) -> list[int]:
    name = "query_start_loc"
    values = as_int_array(name, query_start_loc)
    if not values:
        raise ValueError(f"{name} must have at least one entry (num_requests + 1), got none")
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    for i in range(len(values) - 1):
        if values[i + 1] < values[i]:
            raise ValueError(
                f"{name} must be non-decreasing, but entry {i + 1} ({values[i + 1]}) is "
                f"less than entry {i} ({values[i]})"
            )
    return values


def as_num_scheduled_tokens(num_scheduled_tokens: Any) -> list[int]:
    counts = as_int_array("num_scheduled_tokens", num_scheduled_tokens)
    for r, c in enumerate(counts):
        if c < 0:
            raise ValueError(f"num_scheduled_tokens[{r}] must be >= 0, got {c}")
    return counts


def brief(values: Sequence[int], keep: int = 3) -> str:
    """A list for an error message, its middle elided when long, so the message stays
    readable for any ubatch count."""
    if len(values) <= 2 * keep + 1:
        return str(list(values))
    head = ", ".join(map(str, values[:keep]))
    tail = ", ".join(map(str, values[-keep:]))
    return f"[{head}, ... {len(values) - 2 * keep} more ..., {tail}]"
