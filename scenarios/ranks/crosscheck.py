"""The cross-check of the virtual EP group against real rank processes: one small MoE model and
one seeded routing, replayed in one process (`dbo.sim.cluster`) and run as R gloo processes.

The model (`CrossCheckModel`) is what both sides can run identically: per layer a dense GEMM
on the rank's own tokens (attention's stand-in), then an MoE block with the HT schedule of
`scenarios.model` (yield to the comm stream, dispatch, back to compute, experts, yield,
combine), its experts one `torch._grouped_mm` per projection over the rows the rank actually
receives, on float32 CPU tensors (real values). Tokens are routed by a seeded routing instead
of a router: every rank routes the same whole counts per expert (`dbo.sim.routing.
routed_counts` at the ubatch's token count, `assign_experts`), so the traffic is exactly the
outer product the replay assumes, and since every rank knows it, the dispatch counts are not
exchanged (the one-process recording has no count exchange either).

- In the processes (`crosscheck-*` rank scenarios, `scenarios.ranks.processes`), each rank
  owns E / R experts, moves rows over a real gloo all-to-all, and prices its own timeline on
  a `SimDevice` whose dispatches and combines wait for the peers' rows in virtual time
  (`dbo.comm.PeerTraffic`, `dbo.sim.alltoall`).
- In one process (`crosscheck_replay`), one rank's step is recorded with every expert local
  and replayed for the R ranks under the same routing and placement.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch

import dbo
from dbo.comm import EPGroup
from dbo.sim import SimDevice
from dbo.sim.cluster import ClusterResult, simulate_cluster
from dbo.sim.cluster_program import StreamProgram, record_program
from dbo.sim.options import ProfileOverrides, SimOptions
from dbo.sim.routing import Routing, assign_experts, balanced, contiguous, routed_counts, zipf
from dbo.split import UBatchSlice, split_batch
from scenarios.harness import RunOptions
from scenarios.model import Batch
from scenarios.ranks.records import RankEnv, RankOutcome
from scenarios.ranks.step import run_rank_step
from scenarios.registry import SCENARIOS, rank_scenario
from scenarios.steps import prepare, ubatched_step
from workspace import reset_workspace_manager

__all__ = [
    "SKEWS",
    "CrossCheckModel",
    "crosscheck_routing",
    "crosscheck_program",
    "crosscheck_replay",
    "register_crosscheck",
    "crosscheck_registered",
]

TOKENS = 256  # per rank, every rank the same (the DP ranks' agreed, padded count)
NUM_EXPERTS, TOP_K, HIDDEN, INTER, NUM_LAYERS = 8, 2, 512, 1024, 2
# A fast host, so that the step is device-bound and the routing moves it: on the calibrated
# H200 host one baton pass costs more than this small model's expert GEMMs.
HOST_COSTS = ProfileOverrides(launch_us=1.0, handoff_us=1.0)
MODE = "ht"
# Values: the processes' output against the one-process run of the same batch.
VALUE_TOLERANCE = 1e-4
# Scenario name -> routing: balanced, and Zipf(1) over the 8 experts (the hottest about 4x the
# mean), shuffled per layer, seed 0.
SKEWS = {"crosscheck-balanced": "balanced", "crosscheck-zipf": "zipf:1"}


def crosscheck_routing(skew: str, num_ubatches: int) -> Routing:
    """The routing both sides use, as whole rows per expert at a ubatch's token count (so each
    ubatch, and the serial step at twice the rows, routes it exactly)."""
    if skew == "balanced":
        family = balanced(NUM_LAYERS, NUM_EXPERTS, TOP_K)
    elif skew.startswith("zipf:"):
        family = zipf(NUM_LAYERS, NUM_EXPERTS, float(skew[5:]), top_k=TOP_K, seed=0)
    else:
        raise ValueError(f"unknown cross-check skew {skew!r}: balanced or zipf:S")
    rows = TOKENS // num_ubatches
    counts = routed_counts(family, rows, TOP_K)
    return Routing(counts / (rows * TOP_K), f"{family.label}, whole rows at {rows} tokens")


class CrossCheckModel:
    """The cross-check's MoE stack (module docstring) on EP group `ep`, routed by `routing`."""

    def __init__(
        self,
        ep: EPGroup,
        routing: Routing,
        token_counts: Sequence[int],
        *,
        priced_as_rank: bool = False,
    ) -> None:
        """`priced_as_rank`: in one process, run the grouped GEMMs over one EP rank's E / R
        expert weights (each group the rows of R consecutive experts), so the recording
        prices what a rank reads (a timing recording: its values are not the model's)."""
        self.ep, self.routing = ep, routing
        self.batch = Batch.prefill(1, TOKENS)
        gen = torch.Generator().manual_seed(0)

        def weight(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=gen) / shape[-1] ** 0.5

        lo, hi = ep.local_experts.start, ep.local_experts.stop
        span = hi - lo  # experts whose rows arrive here
        if priced_as_rank:
            hi = lo + NUM_EXPERTS // ep.ep_size
        groups = hi - lo
        self.layers = []
        for _ in range(NUM_LAYERS):
            # (experts, out, in) storage used as (experts, in, out): grouped GEMMs' layout.
            w1 = weight(NUM_EXPERTS, 2 * INTER, HIDDEN).transpose(1, 2)[lo:hi]
            w2 = weight(NUM_EXPERTS, HIDDEN, INTER).transpose(1, 2)[lo:hi]
            self.layers.append({"dense": weight(HIDDEN, HIDDEN), "w1": w1, "w2": w2})
        # The last expert id of each weight group: the group ends in the expert-major rows.
        self.group_last = lo + (torch.arange(groups) + 1) * (span // groups) - 1
        # Host-side routing per token count, made before any step (no device work).
        self.routes = {t: self._routes(t) for t in set(token_counts)}

    def _routes(self, t: int) -> list[tuple[torch.Tensor, torch.Tensor, tuple]]:
        counts = routed_counts(self.routing, t, TOP_K)
        per_rank = counts.reshape(NUM_LAYERS, self.ep.ep_size, -1).sum(axis=2)
        out = []
        for j in range(NUM_LAYERS):
            ids = torch.from_numpy(assign_experts(counts[j], t, TOP_K)).to(torch.int64)
            send = [int(c) for c in per_rank[j]]
            # Every rank routes the same, so each peer sends this rank what it sends itself.
            recv = [send[self.ep.rank]] * self.ep.ep_size
            out.append((ids, torch.full((t, TOP_K), 1.0 / TOP_K), (send, recv)))
        return out

    def inputs(self, seed: int = 1) -> torch.Tensor:
        return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))

    def forward(
        self, x: torch.Tensor, tokens: UBatchSlice | None = None, *, mode: str = MODE
    ) -> torch.Tensor:
        for j, layer in enumerate(self.layers):
            x = x + x @ layer["dense"]
            x = x + self._moe(j, layer, x)
        return x

    def _moe(self, j: int, layer: dict, x: torch.Tensor) -> torch.Tensor:
        ids, weights, counts = self.routes[x.shape[0]][j]
        ep = self.ep
        plan = ep.prepare(ids, weights, dtype=x.dtype, counts=counts if ep.is_distributed else None)
        recv = torch.empty(plan.num_recv_rows, HIDDEN)
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        sent = ep.dispatch(x, ids, weights, plan=plan, out=recv, mode=MODE)
        dbo.dbo_yield_and_switch_from_comm_to_compute()
        offs = torch.searchsorted(sent.recv_expert_ids, self.group_last, right=True)
        offs = offs.to(torch.int32)
        h = torch._grouped_mm(sent.recv_x, layer["w1"], offs=offs)
        inter = torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]
        y = torch._grouped_mm(inter, layer["w2"], offs=offs)
        out = torch.zeros_like(x)
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        ep.combine(y, sent.handle, out=out, mode=MODE)
        dbo.dbo_switch_to_compute_sync()
        return out


