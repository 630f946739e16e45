"""What `dbo-sim analyze` does once `scenarios.tools.analyze` has checked its options.

One job: read the trace, report it (text or one JSON object), set the chosen step beside a
serial trace's (`--against`) or the simulator's (`--against-sim`), and write the chosen
step's PNG timeline and normalised Chrome trace.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dbo.analysis import TraceError, TraceReport, analyze_timeline, format_report, load_timeline
from dbo.analysis.against import SerialComparison, against_serial, ubatch_threads
from dbo.analysis.analyze import step_report
from dbo.analysis.layers import layer_starts
from dbo.analysis.timeline import DeviceTimeline, Step
from dbo.sim.plot import plot_timeline
from dbo.sim.records import SYNC, HostRange, OpRecord
from dbo.sim.trace import Window, WindowSpec, chrome_trace
from scenarios.lib.trace_window import parse_window
from scenarios.lib.usage import UsageError
from scenarios.tools import analyze_sim

__all__ = ["CLASS_COLORS", "analyze", "artifact_records", "write_artifacts"]

# Chrome's reserved colour names (trace viewer `cname`), one per kernel class.
CLASS_COLORS = {
    "gemm": "thread_state_running",
    "grouped_gemm": "good",
    "attention": "rail_animation",
    "norm": "olive",
    "elementwise": "yellow",
    "copy": "grey",
    "gather": "rail_idle",
    "scatter": "rail_load",
    "sort_topk": "rail_response",
    "comm": "terrible",
    "memcpy": "generic_work",
    "memset": "white",
    "other": "black",
}


def _window(timeline: DeviceTimeline, step: Step, text: str | None) -> Window | None:
    """The window in trace microseconds: `START:END` counts from the step's start."""
    if text is None:
        return None
    spec = _window_spec(text)
    try:
        if spec.unit == "us":
            length = step.end_us - step.start_us  # a window past the step is clipped to it
            if not 0 <= spec.start < length:
                raise ValueError(
                    f"--window {text}: {step.label} lasts {length:.1f} us; give START:END "
                    f"with 0 <= START < {length:.1f}"
                )
            return Window(step.start_us + spec.start, step.start_us + min(spec.end, length))
        starts = layer_starts(timeline.step_records(step))
        first, stop = int(spec.start), int(spec.end)
        if first >= len(starts):
            raise ValueError(
                f"--window layers={first}:{stop}: the step has {len(starts)} recognised "
                f"layer(s), numbered from 0"
            )
        end = starts[stop] if stop < len(starts) else step.end_us
        return Window(starts[first], end)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".json", ".trace"):
        name = name.removesuffix(suffix)
    return name


def artifact_records(
    timeline: DeviceTimeline, step: Step
) -> tuple[list[OpRecord], list[HostRange]]:
    """The step's device records, host synchronizations (as SYNC records) and ubatch launch
    calls (as host ranges), shifted so the step starts at 0."""
    t0 = step.start_us
    records = [_shifted(r, t0) for r in timeline.step_records(step)]
    ubatch_of = {t.tid: t.ubatch for t in timeline.threads}
    seq = max((r.seq for r in timeline.records), default=0) + 1
    ranges = []
    for h in timeline.host_between(step.start_us, step.end_us):
        if h.cat == "sync":
            records.append(
                OpRecord(
                    seq,
                    h.name,
                    SYNC,
                    0,
                    ubatch_of.get(h.thread),
                    "host",
                    h.start_us - t0,
                    h.start_us - t0,
                    h.end_us - t0,
                )
            )
            seq += 1
        elif h.thread in ubatch_of and h.cat in ("cuda_runtime", "cuda_driver"):
            ranges.append(
                HostRange(0, ubatch_of[h.thread], h.name, h.start_us - t0, h.end_us - t0, h.cat)
            )
    return records, ranges


def _shifted(r: OpRecord, t0: float) -> OpRecord:
    return OpRecord(
        r.seq,
        r.name,
        r.kind,
        r.rank,
        r.ubatch,
        r.stream,
        r.issue_us - t0,
        r.start_us - t0,
        r.end_us - t0,
        r.flops,
        r.bytes,
        r.replayed,
        r.args,
    )


def write_artifacts(
    report: TraceReport, step: Step, out: Path, window: Window | None
) -> tuple[Path, Path]:
    """`<stem>.analyze.png` and `<stem>.analyze.trace.json` of one step in `out`."""
    records, ranges = artifact_records(report.timeline, step)
    local = (
        None
        if window is None
        else Window(window.start_us - step.start_us, window.end_us - step.start_us)
    )
    stem = out / f"{_stem(report.path)}.analyze"
    figures = next(s for s in report.steps if s.figures.label == step.label).figures.summary
    title = (
        f"{report.path.name} · {step.label} (real {report.device_name or 'GPU'}): "
        f"{figures.step_us:.0f} us, overlap {100 * figures.overlap_fraction:.0f}%, "
        f"host-bound {100 * figures.host_bound_fraction:.0f}%"
    )
    png = plot_timeline(
        Path(f"{stem}.png"), records, title=title, window=local, clock="the profiler's clock"
    )
    trace = chrome_trace(
        records,
        ranges=ranges,
        window=local,
        metadata={"source": str(report.path), "step": step.label, "normalised_by": "analyze"},
    )
    for event in trace["traceEvents"]:
        cls = event.get("args", {}).get("class")
        if event.get("ph") == "X" and cls in CLASS_COLORS:
            event["cname"] = CLASS_COLORS[cls]
    path = Path(f"{stem}.trace.json")
    path.write_text(json.dumps(trace, allow_nan=False, separators=(",", ":")), encoding="utf-8")
    return png, path


