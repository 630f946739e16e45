"""Validate a get_simultaneous request and plan where each tensor goes in the slot.

Everything a request could fail on for its own sake is decided here, before the manager
touches a slot: each dim must be a Python or numpy int or a 0-d integer tensor (never a bool,
whatever its container), and every byte count -- each tensor's span and the slot total --
must fit in int64, so a request no slot could ever hold is refused without releasing or
re-allocating anything.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["ALIGNMENT", "Region", "Layout", "round_up", "plan_layout"]

# Every region starts on a 256-byte boundary: the widest alignment a GPU kernel's vector
# loads or TMA descriptors ask of a base pointer, and a multiple of every dtype's itemsize.
ALIGNMENT = 256
_MAX_DIM = (1 << 63) - 1  # torch sizes are int64
_MAX_BYTES = _MAX_DIM  # and so are byte counts, offsets and numel

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


def _is_integer_scalar_array(dim: Any) -> bool:
    """A 0-d torch tensor or numpy array of an integer dtype (bool is not one)."""
    if isinstance(dim, torch.Tensor):
        return dim.dim() == 0 and not (
            dim.dtype == torch.bool or dim.is_floating_point() or dim.is_complex()
        )
    if isinstance(dim, np.ndarray):
        return dim.ndim == 0 and dim.dtype.kind in "iu"
    return False


def _check_dim(dim: Any, where: str) -> int:
    # bool is an int subclass and a bool tensor converts to 1: True must never mean 1.
    ok = (isinstance(dim, (int, np.integer)) and not isinstance(dim, (bool, np.bool_))) or (
        _is_integer_scalar_array(dim)
    )
    if not ok:
        raise TypeError(
            f"{where} must be an int (Python or numpy) or a 0-d integer tensor, got "
            f"{_describe(dim)}"
        )
    value = operator.index(dim)
    if value < 0:
        raise ValueError(f"{where} must be >= 0, got {value}")
    if value > _MAX_DIM:
        raise ValueError(f"{where} must fit in int64, got {value}")
    return value


def _check_pair(
    pair: Any, index: int, who: str = "get_simultaneous"
) -> tuple[tuple[int, ...], torch.dtype]:
    where = f"shapes_and_dtypes[{index}]"
    if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
        raise TypeError(f"{who}: {where} must be a (shape, dtype) pair, got {_describe(pair)}")
    shape, dtype = pair
    if not isinstance(shape, (tuple, list, torch.Size)):
        hint = f" (write ({shape!r},) for a 1-D shape)" if isinstance(shape, int) else ""
        raise TypeError(
            f"{who}: the shape of {where} must be a tuple, list or torch.Size of "
            f"ints, got {_describe(shape)}{hint}"
        )
    dims = tuple(
        _check_dim(d, f"{who}: dimension {i} of the shape of {where}")
        for i, d in enumerate(shape)
    )
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"{who}: the dtype of {where} must be a torch.dtype, got {_describe(dtype)}"
        )
    # torch multiplies sizes out (numel, strides) before it sees a zero, so a zero-size shape
    # whose other dims overflow int64 would still fail inside torch: refuse it here, by span.
    span = dtype.itemsize
    for d in dims:
        span *= max(d, 1)
    if span > _MAX_BYTES:
        raise ValueError(
            f"{who}: {where} (shape {dims}, {dtype}) spans {span} bytes counting its non-zero "
            f"dims, beyond int64 ({_MAX_BYTES}); no tensor can have that shape"
        )
    return dims, dtype


def plan_layout(shapes_and_dtypes: tuple[Any, ...], who: str = "get_simultaneous") -> Layout:
    """Validate every pair (raising TypeError/ValueError naming it) and lay the regions out.

    Each region is numel * itemsize bytes, rounded up to ALIGNMENT; offsets are the running
    sum from 0, so every call lays out from the start of the slot. `who` names the public
    call in error messages.
    """
    key = tuple(_check_pair(pair, i, who) for i, pair in enumerate(shapes_and_dtypes))
    regions = []
    offset = 0
    for dims, dtype in key:
        numel = 1
        for d in dims:
            numel *= d
        nbytes = numel * dtype.itemsize
        regions.append(Region(dims, dtype, offset, nbytes))
        offset += round_up(nbytes)
    if offset > _MAX_BYTES:
        raise ValueError(
            f"{who}: the request needs {offset} bytes in all (each region rounded up to "
            f"{ALIGNMENT}), beyond int64 ({_MAX_BYTES}); no slot can ever hold it"
        )
    return Layout(key, tuple(regions), offset)
