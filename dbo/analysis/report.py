"""The analysis of a trace as records and words: `TraceReport`, its verdicts and its text.

One job: put the figures of each step (`metrics`, `sidebyside`, `layers`) into one report,
say in a sentence or two what DBO did (the verdict), and print it. The verdict rules, fixed
before looking at any trace:

- No communication in the step: one stream ran everything, nothing could overlap (with two
  or more ubatch threads: DBO ran, but its communication, if any, ran as compute kernels on
  the compute stream).
- Communication kernels mostly (over half their time) on the compute stream: no overlap
  possible.
- Otherwise: the share of comm time hidden under compute, and the comm time left exposed.
- Host-bound when the device was idle for at least a quarter of the step, with what the host
  threads were doing then; device-bound otherwise.
- Side by side: the rate at which each role's kernels progressed beside the other stream's,
  and the time that cost, when kernels did share time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dbo.analysis.layers import LayerFigures
from dbo.analysis.metrics import StepFigures
from dbo.analysis.sidebyside import SideBySide
from dbo.analysis.timeline import DeviceTimeline

__all__ = ["StepReport", "TraceReport", "format_report", "verdict"]

HOST_BOUND_SHARE = 0.25


@dataclass
class StepReport:
    """One step: its figures, side-by-side slowdowns, layers and verdict."""

    figures: StepFigures
    side_by_side: SideBySide
    layers: list[LayerFigures]
    verdict: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.figures.to_dict(),
            "side_by_side": self.side_by_side.to_dict(),
            "layers": [layer.to_dict() for layer in self.layers],
            "verdict": self.verdict,
        }


@dataclass
class TraceReport:
    """What a trace says about its steps. `timeline` holds the normalised records the PNG
    and the Chrome trace are drawn from."""

    path: Path
    source: str
    device_name: str | None
    total_events: int
    read_s: float
    streams: dict[str, str]
    threads: list[dict[str, Any]]
    steps: list[StepReport]
    timeline: DeviceTimeline = field(repr=False)
    notes: list[str] = field(default_factory=list)

    def step(self, index: int) -> StepReport:
        if not -len(self.steps) <= index < len(self.steps):
            raise IndexError(f"the trace has {len(self.steps)} step(s); no step {index}")
        return self.steps[index]

    def to_dict(self) -> dict[str, Any]:
        return {
            "trace": str(self.path),
            "source": self.source,
            "device": self.device_name,
            "events": self.total_events,
            "read_s": round(self.read_s, 3),
            "streams": self.streams,
            "threads": self.threads,
            "notes": self.notes,
            "steps": [s.to_dict() for s in self.steps],
        }


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def _host_words(figures: StepFigures) -> str:
    """What each host thread did while the device was idle, its two largest categories."""
    parts = []
    for thread, cats in sorted(figures.host_in_idle.items()):
        total = sum(cats.values())
        if total <= 0:
            continue
        top = sorted(cats.items(), key=lambda kv: -kv[1])[:2]
        parts.append(f"{thread}: " + ", ".join(f"{k} {_pct(v / total)}" for k, v in top if v > 0))
    return "; ".join(parts)


def verdict(figures: StepFigures, sbs: SideBySide, ubatches: int) -> list[str]:
    """The verdict lines of one step (rules in the module docstring)."""
    s = figures.summary
    out = []
    streams = [k for k in s.busy_us_per_stream if k != "host"]
    if s.comm_us <= 0:
        if ubatches >= 2:
            out.append(
                f"DBO ran ({ubatches} ubatch threads) but all device work ran on one stream: "
                f"no communication beside compute, no overlap possible"
            )
        else:
            out.append(f"{len(streams)} stream(s), no communication kernels: nothing to overlap")
    elif figures.comm_on_compute_us > 0.5 * s.comm_us:
        out.append(
            f"comm ran on the compute stream: no overlap possible "
            f"({figures.comm_on_compute_us:.0f} us of communication kernels there)"
        )
    else:
        out.append(
            f"overlap: {_pct(s.overlap_fraction)} of comm ran under compute "
            f"({s.hidden_comm_us:.0f} of {s.comm_us:.0f} us); {s.exposed_comm_us:.0f} us exposed"
        )
    if s.host_bound_fraction >= HOST_BOUND_SHARE:
        words = _host_words(figures)
        out.append(
            f"host-bound: {_pct(s.host_bound_fraction)} of the step the GPU waited for the host"
            + (f" ({words})" if words else "")
        )
    else:
        out.append(f"device-bound: the GPU was idle {_pct(s.host_bound_fraction)} of the step")
    compute, comm = sbs.roles["compute"], sbs.roles["full_grid"]
    if compute.rate is not None and comm.rate is not None:
        cost = compute.excess_us + comm.excess_us
        out.append(
            f"side by side ({figures.both_busy_us:.0f} us with both streams busy): compute "
            f"kernels with a solo instance ran at "
            f"{compute.rate:.2f} of their solo speed, comm-stream ones at {comm.rate:.2f}; "
            f"sharing the GPU cost {cost:.0f} us of kernel time"
        )
    return out


def format_report(report: TraceReport, detail: int | None = -1) -> str:
    """The report as text: the trace, a row per step, and `detail` step in full."""
    lines = [
        f"trace     {report.path.name} ({report.source}, {report.device_name or 'device ?'}, "
        f"{report.total_events} events, read in {report.read_s:.2f} s)",
        "streams   " + ", ".join(f"{role} = stream {sid}" for sid, role in report.streams.items()),
    ]
    if report.threads:
        lines.append(
            "threads   "
            + ", ".join(
                f"{t['label']} = tid {t['tid']} ({t['launches']} launches)" for t in report.threads
            )
        )
    lines += [f"note      {n}" for n in report.notes]
    lines.append("")
    lines.append(
        f"{'step':<14}{'time us':>11}{'compute us':>12}{'comm us':>10}{'overlap':>9}"
        f"{'exposed us':>12}{'host-bound':>12}"
    )
    for step in report.steps:
        s = step.figures.summary
        lines.append(
            f"{step.figures.label:<14}{s.step_us:>11.1f}{s.compute_us:>12.1f}{s.comm_us:>10.1f}"
            f"{_pct(s.overlap_fraction):>9}{s.exposed_comm_us:>12.1f}"
            f"{_pct(s.host_bound_fraction):>12}"
        )
    if detail is not None and report.steps:
        lines.append("")
        lines += _detail(report.step(detail))
    return "\n".join(lines)


def _detail(step: StepReport) -> list[str]:
    f, s = step.figures, step.figures.summary
    lines = [f"{f.label} in detail ({f.end_us - f.start_us:.1f} us):"]
    busy = ", ".join(
        f"{k} {v:.1f} us ({_pct(v / s.step_us if s.step_us else 0)})"
        for k, v in s.busy_us_per_stream.items()
        if k != "host"
    )
    lines.append(f"  busy        {busy}")
    lines.append(
        f"  compute stream idle {f.compute_idle_us:.1f} us: {f.idle_under_comm_us:.1f} us "
        f"while another stream ran, {f.compute_idle_us - f.idle_under_comm_us:.1f} us with the "
        f"device idle"
    )
    words = _host_words(f)
    if words:
        lines.append(f"  host while the device was idle: {words}")
    if f.threads:
        handoff = "" if f.handoff_us is None else f", {f.handoff_us:.1f} us each (median)"
        lines.append(
            "  threads     "
            + ", ".join(f"{t.label} {t.launches} launches" for t in f.threads)
            + (f"; {f.handoffs} hand-offs{handoff}" if f.handoffs else "")
        )
    lines.append("  kernels by class (count, us):")
    for stream, classes in f.classes.items():
        row = ", ".join(
            f"{c} {v.count} / {v.us:.0f}"
            for c, v in sorted(classes.items(), key=lambda kv: -kv[1].us)
        )
        lines.append(f"    {stream:<10}{row}")
    lines += _side_by_side_lines(step.side_by_side, f.both_busy_us)
    if step.layers:
        lines.append(f"  layers ({len(step.layers)}, recognised by their repeating kernels):")
        lines.append(
            f"    {'layer':<7}{'us':>10}{'compute us':>12}{'comm us':>10}{'overlap':>9}"
            f"{'host-bound':>12}"
        )
        for layer in step.layers:
            lines.append(
                f"    {layer.index:<7}{layer.layer_us:>10.1f}{layer.compute_us:>12.1f}"
                f"{layer.comm_us:>10.1f}{_pct(layer.overlap_fraction):>9}"
                f"{_pct(layer.host_bound_fraction):>12}"
            )
    lines.append("  verdict:")
    lines += [f"    - {v}" for v in step.verdict]
    return lines


def _side_by_side_lines(sbs: SideBySide, both_busy_us: float) -> list[str]:
    if both_busy_us <= 0:
        return ["  side by side: no kernel shared time with another stream's"]
    lines = [
        f"  side by side ({both_busy_us:.1f} us with both streams busy, of which "
        f"{sbs.shared_us:.1f} us between kernels with a solo instance to compare against):"
    ]
    if not any(r.kernels for r in sbs.roles.values()):
        return [*lines, "    no kernel that shared time has a solo instance in this step"]
    for role, r in sbs.roles.items():
        if r.kernels:
            lines.append(
                f"    {role:<10}{r.kernels} kernels with a solo instance, {r.duration_us:.0f} us "
                f"against {r.solo_us:.0f} us solo (x{r.slowdown:.2f}), {r.shared_us:.0f} us "
                f"beside the other stream, rate {r.rate:.3f}"
            )
    slow = sorted(sbs.classes.items(), key=lambda kv: -(kv[1].excess_us))
    lines.append(
        "    by class: "
        + ", ".join(f"{c} x{v.slowdown:.2f}" for c, v in slow if v.slowdown is not None)
    )
    return lines
