"""Fidelity's rows, as the verbs share them: the published sources and figures, the row
records and their acceptance rules, the profile description every assumption set starts with,
and the stored run (`FIDELITY_JSON`) that `dbo-sim fidelity --json` writes and `plan`'s error
bars read (`load_rows`), so the row format has one writer and its reader beside it. The
kernel, step and scale rows all build on one simulated whole step (`scenarios.lib.simulate`)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dbo.jsonsafe import json_safe
from dbo.sim.hardware import H100, H200, HardwareProfile
from scenarios.model import ModelConfig, preset

__all__ = [
    "FIDELITY_JSON",
    "FidelityRow",
    "FidelityReport",
    "deepseek_config",
    "pp_row",
    "range_pp_row",
    "rel_row",
    "describe_profile",
    "load_rows",
    "deepep_ll_constant",
    "deepep_ll_figures",
    "deepep_ll_table_note",
]

# --------------------------------------------------------------------------------------------
# Sources

SGLANG_BLOG = (
    "LMSYS/SGLang, 'Deploying DeepSeek with PD Disaggregation and Large-scale Expert "
    "Parallelism on 96 H100 GPUs' (2025-05-05), lmsys.org/blog/2025-05-05-large-scale-ep"
)
SGLANG_STRATEGY = "sglang srt/batch_overlap/operations_strategy.py (TBO 'blog' strategies)"
DEEPEP_README = "deepseek-ai/DeepEP README, V1 'Performance' tables (now docs/legacy.md)"
VLLM_DBO = (
    "vLLM maintainers on DBO (pays only when comm outweighs GEMMs; eager decode is launch bound)"
)

# DeepEP V1 low-latency kernels, H800 + CX7 400 Gb/s: 128 tokens, hidden 7168, top-8, FP8
# dispatch, BF16 combine. EP -> (dispatch us, combine us): the whole published table.
DEEPEP_LL_PUBLISHED: dict[int, tuple[float, float]] = {
    8: (77.0, 114.0),
    16: (118.0, 195.0),
    32: (155.0, 273.0),
    64: (173.0, 314.0),
    128: (192.0, 369.0),
    256: (194.0, 360.0),
}
# The (EP, kernel) figures DeepEP's low-latency constants are read off (`dbo.sim.hardware`,
# `scenarios.tools.fidelity_fit`): `ll_latency_us` off the one-node dispatch, whose time the
# NIC plays no part in, and `ll_rdma_efficiency` off the largest groups, with one EP size
# between them left out. Every other figure of the table is a check neither constant saw.
DEEPEP_LL_LATENCY_FIGURE = (8, "dispatch")
DEEPEP_LL_EFFICIENCY_FIGURES = tuple(
    (ep, kind) for ep in (64, 256) for kind in ("dispatch", "combine")
)


def deepep_ll_constant(ep: int, kind: str) -> str | None:
    """The low-latency constant read (even in part) off DeepEP's (`ep`, `kind`) figure, or
    None for a figure that is a check."""
    if (ep, kind) == DEEPEP_LL_LATENCY_FIGURE:
        return "ll_latency_us"
    return "ll_rdma_efficiency" if (ep, kind) in DEEPEP_LL_EFFICIENCY_FIGURES else None


def deepep_ll_figures(constant: str) -> str:
    """The figures a low-latency constant ("latency" or "efficiency") is read off, in words."""
    figures = {
        "latency": (DEEPEP_LL_LATENCY_FIGURE,),
        "efficiency": DEEPEP_LL_EFFICIENCY_FIGURES,
    }[constant]
    sizes = [str(ep) for ep in sorted({ep for ep, _ in figures})]
    return "EP " + (sizes[0] if len(sizes) == 1 else ", ".join(sizes[:-1]) + " and " + sizes[-1])


def deepep_ll_table_note(ep: int, kind: str) -> str:
    """Why a model whose times grow with the group misses the (`ep`, `kind`) figure more than
    its neighbours: empty unless the figure is above the next larger group's."""
    column = 0 if kind == "dispatch" else 1
    larger = [e for e in sorted(DEEPEP_LL_PUBLISHED) if e > ep]
    if not larger:
        return ""
    here, there = DEEPEP_LL_PUBLISHED[ep][column], DEEPEP_LL_PUBLISHED[larger[0]][column]
    if here <= there:
        return ""
    return (
        f"DeepEP's table puts this {kind} ({here:g} us) above the EP {larger[0]} one "
        f"({there:g} us), while the model's times grow with the group and already read the "
        f"EP {larger[0]} {kind} low"
    )


