"""The scenarios: each runs a workload or a fault and returns one verdict.

A positive scenario passes when outputs match the serial run, no race is reported, and its own
memory relation holds. A negative scenario injects a fault and passes only when the fault is
caught with the right error, promptly, with nothing left registered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import dbo
from dbo import ubatching
from dbo.sim import GraphReplayError, SimDevice
from scenarios.harness import (
    Comparison,
    RunOptions,
    StepRun,
    compare_serial_dbo,
    new_device,
    run_step,
    write_artifacts,
)
from scenarios.model import Batch, MoEModel, preset
from scenarios.ranks.processes import run_local_ranks
from scenarios.registry import SCENARIOS, Scenario, ScenarioResult, scenario
from scenarios.steps import ubatched_step
from workspace import (
    WorkspaceLockedError,
    current_workspace_manager,
    init_workspace_manager,
    lock_workspace,
    reset_workspace_manager,
    unlock_workspace,
)
from workspace.testing import record_allocations

__all__ = [
    "ScenarioResult",
    "Scenario",
    "SCENARIOS",
    "DEFAULT_SCENARIOS",
    "run_scenario",
    "scenario",
]


def run_scenario(name: str, opts: RunOptions) -> ScenarioResult:
    """Run one scenario; an unexpected exception is a failed verdict, never a crash."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; `dbo-sim list` shows them")
    run = SCENARIOS[name].run
    if run is None:
        raise ValueError(f"scenario {name!r} runs only across ranks; pass --ranks N")
    start = time.monotonic()
    try:
        result = run(opts)
    except Exception as error:  # noqa: BLE001 - reported as the verdict
        result = ScenarioResult(
            name,
            passed=False,
            negative=SCENARIOS[name].negative,
            error=f"{type(error).__name__}: {error}",
        )
    finally:
        reset_workspace_manager()
    result.wall_s = time.monotonic() - start
    return result


def result_from_comparison(name: str, c: Comparison, **details: Any) -> ScenarioResult:
    """A serial-vs-DBO comparison as a scenario verdict: outputs match, no race, nothing
    allocated in the measured step; `details` land in the JSON report."""
    races = len(c.dbo.races) + len(c.serial.races)
    summary = c.dbo.summary
    passed = c.outputs_match and races == 0 and c.dbo.allocations_during_step == 0
    return ScenarioResult(
        scenario=name,
        passed=passed,
        outputs_match=c.outputs_match if c.values_checked else None,
        max_abs_diff=c.max_abs_diff if c.values_checked else None,
        races=races,
        error=None if passed else _why(c, races),
        step_us_serial=c.serial.step_us,
        step_us_dbo=c.dbo.step_us,
        speedup=c.speedup,
        overlap_fraction=summary.overlap_fraction if summary else None,
        exposed_comm_us=summary.exposed_comm_us if summary else None,
        roofline_fraction=summary.fallback_fraction if summary else None,
        workspace_peak_bytes=c.dbo.workspace_peak_bytes,
        trace=c.trace,
        timeline_png=c.timeline_png,
        details=details,
    )


def _why(c: Comparison, races: int) -> str:
    reasons = []
    if not c.outputs_match:
        reasons.append(f"outputs differ (max abs diff {c.max_abs_diff:.3g} > {c.tolerance:g})")
    if races:
        first = (c.dbo.races or c.serial.races)[0]
        reasons.append(f"{races} race(s), first: {first.describe()}")
    if c.dbo.allocations_during_step:
        reasons.append(f"{c.dbo.allocations_during_step} workspace allocation(s) after lock")
    return "; ".join(reasons)


# --------------------------------------------------------------------------------------------
# Overlap correctness on the MoE workload

TINY_DECODE = Batch.decode(num_requests=64, context_len=16)
TINY_PREFILL = Batch(query_start_loc=(0, 40, 70, 128, 160), context_lens=(0, 0, 0, 0))


@scenario(
    "moe-decode-ll",
    "MoE decode, DeepEP low-latency style: recv hooks, 2 yields per layer",
    cuda=True,
)
def _moe_decode_ll(opts: RunOptions) -> ScenarioResult:
    c = compare_serial_dbo("moe-decode-ll", preset("tiny"), TINY_DECODE, "ll", opts)
    return result_from_comparison("moe-decode-ll", c, mode="ll", tokens=TINY_DECODE.num_tokens)


