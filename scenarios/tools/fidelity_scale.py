"""Fidelity at scale: the published multi-GPU rows re-run on the virtual EP group.

The same figures as the one-rank rows (SGLang's TBO gains at EP 32 prefill over 4 nodes and
EP 72 decode over 9 nodes; DeepEP's low-latency kernel times and normal-mode RDMA bandwidth),
now replayed for every rank (`dbo.sim.cluster`) with the routing each publication states:
SGLang serves DeepSeek-V3 with EPLB over 32 redundant experts (288 physical); DeepEP's
benchmarks route random scores. Both become sampled batches (`dbo.sim.routing.sampled`), each
rank drawing its own tokens' top-8 (seeded; under TBO each ubatch's tokens on their own, the
serial step routing their union), so an expert's load is a sum over the ranks' batches; EPLB
places each layer by its long-run load (the shares the batches are drawn from: for SGLang,
the skew its 32 redundant experts even out, `eplb_evened_load`), as DeepSeek's EPLB places
by statistics gathered over many batches, not by the batch it runs;
and the slowest pair of ranks ends each collective. DeepEP's low-latency figure is what a
rank's kineto trace shows for its own kernel, averaged over 30 back-to-back runs that start
together after a barrier: the replay runs the same loop and averages over ranks and runs.
Every rank's kernel waits for every peer's flags, so a rank that finished its combine early
waits inside its next dispatch: each rank's dispatch and combine add up to the group's
period, which its slowest chain of pairs sets.
Bytes move as DeepEP's kernels move them (`dbo.sim.traffic`) and the normal-mode
bandwidths count them as DeepEP's tests do (`recv_x` rows per rank over NVLink; (token, node)
pairs, own node included, over RDMA). The calibration marks of the one-rank rows carry over:
a constant read off a figure still makes its row a calibration row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dbo.sim import SimDevice
from dbo.sim.cluster import simulate_cluster
from dbo.sim.cluster_program import record_program
from dbo.sim.hardware import H800, HardwareProfile
from dbo.sim.options import EngineKnobs, SimOptions
from dbo.sim.routing import Placement, Routing, balanced, contiguous, eplb, sampled
from dbo.sim.traffic import balanced_dedup, layer_bytes
from scenarios.lib.cluster_step import ROUTING_GROUPS, StepSpec, moe_layers, record_step
from scenarios.lib.fidelity_rows import (
    DEEPEP_LL_PUBLISHED,
    DEEPEP_LL_TOKENS,
    DEEPEP_NORMAL_TOKENS,
    DEEPEP_NVLINK_PUBLISHED,
    DEEPEP_RDMA_PUBLISHED,
    DEEPEP_README,
    DEEPEP_TOPK,
    SGLANG_BLOG,
    SGLANG_DECODE_CONTEXT,
    SGLANG_DECODE_EP,
    SGLANG_DECODE_GAIN,
    SGLANG_PREFILL_EP,
    SGLANG_PREFILL_GAIN,
    SGLANG_PROMPT,
    SGLANG_REDUNDANT_EXPERTS,
    STEP_PROFILE,
    FidelityRow,
    deepep_ll_constant,
    deepep_ll_figures,
    deepep_ll_table_note,
    deepseek_config,
    describe_profile,
    pp_row,
    range_pp_row,
    rel_row,
)
from scenarios.tools.fidelity_kernels import DEEPEP_BYTES

__all__ = [
    "SGLangGroup",
    "sglang_group",
    "eplb_evened_load",
    "scale_rows",
    "cluster_gain",
    "deepep_ll_cluster_us",
    "deepep_ll_cluster_times",
    "deepep_normal_cluster_gbps",
]

SCALE_PREFILL_TOKENS = 16384
SEED = 0
# DeepEP's `bench_kineto` times `num_tests` (30) back-to-back dispatch + combine runs after
# one barrier and averages each kernel's time on the rank that prints it.
DEEPEP_BENCH_RUNS = 30


@dataclass(frozen=True)
class SGLangGroup:
    """SGLang's setup as the virtual group runs it: the serial and TBO steps, the group's
    sampled routing and EPLB's placement."""

    specs: dict[int | None, StepSpec]
    routing: Routing
    placement: Placement


