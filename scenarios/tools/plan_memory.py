"""Does one `plan` point fit in a GPU's memory? Weights per rank, the KV cache, DeepEP's buffers.

One job: the bytes one EP rank holds at a point, against the profile's HBM capacity.

- Weights: the model's own tensors as `scenarios.model_weights` lays them out for one rank
  (built on `meta`, so nothing is allocated): attention and the dense layers whole on every
  rank (DP attention), the shared experts whole, the rank's routed experts (and its share of
  EPLB's replicas) only; FP8 where the configuration's weight dtype says so. The embedding and
  the LM head are not in `ModelConfig`: a preset's vocabulary is listed here.
- KV cache: every cached token of the rank's requests, in the activations' dtype: with MLA the
  latent (kv_lora_rank) and the rope key (qk_rope_dim) per token and layer, with MHA a key and
  a value per head. Decode holds `tokens` requests of `context + 1` tokens; prefill the step's
  prompt tokens.
- DeepEP's buffers, sized as DeepEP sizes them (`csrc/config.hpp`). Low-latency (decode): its
  `LowLatencyLayout` for `num_max_dispatch_tokens_per_rank` = the point's tokens: two send and
  two receive buffers, a receive buffer being every expert times that many messages of
  `hidden` BF16 values plus a scale per 128 channels. Normal (prefill): the NVLink and RDMA
  size hints of its recommended dispatch config at `Buffer.num_sms` = 20 (the NVLink buffer
  `num_channels x nvl_peers x recv_tokens x (hidden bytes + top-k indices and weights and
  scales at their 128-entry maxima)`, the RDMA one the same per remote node, doubled).
Not counted: activations, CUDA graphs' pools, the CUDA context and the allocator's slack,
which is why a point "fits" below `USABLE_SHARE` of the capacity, not at 100%.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from dbo.sim.hardware import HardwareProfile
from scenarios.model_config import ModelConfig
from scenarios.model_weights import ModelWeights, layer_weights

__all__ = [
    "MemoryNeed",
    "USABLE_SHARE",
    "deepep_bytes",
    "kv_cache_bytes",
    "memory_need",
    "weight_bytes",
]

GB = 1e9
# Share of HBM a deployment can give to weights, KV and buffers: vLLM's default
# gpu_memory_utilization is 0.9; the rest is activations, graphs and the CUDA context.
USABLE_SHARE = 0.9
# Vocabulary of the presets that have one (embedding and LM head, BF16, on every rank):
# DeepSeek-V3's config.json vocab_size.
VOCAB = {"deepseek-v3": 129280}
# DeepEP's defaults: Buffer.num_sms (normal kernels' SMs), the top-k and scale maxima its
# size hints assume, NVLink peers per node.
DEEPEP_SMS, MAX_TOPK, MAX_SCALES, NVL_PEERS = 20, 128, 128, 8
# num_max_nvl_chunked_recv_tokens of DeepEP's recommended dispatch configs, by EP size.
NVL_RECV_TOKENS = ((8, 256), (64, 288), (96, 480), (128, 560), (4096, 720))
RDMA_RECV_TOKENS = 128


@dataclass(frozen=True)
class MemoryNeed:
    """One rank's bytes at a point, in GB (1e9 B), against its GPU's capacity."""

    weights_gb: float
    kv_cache_gb: float
    deepep_gb: float
    capacity_gb: float | None  # None: the profile does not say (no check)

    @property
    def total_gb(self) -> float:
        return self.weights_gb + self.kv_cache_gb + self.deepep_gb

    @property
    def fits(self) -> bool:
        return self.capacity_gb is None or self.total_gb <= USABLE_SHARE * self.capacity_gb

    def describe(self) -> str:
        of = "capacity unknown"
        if self.capacity_gb is not None:
            of = f"of {USABLE_SHARE:.0%} x {self.capacity_gb:g} GB"
        return (
            f"{self.total_gb:.1f} GB (weights {self.weights_gb:.1f}, KV {self.kv_cache_gb:.1f}, "
            f"DeepEP {self.deepep_gb:.1f}) {of}"
        )


@functools.lru_cache(maxsize=64)
def weight_bytes(config: ModelConfig, ep: int, redundant: int = 0) -> float:
    """One rank's weights: attention and dense layers whole, its routed experts only (cached:
    every token count of an EP size holds the same weights)."""
    c = config.with_(tensor_device="meta", ep_size=ep, num_experts=config.num_experts + redundant)
    make = ModelWeights(c, seed=0)
    total = 0
    for index in range(c.num_layers):
        for tensor in layer_weights(c, make, index).values():
            total += tensor.numel() * tensor.element_size()
    return float(total + 2 * VOCAB.get(config.name, 0) * c.hidden * 2)


def kv_cache_bytes(config: ModelConfig, cached_tokens: int) -> float:
    """Bytes of `cached_tokens` tokens of KV cache over every layer, in the activations' dtype."""
    width = torch.empty((), dtype=config.dtype).element_size()
    if config.attention == "mla":
        per_layer = config.kv_lora_rank + config.qk_rope_dim
    else:
        per_layer = 2 * config.num_heads * config.head_dim
    return float(cached_tokens) * config.num_layers * per_layer * width


def deepep_bytes(config: ModelConfig, phase: str, ep: int, tokens: int, experts: int) -> float:
    """DeepEP's buffer bytes on one rank: the low-latency layout (decode) or the normal
    kernels' NVLink and RDMA size hints (prefill)."""
    hidden = config.hidden
    if phase == "decode":
        scales = hidden // 128
        dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
        combine_msg = scales * 4 + hidden * 2
        send = max(tokens * dispatch_msg, experts * tokens * combine_msg)
        recv = experts * tokens * max(dispatch_msg, combine_msg)
        signal = 128 * math.ceil((experts * 8 + experts // ep * 4) / 128)
        return float(2 * (send + recv + signal))
    channels, per_token_meta = DEEPEP_SMS // 2, MAX_TOPK * (8 + 4) + MAX_SCALES * 4
    hidden_bytes = hidden * 2
    nvl_peers, nodes = min(ep, NVL_PEERS), max(ep // NVL_PEERS, 1)
    recv = next(t for limit, t in NVL_RECV_TOKENS if ep <= limit)
    nvl = channels * nvl_peers * (recv * (hidden_bytes + per_token_meta) + (2 * nodes + 3) * 4)
    rdma = 0.0
    if ep > NVL_PEERS:
        rows = channels * nodes * RDMA_RECV_TOKENS * 2
        rdma = rows * (hidden_bytes + per_token_meta + 16) + (1 << 20)
    return float(nvl + rdma)


def memory_need(
    config: ModelConfig,
    profile: HardwareProfile,
    phase: str,
    ep: int,
    tokens: int,
    *,
    redundant: int = 0,
    context: int = 2000,
) -> MemoryNeed:
    """One rank's weights, KV cache (decode: `tokens` requests of `context` + 1 tokens) and
    DeepEP buffers at a point of `plan`."""
    cached = tokens * (context + 1) if phase == "decode" else tokens
    experts = config.num_experts + redundant
    return MemoryNeed(
        weight_bytes(config, ep, redundant) / GB,
        kv_cache_bytes(config, cached) / GB,
        deepep_bytes(config, phase, ep, tokens, experts) / GB,
        profile.hbm_gb,
    )
