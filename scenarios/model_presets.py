"""The model presets ("tiny" with values, "deepseek-v3" shapes only) and the torch dtypes a
configuration file names. Apart from `scenarios.model_config` because this needs torch.
"""

from __future__ import annotations

import torch

from scenarios.model_config import DTYPE_FIELDS, ModelConfig

__all__ = ["PRESETS", "preset", "torch_dtypes"]

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny",
        num_layers=3,
        hidden=64,
        num_heads=4,
        head_dim=16,
        num_experts=8,
        top_k=2,
        moe_inter=96,
        ep_size=8,
        dtype=torch.float64,
        tensor_device="cpu",
        dispatch_bytes_per_elem=1.0,
        combine_bytes_per_elem=2.0,
    ),
    # DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3): 61 layers, hidden 7168, 128 heads;
    # MLA with q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64,
    # v_head_dim 128; first_k_dense_replace 3 (dense MLP, intermediate_size 18432); then MoE
    # with 256 routed experts top-8 (moe_intermediate_size 2048) and n_shared_experts 1; FP8
    # (e4m3, 128x128 block scales) weights. What the model leaves out is listed in MoEModel.
    "deepseek-v3": ModelConfig(
        name="deepseek-v3",
        num_layers=61,
        hidden=7168,
        num_heads=128,
        head_dim=192,  # qk head dim: nope 128 + rope 64
        num_experts=256,
        top_k=8,
        moe_inter=2048,
        ep_size=64,
        dtype=torch.bfloat16,
        tensor_device="meta",
        dispatch_bytes_per_elem=1.0,
        combine_bytes_per_elem=2.0,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
        num_shared_experts=1,
        num_dense_layers=3,
        dense_inter=18432,
        weight_dtype=getattr(torch, "float8_e4m3fn", torch.bfloat16),
    ),
}


def preset(name: str, **changes: object) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].with_(**changes) if changes else PRESETS[name]


def torch_dtypes(changes: dict[str, object]) -> dict[str, object]:
    """`changes` (checked by `model_config.config_changes`) with dtype names as torch dtypes."""
    out = dict(changes)
    for name in DTYPE_FIELDS:
        if isinstance(out.get(name), str):
            out[name] = getattr(torch, str(out[name]).removeprefix("torch."))
    return out
