"""Byte footprints of strided tensors, and whether two footprints share a byte.

A footprint is (first byte, one past the last byte, run, dims): a dense tensor covers its
whole interval (dims ()); a strided one covers base + sum(i_k * stride_k) + [0, run) over its
(count, byte stride) dims, largest stride first. The overlap test is exact within a bounded
search and answers "may share" beyond it, so the race checker never misses a race.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Dims", "MEET_BUDGET", "canonical_footprint", "footprint", "footprints_meet"]

Dims = tuple[tuple[int, int], ...]  # (count, byte stride), largest stride first
# Search steps an exact strided-overlap test may take before it answers "may overlap": a
# bound on the cost per pair of entries that keeps the answer sound (never a missed race).
MEET_BUDGET = 512


def footprint(t: torch.Tensor) -> tuple[int, int, int, Dims] | None:
    """(first byte, one past the last byte, run, dims) of a strided tensor's elements in
    memory, by absolute address; None for an empty tensor. Dense tensors have dims () and
    cover every byte of the interval; otherwise the bytes are base + sum(i_k * stride_k) +
    [0, run) over the dims. Raises for tensors without addressable strided memory."""
    n = t.numel()
    if n == 0:
        return None
    size = t.element_size()
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + n * size, 0, ()
    return canonical_footprint(start, t.shape, t.stride(), size)


def canonical_footprint(base: int, shape: Sequence[int], stride: Sequence[int], size: int) -> Any:
    """The footprint of elements of `size` bytes at `base` with this shape and stride (in
    elements), as `footprint` gives it."""
    # Innermost first: fold dims that extend the contiguous run, merge dims that extend the
    # dim below them; broadcast (stride 0) and size-1 dims add no byte.
    dims = sorted((st * size, n) for n, st in zip(shape, stride) if n > 1 and st != 0)
    run = size
    out: list[list[int]] = []
    for s, n in dims:
        if not out and s <= run:
            run += (n - 1) * s
        elif out and s == out[-1][0] * out[-1][1]:
            out[-1][0] *= n
        else:
            out.append([n, s])
    extent = run + sum((n - 1) * s for n, s in out)
    if not out:
        return base, base + run, 0, ()
    return base, base + extent, run, tuple((n, s) for n, s in reversed(out))


def footprints_meet(a: tuple[int, int, int, Dims], b: tuple[int, int, int, Dims]) -> bool:
    """True when two footprints share a byte (exact within MEET_BUDGET search steps, "may
    share" beyond)."""
    a0, a1, ar, ad = a
    b0, b1, br, bd = b
    if a1 <= b0 or b1 <= a0:
        return False
    if not ad and not bd:
        return True
    return _meet(a0, a1, ar or a1 - a0, ad, b0, b1, br or b1 - b0, bd, [MEET_BUDGET])


def _residues_disjoint(a0: int, ar: int, ad: Dims, b0: int, br: int, bd: Dims) -> bool:
    # Every stride a multiple of g: each footprint's bytes lie in one interval of residues
    # mod g, so disjoint residue intervals mean disjoint footprints.
    g = 0
    for _, s in ad:
        g = math.gcd(g, s)
    for _, s in bd:
        g = math.gcd(g, s)
    if g == 0 or ar >= g or br >= g:
        return False
    d = (b0 - a0) % g
    return ar <= d <= g - br


def _meet(
    a0: int, a1: int, ar: int, ad: Dims, b0: int, b1: int, br: int, bd: Dims, budget: list[int]
) -> bool:
    """Footprints [a0, a1) and [b0, b1) as base, run, dims (a dense one: run = its length)."""
    if a1 <= b0 or b1 <= a0:
        return False
    if not ad and not bd:
        return True
    if _residues_disjoint(a0, ar, ad, b0, br, bd):
        return False
    budget[0] -= 1
    if budget[0] < 0:
        return True  # out of budget: answer "may overlap", never miss a race
    if not ad or (bd and bd[0][1] > ad[0][1]):
        a0, a1, ar, ad, b0, b1, br, bd = b0, b1, br, bd, a0, a1, ar, ad
    # Split `a` along its largest stride; visit only the slices inside b's span.
    (n, s), inner = ad[0], ad[1:]
    extent = a1 - a0 - (n - 1) * s  # span of one slice
    first = max(0, -(-(b0 - a0 - extent + 1) // s))
    last = min(n - 1, (b1 - 1 - a0) // s)
    for i in range(first, last + 1):
        base = a0 + i * s
        if _meet(base, base + extent, ar, inner, b0, b1, br, bd, budget):
            return True
    return False