@scenario(
    "moe-prefill-ht",
    "MoE prefill, DeepEP high-throughput style: comm stream, 3 yields per layer; a request is "
    "cut by "
    "the ubatch boundary",
    cuda=True,
)
def _moe_prefill_ht(opts: RunOptions) -> ScenarioResult:
    c = compare_serial_dbo("moe-prefill-ht", preset("tiny"), TINY_PREFILL, "ht", opts)
    return result_from_comparison("moe-prefill-ht", c, mode="ht", tokens=TINY_PREFILL.num_tokens)


@scenario("three-ubatches", "The prefill workload split into 3 ubatches round the ring", cuda=True)
def _three_ubatches(opts: RunOptions) -> ScenarioResult:
    three = RunOptions(**{**opts.__dict__, "num_ubatches": 3})
    c = compare_serial_dbo("three-ubatches", preset("tiny"), TINY_PREFILL, "ht", three)
    return result_from_comparison("three-ubatches", c, num_ubatches=3)


# The same schedules at DeepSeek-V3 size on `meta` tensors: timing only (no values), to show
# what the overlap buys where communication is large, and where it does not pay.
DSV3_PREFILL = Batch.prefill(num_requests=2, prompt_len=4096)  # 8K tokens per device
DSV3_DECODE = Batch.decode(num_requests=256, context_len=2048)  # 256 tokens per device


@scenario(
    "dsv3-prefill-ht",
    "DeepSeek-V3 size (meta, timing only), prefill 8K tokens per device, high-throughput EP",
)
def _dsv3_prefill(opts: RunOptions) -> ScenarioResult:
    c = compare_serial_dbo("dsv3-prefill-ht", preset("deepseek-v3"), DSV3_PREFILL, "ht", opts)
    return result_from_comparison("dsv3-prefill-ht", c, mode="ht", tokens=DSV3_PREFILL.num_tokens)


@scenario(
    "dsv3-decode-ll",
    "DeepSeek-V3 size (meta, timing only), decode 256 tokens per device, low-latency EP, "
    "replayed as a CUDA graph",
)
def _dsv3_decode(opts: RunOptions) -> ScenarioResult:
    # Decode runs as a captured graph in an engine (vLLM captures the ubatched step too):
    # eagerly, the host issuing two ubatches' ops would bound the step, not the overlap.
    c = compare_serial_dbo(
        "dsv3-decode-ll", preset("deepseek-v3"), DSV3_DECODE, "ll", opts, graph=True
    )
    return result_from_comparison(
        "dsv3-decode-ll", c, mode="ll", tokens=DSV3_DECODE.num_tokens, graph_replay=True
    )


# --------------------------------------------------------------------------------------------
# vLLM's workspace consumers (DCP attention, fused MoE, sparse indexer, MLA init) under DBO


def _fresh(opts: RunOptions, *, watch_pointers: bool = False) -> tuple[Any, Any]:
    """A new device and a new workspace manager with one slot per ubatch; with
    `watch_pointers`, graph replay on the device checks the manager's slot pointers."""
    device = new_device(opts)
    reset_workspace_manager()
    init_workspace_manager(device.torch_device, opts.num_ubatches)
    manager = current_workspace_manager()
    if watch_pointers:
        device.add_buffer_owner(manager)
    return device, manager


def _ubatched(opts: RunOptions, fn: Callable[[int], Any]) -> tuple[SimDevice, list[Any]]:
    """Run `fn(ubatch id)` as one ubatched step on a fresh device and workspace."""
    device, _ = _fresh(opts)
    outs = dbo.run_ubatches(
        fn, list(range(opts.num_ubatches)), device=device, timeout=opts.timeout_s
    )
    device.synchronize()
    return device, outs


def _with_artifacts(result: ScenarioResult, device: Any, opts: RunOptions) -> ScenarioResult:
    """Write the device's timeline (whatever ran, up to a caught fault) as the scenario's trace
    and PNG, when there is an output folder and the device kept a timeline (the simulator)."""
    records = list(getattr(device, "timeline", []))
    if opts.out_dir is not None and records:
        run = StepRun(torch.empty(0), 0.0, None, records, list(getattr(device, "races", [])))
        result.trace, result.timeline_png = write_artifacts(result.scenario, run, opts)
    return result


