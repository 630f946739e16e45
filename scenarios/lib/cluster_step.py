"""A preset model's step as a stream program, and the cluster questions asked of it.

The bridge between the model presets (`scenarios.model`) and the virtual ranks of
`dbo.sim.cluster`: record one rank's step of a model on a simulated device (serial or with
N ubatches; eager or replayed from a captured graph, by default LL decode replayed and HT
prefill eager, as engines run them), deepen
the recording to the model's layer count (`tile_layers`), and replay it for the EP group under
a routing. DP attention: per-rank token counts go through the DP agreement rule
(`dbo.split.decide_ubatching`: split only if every rank can, pad to the largest), and the
step runs at the agreed (padded) count on every rank, which is what padding costs.

Routing and placement specs, as the CLI writes them: `balanced`, `zipf:S`, `dirichlet:ALPHA`,
or a histogram file; `contiguous` or `eplb:N` (N redundant experts).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

from dbo.sim import SimDevice
from dbo.sim.cluster import ClusterResult, simulate_cluster
from dbo.sim.cluster_program import StreamProgram, record_program, tile_layers
from dbo.sim.hardware import HardwareProfile
from dbo.sim.options import EngineKnobs, SimOptions
from dbo.sim.routing import (
    Placement,
    Routing,
    balanced,
    contiguous,
    dirichlet,
    eplb,
    from_histogram,
    zipf,
)
from dbo.sim.traffic import balanced_dedup
from dbo.split import UBatchProposal, decide_ubatching, is_last_ubatch_empty, split_batch
from scenarios.model import Batch, ModelConfig, MoEModel
from scenarios.steps import serial_step, ubatched_step
from workspace import init_workspace_manager, reset_workspace_manager

__all__ = [
    "StepSpec",
    "DPAgreement",
    "dp_agreement",
    "record_step",
    "routing_from_spec",
    "placement_from_spec",
    "cluster_step",
    "moe_layers",
    "engine_knobs",
]

# Group-limited routing of the presets that have it (n_group, topk_group): DeepEP's normal
# kernels send a token once per node, so it sets the RDMA bytes of HT prefill.
ROUTING_GROUPS = {"deepseek-v3": (8, 4)}
RECORDED_MOE_LAYERS = 4  # enough for `tile_layers` to find a steady layer


@dataclass(frozen=True)
class StepSpec:
    """One rank's step: model, phase, tokens per device, ubatches (None: serial). The EP
    group's shape has one source each: its size is `config.ep_size`, its GPUs per node
    `profile.gpus_per_node`; the recording and its replay read them from there."""

    config: ModelConfig
    phase: str  # "decode" (LL, graph replay) | "prefill" (HT, eager)
    tokens: int
    num_ubatches: int | None
    profile: HardwareProfile
    context: int = 2000  # decode: context length per request
    prompt: int = 4096  # prefill: prompt length
    # Captured once and replayed as a CUDA graph (None: decode yes, prefill no, as engines do).
    graph: bool | None = None

    @property
    def replayed(self) -> bool:
        return self.phase == "decode" if self.graph is None else self.graph

    @property
    def mode(self) -> str:
        return "ll" if self.phase == "decode" else "ht"

    def ubatch_tokens(self) -> tuple[int, ...] | None:
        """Each ubatch's token count, as the step splits its batch (None: serial)."""
        if self.num_ubatches is None:
            return None
        batch = self.batch()
        slices = split_batch(batch.query_start_loc, batch.num_tokens, self.num_ubatches)
        return tuple(s.num_tokens for s in slices)

    def batch(self) -> Batch:
        if self.phase == "decode":
            return Batch.decode(self.tokens, self.context)
        prompt = min(self.prompt, self.tokens)
        return Batch.prefill(max(1, self.tokens // prompt), prompt)


@dataclass(frozen=True)
class DPAgreement:
    """What the DP ranks agree on for one step: whether to split, the count each runs."""

    split: bool
    padded_tokens: int
    real_tokens: tuple[int, ...]
    reason: str

    @property
    def padding_share(self) -> float:
        """Share of the padded work that is padding."""
        total = self.padded_tokens * len(self.real_tokens)
        return 1.0 - sum(self.real_tokens) / total if total else 0.0


def dp_agreement(tokens_per_rank: list[int], num_ubatches: int) -> DPAgreement:
    """The DP rule over every rank's real token count: each proposes to split when its own
    last ubatch would not be empty; the shared decision pads every rank to the largest."""
    proposals = [
        UBatchProposal(
            rank=r,
            should_split=not is_last_ubatch_empty(t, t, num_ubatches),
            num_tokens=t,
            num_tokens_padded=t,
            num_ubatches=num_ubatches,
        )
        for r, t in enumerate(tokens_per_rank)
    ]
    d = decide_ubatching(proposals)
    return DPAgreement(d.split, d.num_tokens_padded, tuple(tokens_per_rank), d.reason)


def moe_layers(config: ModelConfig) -> int:
    return config.num_layers - config.num_dense_layers


def engine_knobs(spec: StepSpec) -> EngineKnobs:
    """SGLang's HT prefill: GEMMs capped at the SMs DeepEP leaves under two-batch overlap,
    and the bytes DeepEP's normal kernels move under balanced routing (one copy per token and
    destination rank over NVLink, per token and destination node over RDMA)."""
    p, c = spec.profile, spec.config
    if spec.mode != "ht":
        return EngineKnobs()
    nvl, rdma = balanced_dedup(
        c.top_k, c.num_experts, c.ep_size, p.gpus_per_node, ROUTING_GROUPS.get(c.name)
    )
    gemm_sms = p.num_sms - p.comm_sms if spec.num_ubatches else None
    return EngineKnobs(dbo_gemm_sms=gemm_sms, ht_rdma_share=rdma, ht_nvl_share=nvl)


@functools.lru_cache(maxsize=64)
def record_step(spec: StepSpec) -> StreamProgram:
    """The stream program of one rank's step of `spec`, recorded at few MoE layers and tiled
    to the model's count (cached: every routing and skew replays the same recording).

    An eager step (prefill) is recorded on its first run, a captured one (decode) captured on
    its first run and replayed, with no warm-up run before either, unlike an engine: the
    workspace growing during that run is allocation, which the simulated device does not
    place, and on meta tensors a graph holds no buffer that growth could leave stale; so a
    warm-up gave the same program (every field, checked on decode and prefill at several EP
    sizes, token and ubatch counts) at one more run's cost."""
    config = spec.config.with_(tensor_device="meta")
    full = moe_layers(config)
    if full > RECORDED_MOE_LAYERS:
        config = config.with_(num_layers=config.num_dense_layers + RECORDED_MOE_LAYERS)
    device = SimDevice(SimOptions(spec.profile, tensor_device="meta", engine=engine_knobs(spec)))
    model = MoEModel(config, spec.batch())
    x = model.inputs()
    if spec.num_ubatches is None:
        step = serial_step(model, x, device, mode=spec.mode)
    else:
        step = ubatched_step(model, x, device, mode=spec.mode, num_ubatches=spec.num_ubatches)
    try:
        # No warm-up run (see above): the workspace grows during the first run.
        reset_workspace_manager()
        init_workspace_manager(device.torch_device, step.num_ubatches)
        run = step
        if spec.replayed:
            graph = device.graph()
            step.capture(graph)
            run = graph.replay
        program = record_program(run, device)
    finally:
        reset_workspace_manager()
    return tile_layers(program, full)


def routing_from_spec(
    spec: str, config: ModelConfig, *, seed: int = 0, histogram: Path | None = None
) -> Routing:
    """`balanced`, `zipf:S`, `dirichlet:ALPHA`, or (with `histogram`) the file's loads."""
    layers, experts, k = moe_layers(config), config.num_experts, config.top_k
    if histogram is not None:
        routing = from_histogram(histogram, layers, experts, k)
    else:
        routing = _family(spec, layers, experts, k, seed)
    # DeepSeek-V3 routes inside 4 of 8 expert groups: fewer nodes per token for DeepEP.
    return replace(routing, groups=ROUTING_GROUPS.get(config.name))


def _family(spec: str, layers: int, experts: int, k: int, seed: int) -> Routing:
    name, _, value = spec.partition(":")
    try:
        number = float(value)
    except ValueError:
        number = None
    if name == "balanced" and not value:
        return balanced(layers, experts, k)
    if name == "zipf" and number is not None:
        return zipf(layers, experts, number, top_k=k, seed=seed)
    if name == "dirichlet" and number is not None:
        return dirichlet(layers, experts, number, top_k=k, seed=seed)
    raise ValueError(
        f"unknown skew {spec!r}: give balanced, zipf:S (S >= 0, e.g. zipf:0.8) or "
        "dirichlet:ALPHA (ALPHA > 0, e.g. dirichlet:4)"
    )


def placement_from_spec(spec: str, config: ModelConfig, routing: Routing) -> Placement:
    """`contiguous`, or `eplb:N` (N redundant experts placed per MoE layer by that layer's
    load, as DeepSeek's EPLB does)."""
    ranks = config.ep_size
    if spec == "contiguous":
        return contiguous(config.num_experts, ranks)
    name, _, value = spec.partition(":")
    if name == "eplb" and value.isdigit():
        return eplb(routing.expert_load(), ranks, int(value))
    raise ValueError(f"unknown placement {spec!r}: give contiguous or eplb:N (e.g. eplb:32)")


def cluster_step(spec: StepSpec, routing: Routing, placement: Placement) -> ClusterResult:
    """`spec`'s step on every rank of its EP group under `routing`: the group's size and GPUs
    per node are the recording's (`spec.config.ep_size`, `spec.profile.gpus_per_node`)."""
    return simulate_cluster(record_step(spec), routing, placement)
