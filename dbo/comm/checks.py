"""The EP group's argument checks: each refusal names the argument and what it got, before any
rank starts a collective (a peer would otherwise wait in it)."""

from __future__ import annotations

from typing import Any

import torch

from dbo.checks import as_int
from dbo.comm.records import DispatchPlan

__all__ = [
    "MODES",
    "as_positive",
    "check_mode",
    "check_plan",
    "check_routing",
    "check_rows",
    "positive_seconds",
]

MODES = ("ht", "ll")


def as_positive(name: str, value: Any) -> int:
    return as_int(name, value, minimum=1)


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def check_rows(name: str, t: Any, rows: int | None, cols: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, hidden), got shape {tuple(t.shape)}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows, got shape {tuple(t.shape)}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name} must have {cols} columns, got shape {tuple(t.shape)}")
    return t


def check_plan(plan: Any, topk_ids: torch.Tensor) -> None:
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan must be a DispatchPlan from prepare(), got {type(plan).__name__}")
    if tuple(topk_ids.shape) != (plan.num_tokens, plan.top_k):
        raise ValueError(
            f"topk_ids has shape {tuple(topk_ids.shape)} but the plan was prepared for "
            f"{(plan.num_tokens, plan.top_k)}"
        )


def positive_seconds(name: str, value: Any) -> float:
    if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def check_routing(topk_ids: Any, topk_weights: Any) -> None:
    """`topk_ids` (tokens x top_k integer expert ids) and `topk_weights` (floating point, the
    same shape), as a router produces them."""
    if not isinstance(topk_ids, torch.Tensor) or not isinstance(topk_weights, torch.Tensor):
        raise TypeError(
            f"topk_ids and topk_weights must be tensors, got {type(topk_ids).__name__} and "
            f"{type(topk_weights).__name__}"
        )
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D (tokens, top_k), got shape {tuple(topk_ids.shape)}")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must hold integer expert ids, got dtype {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got "
            f"{tuple(topk_weights.shape)}"
        )
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got dtype {topk_weights.dtype}")