def sglang_group(phase: str, ep: int, tokens: int, quick: bool, *, seed: int = SEED) -> SGLangGroup:
    """The serial and 2-ubatch steps of SGLang's `phase` at EP `ep`, each rank's batch drawn
    per ubatch (the serial step routes their union), EPLB placed by the long-run load."""
    physical = deepseek_config(ep, quick)
    logical = physical.with_(num_experts=physical.num_experts - SGLANG_REDUNDANT_EXPERTS)
    family = eplb_evened_load(moe_layers(physical), logical.num_experts, SGLANG_REDUNDANT_EXPERTS)
    specs = {
        n: StepSpec(
            physical,
            phase,
            tokens,
            n,
            STEP_PROFILE,
            context=SGLANG_DECODE_CONTEXT,
            prompt=SGLANG_PROMPT,
        )
        for n in (None, 2)
    }
    split = specs[2].ubatch_tokens()
    routing = sampled(family, tokens, DEEPEP_TOPK, ranks=ep, seed=seed, ubatches=split)
    routing = replace(routing, groups=ROUTING_GROUPS["deepseek-v3"])
    # EPLB places each layer by its long-run load (the statistics it collects over many
    # batches, here the family's shares), never by the batch it is about to run.
    placement = eplb(family.expert_load(), ep, SGLANG_REDUNDANT_EXPERTS)
    return SGLangGroup(specs, routing, placement)