def _case_result(
    name: str, device: Any, checks: dict[str, bool], opts: RunOptions, **details: Any
) -> ScenarioResult:
    """The verdict of a workspace case: every named check holds and nothing raced."""
    races = list(getattr(device, "races", []))
    failed = [k for k, ok in checks.items() if not ok]
    error = None
    if failed:
        error = "failed: " + ", ".join(failed)
    elif races:
        error = races[0].describe()
    result = ScenarioResult(
        name,
        passed=not failed and not races,
        outputs_match=checks.get("outputs match"),
        races=len(races),
        error=error,
        workspace_peak_bytes=current_workspace_manager().stats().peak_bytes,
        details={**details, "checks": checks},
    )
    return _with_artifacts(result, device, opts)


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

    device, outs = _ubatched(opts, fn)

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
    return _case_result("dcp-attention", device, checks, opts)


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

    device, outs = _ubatched(opts, fn)
    expected = [torch.nn.functional.silu(x @ w1) @ w2 for x in xs]
    checks = {k: all(r[k] for r in relations.values()) for k in next(iter(relations.values()))}
    checks["outputs match"] = all(
        torch.allclose(o, e, rtol=0, atol=1e-9) for o, e in zip(outs, expected)
    )
    return _case_result("fused-moe-workspace", device, checks, opts)


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

    device, manager = _fresh(opts)
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
    return _case_result("sparse-indexer", device, checks, opts, allocations=allocations)


@scenario(
    "mla-init-reservation",
    "MLA init: a buffer reserved at init and held as an attribute; later calls alias it and "
    "never grow",
)
def _mla_init(opts: RunOptions) -> ScenarioResult:
    max_tokens, heads, head_size = 64, 4, 32
    device, manager = _fresh(opts)

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
    return _case_result("mla-init-reservation", device, checks, opts)


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
    device, manager = _fresh(opts, watch_pointers=True)
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
    return _case_result("graph-pointer-stability", device, checks, opts, replayed_ops=len(replayed))


@scenario(
    "elastic-ep",
    "Elastic EP: unlock, re-warm with larger experts (growth), relock; the stale graph is "
    "refused and a "
    "recaptured one replays",
)
def _elastic_ep(opts: RunOptions) -> ScenarioResult:
    device, manager = _fresh(opts, watch_pointers=True)
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
    return _case_result("elastic-ep", device, checks, opts, stale_graph_error=stale_error)


# --------------------------------------------------------------------------------------------
# Negative scenarios: they pass only when the fault is caught


def _registries_empty() -> bool:
    return not ubatching.ubatch_step_active()


class _NoWaitModel(MoEModel):
    """The seeded bug: switch to the comm stream without waiting for this ubatch's compute."""

    def _yield_to_comm(self) -> None:
        dbo.dbo_yield()
        dbo.dbo_switch_to_comm()


@scenario(
    "missing-wait-race",
    "Negative: dispatch switches to the comm stream without waiting for compute; the race "
    "checker must "
    "report it",
    negative=True,
)
def _missing_wait(opts: RunOptions) -> ScenarioResult:
    device = new_device(opts)
    model = _NoWaitModel(preset("tiny"), TINY_PREFILL)
    run = run_step(
        model,
        model.inputs(),
        device=device,
        num_ubatches=opts.num_ubatches,
        mode="ht",
        timeout_s=opts.timeout_s,
    )
    caught = [
        r
        for r in run.races
        if r.second.op.endswith("dispatch") and r.second.stream.startswith("comm")
    ]
    result = ScenarioResult(
        "missing-wait-race",
        passed=bool(caught),
        negative=True,
        races=len(run.races),
        error=None if caught else "the missing wait was not reported as a race",
        details={"first_race": caught[0].describe() if caught else None},
    )
    if opts.out_dir is not None:
        result.trace, result.timeline_png = write_artifacts("missing-wait-race", run, opts)
    return result


_PROMPT_S = 5.0  # a caught fault must end the step within this (or the step timeout, if less)


