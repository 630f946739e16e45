"""vLLM V2's per-ubatch model inputs and outputs: how many ubatches a step has
(`get_num_ubatches`), the model's per-token inputs narrowed to one ubatch
(`slice_model_inputs`) and the ubatch outputs joined back (`merge_ubatch_outputs`).

Same names, signatures and results as vLLM 0.33's `vllm/v1/worker/ubatch_utils.py` and
`gpu/ubatch_utils.py`. vLLM is never imported: its `IntermediateTensors` (a record holding a
`tensors` dict) is recognised by shape and rebuilt with its own type."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["get_num_ubatches", "merge_ubatch_outputs", "slice_model_inputs"]


def get_num_ubatches(parallel_config: Any) -> int:
    """How many ubatches a step is split into: `num_ubatches` with ubatching on, else 1
    (a vLLM `ParallelConfig` or dbo.split's `DBOConfig`)."""
    return int(parallel_config.num_ubatches) if parallel_config.use_ubatching else 1


def slice_model_inputs(model_inputs: dict[str, Any], token_slice: slice) -> dict[str, Any]:
    """The model's per-token inputs narrowed to `token_slice` (`input_ids`, `inputs_embeds`,
    `positions`, M-RoPE's 2-D `positions` along dim 1, `intermediate_tensors`); every other
    entry is passed on as it is."""
    if "positions" not in model_inputs:
        raise KeyError("model_inputs needs 'positions' (vLLM's model runners always pass it)")
    sliced = dict(model_inputs)
    for key in ("input_ids", "inputs_embeds"):
        value = model_inputs.get(key)
        if value is not None:
            sliced[key] = value[token_slice]
    positions = model_inputs["positions"]
    sliced["positions"] = (
        positions[:, token_slice] if positions.ndim == 2 else positions[token_slice]
    )
    intermediate = model_inputs.get("intermediate_tensors")
    if intermediate is not None:
        sliced["intermediate_tensors"] = intermediate[token_slice]
    return sliced


def merge_ubatch_outputs(outputs: list[Any]) -> Any:
    """The whole batch's model output from the ubatches' outputs, concatenated along dim 0:
    hidden states, a tuple of them (EAGLE3's auxiliary states), or IntermediateTensors (on a
    non-final pipeline rank), rebuilt with the type the ubatches returned."""
    if not outputs:
        raise ValueError("merge_ubatch_outputs needs one output per ubatch, got none")
    first = outputs[0]
    if isinstance(getattr(first, "tensors", None), dict):
        return type(first)(
            {key: torch.cat([out.tensors[key] for out in outputs]) for key in first.tensors}
        )
    if isinstance(first, tuple):
        return tuple(torch.cat(parts, dim=0) for parts in zip(*outputs))
    return torch.cat(outputs, dim=0)
