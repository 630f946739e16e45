"""A small MoE transformer stack whose dbo_* calls sit where vLLM puts them.

Each layer is attention then a mixture-of-experts block with expert-parallel dispatch and
combine. Scratch buffers come from the WorkspaceManager as vLLM's layers take them: the
attention output (as DCP attention does) and the MoE block's receive buffer, intermediate and
expert output, taken in one `get_simultaneous` call because they are alive at the same time
(as fused MoE does).

Two overlap schedules, as in vLLM's DeepEP back ends:
- "ht" (high-throughput): dispatch and combine run on the comm stream; 3 yields per layer
  (compute->comm before dispatch, comm->compute after it, compute->comm before combine).
- "ll" (low-latency): everything is issued from the compute stream; the transfer arrives later
  and a recv hook, run by the *next* ubatch (`dbo_register_recv_hook`), makes the compute
  stream wait for it; 2 yields per layer (after dispatch, after combine).
Outside a ubatch thread every dbo_* call is a no-op and the same code is the serial run.

Presets: "tiny" (plain MHA + MoE, real float64 tensors, values checked) and "deepseek-v3"
(`meta`, shapes only, for timing): 61 layers, hidden 7168; MLA attention (q through a 1536
low-rank, a cached latent of 512 + a 64-wide rope key per token; absorbed in decode); 3 dense
layers (MLP 18432) then MoE with 256 experts top-8 and 1 shared expert; FP8 linear layers.
What moves its numbers is modelled; simplifications, stated: RMSNorm is costed as one
layer_norm kernel; rotary embedding, the router's group-limited top-k, the FP8 scale tensors
and the MTP head are left out; routing is balanced (each EP rank receives top_k rows per token,
split evenly over its experts); the FP8 expert GEMMs' outputs are FP8-sized (BF16 in engines);
the dense layers run data-parallel (no comm); a layer's attention is data-parallel (DP
attention, as in large-EP deployments). A model can also live on `cuda` (bf16, MHA): weights
are made on the GPU, attention is one fused kernel and the experts one grouped GEMM per
projection (`torch._grouped_mm`), as engines run them.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator

import torch

import dbo
from dbo.comm import current_ep_group, ep_group_for
from dbo.split import UBatchSlice
from scenarios.model_config import Batch, ModelConfig
from scenarios.model_presets import PRESETS, preset
from scenarios.model_weights import ModelWeights, layer_weights
from workspace import current_workspace_manager

__all__ = ["ModelConfig", "PRESETS", "Batch", "MoEModel", "preset"]

# (device type, dtype) -> whether torch._grouped_mm runs there. Kept per kind because support
# differs by both (float64 is refused where bf16 works), and one failure must not send every
# later call, on meta too, down the fallback (whose host read cannot run on meta).
_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of `a` in expert-major groups ending at `offs` times their expert's `b`: one
    `torch._grouped_mm` kernel; where this torch, device or dtype lacks it, one mm per expert
    with the group sizes read on the host (a sync, so not capturable in a graph), said once per
    kind on stderr."""
    kind = (a.device.type, a.dtype)
    if _GROUPED_MM_OK.get(kind, True):
        try:
            out = torch._grouped_mm(a, b, offs=offs)
            _GROUPED_MM_OK[kind] = True
            return out
        except (AttributeError, RuntimeError, NotImplementedError) as error:
            if _GROUPED_MM_OK.get(kind) or a.is_meta:  # meta has no group sizes to read
                raise
            _GROUPED_MM_OK[kind] = False
            print(
                f"scenarios.model: torch._grouped_mm unavailable for {kind[1]} on {kind[0]} "
                f"({error}); one mm per expert",
                file=sys.stderr,
            )
    ends = [0] + offs.tolist()
    out = a.new_empty(a.shape[0], b.shape[-1])
    for e in range(b.shape[0]):
        if ends[e + 1] > ends[e]:
            torch.mm(a[ends[e] : ends[e + 1]], b[e], out=out[ends[e] : ends[e + 1]])
    return out


