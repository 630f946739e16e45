"""Validate a get_simultaneous request and plan where each tensor goes in the slot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dbo._checks import as_int

__all__ = ["ALIGNMENT", "Region", "Layout", "round_up", "plan_layout"]

# Every region starts on a 256-byte boundary: the widest alignment a GPU kernel's vector
# loads or TMA descriptors ask of a base pointer, and a multiple of every dtype's itemsize.
ALIGNMENT = 256
_MAX_DIM = (1 << 63) - 1  # torch sizes are int64

Key = tuple[tuple[tuple[int, ...], torch.dtype], ...]


@dataclass(frozen=True, slots=True)
class Region:
    """One requested tensor: where it starts in the slot and how many bytes it really uses."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Layout:
    """A validated request: its normalised key, its regions, and the slot size it needs."""

    key: Key
    regions: tuple[Region, ...]
    total_bytes: int


def round_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _check_dim(dim: Any, where: str) -> int:
    value = as_int(where, dim)
    if value > _MAX_DIM:
        raise ValueError(f"{where} must fit in int64, got {value}")
    return value


def _check_pair(pair: Any, index: int) -> tuple[tuple[int, ...], torch.dtype]:
    where = f"shapes_and_dtypes[{index}]"
    if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
        raise TypeError(
            f"get_simultaneous: {where} must be a (shape, dtype) pair, got {_describe(pair)}"
        )
    shape, dtype = pair
    if not isinstance(shape, (tuple, list, torch.Size)):
        hint = f" (write ({shape!r},) for a 1-D shape)" if isinstance(shape, int) else ""
        raise TypeError(
            f"get_simultaneous: the shape of {where} must be a tuple, list or torch.Size of "
            f"ints, got {_describe(shape)}{hint}"
        )
    dims = tuple(
        _check_dim(d, f"get_simultaneous: dimension {i} of the shape of {where}")
        for i, d in enumerate(shape)
    )
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"get_simultaneous: the dtype of {where} must be a torch.dtype, got {_describe(dtype)}"
        )
    return dims, dtype


def plan_layout(shapes_and_dtypes: tuple[Any, ...]) -> Layout:
    """Validate every pair (raising TypeError/ValueError naming it) and lay the regions out.

    Each region is numel * itemsize bytes, rounded up to ALIGNMENT; offsets are the running
    sum from 0, so every call lays out from the start of the slot.
    """
    key = tuple(_check_pair(pair, i) for i, pair in enumerate(shapes_and_dtypes))
    regions = []
    offset = 0
    for dims, dtype in key:
        numel = 1
        for d in dims:
            numel *= d
        nbytes = numel * dtype.itemsize
        regions.append(Region(dims, dtype, offset, nbytes))
        offset += round_up(nbytes)
    return Layout(key, tuple(regions), offset)
