"""What `dbo-sim plan` prints and writes: the answer per phase, the engine flags, the points
as CSV, the gain curves as a PNG, and the replayed EP group at the answer's point."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from dbo.sim.cluster import ClusterResult
from dbo.sim.cluster_report import (
    critical_path,
    gating_table,
    path_summary,
    plot_cluster,
    write_cluster_trace,
)

__all__ = ["PlanPoint", "PhaseAnswer", "engine_flags", "report", "write_outputs"]


@dataclass(frozen=True)
class PlanPoint:
    """One replayed step: the slowest rank's time, and what gated it."""

    phase: str
    ep: int
    skew: str
    tokens: int
    num_ubatches: int  # 1: serial
    step_us: float
    gain_pct: float  # against the serial step of the same point (0 for serial)
    slowest_rank: int
    peer_wait_us: float  # the slowest rank's wait for peers' rows
    exposed_comm_us: float
    padded_tokens: int
    padding_share: float
    split: bool  # the DP ranks agreed to split


@dataclass(frozen=True)
class PhaseAnswer:
    phase: str
    ep: int
    skew: str
    pays_from: int | None  # tokens per device
    best_ubatches: int | None
    best_gain_pct: float
    best_tokens: int | None


def engine_flags(answers: list[PhaseAnswer], comm_sms: int | None = None) -> list[str]:
    """The flags that turn DBO on where it pays, at the token counts it pays from, and
    (given `comm_sms`, the SMs the simulation reserved for high-throughput comm kernels)
    vLLM 0.33's `VLLM_DBO_COMM_SMS`, so the engine reserves what the plan assumed."""
    by_phase = {a.phase: a for a in answers}
    paying = [a for a in answers if a.pays_from is not None]
    if not paying:
        return ["DBO does not pay in this range: leave it off (no --enable-dbo)."]
    vllm = ["--enable-dbo"]
    for phase in ("decode", "prefill"):
        a = by_phase.get(phase)
        if a is not None and a.pays_from is not None:
            vllm.append(f"--dbo-{phase}-token-threshold {a.pays_from}")
        elif a is not None:
            vllm.append(f"--dbo-{phase}-token-threshold 1000000000  # never pays in range")
    counts = sorted({a.best_ubatches for a in paying if a.best_ubatches})
    lines = [f"vLLM:   {' '.join(vllm)}", "SGLang: --enable-two-batch-overlap"]
    if comm_sms is not None:
        lines.insert(
            1, f"vLLM env: VLLM_DBO_COMM_SMS={comm_sms}  # SMs for DeepEP's normal kernels"
        )
    if counts and counts != [2]:
        lines.append(
            f"best ubatch count {', '.join(map(str, counts))}: both engines run 2; more "
            "needs an engine that supports it"
        )
    return lines


def _skew_lines(answers: list[PhaseAnswer]) -> list[str]:
    lines = []
    for a in answers:
        where = f"from {a.pays_from} tokens/device" if a.pays_from else "never in range"
        lines.append(
            f"  EP {a.ep:<4} {a.skew:<22} pays {where}; best {a.best_gain_pct:+.1f}% "
            f"at {a.best_tokens} tokens"
        )
    return lines


def _phase_table(points: list[PlanPoint], phase: str, ep: int, skew: str) -> list[str]:
    rows = [p for p in points if (p.phase, p.ep, p.skew) == (phase, ep, skew)]
    counts = sorted({p.num_ubatches for p in rows if p.num_ubatches > 1})
    head = "  tokens  serial_ms " + " ".join(f"gain_n{n:<2}" for n in counts)
    head += "  slowest  peer_wait_us  padded"
    lines = [head]
    for t in sorted({p.tokens for p in rows}):
        at = {p.num_ubatches: p for p in rows if p.tokens == t}
        serial = at[1]
        gains = " ".join(f"{at[n].gain_pct:+7.1f}%" if n in at else "      -" for n in counts)
        best = max((at[n] for n in counts if n in at), key=lambda p: p.gain_pct)
        lines.append(
            f"  {t:>6}  {serial.step_us / 1e3:9.2f} {gains}  {best.slowest_rank:>7}  "
            f"{best.peer_wait_us:12.1f}  {best.padded_tokens:>6}"
        )
    return lines