def eplb_evened_load(layers: int, experts: int, redundant: int) -> Routing:
    """The long-run load that `redundant` EPLB replicas even out exactly: `redundant` experts
    twice as hot as the rest (every `experts / redundant`-th, so each of DeepSeek-V3's groups
    holds its share of them). SGLang runs EPLB because its real load is skewed, and publishes
    no histogram; a uniform load would contradict the setup, since EPLB's replicas of equal
    experts leave some ranks whole experts and others halves (1.125x the mean at EP 72). This
    is the skew for which the operator's choice of replicas is the right one."""
    load = np.ones((layers, experts))
    load[:, np.arange(redundant) * experts // redundant] = 2.0
    shares = load / load.sum(axis=1, keepdims=True)
    return Routing(shares, f"eplb-evened(+{redundant})", DEEPEP_TOPK)


def cluster_gain(phase: str, ep: int, tokens: int, quick: bool) -> tuple[float, dict[str, Any]]:
    """SGLang's setup on the virtual group: the slowest rank's serial step over its TBO step."""
    group = sglang_group(phase, ep, tokens, quick)
    steps, facts = {}, {}
    for n, spec in group.specs.items():
        result = simulate_cluster(record_step(spec), group.routing, group.placement)
        steps[n] = float(result.step_us.max())
        facts[f"{'serial' if n is None else 'tbo'}_peer_wait_us"] = float(result.peer_wait_us.max())
        facts["max_rank_rows"] = float(result.expert_factor.max())
    return (steps[None] / steps[2] - 1.0) * 100.0, {"step_us": steps, **facts}


def deepep_ll_cluster_us(
    kind: str, ep: int, profile: HardwareProfile = H800, *, runs: int = DEEPEP_BENCH_RUNS
) -> float:
    """DeepEP's low-latency benchmark on the virtual group: `runs` back-to-back dispatches
    and combines of 128 random-routed tokens on each rank (its own draw, the same every run,
    as DeepEP's test keeps its `topk_idx`); the mean over ranks and runs of each rank's own
    kernel time, as DeepEP's test prints it per rank (`bench_kineto`)."""
    return deepep_ll_cluster_times(ep, profile, runs=runs)[kind]


def deepep_ll_cluster_times(
    ep: int, profile: HardwareProfile = H800, *, runs: int = DEEPEP_BENCH_RUNS
) -> dict[str, float]:
    """`deepep_ll_cluster_us` of both kernels ("dispatch", "combine") from one replay."""
    device = SimDevice(SimOptions(profile, tensor_device="meta"))
    sent = {
        k: int(DEEPEP_LL_TOKENS * DEEPEP_TOPK * DEEPEP_BYTES[k] * (ep - 1) / ep)
        for k in ("dispatch", "combine")
    }

    def step() -> None:
        with device.thread_scope(None):
            for _ in range(runs):
                for k in ("dispatch", "combine"):
                    with device.comm_region(k, nbytes=sent[k], mode="ll", ep_size=ep):
                        pass

    program = record_program(step, device)
    base = balanced(1, 256, DEEPEP_TOPK)
    routing = sampled(base, DEEPEP_LL_TOKENS, DEEPEP_TOPK, ranks=ep, seed=SEED)
    result = simulate_cluster(program, routing, contiguous(256, ep))
    times = {}
    for kind in sent:
        ops = [c.op for c in program.collectives if c.kind == kind]
        times[kind] = float(np.mean(result.end[ops] - result.start[ops]))
    return times


def deepep_normal_cluster_gbps(
    kind: str, ep: int, profile: HardwareProfile = H800, *, random: bool = True
) -> float:
    """DeepEP's normal-mode benchmark on the virtual group: one HT dispatch or combine of 4096
    random-routed tokens on each rank (its own draw; across nodes, DeepEP's test routing:
    the experts inside the top-4 node groups); the mean over ranks of the bytes as DeepEP's
    tests count them (NVLink inside one node: the rows each rank receives, its own included;
    RDMA: one per token and node, its own node included) over the kernel's time.
    `random=False`: balanced routing instead of sampled batches."""
    nodes = max(ep // profile.gpus_per_node, 1)
    groups = (nodes, min(nodes, 4)) if nodes > 1 else None
    nvl, rdma = balanced_dedup(DEEPEP_TOPK, 256, ep, profile.gpus_per_node, groups)
    engine = EngineKnobs(ht_rdma_share=rdma, ht_nvl_share=nvl)
    device = SimDevice(SimOptions(profile, tensor_device="meta", engine=engine))
    sent = int(DEEPEP_NORMAL_TOKENS * DEEPEP_TOPK * DEEPEP_BYTES[kind] * (ep - 1) / ep)

    def step() -> None:
        with device.thread_scope(None):
            with device.comm_region(kind, nbytes=sent, mode="ht", ep_size=ep):
                pass

    program = record_program(step, device)
    base = replace(balanced(1, 256, DEEPEP_TOPK), groups=groups)
    routing = base
    if random:
        routing = sampled(base, DEEPEP_NORMAL_TOKENS, DEEPEP_TOPK, ranks=ep, seed=SEED)
    result = simulate_cluster(program, routing, contiguous(256, ep))
    collective = next(c for c in result.collectives if c.kind == kind)
    seconds = result.end[collective.op] - result.start[collective.op]
    if nodes == 1:  # NVLink: the rows each rank receives, its own included
        return float(np.mean(collective.recv_mb / seconds)) * 1e3
    moved = layer_bytes(
        routing.sources(0, ep),
        contiguous(256, ep).share,
        sent * ep / (ep - 1),
        DEEPEP_TOPK,
        "ht",
        profile.gpus_per_node,
        groups,
    )
    return float(np.mean(moved.rdma_counted * 1e-6 / seconds)) * 1e3


def _deepep_normal_rows() -> list[FidelityRow]:
    rows = [
        rel_row(
            f"scale-deepep-normal-nvlink-{kind}",
            f"DeepEP normal {kind} NVLink bw, EP 8, all ranks",
            published,
            deepep_normal_cluster_gbps(kind, 8),
            "GB/s",
            "S-N",
            DEEPEP_README,
            "calibration: the one-rank row's nvlink_efficiency came off the '~160 GB/s NVLink "
            "maximum' stated beside this figure",
            calibration=True,
            twin=f"deepep-normal-nvlink-{kind}",
        )
        for kind, published in DEEPEP_NVLINK_PUBLISHED.items()
    ]
    for ep, published in DEEPEP_RDMA_PUBLISHED.items():
        for kind, value in zip(("dispatch", "combine"), published):
            rows.append(
                rel_row(
                    f"scale-deepep-normal-rdma-{kind}-ep{ep}",
                    f"DeepEP normal {kind} RDMA bw, EP {ep}, all ranks",
                    value,
                    deepep_normal_cluster_gbps(kind, ep),
                    "GB/s",
                    "S-N",
                    DEEPEP_README,
                    f"calibration: the normal kernels keep rdma_efficiency "
                    f"{H800.rdma_efficiency:g} because with it this replay reads these figures "
                    "within 10%",
                    calibration=True,
                    twin=f"deepep-normal-rdma-{kind}-ep{ep}",
                )
            )
    return rows


def _deepep_rows() -> list[FidelityRow]:
    rows = []
    for ep, published in DEEPEP_LL_PUBLISHED.items():
        times = deepep_ll_cluster_times(ep)
        for kind, value in zip(("dispatch", "combine"), published):
            calibration = deepep_ll_constant(ep, kind) is not None
            note = (
                f"calibration: ll_latency_us came off the {deepep_ll_figures('latency')} "
                "figure (read as if every pair were equal), ll_rdma_efficiency off the "
                f"{deepep_ll_figures('efficiency')} ones through this replay; over the 30-run "
                "loop a rank that ends its combine early waits in its next dispatch, whose "
                "puts land while a late rank still finishes"
                if calibration
                else "each rank waits for its slowest pair: under random routing the busiest "
                "receiver of the dispatch sends the most back and starts last"
            )
            table = deepep_ll_table_note(ep, kind)
            rows.append(
                rel_row(
                    f"scale-deepep-ll-{kind}-ep{ep}",
                    f"DeepEP LL {kind}, EP {ep}, all ranks",
                    value,
                    times[kind],
                    "us",
                    "S-K",
                    DEEPEP_README,
                    f"{note}; {table}" if table else note,
                    calibration=calibration,
                    twin=f"deepep-ll-{kind}-ep{ep}",
                )
            )
    return rows


def scale_rows(
    quick: bool = False, *, on_point: Callable[[str], None] | None = None
) -> tuple[list[FidelityRow], dict[str, str], dict[str, Any]]:
    """The scale rows, their assumption sets and what each replay found."""
    extra: dict[str, Any] = {}
    gain, facts = cluster_gain("prefill", SGLANG_PREFILL_EP, SCALE_PREFILL_TOKENS, quick)
    extra["scale-prefill"] = facts
    rows = [
        range_pp_row(
            "scale-sglang-prefill-ep32",
            "SGLang TBO prefill gain, 16K tok/dev, all ranks",
            *SGLANG_PREFILL_GAIN,
            gain,
            "S-P",
            SGLANG_BLOG,
            "each rank's own 16K-token batch leaves the busiest rank within a fraction of a "
            "percent of the mean: the replay's gain is the one-rank gain (see its note), not "
            "stragglers",
            twin=f"sglang-prefill-{SCALE_PREFILL_TOKENS}",
        )
    ]
    if on_point:
        on_point("scale prefill")
    for tokens, published in SGLANG_DECODE_GAIN.items():
        gain, facts = cluster_gain("decode", SGLANG_DECODE_EP, tokens, quick)
        extra[f"scale-decode-{tokens}"] = facts
        row = pp_row(
            f"scale-sglang-decode-ep72-{tokens}",
            f"SGLang TBO decode gain, {tokens} tok/dev, all ranks",
            published,
            gain,
            "S-D",
            SGLANG_BLOG,
            "EPLB evens the long-run load (an assumed skew), but each rank's own batch "
            "leaves the busiest rank above the mean; serial steps wait for it in every "
            "collective, TBO hides most of it, so the gain exceeds the one-rank row's, "
            "whose miss (per-ubatch cost) it keeps",
            twin=f"sglang-decode-{tokens}",
        )
        rows.append(row)
        if on_point:
            on_point(f"scale decode {tokens}")
    rows += _deepep_rows() + _deepep_normal_rows()
    return rows, _assumptions(), extra


def _assumptions() -> dict[str, str]:
    """What each scale row's replay assumed, by assumption set."""
    return {
        "S-P": (
            f"{describe_profile(STEP_PROFILE)}. Every rank of EP {SGLANG_PREFILL_EP} (4 nodes) "
            f"replayed; 288 physical experts placed by EPLB per layer on its long-run "
            f"load (assumed: 32 experts twice as hot as the rest, which the 32 replicas even "
            f"out; no histogram is published); "
            f"routing: {SCALE_PREFILL_TOKENS} tokens on each rank, its own draw of top-8 of "
            f"that load inside 4 of 8 groups, each ubatch's tokens drawn on "
            f"their own (seed {SEED}); bytes as DeepEP's normal "
            "kernels move them (one row per token and destination rank over NVLink, per token "
            "and remote node over RDMA); otherwise as [P]"
        ),
        "S-D": (
            f"{describe_profile(STEP_PROFILE)}. Every rank of EP {SGLANG_DECODE_EP} (9 nodes) "
            "replayed; EPLB 288 physical experts per layer on its long-run load (32 experts "
            "twice as hot as the rest, which the 32 replicas even out: assumed, no histogram "
            "is published); routing: each rank's own batch sampled top-8, each ubatch's "
            "tokens drawn on their own (seeded); LL pairs leave as DeepEP's per-(expert, "
            "destination) senders share a link; otherwise as [D]"
        ),
        "S-K": (
            f"{describe_profile(H800)}. DeepEP's LL benchmark on every rank: "
            f"{DEEPEP_BENCH_RUNS} back-to-back dispatches and combines of {DEEPEP_LL_TOKENS} "
            f"tokens on each rank, its own random top-{DEEPEP_TOPK} draw (seeded); every "
            "(token, expert) copy sent, a pair's rows leaving as DeepEP's per-(expert, "
            "destination) senders share a link, a port taking them from its first sender's "
            "start once it is free (one-sided puts); mean over ranks and runs of each rank's "
            "own kernel time (as DeepEP's test prints it), each ending when its slowest pair "
            "does"
        ),
        "S-N": (
            f"{describe_profile(H800)}. DeepEP's normal-mode benchmark on every rank: one HT "
            f"dispatch or combine of {DEEPEP_NORMAL_TOKENS} tokens on each rank, its own random "
            f"top-{DEEPEP_TOPK} draw inside the top-4 node groups (seeded); bytes counted as "
            "DeepEP's tests count them (NVLink: rows received per rank, own included; RDMA: "
            "(token, node) pairs, own node included) over the kernel time, mean over ranks"
        ),
    }
