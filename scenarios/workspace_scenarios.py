"""vLLM's workspace consumers under DBO (DCP attention, fused MoE, sparse indexer, MLA init),
and graphs with elastic EP: each a case whose named checks must all hold with no race."""

from __future__ import annotations

from typing import Any

import torch

import dbo
from dbo.sim import GraphReplayError, SimDevice
from scenarios.harness import (
    RunOptions,
)
from scenarios.registry import ScenarioResult, scenario
from scenarios.verdicts import case_result, fresh_device, run_ubatched
from workspace import (
    current_workspace_manager,
    lock_workspace,
    unlock_workspace,
)
from workspace.testing import record_allocations


@scenario("dcp-attention", "DCP attention: two buffers from two calls alias, per ubatch slot")
def _dcp_attention(opts: RunOptions) -> ScenarioResult:
    n, heads, dim = 24, 4, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(opts.num_ubatches, n, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(opts.num_ubatches, n, heads, dim, generator=gen, dtype=torch.float64)
    ptrs: dict[int, tuple[int, int]] = {}

    def attend(qq: torch.Tensor, kk: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("nhd,mhd->nhm", qq, kk).softmax(-1)
        out.copy_(torch.einsum("nhm,mhd->nhd", scores, kk))
        return out

    def fn(u: int) -> torch.Tensor:
        ws = current_workspace_manager()
        (context_out,) = ws.get_simultaneous(((n, heads, dim), torch.float64))
        context = attend(q[u], k[u], context_out).sum()  # consumed before the next call
        dbo.dbo_yield()
        (query_out,) = ws.get_simultaneous(((n, heads, dim), torch.float64))
        query = attend(q[u] * 2, k[u], query_out)
        ptrs[u] = (context_out.data_ptr(), query_out.data_ptr())
        return query + context

    device, outs = run_ubatched(opts, fn)

    def fresh() -> torch.Tensor:
        return torch.empty(n, heads, dim, dtype=torch.float64)

    expected = [
        attend(q[u] * 2, k[u], fresh()) + attend(q[u], k[u], fresh()).sum()
        for u in range(opts.num_ubatches)
    ]
    checks = {
        "two calls alias within a ubatch": all(a == b for a, b in ptrs.values()),
        "ubatch slots are distinct": len({a for a, _ in ptrs.values()}) == opts.num_ubatches,
        "outputs match": all(
            torch.allclose(o, e, rtol=0, atol=1e-12) for o, e in zip(outs, expected)
        ),
    }
    return case_result("dcp-attention", device, checks, opts)


@scenario(
    "fused-moe-workspace",
    "Fused MoE: one call gives a shared region (workspace13 / fused_out views) and an "
    "independent workspace2",
)
def _fused_moe(opts: RunOptions) -> ScenarioResult:
    m, hidden, inter = 32, 48, 64
    gen = torch.Generator().manual_seed(1)
    w1 = torch.randn(hidden, inter, generator=gen, dtype=torch.float64)
    w2 = torch.randn(inter, hidden, generator=gen, dtype=torch.float64)
    xs = [
        torch.randn(m, hidden, generator=gen, dtype=torch.float64) for _ in range(opts.num_ubatches)
    ]
    relations: dict[int, dict[str, bool]] = {}

    def fn(u: int) -> torch.Tensor:
        shared_elems = max(m * inter, m * hidden)
        common, workspace2 = current_workspace_manager().get_simultaneous(
            ((shared_elems,), torch.float64), ((m, inter), torch.float64)
        )
        workspace13 = common[: m * inter].view(m, inter)
        fused_out = common[: m * hidden].view(m, hidden)
        torch.mm(xs[u], w1, out=workspace13)  # cache1
        torch.nn.functional.silu(workspace13, inplace=False).mul_(1.0)
        workspace2.copy_(torch.nn.functional.silu(workspace13))  # cache2, independent
        dbo.dbo_yield()
        torch.mm(workspace2, w2, out=fused_out)  # reuses cache1's memory: cache1 is dead
        relations[u] = {
            "workspace13 and fused_out alias": workspace13.data_ptr() == fused_out.data_ptr(),
            "workspace2 is independent": workspace2.data_ptr()
            >= common.data_ptr() + common.numel() * 8,
        }
        return fused_out.clone()

    device, outs = run_ubatched(opts, fn)
    expected = [torch.nn.functional.silu(x @ w1) @ w2 for x in xs]
    checks = {k: all(r[k] for r in relations.values()) for k in next(iter(relations.values()))}
    checks["outputs match"] = all(
        torch.allclose(o, e, rtol=0, atol=1e-9) for o, e in zip(outs, expected)
    )
    return case_result("fused-moe-workspace", device, checks, opts)


@scenario(
    "sparse-indexer",
    "Sparse indexer: a profile call reserves three buffers; prefill and decode calls then "
    "allocate nothing",
)
def _sparse_indexer(opts: RunOptions) -> ScenarioResult:
    total_seq, head_dim, topk_ws = 96, 32, 4096
    allocations = {"profile": 0, "run": 0}
    phase = ["profile"]
    outputs: dict[int, torch.Tensor] = {}
    aliases: dict[int, bool] = {}

    def fn(u: int) -> torch.Tensor:
        ws = current_workspace_manager()
        if phase[0] == "profile":
            ws.get_simultaneous(
                ((total_seq, head_dim), torch.float8_e4m3fn),
                ((total_seq, 4), torch.uint8),
                ((topk_ws,), torch.uint8),
            )
            return torch.zeros(1)
        k_fp8, k_scale = ws.get_simultaneous(
            ((total_seq, head_dim), torch.float8_e4m3fn), ((total_seq, 4), torch.uint8)
        )
        for chunk in (40, total_seq):  # chunks slice the full-size buffers
            k_fp8[:chunk].view(torch.uint8).fill_(u + 1)
            k_scale[:chunk].fill_(u + 2)
        outputs[u] = k_scale[:, 0].clone()  # consumed before the decode path reuses the slot
        dbo.dbo_yield()
        (topk,) = ws.get_simultaneous(((topk_ws,), torch.uint8))
        topk.fill_(7)
        aliases[u] = topk.data_ptr() == k_fp8.data_ptr()
        return torch.zeros(1)

    device, manager = fresh_device(opts)
    for phase[0] in ("profile", "run"):
        if phase[0] == "run":
            lock_workspace()
        with record_allocations(manager) as sizes:
            dbo.run_ubatches(
                fn, list(range(opts.num_ubatches)), device=device, timeout=opts.timeout_s
            )
        allocations[phase[0]] = len(sizes)
    every_ubatch = len(outputs) == len(aliases) == opts.num_ubatches
    checks = {
        "profile grew the workspace": allocations["profile"] >= opts.num_ubatches,
        "run allocated nothing": allocations["run"] == 0,
        "each ubatch kept its own scale buffer": every_ubatch
        and all(bool((outputs[u] == u + 2).all()) for u in outputs),
        "decode topk workspace aliases the prefill key buffer": every_ubatch
        and all(aliases.values()),
    }
    return case_result("sparse-indexer", device, checks, opts, allocations=allocations)


@scenario(
    "mla-init-reservation",
    "MLA init: a buffer reserved at init and held as an attribute; later calls alias it and "
    "never grow",
)
def _mla_init(opts: RunOptions) -> ScenarioResult:
    max_tokens, heads, head_size = 64, 4, 32
    device, manager = fresh_device(opts)

    class FlashMLASparseLike:
        def __init__(self) -> None:
            # Reserved outside any ubatch thread: slot 0, as at engine init.
            (self.q_concat_buffer,) = manager.get_simultaneous(
                ((max_tokens, heads, head_size), torch.bfloat16)
            )

        def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
            buf = self.q_concat_buffer[: q_nope.shape[0]]
            buf[..., : q_nope.shape[-1]].copy_(q_nope)
            buf[..., q_nope.shape[-1] :].copy_(q_pe)
            return buf.float().sum(dim=(1, 2))

    impl = FlashMLASparseLike()
    generation_before = manager.slot_generation(0)
    q_nope = torch.randn(16, heads, 24).to(torch.bfloat16)
    q_pe = torch.randn(16, heads, 8).to(torch.bfloat16)
    with dbo.use_device(device), device.thread_scope(None):
        out = impl.forward(q_nope, q_pe)
        (later,) = manager.get_simultaneous(((max_tokens // 2, heads, head_size), torch.bfloat16))
    expected = torch.cat([q_nope, q_pe], dim=-1).float().sum(dim=(1, 2))
    checks = {
        "later call aliases the reservation": later.data_ptr() == impl.q_concat_buffer.data_ptr(),
        "no growth after init": manager.slot_generation(0) == generation_before,
        "all slots reserved equally": len(set(manager.slot_capacities())) == 1,
        "outputs match": torch.equal(out, expected),
        "no orphaned bytes": manager.orphaned_bytes() == 0,
    }
    return case_result("mla-init-reservation", device, checks, opts)


# --------------------------------------------------------------------------------------------
# Graphs and elastic EP


def _graph_step(
    opts: RunOptions, device: SimDevice, width: int
) -> tuple[Any, list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """Warm up, then capture one ubatched step that takes its scratch from the workspace:
    (graph, per-ubatch inputs, weight, per-ubatch outputs); replays read the inputs in place."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(32, width, generator=gen, dtype=torch.float64)
    xs = [torch.randn(8, 32, generator=gen, dtype=torch.float64) for _ in range(opts.num_ubatches)]
    outs = [torch.empty(8, width, dtype=torch.float64) for _ in range(opts.num_ubatches)]

    def fn(u: int) -> None:
        (scratch,) = current_workspace_manager().get_simultaneous(((8, width), torch.float64))
        torch.mm(xs[u], w, out=scratch)
        dbo.dbo_yield()
        torch.mul(scratch, 2.0, out=outs[u])

    dbo.run_ubatches(
        fn, list(range(opts.num_ubatches)), device=device
    )  # warm-up grows the workspace
    graph = device.graph()
    dbo.run_ubatches(fn, list(range(opts.num_ubatches)), device=device, graph=graph)
    return graph, xs, w, outs


@scenario(
    "graph-pointer-stability",
    "CUDA graphs: warm up, capture, lock; replays reuse the captured workspace pointers and "
    "recompute "
    "from new inputs",
)
def _graph_pointer_stability(opts: RunOptions) -> ScenarioResult:
    device, manager = fresh_device(opts, watch_pointers=True)
    graph, xs, w, outs = _graph_step(opts, device, width=16)
    lock_workspace()
    ok_values = True
    for _ in range(3):
        for x in xs:
            x.copy_(torch.randn_like(x))
        graph.replay()
        ok_values &= all(
            torch.allclose(o, (x @ w) * 2, rtol=0, atol=1e-12) for o, x in zip(outs, xs)
        )
    replayed = [r for r in device.timeline if r.replayed]
    checks = {
        "outputs match": ok_values,
        "replays issue no host launch cost": bool(replayed)
        and all(r.issue_us <= r.start_us for r in replayed),
        "workspace never regrew": all(
            manager.slot_generation(k) == 1 for k in range(opts.num_ubatches)
        ),
    }
    return case_result("graph-pointer-stability", device, checks, opts, replayed_ops=len(replayed))


@scenario(
    "elastic-ep",
    "Elastic EP: unlock, re-warm with larger experts (growth), relock; the stale graph is "
    "refused and a "
    "recaptured one replays",
)
def _elastic_ep(opts: RunOptions) -> ScenarioResult:
    device, manager = fresh_device(opts, watch_pointers=True)
    old_graph, *_ = _graph_step(opts, device, width=16)
    lock_workspace()
    capacity_before = manager.capacity
    unlock_workspace()  # the expert count changed: re-warm-up may grow
    new_graph, xs, w, outs = _graph_step(opts, device, width=64)
    lock_workspace()
    stale_error = None
    try:
        old_graph.replay()
    except GraphReplayError as error:
        stale_error = str(error)
    for x in xs:  # new inputs: the recaptured graph must recompute, not replay stale values
        x.copy_(torch.randn_like(x))
    new_graph.replay()
    checks = {
        "grew while unlocked": manager.capacity > capacity_before,
        "locked again": manager.is_locked(),
        "all slots equal after growth": len(set(manager.slot_capacities())) == 1,
        "stale graph refused, naming the slot": stale_error is not None
        and "workspace slot" in stale_error,
        "outputs match": all(
            torch.allclose(o, (x @ w) * 2, rtol=0, atol=1e-12) for o, x in zip(outs, xs)
        ),
    }
    return case_result("elastic-ep", device, checks, opts, stale_graph_error=stale_error)