def _answer_lines(a: PhaseAnswer, result: ClusterResult | None) -> list[str]:
    if a.pays_from is None:
        lines = [f"  DBO does not pay for {a.phase} in this range (best {a.best_gain_pct:+.1f}%)"]
    else:
        lines = [
            f"  DBO pays for {a.phase} from {a.pays_from} tokens per device with "
            f"{a.best_ubatches} ubatches (best {a.best_gain_pct:+.1f}% at {a.best_tokens})"
        ]
    if result is not None:
        s = path_summary(critical_path(result))
        lines.append(
            f"  critical path at that point: compute {s['compute'] / 1e3:.2f} ms, comm "
            f"{s['comm'] / 1e3:.2f} ms, across {int(s['ranks'])} rank(s)"
        )
        lines += [f"  {line}" for line in gating_table(result, top=3)]
    return lines


def _shown_result(shown: dict, phase: str) -> ClusterResult | None:
    answer, results = shown.get(phase, (None, {}))
    if answer is None or not results:
        return None
    key = (answer.pays_from or answer.best_tokens, answer.best_ubatches or 2)
    return results.get(key) or next(iter(results.values()))


def report(inputs: Any, answers: list[PhaseAnswer], points: list[PlanPoint], shown: dict,
           *, as_json: bool = False) -> str:  # fmt: skip
    """The printed answer: per phase the table, the answer, the gating, how skew moves it,
    then the engine flags."""
    if as_json:
        return json.dumps(
            {"answers": [asdict(a) for a in answers], "points": [asdict(p) for p in points],
             "flags": engine_flags(answers, inputs.profile.comm_sms)}, indent=2,
        )  # fmt: skip
    c, p = inputs.config, inputs.profile
    kernels = p.kernel_source
    lines = [
        f"dbo-sim plan: {c.name} on {p.name} (kernels: {kernels}), EP {inputs.eps[0]} "
        f"({-(-inputs.eps[0] // inputs.gpus_per_node)} node(s) of {inputs.gpus_per_node}), "
        f"placement {inputs.placement}"
    ]
    main = [a for a in answers if a.ep == inputs.eps[0] and a.skew == inputs.skews[0]]
    for a in main:
        mode = "LL kernels, CUDA graphs" if a.phase == "decode" else "normal kernels, eager"
        lines += ["", f"{a.phase} ({mode}), skew {a.skew}:"]
        lines += _phase_table(points, a.phase, a.ep, a.skew)
        lines += _answer_lines(a, _shown_result(shown, a.phase))
        lines += [f"how it moves ({a.phase}):"]
        lines += _skew_lines([b for b in answers if b.phase == a.phase])
    lines += ["", "engine flags:"] + [f"  {f}" for f in engine_flags(main, p.comm_sms)]
    return "\n".join(lines)


def _write_csv(path: Path, points: list[PlanPoint]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([f.name for f in fields(PlanPoint)])
        for p in points:
            writer.writerow(list(asdict(p).values()))
    return path


def _plot_gains(path: Path, points: list[PlanPoint]) -> Path:
    from matplotlib.figure import Figure

    phases = sorted({p.phase for p in points})
    fig = Figure(figsize=(6.5 * len(phases), 4.2))
    for k, phase in enumerate(phases):
        ax = fig.add_subplot(1, len(phases), k + 1)
        for ep, skew in sorted({(p.ep, p.skew) for p in points if p.phase == phase}):
            best: dict[int, float] = {}
            for p in points:
                if (p.phase, p.ep, p.skew) == (phase, ep, skew) and p.num_ubatches > 1:
                    best[p.tokens] = max(best.get(p.tokens, -1e9), p.gain_pct)
            xs = sorted(best)
            ax.plot(xs, [best[x] for x in xs], marker="o", label=f"EP {ep}, {skew}")
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per device")
        ax.set_ylabel("best DBO gain over serial (%)")
        ax.set_title(phase)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write_outputs(out: Path, points: list[PlanPoint], shown: dict) -> list[Path]:
    """plan.csv, plan.png, and per phase the answer's EP group as trace and timeline PNG."""
    paths = [_write_csv(out / "plan.csv", points), _plot_gains(out / "plan.png", points)]
    for phase in sorted(shown):
        result = _shown_result(shown, phase)
        if result is None:
            continue
        paths.append(write_cluster_trace(result, out / f"plan.{phase}.trace.json", phase=phase))
        paths.append(plot_cluster(result, out / f"plan.{phase}.timeline.png", title=phase))
    return paths
