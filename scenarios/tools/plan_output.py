"""What `dbo-sim plan` prints and writes: the answer per phase, the engine flags, the points
as CSV, the gain curves as a PNG, and the replayed EP group at the answer's point."""

from __future__ import annotations

import csv
import json
import textwrap
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
from scenarios.tools.plan_errors import ErrorBar

__all__ = [
    "PlanPoint",
    "PhaseAnswer",
    "engine_flags",
    "gain_figure",
    "report",
    "setup_line",
    "write_outputs",
]


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
    fits: bool = True  # weights, KV cache and DeepEP buffers fit in one GPU's memory
    memory_gb: float = 0.0  # what one rank holds at this point (scenarios.tools.plan_memory)


@dataclass(frozen=True)
class PhaseAnswer:
    phase: str
    ep: int
    skew: str
    pays_from: int | None  # tokens per device
    best_ubatches: int | None
    best_gain_pct: float
    best_tokens: int | None
    unfit_tokens: tuple[int, ...] = ()  # counts whose points do not fit: not in the answer
    range_note: str = ""  # how the token range grew to find the crossover, and why it stopped
    error_bars: tuple[ErrorBar, ...] = ()  # the replay's misses on the nearest published rows


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
            f"at {a.best_tokens} tokens" + (f" ({a.range_note})" if a.range_note else "")
        )
    return lines


def error_text(a: PhaseAnswer) -> str:
    """The replay's known error near the answer, as printed beside its gain."""
    if not a.error_bars:
        return "replay error unknown: no stored fidelity run"
    return "replay off by up to " + "; ".join(b.describe() for b in a.error_bars)


def _phase_table(points: list[PlanPoint], phase: str, ep: int, skew: str) -> list[str]:
    rows = [p for p in points if (p.phase, p.ep, p.skew) == (phase, ep, skew)]
    counts = sorted({p.num_ubatches for p in rows if p.num_ubatches > 1})
    head = "  tokens  serial_ms " + " ".join(f"gain_n{n:<2}" for n in counts)
    head += "  slowest  peer_wait_us  padded  memory_gb"
    lines = [head]
    for t in sorted({p.tokens for p in rows}):
        at = {p.num_ubatches: p for p in rows if p.tokens == t}
        serial = at[1]
        gains = " ".join(f"{at[n].gain_pct:+7.1f}%" if n in at else "      -" for n in counts)
        best = max((at[n] for n in counts if n in at), key=lambda p: p.gain_pct)
        lines.append(
            f"  {t:>6}  {serial.step_us / 1e3:9.2f} {gains}  {best.slowest_rank:>7}  "
            f"{best.peer_wait_us:12.1f}  {best.padded_tokens:>6}  {serial.memory_gb:9.1f}"
            + ("  does not fit" if not serial.fits else "")
        )
    return lines


def _answer_lines(a: PhaseAnswer, result: ClusterResult | None) -> list[str]:
    if a.pays_from is None:
        lines = [
            f"  DBO does not pay for {a.phase} in this range (best {a.best_gain_pct:+.1f}%; "
            f"{error_text(a)})"
        ]
    else:
        lines = [
            f"  DBO pays for {a.phase} from {a.pays_from} tokens per device with "
            f"{a.best_ubatches} ubatches (best {a.best_gain_pct:+.1f}% at {a.best_tokens}; "
            f"{error_text(a)})"
        ]
    if a.range_note:
        lines.append(f"  {a.range_note}")
    if a.unfit_tokens:
        counts = ", ".join(map(str, a.unfit_tokens))
        lines.append(
            f"  does not fit in GPU memory at {counts} tokens per device (weights, KV cache, "
            "DeepEP buffers): left out of the answer"
        )
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


def setup_line(inputs: Any) -> str:
    """What was planned for, in one line: model, GPU, kernels, EP group, placement."""
    c, p = inputs.config, inputs.profile
    return (
        f"{c.name} on {p.name} (kernels: {p.kernel_source}), EP {inputs.eps[0]} "
        f"({-(-inputs.eps[0] // inputs.gpus_per_node)} node(s) of {inputs.gpus_per_node}), "
        f"placement {inputs.placement}"
    )


