"""vLLM 0.33's model runner V2 slicing (`vllm/v1/worker/gpu/ubatch_utils.py`): where the
ubatches of a DP-padded batch run (`create_ubatch_slices`), each ubatch's model inputs
(`slice_model_inputs`), and the full batch's output from theirs (`merge_ubatch_outputs`,
hidden states, tuples of them, or `IntermediateTensors` on a non-final pipeline rank).

V2 cuts at the midpoint of the padded token count, so its trailing ubatch may lie wholly in
the padding: its request slice is clamped onto the last real request, which it then holds with
no query tokens, a well-formed ubatch with nothing to do (`split_attn_metadata(...,
allow_empty=True)` gives it its record).

Differences from vLLM, each a refusal where vLLM fails later or not at all: an input batch
missing a field, a model-input dict without `positions`, outputs of mixed kinds, and an empty
output list are refused with one line naming what is wrong.
"""

from __future__ import annotations

import bisect
from collections.abc import ItemsView, Mapping, Sequence
from itertools import accumulate, pairwise
from typing import Any

import torch

from dbo.split.checks import as_count, as_num_scheduled_tokens
from dbo.split.records import UBatchSlice, UBatchSlices
from dbo.split.slicing import ubatch_cut_points

__all__ = [
    "IntermediateTensors",
    "create_ubatch_slices",
    "merge_ubatch_outputs",
    "slice_model_inputs",
]

# The fields of vLLM's `InputBatch` that the V2 split reads.
_BATCH_FIELDS = ("num_scheduled_tokens", "num_tokens_after_padding", "num_reqs_after_padding")


def create_ubatch_slices(input_batch: Any, num_ubatches: int) -> UBatchSlices:
    """The slices a DP-padded batch's ubatches run on (V2's). `input_batch`: vLLM's
    `InputBatch`, or any object with `num_scheduled_tokens` (per real request),
    `num_tokens_after_padding` and `num_reqs_after_padding`.

        >>> from types import SimpleNamespace as Batch
        >>> b = Batch(num_scheduled_tokens=[3, 1], num_reqs=2,
        ...           num_tokens_after_padding=16, num_reqs_after_padding=2)
        >>> [(s.request_slice, s.token_slice) for s in create_ubatch_slices(b, 2)]
        [(slice(0, 2, None), slice(0, 8, None)), (slice(1, 2, None), slice(8, 16, None))]
    """
    missing = [f for f in _BATCH_FIELDS if not hasattr(input_batch, f)]
    if missing:
        raise TypeError(
            f"input_batch must carry vLLM InputBatch's {', '.join(missing)}; got a "
            f"{type(input_batch).__name__} without"
        )
    counts = as_num_scheduled_tokens(input_batch.num_scheduled_tokens)
    tokens_padded = as_count("num_tokens_after_padding", input_batch.num_tokens_after_padding)
    reqs_padded = as_count("num_reqs_after_padding", input_batch.num_reqs_after_padding)
    if tokens_padded < sum(counts) or reqs_padded < len(counts) or not counts:
        raise ValueError(
            f"input_batch's padded sizes ({tokens_padded} tokens, {reqs_padded} requests) are "
            f"below its {sum(counts)} tokens and {len(counts)} requests, or it has none"
        )
    cu = [0, *accumulate(counts)]
    bounds = [0, *ubatch_cut_points(tokens_padded, num_ubatches), tokens_padded]
    slices = []
    for start, end in pairwise(bounds):
        # vLLM's rule, unclamped: from the request holding `start` to the first one starting
        # at or after `end`, which for a cut in the padding may be a padding request row
        first = min(bisect.bisect_right(cu, start) - 1, len(counts) - 1)
        stop = min(bisect.bisect_left(cu, end), reqs_padded)
        slices.append(UBatchSlice(slice(first, stop), slice(start, end)))
    last = slices[-1]  # runs to the padded end, holding the padding requests (vLLM's pad-out)
    slices[-1] = UBatchSlice(slice(last.request_slice.start, reqs_padded), last.token_slice)
    return slices


def slice_model_inputs(model_inputs: Mapping[str, Any], token_slice: slice) -> dict[str, Any]:
    """One ubatch's model inputs: `input_ids`, `inputs_embeds`, `positions` (M-RoPE's 2-D
    positions along their token dim) and `intermediate_tensors` narrowed to `token_slice`;
    every other entry passed on as is. A new dict; the tensors are views."""
    if "positions" not in model_inputs:
        raise KeyError("model_inputs has no 'positions': every model forward takes them")
    sliced = dict(model_inputs)
    for key in ("input_ids", "inputs_embeds"):
        value = model_inputs.get(key)
        if value is not None:
            sliced[key] = value[token_slice]
    positions = model_inputs["positions"]
    # M-RoPE's positions carry a leading section dim
    by_token = positions[:, token_slice] if positions.ndim == 2 else positions[token_slice]
    sliced["positions"] = by_token
    intermediate = model_inputs.get("intermediate_tensors")
    if intermediate is not None:
        sliced["intermediate_tensors"] = intermediate[token_slice]
    return sliced


def merge_ubatch_outputs(outputs: Sequence[Any]) -> Any:
    """The full batch's model output from the ubatches' outputs, in ubatch order: hidden
    states concatenated along tokens, a tuple element-wise (EAGLE3's auxiliary hidden
    states), `IntermediateTensors` (dbo-sim's or vLLM's) key by key, of the first's type."""
    if len(outputs) == 0:
        raise ValueError("merge_ubatch_outputs needs the output of at least one ubatch")
    first = outputs[0]
    kinds = {_kind(o) for o in outputs}
    if len(kinds) != 1:
        raise TypeError(f"ubatches returned outputs of different kinds: {sorted(kinds)}")
    if _kind(first) == "IntermediateTensors":
        return type(first)(
            {key: torch.cat([o.tensors[key] for o in outputs], dim=0) for key in first.tensors}
        )
    if isinstance(first, tuple):
        return tuple(torch.cat(parts, dim=0) for parts in zip(*outputs))
    return torch.cat(list(outputs), dim=0)


def _kind(output: Any) -> str:
    if isinstance(getattr(output, "tensors", None), dict):
        return "IntermediateTensors"
    if isinstance(output, (torch.Tensor, tuple)):
        return type(output).__name__
    raise TypeError(
        f"a ubatch returned a {type(output).__name__}; merge_ubatch_outputs takes hidden "
        f"states (a tensor), a tuple of them, or IntermediateTensors"
    )


class IntermediateTensors:
    """What a non-final pipeline rank returns (vLLM's record, same behaviour): named tensors,
    indexed by name, or sliced along tokens into a record of the same names."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __getitem__(self, key: str | slice) -> Any:
        if isinstance(key, slice):
            return type(self)({k: v[key] for k, v in self.tensors.items()})
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def items(self) -> ItemsView[str, torch.Tensor]:
        return self.tensors.items()

    def __len__(self) -> int:
        return len(self.tensors)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, type(self)) or self.tensors.keys() != other.tensors.keys():
            return False
        return all(torch.equal(v, other.tensors[k]) for k, v in self.tensors.items())

    def __repr__(self) -> str:
        return f"IntermediateTensors(tensors={self.tensors})"