def _read(path: str | Path, steps: int | None) -> tuple[DeviceTimeline, TraceReport]:
    try:
        timeline, read_s = load_timeline(path)
        return timeline, analyze_timeline(timeline, path, read_s, steps=steps)
    except TraceError as error:
        raise UsageError(str(error)) from None


def _against_serial(args: argparse.Namespace, report: TraceReport) -> SerialComparison | None:
    """The chosen step against the serial trace's, added to the step's verdict; for a DBO
    step without a serial trace, a note that this trace alone cannot say whether DBO paid."""
    if args.against is None:
        if ubatch_threads(report) >= 2:
            report.notes.append(
                "whether DBO paid: give a serial trace of the same step (--against "
                "SERIAL_TRACE); a DBO trace alone cannot say"
            )
        return None
    _, serial = _read(args.against, args.steps)
    try:
        comparison = against_serial(report, args.step, serial)
    except TraceError as error:
        raise UsageError(f"--against {error}") from None
    report.step(args.step).verdict.append(comparison.words())
    return comparison


def analyze(args: argparse.Namespace) -> int:
    """The report, the comparisons asked for, the PNG and the normalised trace of one step."""
    request = _sim_request(args)
    if args.window is not None:
        _window_spec(args.window)
    began = time.perf_counter()
    timeline, report = _read(args.trace, args.steps)
    try:
        chosen = report.step(args.step)
    except IndexError as error:
        raise UsageError(f"--step {args.step}: {error}") from None
    step = timeline.steps[report.steps.index(chosen)]
    window = _window(timeline, step, args.window)
    if window is not None:
        chosen = step_report(timeline, step, (window.start_us, window.end_us))
        report.steps[report.steps.index(report.step(args.step))] = chosen
    serial = _against_serial(args, report)
    comparison = _against_sim(request, report, chosen, step) if request else None
    written = []
    if not args.no_artifacts:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        written = [str(p) for p in write_artifacts(report, step, Path(args.out), window)]
    _print(args, report, serial, comparison, written, time.perf_counter() - began)
    return 0


def _print(
    args: argparse.Namespace,
    report: TraceReport,
    serial: SerialComparison | None,
    comparison: tuple[str, list[analyze_sim.Row]] | None,
    written: list[str],
    wall: float,
) -> None:
    if args.json:
        out = report.to_dict()
        if serial is not None:
            out["against"] = serial.to_dict()
        if comparison is not None:
            out["against_sim"] = [vars(r) | {"delta": r.delta} for r in comparison[1]]
        out["written"], out["wall_s"] = written, round(wall, 3)
        print(json.dumps(out, allow_nan=False))
        return
    print(format_report(report, detail=args.step))
    if comparison is not None:
        print()
        print(analyze_sim.format_rows(comparison[1], comparison[0]))
    print()
    if written:
        print(f"wrote {', '.join(written)}")
    print(f"analyzed in {wall:.2f} s (reading {report.read_s:.2f} s)")


def _sim_request(args: argparse.Namespace) -> analyze_sim.SimRequest | None:
    if args.against_sim is None:
        return None
    request = analyze_sim.SimRequest(
        args.against_sim, args.sim_mode, args.sim_tokens, args.sim_profile
    )
    try:
        analyze_sim.check_request(request)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return request


def _window_spec(text: str) -> WindowSpec:
    try:
        return parse_window(text)
    except ValueError as error:
        raise UsageError(f"--window {text!r}: {error}") from None


def _against_sim(
    request: analyze_sim.SimRequest, report: TraceReport, chosen, step: Step
) -> tuple[str, list[analyze_sim.Row]]:
    layers = len(chosen.layers) or None
    ubatches = sum(1 for t in chosen.figures.threads if t.label.startswith("ubatch"))
    try:
        case = analyze_sim.plan(request, layers)
    except ValueError as error:
        raise UsageError(str(error)) from None
    profile = analyze_sim.profile_for(report.device_name, request.profile)
    records = analyze_sim.simulate(case, profile, ubatches if ubatches >= 2 else None)
    title = (
        f"against the simulator: {request.config} {request.mode}, {case.config.num_layers} "
        f"layers, {ubatches if ubatches >= 2 else 'no'} ubatches, {case.batch.num_tokens} "
        f"tokens, profile {profile} (largest disagreement first)"
    )
    return title, analyze_sim.compare(report, chosen, records)