DEEPEP_HIDDEN, DEEPEP_TOPK, DEEPEP_LL_TOKENS, DEEPEP_NORMAL_TOKENS = 7168, 8, 128, 4096
# DeepEP normal kernels: intranode EP 8 dispatch 153 GB/s, combine 158 GB/s (NVLink);
# internode (RDMA) EP -> (dispatch GB/s, combine GB/s), 4096 tokens, top-4 groups of top-8.
DEEPEP_NVLINK_PUBLISHED = {"dispatch": 153.0, "combine": 158.0}
DEEPEP_RDMA_PUBLISHED: dict[int, tuple[float, float]] = {
    16: (43.0, 43.0),
    32: (58.0, 57.0),
    64: (51.0, 50.0),
}

# SGLang's TBO results (published gains, in %), and the setup the blog describes.
SGLANG_PREFILL_GAIN = (27.0, 35.0)  # a range over their prefill configurations
SGLANG_DECODE_GAIN = {32: -27.0, 256: 25.5}  # tokens per device -> gain
SGLANG_PREFILL_TOKENS = (8192, 16384)  # 8K-16K tokens per device
SGLANG_PROMPT = 4096  # 4K-token prompts
SGLANG_PREFILL_EP = 32  # assumption: 4 prefill nodes (DeepSeek's own prefill also runs EP 32)
SGLANG_DECODE_EP = 72  # 9 decode nodes
SGLANG_REDUNDANT_EXPERTS = 32  # EPLB with 32 redundant experts: 288 physical (4 per rank at EP 72)
SGLANG_DECODE_CONTEXT = 2000  # the blog's benchmark uses ~2000-token inputs
# DeepSeek-V3 routing (config.json): n_group 8, topk_group 4. DeepEP normal kernels send a
# token once per node it routes to, so this decides the RDMA bytes of the prefill path.
DSV3_GROUPS, DSV3_TOPK_GROUPS = 8, 4

VLLM_EAGER_GPU_BUSY_MS, VLLM_EAGER_STEP_MS = 11.8, 55.6

# The whole-step rows' GPU: H100 (no measured kernels: roofline), issued by a host with the
# figures measured on the H200 host (eager issue cost per op kind, baton passes).
STEP_PROFILE = replace(
    H100,
    launch_us=H200.launch_us,
    host_op_scale=dict(H200.host_op_scale),
    handoff_us=H200.handoff_us,
)

# The committed `dbo-sim fidelity --json` run (rerun the verb to refresh it): reading it costs
# nothing, running the verb per `plan` call would cost a minute.
FIDELITY_JSON = Path(__file__).parents[1] / "tools" / "fidelity.json"

GAIN_TOLERANCE_PP = 5.0
KERNEL_TOLERANCE = 0.10

# --------------------------------------------------------------------------------------------
# Rows


@dataclass(frozen=True)
class FidelityRow:
    """One published figure against the simulator."""

    key: str  # stable id (tests and JSON consumers)
    what: str
    published: str  # as published
    simulated: float
    unit: str  # "%", "us", "GB/s"
    delta: float | None  # simulated - published: in pp for "%", relative (%) otherwise
    delta_unit: str  # "pp" or "%"
    target: str  # the acceptance rule, in words
    met: bool
    assumptions: str  # key into the assumption sets printed under the table
    source: str
    note: str = ""  # why a target is missed, or what a row cannot check
    # A model constant was taken (even in part) from this very figure: shown, never a hit.
    calibration: bool = False
    # On an all-ranks row: the key of the one-rank row that scores the same figure.
    twin: str = ""

    @property
    def hit(self) -> bool:
        return self.met and not self.calibration

    def to_dict(self) -> dict[str, Any]:
        d = json_safe(asdict(self))
        d["hit"] = self.hit
        return d


@dataclass
class FidelityReport:
    rows: list[FidelityRow]
    assumptions: dict[str, str]  # key -> the numbers behind the rows that cite it
    quick: bool
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "quick": self.quick,
            "seconds": self.seconds,
            "rows": [r.to_dict() for r in self.rows],
            "assumptions": self.assumptions,
            "extra": self.extra,
        }