def _expect_failure(
    name: str,
    opts: RunOptions,
    fn: Callable[[int], Any],
    expected: type[BaseException],
    check: Callable[[BaseException], bool],
) -> ScenarioResult:
    """Run `fn` as a ubatched step; pass only if it raised `expected`, `check` accepts the
    error, it ended promptly and the runtime's registries are empty afterwards."""
    device, _ = _fresh(opts)
    start = time.monotonic()
    caught: BaseException | None = None
    try:
        dbo.run_ubatches(fn, list(range(opts.num_ubatches)), device=device, timeout=opts.timeout_s)
    except BaseException as error:  # noqa: BLE001 - the fault under test
        caught = error
    elapsed = time.monotonic() - start
    prompt = elapsed < min(_PROMPT_S, opts.timeout_s)
    ok = isinstance(caught, expected) and check(caught) and _registries_empty() and prompt
    got = f"{type(caught).__name__}: {caught}" if caught is not None else "no error"
    result = ScenarioResult(
        name,
        passed=ok,
        negative=True,
        error=None
        if ok
        else (
            f"expected {expected.__name__} within {_PROMPT_S:g} s with empty registries, got {got} "
            f"after {elapsed:.2f} s"
        ),
        details={
            "caught": got if caught is not None else None,
            "seconds": round(elapsed, 3),
            "threads_alive": threading.active_count(),
        },
    )
    return _with_artifacts(result, device, opts)


@scenario(
    "yield-mismatch",
    "Negative: one ubatch yields once more than the others; a YieldMismatchError must name "
    "every count",
    negative=True,
    cuda=True,
)
def _yield_mismatch(opts: RunOptions) -> ScenarioResult:
    def fn(u: int) -> None:
        for _ in range(3 + (1 if u == 0 else 0)):
            dbo.dbo_yield()

    def names_every_count(error: BaseException) -> bool:
        return all(f"ubatch {i}:" in str(error) for i in range(opts.num_ubatches))

    return _expect_failure("yield-mismatch", opts, fn, dbo.YieldMismatchError, names_every_count)


@scenario(
    "exception-in-ubatch",
    "Negative: the last ubatch raises mid-step; every peer is released and one UBatchError "
    "names it",
    negative=True,
    cuda=True,
)
def _exception_in_ubatch(opts: RunOptions) -> ScenarioResult:
    last = opts.num_ubatches - 1

    def fn(u: int) -> None:
        dbo.dbo_yield()
        if u == last:
            raise RuntimeError("expert kernel failed")
        dbo.dbo_yield()

    def names_the_raiser(error: BaseException) -> bool:
        return getattr(error, "ubatch_id", None) == last and isinstance(
            error.__cause__, RuntimeError
        )

    return _expect_failure("exception-in-ubatch", opts, fn, dbo.UBatchError, names_the_raiser)


@scenario(
    "locked-growth",
    "Negative: after warm-up and lock, a larger batch needs more workspace; the error names the "
    "caller "
    "and both sizes",
    negative=True,
)
def _locked_growth(opts: RunOptions) -> ScenarioResult:
    device = new_device(opts)
    small = MoEModel(preset("tiny"), Batch.decode(64, 16))
    run_step(
        small,
        small.inputs(),
        device=device,
        num_ubatches=opts.num_ubatches,
        mode="ll",
        timeout_s=opts.timeout_s,
    )
    # run_step left the workspace warmed for 64 tokens and locked; now 128 tokens arrive.
    big = MoEModel(preset("tiny"), Batch.decode(128, 16))
    step = ubatched_step(
        big,
        big.inputs(),
        device,
        mode="ll",
        num_ubatches=opts.num_ubatches,
        timeout_s=opts.timeout_s,
    )
    caught: BaseException | None = None
    try:
        step()
    except dbo.UBatchError as error:
        caught = error.__cause__
    message = str(caught)
    ok = (
        isinstance(caught, WorkspaceLockedError)
        and "model.py" in message  # the caller, outside the manager
        and "MB" in message  # both sizes
        and _registries_empty()
    )
    result = ScenarioResult(
        "locked-growth",
        passed=ok,
        negative=True,
        error=None if ok else f"expected WorkspaceLockedError naming model.py, got {caught!r}",
        details={"caught": message if caught is not None else None},
    )
    return _with_artifacts(result, device, opts)


@scenario(
    "dp-disagreement",
    "Negative, 2 processes (or --ranks N): DP ranks decide ubatching alone (2 vs 1 ubatches); "
    "the EP step "
    "handshake must stop every rank with an error naming each rank's count, and the agreed step "
    "must then run",
    negative=True,
)
def _dp_disagreement(opts: RunOptions) -> ScenarioResult:
    return run_local_ranks(["dp-disagreement"], opts, ranks=2)[0]


DEFAULT_SCENARIOS = [name for name, s in SCENARIOS.items() if s.default and s.run is not None]