def _slices(num_ubatches: int) -> list[UBatchSlice]:
    return split_batch((0, TOKENS), TOKENS, num_ubatches)


def crosscheck_program(
    skew: str, ranks: int, num_ubatches: int, profile: str = "h200"
) -> StreamProgram:
    """One rank's ubatched step recorded in one process (every expert's rows local, EP
    `ranks` simulated, the grouped GEMMs over one rank's expert weights): the program the
    virtual EP group replays."""
    routing = crosscheck_routing(skew, num_ubatches)
    model = CrossCheckModel(
        EPGroup(num_experts=NUM_EXPERTS, ep_size=ranks),
        routing,
        [TOKENS // num_ubatches],
        priced_as_rank=True,
    )
    device = SimDevice(SimOptions(profile, overrides=HOST_COSTS))
    step = ubatched_step(model, model.inputs(), device, mode=MODE, slices=_slices(num_ubatches))  # type: ignore[arg-type]
    try:
        prepare(device.torch_device, step.num_ubatches, [step])
        return record_program(step, device)
    finally:
        reset_workspace_manager()


def crosscheck_replay(
    skew: str, ranks: int, num_ubatches: int, profile: str = "h200"
) -> ClusterResult:
    """The virtual EP group's step of the cross-check: every rank replayed from one recording
    under the same routing, experts placed contiguously."""
    program = crosscheck_program(skew, ranks, num_ubatches, profile)
    routing = crosscheck_routing(skew, num_ubatches)
    return simulate_cluster(program, routing, contiguous(NUM_EXPERTS, ranks))


def _reference_output(
    world: int, routing: Routing, x: torch.Tensor, opts: RunOptions
) -> torch.Tensor:
    """The same ubatched step in one process, every expert local: the values to reproduce."""
    n = opts.num_ubatches
    ep = EPGroup(num_experts=NUM_EXPERTS, ep_size=world)
    model = CrossCheckModel(ep, routing, [TOKENS // n])
    device = SimDevice(SimOptions(opts.profile, overrides=HOST_COSTS))
    step = ubatched_step(model, x, device, mode=MODE, slices=_slices(n))  # type: ignore[arg-type]
    prepare(device.torch_device, n, [])
    try:
        return step.output()
    finally:
        reset_workspace_manager()


def _crosscheck_rank(env: RankEnv, opts: RunOptions, *, skew: str) -> RankOutcome:
    """This rank's ubatched step over the real EP group, its clock coupled to its peers', and
    its values against the one-process run."""
    start = time.monotonic()
    n = opts.num_ubatches
    routing = crosscheck_routing(skew, n)
    ep = EPGroup(env.group, num_experts=NUM_EXPERTS, store=env.store, timeout_s=opts.timeout_s)
    model = CrossCheckModel(ep, routing, [TOKENS // n])
    x = model.inputs()
    run = run_rank_step(
        model,  # type: ignore[arg-type]
        x,
        device=SimDevice(SimOptions(opts.profile, overrides=HOST_COSTS, rank=env.rank)),
        ep=ep,
        slices=_slices(n),
        mode=MODE,
        timeout_s=opts.timeout_s,
        warmups=0,  # nothing to warm: the model takes no workspace, its clock is virtual
    )
    diff = float((run.output - _reference_output(env.world, routing, x, opts)).abs().max())
    wait = sum(float((r.args or {}).get("peer_wait_us", 0.0)) for r in run.records)
    ok = diff <= VALUE_TOLERANCE and not run.races
    return RankOutcome(
        rank=env.rank,
        passed=ok,
        error=None if ok else f"rank {env.rank}: max abs diff {diff:.3g}, {len(run.races)} races",
        outputs_match=diff <= VALUE_TOLERANCE,
        max_abs_diff=diff,
        races=run.races,
        dbo_records=run.records,
        wall_s=time.monotonic() - start,
        details={
            "skew": skew,
            "tokens": TOKENS,
            "num_ubatches": n,
            "step_us_dbo": run.step_us,
            "exposed_comm_us": run.summary.exposed_comm_us if run.summary else None,
            "peer_wait_us": wait,
        },
    )


def register_crosscheck() -> list[str]:
    """Register the `crosscheck-*` rank halves (once): rank processes do at start; a launcher
    uses `crosscheck_registered`. They have no one-process half, so the catalog leaves them
    out."""
    for name, skew in SKEWS.items():
        if name not in SCENARIOS:
            rank_scenario(name, summary=f"the virtual EP group against real ranks, {skew} routing")(
                partial(_crosscheck_rank, skew=skew)
            )
    return list(SKEWS)


@contextmanager
def crosscheck_registered() -> Iterator[list[str]]:
    """The `crosscheck-*` scenarios registered for the block (to launch them), then removed."""
    try:
        yield register_crosscheck()
    finally:
        for name in SKEWS:
            SCENARIOS.pop(name, None)