def load_rows(path: Path = FIDELITY_JSON) -> list[dict]:
    """The stored run's rows (`FidelityRow.to_dict`), or none when the file is missing or
    unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    rows = data.get("rows") if isinstance(data, dict) else None
    return [r for r in rows or [] if isinstance(r, dict) and isinstance(r.get("key"), str)]


def pp_row(
    key: str,
    what: str,
    published: float,
    simulated: float,
    assumptions: str,
    source: str,
    note: str = "",
    *,
    twin: str = "",
) -> FidelityRow:
    delta = simulated - published
    met = abs(delta) <= GAIN_TOLERANCE_PP and math.copysign(1, simulated) == math.copysign(
        1, published
    )
    return FidelityRow(
        key,
        what,
        f"{published:+.1f}%",
        simulated,
        "%",
        delta,
        "pp",
        f"within {GAIN_TOLERANCE_PP:g} pp, same sign",
        met,
        assumptions,
        source,
        "" if met else note,
        twin=twin,
    )


def range_pp_row(
    key: str,
    what: str,
    lo: float,
    hi: float,
    simulated: float,
    assumptions: str,
    source: str,
    note: str = "",
    *,
    twin: str = "",
) -> FidelityRow:
    delta = 0.0 if lo <= simulated <= hi else (simulated - hi if simulated > hi else simulated - lo)
    met = abs(delta) <= GAIN_TOLERANCE_PP and simulated > 0
    return FidelityRow(
        key,
        what,
        f"+{lo:g}% to +{hi:g}%",
        simulated,
        "%",
        delta,
        "pp",
        f"within {GAIN_TOLERANCE_PP:g} pp of the range, positive",
        met,
        assumptions,
        source,
        "" if met else note,
        twin=twin,
    )


def rel_row(
    key: str,
    what: str,
    published: float,
    simulated: float,
    unit: str,
    assumptions: str,
    source: str,
    note: str = "",
    calibration: bool = False,
    *,
    twin: str = "",
) -> FidelityRow:
    delta = (simulated / published - 1.0) * 100.0
    met = abs(delta) <= KERNEL_TOLERANCE * 100
    return FidelityRow(
        key,
        what,
        f"{published:g} {unit}",
        simulated,
        unit,
        delta,
        "%",
        f"within {KERNEL_TOLERANCE:.0%}",
        met,
        assumptions,
        source,
        note,
        calibration,
        twin,
    )


def describe_profile(profile: HardwareProfile) -> str:
    p = profile
    return (
        f"{p.name.upper()}: {p.peak_tflops['bf16']:g}/{p.peak_tflops['fp8']:g} TF bf16/fp8 at "
        f"{p.compute_efficiency:g}/{p.compute_efficiency_fp8:g}, HBM {p.hbm_gbps / 1e3:g} TB/s at "
        f"{p.memory_efficiency:g} (fp8 GEMMs {p.memory_efficiency_fp8:g}); NVLink "
        f"{p.nvlink_gbps:g} GB/s/dir at {p.nvlink_efficiency:g}, RDMA {p.rdma_gbps:g} GB/s at "
        f"{p.rdma_efficiency:g} ({p.ll_rdma_efficiency:g} under LL kernels), "
        f"{p.gpus_per_node} GPUs/node; LL fixed {p.ll_latency_us:g} us; "
        f"{p.comm_sms}/{p.num_sms} SMs per HT comm kernel; kernels: {_kernels(p)}; host: "
        f"{p.launch_us:g} us per eager elementwise op{_scales(p)}, handoff {p.handoff_us:g} us, "
        f"graph launch {p.graph_launch_us:g} us"
    )


def _kernels(p: HardwareProfile) -> str:
    if p.calibrated:
        return f"{p.kernel_source} (roofline beyond it)"
    return f"roofline (uncalibrated), {p.kernel_fixed_us:g} us fixed per kernel"


def _scales(p: HardwareProfile) -> str:
    scaled = [f"{k} x{v:g}" for k, v in sorted(p.host_op_scale.items()) if v != 1]
    return f" ({', '.join(scaled)})" if scaled else ""


def deepseek_config(ep_size: int, quick: bool) -> ModelConfig:
    """DeepSeek-V3 as the SGLang runs deploy it: 256 routed experts plus 32 redundant copies
    (EPLB) as 288 physical experts over the EP group."""
    config = preset("deepseek-v3", ep_size=ep_size, num_experts=256 + SGLANG_REDUNDANT_EXPERTS)
    if quick:  # per-layer gains: five MoE layers, no dense ones
        config = config.with_(num_layers=5, num_dense_layers=0)
    return config