def report(
    inputs: Any,
    answers: list[PhaseAnswer],
    points: list[PlanPoint],
    shown: dict,
    *,
    as_json: bool = False,
) -> str:
    """The printed answer: per phase the table, the answer, the gating, how skew moves it,
    then the engine flags."""
    # The answer is the first EP size's under the first skew; the others show how it moves.
    main = [a for a in answers if a.ep == inputs.eps[0] and a.skew == inputs.skews[0]]
    if as_json:
        document = {
            "answers": [asdict(a) for a in answers],
            "points": [asdict(p) for p in points],
            "flags": engine_flags(main, inputs.profile.comm_sms),
        }
        return json.dumps(document, indent=2, allow_nan=False)
    lines = [f"dbo-sim plan: {setup_line(inputs)}"]
    for a in main:
        mode = "LL kernels, CUDA graphs" if a.phase == "decode" else "normal kernels, eager"
        lines += ["", f"{a.phase} ({mode}), skew {a.skew}:"]
        lines += _phase_table(points, a.phase, a.ep, a.skew)
        lines += _answer_lines(a, _shown_result(shown, a.phase))
        lines += [f"how it moves ({a.phase}):"]
        lines += _skew_lines([b for b in answers if b.phase == a.phase])
    lines += ["", "engine flags:"] + [f"  {f}" for f in engine_flags(main, inputs.profile.comm_sms)]
    return "\n".join(lines)


def _write_csv(path: Path, points: list[PlanPoint]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([f.name for f in fields(PlanPoint)])
        for p in points:
            writer.writerow(list(asdict(p).values()))
    return path


def gain_figure(points: list[PlanPoint], answers: list[PhaseAnswer], setup: str = "") -> Any:
    """The best gain against tokens per device, a panel per phase and a curve per (EP, skew),
    with each answer's threshold marked where DBO starts to pay (or said not to), under a
    title naming the setup."""
    from matplotlib.figure import Figure

    phases = sorted({p.phase for p in points})
    fig = Figure(figsize=(6.5 * len(phases), 4.6))
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
        _mark_threshold(ax, next((a for a in answers if a.phase == phase), None))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per device")
        ax.set_ylabel("best DBO gain over serial (%)")
        ax.set_title(phase)
        ax.legend(fontsize=7)
    if setup:  # wrapped to the figure's width (about 75 characters a panel at this size)
        fig.suptitle(textwrap.fill(setup, 75 * len(phases)), fontsize=9)
    fig.tight_layout()
    return fig


def _mark_threshold(ax: Any, answer: PhaseAnswer | None) -> None:
    """The chosen threshold as a dashed line, labelled with the flag value; or, where DBO
    never pays, a note saying so."""
    if answer is None:
        return
    if answer.pays_from is None:
        note = "DBO does not pay in this range: leave it off"
        ax.text(0.5, 0.92, note, ha="center", transform=ax.transAxes, fontsize=8, color="C3")
        return
    label = (
        f"threshold {answer.pays_from} tokens, {answer.best_ubatches} ubatches "
        f"(EP {answer.ep}, {answer.skew})"
    )
    ax.axvline(answer.pays_from, color="C3", linestyle="--", linewidth=1.2, label=label)


def write_outputs(out: Path, points: list[PlanPoint], shown: dict, setup: str = "") -> list[Path]:
    """plan.csv, plan.png (`setup` its title), and per phase the answer's EP group as trace
    and timeline PNG."""
    answers = [answer for answer, _ in shown.values() if answer is not None]
    fig = gain_figure(points, answers, setup)
    fig.savefig(out / "plan.png", dpi=110)
    paths = [_write_csv(out / "plan.csv", points), out / "plan.png"]
    for phase in sorted(shown):
        result = _shown_result(shown, phase)
        if result is None:
            continue
        paths.append(write_cluster_trace(result, out / f"plan.{phase}.trace.json", phase=phase))
        paths.append(plot_cluster(result, out / f"plan.{phase}.timeline.png", title=phase))
    return paths
