"""A model's shape and a step's requests: `ModelConfig`, the presets ("tiny" with values,
"deepseek-v3" shapes only) and `Batch`. `scenarios.model` re-exports them beside the model."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = ["Batch", "ModelConfig", "PRESETS", "preset"]


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_inter: int
    ep_size: int
    dtype: torch.dtype
    tensor_device: str  # "cpu" (values) or "meta" (shapes only)
    dispatch_bytes_per_elem: float  # DeepEP sends FP8 on dispatch, BF16 on combine
    combine_bytes_per_elem: float
    # DeepSeek-style options; the defaults are a plain MHA + MoE stack (what "tiny" is).
    attention: str = "mha"  # "mha", or "mla" (multi-head latent attention, DeepSeek-V2/V3)
    q_lora_rank: int = 0  # MLA: q goes hidden -> q_lora_rank -> heads x (nope + rope)
    kv_lora_rank: int = 0  # MLA: the cached latent per token (plus one rope key)
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    num_shared_experts: int = 0  # always-on experts run on the rank's own tokens, no dispatch
    num_dense_layers: int = 0  # the first layers have a dense MLP instead of MoE (no comm)
    dense_inter: int = 0
    # Dtype of the linear layers' weights and GEMM inputs (FP8 for DeepSeek-V3's block-quantized
    # checkpoint); None: `dtype`. Only shapes-only (meta) runs use it.
    weight_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"attention must be 'mha' or 'mla', got {self.attention!r}")
        if (
            self.attention == "mla"
            and min(self.kv_lora_rank, self.qk_nope_dim, self.qk_rope_dim, self.v_head_dim) <= 0
        ):
            raise ValueError(
                "attention='mla' needs positive kv_lora_rank, qk_nope_dim, qk_rope_dim and "
                "v_head_dim"
            )
        if self.tensor_device not in ("cpu", "meta", "cuda") and not self.tensor_device.startswith(
            "cuda:"
        ):
            raise ValueError(
                f"tensor_device must be 'cpu', 'meta' or 'cuda', got {self.tensor_device!r}"
            )

    @property
    def local_experts(self) -> int:
        """Experts held by one EP rank (the grouped GEMM reads all their weights)."""
        return max(1, self.num_experts // max(self.ep_size, 1))

    def with_(self, **changes: object) -> ModelConfig:
        return replace(self, **changes)


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


@dataclass(frozen=True)
class Batch:
    """The requests of one step. `query_start_loc[r]..[r+1]` are request r's new tokens;
    `context_lens[r]` tokens of request r are already in the KV cache (decode)."""

    query_start_loc: tuple[int, ...]
    context_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def is_decode(self) -> bool:
        q = self.query_start_loc
        return all(q[r + 1] - q[r] == 1 for r in range(len(q) - 1))

    @staticmethod
    def decode(num_requests: int, context_len: int) -> Batch:
        return Batch(tuple(range(num_requests + 1)), (context_len,) * num_requests)

    @staticmethod
    def prefill(num_requests: int, prompt_len: int) -> Batch:
        return Batch(tuple(r * prompt_len for r in range(num_requests + 1)), (0,) * num_requests)