def _context_offsets(batch: Batch) -> tuple[list[int], int]:
    """Where each request's KV rows start (its context, then this step's tokens), and the
    cache length."""
    offsets, off = [], 0
    for r in range(len(batch.context_lens)):
        offsets.append(off)
        off += batch.context_lens[r] + batch.query_start_loc[r + 1] - batch.query_start_loc[r]
    return offsets, off


class MoEModel:
    """Weights, a KV cache for one step, and `forward` for any token range of the batch."""

    def __init__(self, config: ModelConfig, batch: Batch, *, seed: int = 0) -> None:
        self.config = config
        self.batch = batch
        c = config
        make = ModelWeights(config, seed)
        self.layers = [layer_weights(c, make, index) for index in range(c.num_layers)]
        dev = c.tensor_device
        self._unit_scale = torch.ones((), device=dev, dtype=torch.float32)  # FP8 GEMM scales
        self._expert_ids = torch.arange(c.num_experts, device=dev)
        # KV cache per layer: the context of every request, then this step's tokens. Ubatch k
        # writes its tokens' K/V before ubatch k+1 attends in the same layer (ring order), so a
        # request cut by a ubatch boundary sees the same keys as in the serial run.
        self.context_offset, self.kv_len = _context_offsets(batch)
        # MHA caches K and V per head; MLA caches one latent (kv_lora_rank) plus one rope key
        # per token, shared by every head.
        kv_shape = (
            (self.kv_len, c.kv_lora_rank + c.qk_rope_dim)
            if c.attention == "mla"
            else (2, self.kv_len, c.num_heads, c.head_dim)
        )
        self.kv = [make.cache(kv_shape) for _ in range(c.num_layers)]
        # token -> request, for the attention masks (host-side metadata, as an engine has)
        q = batch.query_start_loc
        self.token_request = [r for r in range(len(q) - 1) for _ in range(q[r + 1] - q[r])]

    def inputs(self, seed: int = 1) -> torch.Tensor:
        c = self.config
        if c.tensor_device == "meta":
            return torch.empty(self.batch.num_tokens, c.hidden, device="meta", dtype=c.dtype)
        if c.tensor_device.startswith("cuda"):
            gen = torch.Generator(device=c.tensor_device).manual_seed(seed)
            return torch.randn(
                self.batch.num_tokens,
                c.hidden,
                generator=gen,
                device=c.tensor_device,
                dtype=c.dtype,
            )
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(self.batch.num_tokens, c.hidden, generator=gen, dtype=torch.float64).to(
            c.dtype
        )

    # ---------------------------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        tokens: UBatchSlice | None = None,
        *,
        mode: str = "ht",
        timeout_s: float | None = None,
    ) -> torch.Tensor:
        """Run every layer on tokens `tokens.token_slice` of the batch (all tokens if None).
        With `timeout_s`, a forward still running after that many seconds raises TimeoutError
        before its next layer (the serial step's bound; a ubatch's waits are bounded by
        `run_ubatches`)."""
        if mode not in ("ht", "ll"):
            raise ValueError(f"mode must be 'ht' or 'll', got {mode!r}")
        start = 0 if tokens is None else tokens.token_slice.start
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for index, layer in enumerate(self.layers):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"the forward ran past its {timeout_s:g} s timeout after {index} of "
                    f"{len(self.layers)} layers"
                )
            x = x + self._attention(index, layer, x, start)
            if index < self.config.num_dense_layers:
                x = x + self._mlp(self._norm(x), layer["w_gate_up"], layer["w_down"])
                continue
            # The shared expert runs on the rank's own tokens, before the dispatch (so under DBO
            # it is compute that another ubatch's communication can hide behind).
            h = self._norm(x)
            shared = (
                self._mlp(h, layer["ws_gate_up"], layer["ws_down"])
                if "ws_gate_up" in layer
                else None
            )
            x = x + self._moe(layer, h, mode)
            if shared is not None:
                x = x + shared
        return x

    # -- building blocks shared by the DeepSeek-style paths -----------------------------------

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm where the config is DeepSeek-style (MLA), as one memory-bound kernel
        (layer_norm has RMSNorm's traffic and kernel count); the plain MHA stack has none."""
        if self.config.attention != "mla":
            return x
        return torch.nn.functional.layer_norm(x, (x.shape[-1],))

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w; with FP8 weights (shapes-only runs), the activations are quantized first (one
        memory-bound kernel, as an engine's per-token-group quant) and the GEMM runs in FP8
        with a BF16 output."""
        if w.dtype == x.dtype:
            return x @ w
        scale = self._unit_scale
        return torch._scaled_mm(x.to(w.dtype), w, scale_a=scale, scale_b=scale, out_dtype=x.dtype)

    def _mlp(self, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        """SwiGLU MLP (a dense layer, or the shared expert)."""
        h = self._linear(x, w_gate_up)
        half = h.shape[-1] // 2
        return self._linear(torch.nn.functional.silu(h[:, :half]) * h[:, half:], w_down)

    @staticmethod
    def _attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
    ) -> torch.Tensor:
        """softmax(q k^T * scale) v over (batch, heads, seq, dim) tensors; k and v may have one
        head shared by all of q's. Causal masks are aligned to the end of the keys (the queries
        are the last of them). On the CPU it runs as plain ops (values checked); elsewhere as
        one fused flash-attention kernel, as engines run it."""
        n_q, n_k = q.shape[-2], k.shape[-2]
        if q.device.type == "cpu":
            scores = torch.matmul(q, k.transpose(-1, -2)) * scale
            if causal:
                mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
                scores = scores.masked_fill(~mask, float("-inf"))
            return torch.matmul(scores.softmax(dim=-1), v)
        if q.device.type == "meta":  # the fused kernel itself (torch's dispatcher picks it on GPUs)
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, scale=scale
            )[0]
            return out[..., : v.shape[-1]]
        mask = None
        if causal and n_q != n_k:
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        return torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal and mask is None,
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )

    def _attention(self, index: int, layer: dict, x: torch.Tensor, start: int) -> torch.Tensor:
        c = self.config
        if c.attention == "mla":
            return self._mla(index, layer, x, start)
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
            window = kv[:, first : first + t * (ctx + 1)].view(
                2, t, ctx + 1, c.num_heads, c.head_dim
            )
            window[0, :, ctx].copy_(qkv[:, 1])  # this step's token goes after its context
            window[1, :, ctx].copy_(qkv[:, 2])
            if x.device.type == "cpu":
                scores = torch.einsum("thd,tshd->ths", qkv[:, 0], window[0]) * scale
                out = torch.einsum("ths,tshd->thd", scores.softmax(dim=-1), window[1])
            else:  # one fused kernel: each request is a batch entry with one query
                out = self._attend(
                    qkv[:, 0].unsqueeze(2),
                    window[0].transpose(1, 2),
                    window[1].transpose(1, 2),
                    causal=False,
                    scale=scale,
                )
            attn_out.copy_(out.reshape(t, -1))
        else:
            # Prefill: per request segment of this ubatch, causal over the request's tokens so far.
            for r, rows, lo, hi in self._segments(start, t):
                kv[0, lo:hi].copy_(qkv[rows, 1])
                kv[1, lo:hi].copy_(qkv[rows, 2])
                keys, vals = kv[0, self.context_offset[r] : hi], kv[1, self.context_offset[r] : hi]
                n_q, n_k = rows.stop - rows.start, keys.shape[0]
                if x.device.type == "cpu":
                    scores = torch.einsum("qhd,khd->hqk", qkv[rows, 0], keys) * scale
                    causal = torch.ones(n_q, n_k, dtype=torch.bool, device=kv.device).tril(
                        n_k - n_q
                    )
                    scores = scores.masked_fill(~causal, float("-inf"))
                    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vals)
                else:  # one fused causal kernel per request segment, heads as the batch
                    out = self._attend(
                        qkv[rows, 0].transpose(0, 1).unsqueeze(0),
                        keys.transpose(0, 1).unsqueeze(0),
                        vals.transpose(0, 1).unsqueeze(0),
                        causal=True,
                        scale=scale,
                    )[0].transpose(0, 1)
                attn_out[rows].copy_(out.reshape(n_q, -1))
        return attn_out @ layer["wo"]

    def _segments(self, start: int, t: int) -> Iterator[tuple[int, slice, int, int]]:
        """The prefill pieces of tokens [start, start + t): per request r they touch, the rows
        of this ubatch that are r's, and where those tokens' K/V go in the cache ([lo, hi),
        after r's context). A request cut by the ubatch boundary yields only its part here."""
        q = self.batch.query_start_loc
        seg_start = start
        while seg_start < start + t:
            r = self.token_request[seg_start]
            seg_end = min(q[r + 1], start + t)
            base = self.context_offset[r] + self.batch.context_lens[r]
            yield (
                r,
                slice(seg_start - start, seg_end - start),
                base + seg_start - q[r],
                base + seg_end - q[r],
            )
            seg_start = seg_end

    def _mla(self, index: int, layer: dict, x: torch.Tensor, start: int) -> torch.Tensor:
        """Multi-head latent attention (DeepSeek-V2/V3). The cache holds, per token, one latent
        of kv_lora_rank plus one rope key shared by every head.

        Decode runs the absorbed form, as FlashMLA-class kernels do: q_nope is mapped into the
        latent space per head (W_UK), every head attends over the latent cache directly (the
        heads become the query rows of one shared-KV attention per request), and the result
        leaves the latent space through W_UV. Prefill runs the plain form: the segment's
        latents are expanded to per-head K (nope + the shared rope key) and V by W_KV_B, then
        causal attention with qk dim nope + rope and v dim v_head_dim. Rotary embedding is
        left out (an elementwise kernel on q and the rope key: no FLOPs or bytes that matter).
        """
        c = self.config
        t, h = x.shape[0], c.num_heads
        dn, dr, dv, rank = c.qk_nope_dim, c.qk_rope_dim, c.v_head_dim, c.kv_lora_rank
        x = self._norm(x)
        q_in = self._norm(self._linear(x, layer["wq_a"])) if "wq_a" in layer else x
        q = self._linear(q_in, layer["wq_b"]).view(t, h, dn + dr)
        kv_a = self._linear(x, layer["wkv_a"])  # (t, latent + rope key)
        latent = self._norm(kv_a[:, :rank])
        cache = self.kv[index]
        (attn_out,) = current_workspace_manager().get_simultaneous(((t, h * dv), c.dtype))
        scale = 1.0 / math.sqrt(dn + dr)
        if self.batch.is_decode:
            ctx = self.batch.context_lens[0]
            first = self.context_offset[start]
            window = cache[first : first + t * (ctx + 1)].view(t, ctx + 1, rank + dr)
            window[:, ctx, :rank].copy_(latent)  # this step's token goes after its context
            window[:, ctx, rank:].copy_(kv_a[:, rank:])
            q_latent = torch.bmm(q[:, :, :dn].transpose(0, 1), layer["w_uk"])  # (h, t, rank)
            q_full = torch.cat(
                [q_latent.transpose(0, 1), q[:, :, dn:]], dim=-1
            )  # (t, h, rank + dr)
            o_latent = self._attend(
                q_full.unsqueeze(1),
                window.unsqueeze(1),
                window[:, :, :rank].unsqueeze(1),
                causal=False,
                scale=scale,
            )  # (t, 1, h, rank)
            o = torch.bmm(o_latent.squeeze(1).transpose(0, 1), layer["w_uv"])  # (h, t, dv)
            attn_out.copy_(o.transpose(0, 1).reshape(t, h * dv))
        else:
            for r, rows, lo, hi in self._segments(start, t):
                cache[lo:hi, :rank].copy_(latent[rows])
                cache[lo:hi, rank:].copy_(kv_a[rows, rank:])
                keys = cache[self.context_offset[r] : hi]  # the request's latents so far
                n_q, n_k = rows.stop - rows.start, keys.shape[0]
                kv = self._linear(keys[:, :rank], layer["wkv_b"]).view(n_k, h, dn + dv)
                k = torch.cat([kv[:, :, :dn], keys[:, None, rank:].expand(n_k, h, dr)], dim=-1)
                out = self._attend(
                    q[rows].transpose(0, 1).unsqueeze(0),
                    k.transpose(0, 1).unsqueeze(0),
                    kv[:, :, dn:].transpose(0, 1).unsqueeze(0),
                    causal=True,
                    scale=scale,
                )[0].transpose(0, 1)  # (n_q, h, dv)
                attn_out[rows].copy_(out.reshape(n_q, h * dv))
        return self._linear(attn_out, layer["wo"])

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
        else:
            dbo.dbo_maybe_run_recv_hook()
        sent = ep.dispatch(
            x,
            experts,
            weights,
            plan=plan,
            out=recv,
            mode=mode,
            bytes_per_elem=c.dispatch_bytes_per_elem,
        )
        if mode == "ht":
            dbo.dbo_yield_and_switch_from_comm_to_compute()
        else:
            self._receive(sent.event)

        # -- experts (a grouped GEMM over the received rows) ---------------------------------
        self._experts(layer, sent.recv_x, inter, expert_out, sent.recv_expert_ids, mode)

        # -- combine -------------------------------------------------------------------------
        out = torch.zeros_like(x)
        if mode == "ht":
            self._yield_to_comm()
            ep.combine(
                expert_out, sent.handle, out=out, mode="ht", bytes_per_elem=c.combine_bytes_per_elem
            )
            dbo.dbo_switch_to_compute_sync()
        else:
            dbo.dbo_maybe_run_recv_hook()
            ep.combine(
                expert_out, sent.handle, out=out, mode="ll", bytes_per_elem=c.combine_bytes_per_elem
            )
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

    def _experts(
        self,
        layer: dict,
        recv: torch.Tensor,
        inter: torch.Tensor,
        out: torch.Tensor,
        row_expert: torch.Tensor,
        mode: str = "ll",
    ) -> None:
        c = self.config
        if layer["w1"].dtype != recv.dtype:
            # FP8 experts (shapes only): one grouped GEMM per projection over the rank's
            # experts, rows split evenly among them (balanced routing). DeepEP's normal kernels
            # deliver rows per token, so SGLang permutes them into the GEMM's expert-contiguous
            # layout (ep_scatter) and reduces the down GEMM's rows back per token (ep_gather):
            # two memory-bound passes over every row ("ht"). Low-latency kernels deliver and
            # combine the expert layout themselves ("ll").
            e = layer["w1"].shape[0]
            a = torch.empty(
                e, -(-recv.shape[0] // e), c.hidden, device=recv.device, dtype=layer["w1"].dtype
            )
            if mode == "ht":
                a.view(-1, c.hidden)[: recv.shape[0]].copy_(recv)
            h = torch.bmm(a, layer["w1"])
            y = torch.bmm(
                torch.nn.functional.silu(h[..., : c.moe_inter]) * h[..., c.moe_inter :], layer["w2"]
            )
            if mode == "ht":
                out.copy_(y.view(-1, c.hidden)[: out.shape[0]])
            return
        if recv.device.type != "cpu":
            # Grouped GEMM over the expert-major rows: the group ends come from the sorted row
            # experts on the device (no host sync), as a GPU MoE kernel takes them.
            order = None
            if current_ep_group() is not None:  # across processes rows arrive per source rank
                order = row_expert.argsort(stable=True)
                recv, row_expert = recv[order], row_expert[order]
            ends = torch.searchsorted(
                row_expert, self._expert_ids[: layer["w1"].shape[0]], right=True
            )
            offs = ends.to(torch.int32)
            h = _grouped_mm(recv, layer["w1"], offs)
            inter.copy_(torch.nn.functional.silu(h[:, : c.moe_inter]) * h[:, c.moe_inter :])
            y = _grouped_mm(inter, layer["w2"], offs)
            if order is None:
                out.copy_(y)
            else:
                out.index_copy_(0, order, y)
            return
        # Values path: every expert on every row, then each row keeps its own expert's result.
        # E times the FLOPs of a grouped GEMM, but no host sync for per-expert counts (which
        # would stall the timeline) and the same arithmetic per row in serial and DBO runs.
        rows = torch.arange(recv.shape[0])
        h = torch.einsum("rh,ehi->eri", recv, layer["w1"])[row_expert, rows]
        inter.copy_(torch.nn.functional.silu(h[:, : c.moe_inter]) * h[:, c.moe_inter :])
        out.copy_(torch.einsum("ri,eih->erh", inter, layer["w2"])[row_expert, rows])
