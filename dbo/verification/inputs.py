"""The batch cut into ubatch inputs: the default split along dim 0 (`split_inputs`), a user's
`split`, or an explicit layout (`slices`), with the attention metadata its pieces carry checked."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from dbo.split import UBatchSlice, check_split_inputs, ubatch_cut_points
from dbo.verification.layout import SplitRules, resolve_layout, split_by_layout

__all__ = ["input_leaves", "split_and_check", "split_inputs", "ubatch_inputs"]


def _rows(value: Any) -> int | None:
    return value.shape[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else None


def input_leaves(inputs: Any) -> list[Any]:
    """The values of a batch given as a mapping, a tuple or list, or one value."""
    if isinstance(inputs, Mapping):
        return list(inputs.values())
    if isinstance(inputs, (tuple, list)):
        return list(inputs)
    return [inputs]


def split_inputs(inputs: Any, num_ubatches: int) -> list[Any]:
    """The default split: cut a tensor, or a tuple/list/dict of tensors sharing dim 0, along
    dim 0 at `dbo.split.ubatch_cut_points` (the last ubatch takes the remainder)."""
    leaves = input_leaves(inputs)
    rows = {_rows(v) for v in leaves}
    if not leaves or None in rows:
        raise TypeError(
            f"the default split cuts a tensor, or a tuple/list/dict of tensors, along dim 0; "
            f"got {_describe(inputs)}; pass split=fn(inputs, num_ubatches) -> list"
        )
    if len(rows) != 1:
        raise ValueError(
            f"the default split needs every input tensor to have the same dim 0, "
            f"got sizes {sorted(rows)}; pass split=fn(inputs, num_ubatches)"
        )
    (n,) = rows
    if n < num_ubatches:
        raise ValueError(
            f"inputs have {n} rows, fewer than num_ubatches={num_ubatches}: some "
            f"ubatch would be empty"
        )
    bounds = [0, *ubatch_cut_points(n, num_ubatches), n]
    pieces = [slice(a, b) for a, b in itertools.pairwise(bounds)]

    def cut(s: slice) -> Any:
        if isinstance(inputs, torch.Tensor):
            return inputs[s]
        if isinstance(inputs, Mapping):
            return {k: v[s] for k, v in inputs.items()}
        return type(inputs)(v[s] for v in inputs)

    return [cut(s) for s in pieces]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list, Mapping)):
        return f"a {type(value).__name__} of {[type(v).__name__ for v in input_leaves(value)]}"
    return f"a {type(value).__name__}"


def ubatch_inputs(inputs: Any, num_ubatches: int, split: Callable | None) -> list[Any]:
    """The ubatch inputs by `split` (default: `split_inputs`), refused unless one per ubatch."""
    if split is None:
        return split_inputs(inputs, num_ubatches)
    pieces = split(inputs, num_ubatches)
    if not isinstance(pieces, (list, tuple)) or len(pieces) != num_ubatches:
        got = len(pieces) if isinstance(pieces, (list, tuple)) else type(pieces).__name__
        raise ValueError(
            f"split must return a list of num_ubatches={num_ubatches} ubatch inputs, got {got}"
        )
    return list(pieces)


def split_and_check(
    inputs: Any, num_ubatches: int, split: Callable | None, slices: Any, rules: SplitRules
) -> tuple[Callable | None, Exception | None]:
    """The split to run (the layout's, given `slices` and no `split`) and the error of the
    first attention metadata its pieces carry that breaks an invariant, all before work."""
    layout = None if slices is None else resolve_layout(slices, inputs, num_ubatches, rules)
    if layout is not None and split is None:
        split = partial(_layout_split, layout=layout, allow_empty=rules.empty != "never")
    pieces = ubatch_inputs(inputs, num_ubatches, split)  # a bad split: refused before work
    # Attention metadata the pieces carry must describe exactly their part of the batch
    # (dbo.split's checker); a wrong split is the cause of whatever the step then does.
    found = check_split_inputs(
        inputs, pieces, layout, padding_in_last_ubatch=rules.empty == "never"
    )
    return split, found


def _layout_split(
    inputs: Any, num_ubatches: int, *, layout: list[UBatchSlice], allow_empty: bool
) -> list[Any]:
    return split_by_layout(inputs, layout, allow_empty)
