"""A small MoE transformer stack whose dbo_* calls sit where vLLM puts them.

Each layer is attention then a mixture-of-experts block with expert-parallel dispatch and
combine. Scratch buffers come from the WorkspaceManager as in the seed's cases: the attention
output (6.1) and the MoE block's receive buffer, intermediate and expert output, taken in one
`get_simultaneous` call because they are alive at the same time (6.2).

Two overlap schedules, as in vLLM's DeepEP back ends:
- "ht" (high-throughput): dispatch and combine run on the comm stream; 3 yields per layer
  (compute->comm before dispatch, comm->compute after it, compute->comm before combine).
- "ll" (low-latency): everything is issued from the compute stream; the transfer arrives later
  and a recv hook, run by the *next* ubatch (`dbo_register_recv_hook`), makes the compute
  stream wait for it; 2 yields per layer (after dispatch, after combine).
Outside a ubatch thread every dbo_* call is a no-op and the same code is the serial run.

Presets: "tiny" (real float64 tensors, values checked) and "deepseek-v3" (`meta`, shapes only:
61 layers, hidden 7168, 256 experts top-8, for timing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

import dbo
from dbo.comm import ep_group_for
from dbo.split import UBatchSlice
from workspace import current_workspace_manager

__all__ = ["ModelConfig", "PRESETS", "Batch", "MoEModel", "preset"]


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

    def with_(self, **changes: object) -> "ModelConfig":
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
    # DeepSeek-V3: 61 layers, hidden 7168, 128 heads, 256 routed experts top-8, expert
    # intermediate 2048 (config.json of deepseek-ai/DeepSeek-V3). Simplifications, stated:
    # every layer is MoE (the real model has 3 dense ones), attention is plain MHA with head
    # dim 128 instead of MLA, no shared expert.
    "deepseek-v3": ModelConfig(
        name="deepseek-v3",
        num_layers=61,
        hidden=7168,
        num_heads=128,
        head_dim=128,
        num_experts=256,
        top_k=8,
        moe_inter=2048,
        ep_size=64,
        dtype=torch.bfloat16,
        tensor_device="meta",
        dispatch_bytes_per_elem=1.0,
        combine_bytes_per_elem=2.0,
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
    def decode(num_requests: int, context_len: int) -> "Batch":
        return Batch(tuple(range(num_requests + 1)), (context_len,) * num_requests)

    @staticmethod
    def prefill(num_requests: int, prompt_len: int) -> "Batch":
        return Batch(
            tuple(r * prompt_len for r in range(num_requests + 1)), (0,) * num_requests
        )


class MoEModel:
    """Weights, a KV cache for one step, and `forward` for any token range of the batch."""

    def __init__(self, config: ModelConfig, batch: Batch, *, seed: int = 0) -> None:
        self.config = config
        self.batch = batch
        c = config
        dev, dt = c.tensor_device, c.dtype
        gen = torch.Generator().manual_seed(seed)

        def weight(*shape: int) -> torch.Tensor:
            if dev == "meta":
                return torch.empty(shape, device="meta", dtype=dt)
            return (torch.randn(shape, generator=gen, dtype=torch.float64) / math.sqrt(shape[0])).to(dt)

        qkv = c.num_heads * c.head_dim
        self.layers = []
        for _ in range(c.num_layers):
            layer = {
                "wqkv": weight(c.hidden, 3 * qkv),
                "wo": weight(qkv, c.hidden),
                "router": weight(c.hidden, c.num_experts),
            }
            if dev == "meta":
                # Shapes only: one stacked GEMM per projection has the FLOPs and bytes of the
                # grouped GEMM over the rank's experts, without 256 separate ops per layer.
                layer["w1"] = weight(c.hidden, 2 * c.moe_inter)
                layer["w2"] = weight(c.moe_inter, c.hidden)
            else:
                layer["w1"] = torch.stack([weight(c.hidden, 2 * c.moe_inter) for _ in range(c.num_experts)])
                layer["w2"] = torch.stack([weight(c.moe_inter, c.hidden) for _ in range(c.num_experts)])
            self.layers.append(layer)
        # KV cache per layer: the context of every request, then this step's tokens. Ubatch k
        # writes its tokens' K/V before ubatch k+1 attends in the same layer (ring order), so a
        # request cut by a ubatch boundary sees the same keys as in the serial run.
        self.context_offset = []
        off = 0
        for r in range(len(batch.context_lens)):
            self.context_offset.append(off)
            off += batch.context_lens[r] + batch.query_start_loc[r + 1] - batch.query_start_loc[r]
        self.kv_len = off
        self.kv = [
            torch.zeros(2, self.kv_len, c.num_heads, c.head_dim, device=dev, dtype=dt)
            if dev == "meta"
            else torch.randn(2, self.kv_len, c.num_heads, c.head_dim, generator=gen, dtype=torch.float64).to(dt)
            for _ in range(c.num_layers)
        ]
        # token -> request, for the attention masks (host-side metadata, as an engine has)
        q = batch.query_start_loc
        self.token_request = [r for r in range(len(q) - 1) for _ in range(q[r + 1] - q[r])]

    def inputs(self, seed: int = 1) -> torch.Tensor:
        c = self.config
        if c.tensor_device == "meta":
            return torch.empty(self.batch.num_tokens, c.hidden, device="meta", dtype=c.dtype)
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(self.batch.num_tokens, c.hidden, generator=gen, dtype=torch.float64).to(c.dtype)

    # ---------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, tokens: UBatchSlice | None = None, *, mode: str = "ht") -> torch.Tensor:
        """Run every layer on tokens `tokens.token_slice` of the batch (all tokens if None)."""
        if mode not in ("ht", "ll"):
            raise ValueError(f"mode must be 'ht' or 'll', got {mode!r}")
        start = 0 if tokens is None else tokens.token_slice.start
        for index, layer in enumerate(self.layers):
            x = x + self._attention(index, layer, x, start)
            x = x + self._moe(layer, x, mode)
        return x

    def _attention(self, index: int, layer: dict, x: torch.Tensor, start: int) -> torch.Tensor:
        c = self.config
        t = x.shape[0]
        qkv = (x @ layer["wqkv"]).view(t, 3, c.num_heads, c.head_dim)
        kv = self.kv[index]
        (attn_out,) = current_workspace_manager().get_simultaneous(
            ((t, c.num_heads * c.head_dim), c.dtype)
        )
        scale = 1.0 / math.sqrt(c.head_dim)
        if self.batch.is_decode:
            # One new token per request, uniform context: one batched op for all requests.
            ctx = self.batch.context_lens[0]
            first = self.context_offset[start]
            window = kv[:, first : first + t * (ctx + 1)].view(2, t, ctx + 1, c.num_heads, c.head_dim)
            window[0, :, ctx].copy_(qkv[:, 1])  # this step's token goes after its context
            window[1, :, ctx].copy_(qkv[:, 2])
            scores = torch.einsum("thd,tshd->ths", qkv[:, 0], window[0]) * scale
            out = torch.einsum("ths,tshd->thd", scores.softmax(dim=-1), window[1])
            attn_out.copy_(out.reshape(t, -1))
        else:
            # Prefill: per request segment of this ubatch, causal over the request's tokens so far.
            q = self.batch.query_start_loc
            seg_start = start
            while seg_start < start + t:
                r = self.token_request[seg_start]
                seg_end = min(q[r + 1], start + t)
                base = self.context_offset[r] + self.batch.context_lens[r]
                lo, hi = base + seg_start - q[r], base + seg_end - q[r]
                rows = slice(seg_start - start, seg_end - start)
                kv[0, lo:hi].copy_(qkv[rows, 1])
                kv[1, lo:hi].copy_(qkv[rows, 2])
                keys, vals = kv[0, self.context_offset[r] : hi], kv[1, self.context_offset[r] : hi]
                scores = torch.einsum("qhd,khd->hqk", qkv[rows, 0], keys) * scale
                n_q, n_k = seg_end - seg_start, keys.shape[0]
                causal = torch.ones(n_q, n_k, dtype=torch.bool, device=kv.device).tril(n_k - n_q)
                scores = scores.masked_fill(~causal, float("-inf"))
                out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vals)
                attn_out[rows].copy_(out.reshape(n_q, -1))
                seg_start = seg_end
        return attn_out @ layer["wo"]

    def _moe(self, layer: dict, x: torch.Tensor, mode: str) -> torch.Tensor:
        c = self.config
        k = c.top_k
        logits = x @ layer["router"]
        weights, experts = logits.softmax(dim=-1).topk(k, dim=-1)
        # The process's EP group (dbo.comm.use_ep_group: real all-to-all across processes), else
        # every expert in this process with ep_size simulated. The plan lays the rows out
        # expert-major, as a dispatch fills the receive buffer, and says how many arrive here.
        ep = ep_group_for(c.num_experts, c.ep_size)
        plan = ep.prepare(experts, weights, dtype=c.dtype, mode=mode)
        rows = plan.num_recv_rows
        recv, inter, expert_out = current_workspace_manager().get_simultaneous(
            ((rows, c.hidden), c.dtype), ((rows, c.moe_inter), c.dtype), ((rows, c.hidden), c.dtype)
        )

        # -- dispatch ------------------------------------------------------------------------
        if mode == "ht":
            self._yield_to_comm()
            sent = ep.dispatch(x, experts, weights, plan=plan, out=recv, mode="ht", bytes_per_elem=c.dispatch_bytes_per_elem)
            dbo.dbo_yield_and_switch_from_comm_to_compute()
        else:
            dbo.dbo_maybe_run_recv_hook()
            sent = ep.dispatch(x, experts, weights, plan=plan, out=recv, mode="ll", bytes_per_elem=c.dispatch_bytes_per_elem)
            self._receive(sent.event)

        # -- experts (a grouped GEMM over the received rows) ---------------------------------
        self._experts(layer, sent.recv_x, inter, expert_out, sent.recv_expert_ids)

        # -- combine -------------------------------------------------------------------------
        out = torch.zeros_like(x)
        if mode == "ht":
            self._yield_to_comm()
            ep.combine(expert_out, sent.handle, out=out, mode="ht", bytes_per_elem=c.combine_bytes_per_elem)
            dbo.dbo_switch_to_compute_sync()
        else:
            dbo.dbo_maybe_run_recv_hook()
            ep.combine(expert_out, sent.handle, out=out, mode="ll", bytes_per_elem=c.combine_bytes_per_elem)
            self._receive(sent.handle.combine_event)
        return out

    def _yield_to_comm(self) -> None:
        """Hand the baton on, then continue on the comm stream after this ubatch's compute."""
        dbo.dbo_yield_and_switch_from_compute_to_comm()

    @staticmethod
    def _receive(arrival: dbo.Event) -> None:
        """The low-latency recv: under DBO the next ubatch runs it (hiding the transfer behind
        its own compute); in a serial run it runs here, as vLLM's modular kernel does."""

        def hook() -> None:
            dbo.current_stream().wait_event(arrival)

        if dbo.dbo_enabled():
            dbo.dbo_register_recv_hook(hook)
            dbo.dbo_yield()
        else:
            hook()

    def _experts(self, layer: dict, recv: torch.Tensor, inter: torch.Tensor, out: torch.Tensor, row_expert: torch.Tensor) -> None:
        c = self.config
        if recv.is_meta:
            h = recv @ layer["w1"]
            inter.copy_(torch.nn.functional.silu(h[:, : c.moe_inter]) * h[:, c.moe_inter :])
            torch.mm(inter, layer["w2"], out=out)
            return
        # Values path: every expert on every row, then each row keeps its own expert's result.
        # E times the FLOPs of a grouped GEMM, but no host sync for per-expert counts (which
        # would stall the timeline) and the same arithmetic per row in serial and DBO runs.
        rows = torch.arange(recv.shape[0])
        h = torch.einsum("rh,ehi->eri", recv, layer["w1"])[row_expert, rows]
        inter.copy_(torch.nn.functional.silu(h[:, : c.moe_inter]) * h[:, c.moe_inter :])
        out.copy_(torch.einsum("ri,eih->erh", inter, layer["w2"])[row_expert, rows])
