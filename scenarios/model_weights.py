"""A model's tensors: `ModelWeights` makes them (random on CPU or GPU from a fixed seed,
empty on `meta`, FP8 weights in shapes-only runs) and `layer_weights` lays out one layer's
(attention, MLA or MHA, then a dense MLP or the MoE block with its shared expert)."""

from __future__ import annotations

import math

import torch

from scenarios.model_config import ModelConfig

__all__ = ["ModelWeights", "layer_weights"]


class ModelWeights:
    """Where and how a model's tensors are made: random values on CPU or GPU (a fixed seed, in
    a fixed draw order), empty ones on `meta`, FP8 weights only in shapes-only runs."""

    def __init__(self, config: ModelConfig, seed: int) -> None:
        self.dev, self.dt = config.tensor_device, config.dtype
        self.meta = self.dev == "meta"
        self.on_gpu = self.dev.startswith("cuda")
        self.gen = torch.Generator().manual_seed(seed)
        self.cuda_gen = torch.Generator(device=self.dev).manual_seed(seed) if self.on_gpu else None
        # FP8 weights exist only in shapes-only runs (there is no FP8 GEMM on the CPU).
        fp8 = config.weight_dtype is not None and self.meta
        self.wdt = config.weight_dtype if fp8 else self.dt

    @property
    def fp8(self) -> bool:
        return self.wdt != self.dt

    def weight(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dt
        if self.meta:
            return torch.empty(shape, device="meta", dtype=dtype)
        if self.cuda_gen is not None:  # made on the GPU: a CPU randn of GBs of weights is slow
            w = torch.randn(shape, generator=self.cuda_gen, device=self.dev, dtype=torch.float32)
            return (w / math.sqrt(shape[-1] if len(shape) > 2 else shape[0])).to(dtype)
        w = torch.randn(shape, generator=self.gen, dtype=torch.float64)
        return (w / math.sqrt(shape[0])).to(dtype)

    def linear(self, n_in: int, n_out: int) -> torch.Tensor:
        if self.fp8:  # stored (out, in), used transposed, as an FP8 GEMM wants it
            return torch.empty(n_out, n_in, device="meta", dtype=self.wdt).t()
        return self.weight(n_in, n_out)

    def cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A KV cache's prior context: random values (zeros on meta)."""
        if self.meta:
            return torch.zeros(shape, device=self.dev, dtype=self.dt)
        if self.on_gpu:
            w = torch.randn(shape, generator=self.cuda_gen, device=self.dev, dtype=torch.float32)
            return w.to(self.dt)
        return torch.randn(shape, generator=self.gen, dtype=torch.float64).to(self.dt)


def _mla_weights(c: ModelConfig, make: ModelWeights) -> dict[str, torch.Tensor]:
    h, dq = c.num_heads, c.qk_nope_dim + c.qk_rope_dim
    q_in = c.q_lora_rank or c.hidden
    layer = {
        "wq_b": make.linear(q_in, h * dq),
        "wkv_a": make.linear(c.hidden, c.kv_lora_rank + c.qk_rope_dim),
        "wkv_b": make.linear(c.kv_lora_rank, h * (c.qk_nope_dim + c.v_head_dim)),
        # wkv_b split per head for the absorbed (decode) form, in the activations' dtype as
        # engines keep them (BF16 batched GEMMs); views of wkv_b below when the weights hold
        # values
        "w_uk": make.weight(h, c.qk_nope_dim, c.kv_lora_rank),
        "w_uv": make.weight(h, c.kv_lora_rank, c.v_head_dim),
        "wo": make.linear(h * c.v_head_dim, c.hidden),
    }
    if not make.fp8:
        # Real values: W_UK and W_UV are W_KV_B's own slices, so the absorbed (decode) and
        # expanded (prefill) forms compute the same attention.
        kv_b = layer["wkv_b"].view(c.kv_lora_rank, h, c.qk_nope_dim + c.v_head_dim)
        layer["w_uk"] = kv_b[:, :, : c.qk_nope_dim].permute(1, 2, 0)
        layer["w_uv"] = kv_b[:, :, c.qk_nope_dim :].transpose(0, 1)
    if c.q_lora_rank:
        layer["wq_a"] = make.linear(c.hidden, c.q_lora_rank)
    return layer


def _attention_weights(c: ModelConfig, make: ModelWeights) -> dict[str, torch.Tensor]:
    if c.attention == "mla":
        return _mla_weights(c, make)
    qkv = c.num_heads * c.head_dim
    return {"wqkv": make.weight(c.hidden, 3 * qkv), "wo": make.weight(qkv, c.hidden)}


def _moe_weights(c: ModelConfig, make: ModelWeights) -> dict[str, torch.Tensor]:
    layer = {"router": make.weight(c.hidden, c.num_experts)}
    if c.num_shared_experts:
        shared = c.num_shared_experts * c.moe_inter
        layer["ws_gate_up"] = make.linear(c.hidden, 2 * shared)
        layer["ws_down"] = make.linear(shared, c.hidden)
    if make.meta:
        # One grouped GEMM per projection over one EP rank's experts.
        layer["w1"] = make.weight(c.local_experts, c.hidden, 2 * c.moe_inter, dtype=make.wdt)
        layer["w2"] = make.weight(c.local_experts, c.moe_inter, c.hidden, dtype=make.wdt)
    elif make.on_gpu:
        # Every expert in this process; (experts, in, out) views of (experts, out, in)
        # storage, the column-major operand grouped GEMM kernels take.
        layer["w1"] = make.weight(c.num_experts, 2 * c.moe_inter, c.hidden).transpose(1, 2)
        layer["w2"] = make.weight(c.num_experts, c.hidden, c.moe_inter).transpose(1, 2)
    else:
        experts = range(c.num_experts)
        layer["w1"] = torch.stack([make.weight(c.hidden, 2 * c.moe_inter) for _ in experts])
        layer["w2"] = torch.stack([make.weight(c.moe_inter, c.hidden) for _ in experts])
    return layer


def layer_weights(c: ModelConfig, make: ModelWeights, index: int) -> dict[str, torch.Tensor]:
    """Layer `index`: attention, then a dense MLP (the first num_dense_layers) or the MoE."""
    layer = _attention_weights(c, make)
    if index < c.num_dense_layers:
        layer["w_gate_up"] = make.linear(c.hidden, 2 * c.dense_inter)
        layer["w_down"] = make.linear(c.dense_inter, c.hidden)
    else:
        layer.update(_moe_weights(c, make))
    return layer
