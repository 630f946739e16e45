"""`dbo-sim analyze TRACE`: what a real GPU profiler trace says DBO did.

One job: the command line of `dbo.analyze_trace`. It prints the report (a row per step, the
chosen step in full, the verdict) or, with `--json`, the report as one JSON object, and writes
beside it, for the chosen step, the simulator's PNG timeline and a normalised Chrome trace
(streams named compute/comm, kernels coloured by class):

    dbo-sim analyze prefill-dbo.json.gz [--out out] [--step -1] [--steps N]
    dbo-sim analyze trace.json --window layers=0:2        # two layers drawn and reported
    dbo-sim analyze trace.json.gz --steps 2 --against-sim gpu-check --sim-mode prefill

Bad input (no such file, not a profiler trace, a CPU-only profile, a truncated `.gz`, a step
or window the trace does not have) is one line, exit status 2, and nothing written.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from dbo.analysis import TraceError, TraceReport, analyze_timeline, format_report, load_timeline
from dbo.analysis.analyze import step_report
from dbo.analysis.layers import layer_starts
from dbo.analysis.timeline import DeviceTimeline, Step
from dbo.sim.plot import plot_timeline
from dbo.sim.records import SYNC, HostRange, OpRecord
from dbo.sim.trace import Window, WindowSpec, chrome_trace
from scenarios.lib.trace_window import window_type
from scenarios.lib.usage import UsageError, writable_dir
from scenarios.tools import analyze_sim

__all__ = ["add_arguments", "artifact_records", "run", "write_artifacts"]

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", help="a torch.profiler Chrome trace (.json[.gz])")
    p.add_argument("--out", default="out", help="folder for the PNG and trace (default: out/)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument(
        "--step", type=int, default=-1, help="the step drawn and shown in full (default: last)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help="cut a trace of N identical unmarked steps into N equal steps",
    )
    p.add_argument(
        "--window",
        type=window_type,
        default=None,
        metavar="START:END|layers=A:B",
        help="report and draw only microseconds START to END of the step, or layers A to B-1",
    )
    p.add_argument("--no-artifacts", action="store_true", help="write no PNG or trace")
    p.add_argument(
        "--against-sim",
        metavar="CONFIG",
        default=None,
        help="simulate this configuration (gpu-check, a scenarios.model preset, or a JSON "
        "file) beside the trace",
    )
    p.add_argument("--sim-mode", choices=("prefill", "decode"), help="the step's kind (needed)")
    p.add_argument("--sim-tokens", type=int, default=None, help="tokens in the simulated step")
    p.add_argument("--sim-profile", default=None, help="simulator profile (default: the GPU's)")


def _check_args(args: argparse.Namespace) -> analyze_sim.SimRequest | None:
    if not Path(args.trace).is_file():
        raise UsageError(f"{args.trace}: no such trace file")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if not args.no_artifacts:
        _check_out(Path(args.out))
    if args.against_sim is None:
        return None
    if args.sim_mode is None:
        raise UsageError("--against-sim needs --sim-mode prefill or decode (the step's kind)")
    request = analyze_sim.SimRequest(
        args.against_sim, args.sim_mode, args.sim_tokens, args.sim_profile
    )
    try:
        analyze_sim.check_request(request)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return request


def _check_out(out: Path) -> None:
    """`out` can be written, checked without creating it: a refused trace leaves nothing."""
    if out.exists():
        writable_dir(out)
        return
    parent = next(p for p in out.absolute().parents if p.exists())
    if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
        raise UsageError(f"--out {out}: cannot create this folder in {parent}; choose another")


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".json", ".trace"):
        name = name.removesuffix(suffix)
    return name


def _window(timeline: DeviceTimeline, step: Step, spec: WindowSpec | None) -> Window | None:
    """The window in trace microseconds: `START:END` counts from the step's start."""
    if spec is None:
        return None
    try:
        if spec.unit == "us":
            return Window(step.start_us + spec.start, step.start_us + spec.end)
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
    png = plot_timeline(Path(f"{stem}.png"), records, title=title, window=local)
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


def run(args: argparse.Namespace) -> int:
    """`dbo-sim analyze`: the report, the PNG and the normalised trace of one step."""
    request = _check_args(args)
    began = time.perf_counter()
    try:
        timeline, read_s = load_timeline(args.trace)
        report = analyze_timeline(timeline, args.trace, read_s, steps=args.steps)
    except TraceError as error:
        raise UsageError(str(error)) from None
    try:
        chosen = report.step(args.step)
    except IndexError as error:
        raise UsageError(f"--step {args.step}: {error}") from None
    step = timeline.steps[report.steps.index(chosen)]
    window = _window(timeline, step, args.window)
    if window is not None:
        chosen = step_report(timeline, step, (window.start_us, window.end_us))
        report.steps[report.steps.index(report.step(args.step))] = chosen
    comparison = _against_sim(request, report, chosen, step) if request else None
    if args.json:
        out = report.to_dict()
        if comparison is not None:
            out["against_sim"] = [vars(r) | {"delta": r.delta} for r in comparison[1]]
    else:
        print(format_report(report, detail=args.step))
        if comparison is not None:
            print()
            print(analyze_sim.format_rows(comparison[1], comparison[0]))
    written = []
    if not args.no_artifacts:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        written = [str(p) for p in write_artifacts(report, step, Path(args.out), window)]
    wall = time.perf_counter() - began
    if args.json:
        out["written"], out["wall_s"] = written, round(wall, 3)
        print(json.dumps(out))
    else:
        print()
        if written:
            print(f"wrote {', '.join(written)}")
        print(f"analyzed in {wall:.2f} s (reading {report.read_s:.2f} s)")
    return 0


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
