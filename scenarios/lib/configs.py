"""Reading a configuration: the model and batches a verb runs, by name.

`check_cases` is gpu-check's mid-size MoE stack (a prefill and a decode step); `plan_cases`
turns a configuration name (that stack, or a `scenarios.model` preset) and size overrides into
the steps to record or simulate. `profile`, `gpu-check` and `analyze` share them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from scenarios.lib.choices import DECODE_CONTEXT, GPU_CHECK, PREFILL_REQUESTS
from scenarios.model import PRESETS, Batch, ModelConfig

__all__ = [
    "DECODE_CONTEXT",
    "GPU_CHECK",
    "MODES",
    "PREFILL_REQUESTS",
    "CheckCase",
    "check_cases",
    "config_names",
    "plan_cases",
]


@dataclass(frozen=True)
class CheckCase:
    name: str
    config: ModelConfig
    batch: Batch
    mode: str  # "ht" (prefill: comm stream) or "ll" (decode: recv hooks)


def check_cases(layers: int = 8) -> list[CheckCase]:
    """A mid-size MoE stack: hidden 4096, 32 heads x 128, 64 experts top-8 (expert MLP 1024),
    bf16. Prefill: 4 prompts of 1024 tokens (4096 tokens); decode: 128 requests with 1024
    tokens of context. ~1.7 GB of weights per layer (experts 1.6 GB), so a decode step reads
    GBs and a prefill step does ~10 TFLOP: device time, not launch overhead, dominates."""
    config = ModelConfig(
        name="gpu-check",
        num_layers=layers,
        hidden=4096,
        num_heads=32,
        head_dim=128,
        num_experts=64,
        top_k=8,
        moe_inter=1024,
        ep_size=1,
        dtype=torch.bfloat16,
        tensor_device="cuda",
        dispatch_bytes_per_elem=2.0,  # one GPU: the rows move as they are (bf16)
        combine_bytes_per_elem=2.0,
    )
    return [
        CheckCase("prefill", config, Batch.prefill(4, 1024), "ht"),
        CheckCase("decode", config, Batch.decode(128, 1024), "ll"),
    ]


MODES = {"prefill": "ht", "decode": "ll"}  # step kind -> the model's comm mode


def config_names() -> list[str]:
    return [GPU_CHECK, *sorted(PRESETS)]


def plan_cases(
    config: str = GPU_CHECK,
    *,
    layers: int | None = None,
    hidden: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    tokens: int | None = None,
    mode: str = "both",
) -> list[CheckCase]:
    """The steps to record: a named configuration (gpu_check's model and batches, or a
    `scenarios.model` preset) with overrides. Raises ValueError on a bad choice, before any
    work. `layers` defaults to enough to see every kind of layer (the dense ones and one MoE
    layer): distinct shapes repeat per layer. A float64 preset (made for value checks on the
    CPU) is recorded in bf16, the dtype its kernels would run in on a GPU."""
    if config not in config_names():
        known = ", ".join(config_names())
        raise ValueError(f"unknown --config {config!r}; choose one of {known}")
    if mode not in ("both", *MODES):
        raise ValueError(f"--mode must be prefill, decode or both, got {mode!r}")
    sizes = {"layers": layers, "hidden": hidden, "experts": experts, "top-k": top_k}
    for flag, value in {**sizes, "tokens": tokens}.items():
        if value is not None and value < 1:
            raise ValueError(f"--{flag} must be >= 1, got {value}")
    if config == GPU_CHECK:
        base = {c.mode: c for c in check_cases(1)}
        model = base["ht"].config
    else:
        base = {}
        model = PRESETS[config]
    default_layers = min(model.num_layers, model.num_dense_layers + 1)
    changes: dict[str, Any] = {"num_layers": layers or default_layers}
    if model.dtype == torch.float64:  # a preset for CPU value checks: GPUs run it in bf16
        changes["dtype"] = torch.bfloat16
    if hidden is not None:
        changes["hidden"] = hidden
    if experts is not None:
        changes["num_experts"] = experts
    if top_k is not None:
        changes["top_k"] = top_k
    # Named by flag before ModelConfig refuses the pair by its field names.
    chosen_k = changes.get("top_k", model.top_k)
    chosen_experts = changes.get("num_experts", model.num_experts)
    if chosen_k > chosen_experts:
        raise ValueError(f"--top-k {chosen_k} exceeds the {chosen_experts} experts")
    model = model.with_(**changes)
    if tokens is not None and mode != "decode" and tokens % PREFILL_REQUESTS:
        raise ValueError(
            f"--tokens of a prefill must be a multiple of {PREFILL_REQUESTS} (its prompts)"
        )
    return [_case(step, model, base, tokens) for step in MODES if mode in ("both", step)]


def _case(
    step: str, model: ModelConfig, base: dict[str, CheckCase], tokens: int | None
) -> CheckCase:
    """One step of `model`: the base configuration's batch unless `tokens` sets one."""
    comm_mode = MODES[step]
    if tokens is None and comm_mode in base:
        batch = base[comm_mode].batch
    elif step == "prefill":
        batch = Batch.prefill(PREFILL_REQUESTS, (tokens or 4096) // PREFILL_REQUESTS)
    else:
        batch = Batch.decode(tokens or 128, DECODE_CONTEXT)
    return CheckCase(step, model, batch, comm_mode)
