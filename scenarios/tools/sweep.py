"""Where DBO pays: simulated speedup against tokens per device, for decode and prefill.

Each point runs the DeepSeek-V3-size workload (`meta`, shapes only) serially and with DBO on
the simulated device and records the ratio of step times, and the DBO run's communication
against its compute time (`comm_compute_ratio`): the vLLM maintainers' rule is that DBO pays
only when communication outweighs the GEMMs it could hide under. Small decode batches are
host-launch and latency bound, so overlap cannot pay for its handoffs there; large prefill
batches move enough bytes for the comm stream to hide under compute. `pays_from` reads off
where a phase's gain turns positive; the PNG plots the gain against tokens per device (one
panel per phase) and against the comm/compute ratio.
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from dbo._json import finite_or_none
from scenarios.harness import RunOptions, compare_serial_dbo
from scenarios.model import Batch, ModelConfig, preset

DECODE_TOKENS = (16, 32, 64, 128, 256, 512)
PREFILL_TOKENS = (1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class SweepPoint:
    phase: str  # "decode" | "prefill"
    tokens_per_device: int
    step_us_serial: float
    step_us_dbo: float
    speedup: float
    overlap_fraction: float
    exposed_comm_us: float
    comm_us: float
    compute_us: float

    @property
    def comm_compute_ratio(self) -> float:
        """Communication time over compute time in the DBO run (inf with no compute)."""
        return self.comm_us / self.compute_us if self.compute_us > 0 else float("inf")

    def to_dict(self) -> dict[str, float | int | str]:
        """One CSV row (and one `sweep --json` line): the fields and the comm/compute ratio."""
        ratio = self.comm_compute_ratio
        return {**asdict(self), "comm_compute_ratio": finite_or_none(ratio)}


def pays_from(points: Sequence[SweepPoint]) -> int | None:
    """The smallest token count from which DBO is faster at every larger point tried (None:
    it is slower at the largest point, or there are no points)."""
    start = None
    for p in sorted(points, key=lambda p: p.tokens_per_device, reverse=True):
        if p.speedup <= 1.0:
            break
        start = p.tokens_per_device
    return start


def _batch(phase: str, tokens: int) -> Batch:
    if phase == "decode":
        return Batch.decode(num_requests=tokens, context_len=128)
    prompt = min(tokens, 4096)  # 4K-token prompts, as in SGLang's prefill benchmark
    return Batch.prefill(num_requests=max(tokens // prompt, 1), prompt_len=prompt)


def reduced(config: ModelConfig, num_layers: int) -> ModelConfig:
    """`config` with `num_layers` layers and its dense:MoE mix kept in proportion (DeepSeek-V3:
    3 dense of 61), so a few-layer sweep is not all dense layers with no communication."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    dense = round(config.num_dense_layers * num_layers / config.num_layers)
    return config.with_(num_layers=num_layers, num_dense_layers=min(dense, num_layers - 1))


def run_sweep(
    opts: RunOptions,
    *,
    decode_tokens: Sequence[int] = DECODE_TOKENS,
    prefill_tokens: Sequence[int] = PREFILL_TOKENS,
    num_layers: int | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
) -> list[SweepPoint]:
    config = preset("deepseek-v3")
    if num_layers is not None:
        config = reduced(config, num_layers)
    no_artifacts = replace(opts, out_dir=None)
    points = []
    for phase, tokens_list in (("decode", decode_tokens), ("prefill", prefill_tokens)):
        mode = "ll" if phase == "decode" else "ht"
        for tokens in tokens_list:
            c = compare_serial_dbo(f"sweep-{phase}-{tokens}", config, _batch(phase, tokens), mode, no_artifacts)
            s = c.dbo.summary
            point = SweepPoint(
                phase=phase,
                tokens_per_device=tokens,
                step_us_serial=c.serial.step_us,
                step_us_dbo=c.dbo.step_us,
                speedup=c.speedup,
                overlap_fraction=s.overlap_fraction,
                exposed_comm_us=s.exposed_comm_us,
                comm_us=s.comm_us,
                compute_us=s.compute_us,
            )
            points.append(point)
            if on_point is not None:
                on_point(point)
    return points


def write_csv(path: Path, points: Sequence[SweepPoint]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(points[0].to_dict()))
        writer.writeheader()
        for p in points:
            writer.writerow(p.to_dict())
    return path


def plot_sweep(path: Path, points: Sequence[SweepPoint]) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4))
    phases = (("decode", "low-latency"), ("prefill", "high-throughput"))
    for i, (phase, style) in enumerate(phases):
        ax = fig.add_subplot(1, 3, i + 1)
        pts = [p for p in points if p.phase == phase]
        if not pts:
            continue
        ax.plot([p.tokens_per_device for p in pts], [(p.speedup - 1) * 100 for p in pts], marker="o")
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per device")
        ax.set_ylabel("DBO gain over serial (%)")
        ax.set_title(f"{phase} ({style} EP)")
    ax = fig.add_subplot(1, 3, 3)
    for phase, _ in phases:
        pts = [p for p in points if p.phase == phase and p.compute_us > 0]
        if pts:
            ax.plot([p.comm_compute_ratio for p in pts], [(p.speedup - 1) * 100 for p in pts], "o", label=phase)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("comm time / compute time (DBO run)")
    ax.set_ylabel("DBO gain over serial (%)")
    ax.set_title("gain against comm/compute")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
