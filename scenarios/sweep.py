"""Where DBO pays: simulated speedup against tokens per device, for decode and prefill.

Each point runs the DeepSeek-V3-size workload (`meta`, shapes only) serially and with DBO on
the simulated device and records the ratio of step times. Small decode batches are host-launch
and latency bound, so overlap cannot pay for its handoffs there; large prefill batches move
enough bytes for the comm stream to hide under compute.
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from scenarios.harness import RunOptions, compare_serial_dbo
from scenarios.model import Batch, preset

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


def _batch(phase: str, tokens: int) -> Batch:
    if phase == "decode":
        return Batch.decode(num_requests=tokens, context_len=128)
    prompt = min(tokens, 4096)  # 4K-token prompts, as in SGLang's prefill benchmark
    return Batch.prefill(num_requests=max(tokens // prompt, 1), prompt_len=prompt)


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
        config = config.with_(num_layers=num_layers)
    points = []
    for phase, tokens_list in (("decode", decode_tokens), ("prefill", prefill_tokens)):
        mode = "ll" if phase == "decode" else "ht"
        for tokens in tokens_list:
            c = compare_serial_dbo(f"sweep-{phase}-{tokens}", config, _batch(phase, tokens), mode, RunOptions(**{**opts.__dict__, "out_dir": None}))
            s = c.dbo.summary
            point = SweepPoint(phase, tokens, c.serial.step_us, c.dbo.step_us, c.speedup, s.overlap_fraction, s.exposed_comm_us, s.comm_us, s.compute_us)
            points.append(point)
            if on_point is not None:
                on_point(point)
    return points


def write_csv(path: Path, points: Sequence[SweepPoint]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(points[0])))
        writer.writeheader()
        for p in points:
            writer.writerow(asdict(p))
    return path


def plot_sweep(path: Path, points: Sequence[SweepPoint]) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4))
    for i, phase in enumerate(("decode", "prefill")):
        ax = fig.add_subplot(1, 2, i + 1)
        pts = [p for p in points if p.phase == phase]
        if not pts:
            continue
        ax.plot([p.tokens_per_device for p in pts], [(p.speedup - 1) * 100 for p in pts], marker="o")
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per device")
        ax.set_ylabel("DBO gain over serial (%)")
        ax.set_title(f"{phase} ({'low-latency' if phase == 'decode' else 'high-throughput'} EP)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
