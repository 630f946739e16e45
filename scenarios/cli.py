"""The command line: `python -m scenarios {list,run,sweep,stress,bench,fidelity}` (also `dbo-sim`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from scenarios.catalog import DEFAULT_SCENARIOS, SCENARIOS, ScenarioResult, run_scenario
from scenarios.harness import RunOptions
from scenarios.tools.progress import Progress


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class UsageError(Exception):
    """A bad command line: `main` prints it after "dbo-sim: " and exits 2."""


def _options(args: argparse.Namespace) -> RunOptions:
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda needs a CUDA GPU, and none is present here; use --device sim")
    from dbo.sim import profile_from_name

    try:
        profile_from_name(args.profile)  # a clear error for an unknown profile, before any work
    except ValueError as error:
        raise UsageError(f"--profile: {error}") from None
    return RunOptions(
        num_ubatches=args.ubatches,
        device=args.device,
        profile=args.profile,
        out_dir=None if args.no_artifacts else Path(args.out),
        timeout_s=args.timeout,
    )


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ubatches", "-n", type=int, default=2, help="ubatches per step (>= 2; default 2)")
    p.add_argument(
        "--device", choices=["sim", "cuda"], default="sim", help="simulated GPU (default) or real CUDA streams"
    )
    p.add_argument(
        "--profile", default="h200", help="hardware profile of the simulated device: h200, h100, h800, b200"
    )
    p.add_argument("--out", default="out", help="folder for traces, timelines, CSV (default: out/)")
    p.add_argument("--no-artifacts", action="store_true", help="write no trace or PNG files")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck step is ended")
    p.add_argument("--json", action="store_true", help="print one JSON report per line instead of the table")


def _fmt(value: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{suffix}"


def _fmt_bytes(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / 1024:.0f} KiB"


def _table(results: Sequence[ScenarioResult]) -> str:
    header = ("scenario", "verdict", "match", "races", "serial us", "dbo us", "speedup", "overlap", "ws peak")
    rows = [header]
    for r in results:
        verdict = ("PASS" if r.passed else "FAIL") + (" (fault caught)" if r.negative and r.passed else "")
        rows.append(
            (
                r.scenario,
                verdict,
                "-" if r.outputs_match is None else ("yes" if r.outputs_match else "NO"),
                str(r.races),
                _fmt(r.step_us_serial, ".1f"),
                _fmt(r.step_us_dbo, ".1f"),
                _fmt(r.speedup, ".2f", suffix="x"),
                _fmt(r.overlap_fraction, ".0f", 100, "%"),
                _fmt_bytes(r.workspace_peak_bytes),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_list(args: argparse.Namespace) -> int:
    for name, s in SCENARIOS.items():
        kind = "negative" if s.negative else "positive"
        print(f"{name:24} {kind:8}  {s.summary}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from scenarios import distributed

    across_ranks = args.ranks > 1 or distributed.launched_by_torchrun()
    names = args.names or [
        n
        for n in DEFAULT_SCENARIOS
        if (not across_ranks or SCENARIOS[n].rank is not None) and (args.device == "sim" or SCENARIOS[n].cuda)
    ]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise UsageError(f"unknown scenario(s) {', '.join(unknown)}; `python -m scenarios list` shows them")
    sim_only = [n for n in names if args.device != "sim" and not SCENARIOS[n].cuda]
    if sim_only and not across_ranks:
        raise UsageError(
            f"{', '.join(sim_only)}: simulator-only (race checker, graph replay or meta tensors); "
            f"run with --device sim"
        )
    if args.ubatches < 2:
        raise UsageError(f"--ubatches must be >= 2, got {args.ubatches}")
    if across_ranks:
        return _run_across_ranks(args, names, distributed)
    opts = _options(args)
    progress = Progress(len(names), "scenarios", enabled=False if args.json else None)
    results = []
    for name in names:
        result = run_scenario(name, opts)
        results.append(result)
        progress.update(f"{name}: {'pass' if result.passed else 'FAIL'}")
        if args.json:
            print(json.dumps(result.to_dict(), default=str), flush=True)
    progress.close()
    return _report(args, opts, results)


def _run_across_ranks(args: argparse.Namespace, names: Sequence[str], distributed: Any) -> int:
    """`--ranks N` (local processes) or a torchrun launch: one merged result per scenario."""
    single = distributed.check_names(names)
    if single:
        raise UsageError(
            f"scenario(s) {', '.join(single)} run in one process; across ranks choose from "
            f"{', '.join(distributed.across_ranks())}"
        )
    torchrun = distributed.launched_by_torchrun()
    if torchrun and args.ranks > 1:
        raise UsageError("--ranks starts local processes itself; under torchrun drop it (torchrun sets the ranks)")
    if not torchrun:
        bad_world = distributed.check_world_size(args.ranks)
        if bad_world:
            raise UsageError(f"--ranks {args.ranks}: {bad_world}")
    opts = _options(args)
    if torchrun:
        try:
            results = distributed.run_as_torchrun_rank(names, opts)
        except distributed.RankSetupError as error:
            print(f"dbo-sim: {error}", file=sys.stderr)
            return 1
        if results is None:
            return 0  # rank 0 reports for every rank
    else:
        results = distributed.run_local_ranks(names, opts, args.ranks)
    if args.json:
        for result in results:
            print(json.dumps(result.to_dict(), default=str), flush=True)
    return _report(args, opts, results)


def _report(args: argparse.Namespace, opts: RunOptions, results: Sequence[ScenarioResult]) -> int:
    if not args.json:
        print(_table(results))
        for r in results:
            if not r.passed:
                print(f"\n{r.scenario} FAILED: {r.error}")
        passed = sum(r.passed for r in results)
        print(f"\n{passed} passed, {len(results) - passed} failed")
        if opts.out_dir is not None:
            print(f"traces (open in https://ui.perfetto.dev) and timelines in {opts.out_dir}/")
    return 0 if all(r.passed for r in results) else 1


def cmd_sweep(args: argparse.Namespace) -> int:
    from scenarios.tools.sweep import DECODE_TOKENS, PREFILL_TOKENS, pays_from, plot_sweep, run_sweep, write_csv

    if args.ubatches < 2:
        raise UsageError(f"--ubatches must be >= 2, got {args.ubatches}")
    opts = _options(args)
    decode = args.decode or DECODE_TOKENS
    prefill = args.prefill or PREFILL_TOKENS
    progress = Progress(len(decode) + len(prefill), "sweep", enabled=False if args.json else None)
    points = run_sweep(
        opts,
        decode_tokens=decode,
        prefill_tokens=prefill,
        num_layers=args.layers,
        on_point=lambda p: progress.update(f"{p.phase} {p.tokens_per_device}"),
    )
    progress.close()
    out = Path(args.out)
    csv_path = write_csv(out / "sweep.csv", points)
    png_path = plot_sweep(out / "sweep.png", points)
    if args.json:
        for p in points:
            print(json.dumps(p.to_dict()))
        return 0
    print(f"{'phase':8} {'tokens':>7} {'serial us':>10} {'dbo us':>10} {'gain':>7} {'overlap':>8} {'comm/compute':>13}")
    for p in points:
        print(
            f"{p.phase:8} {p.tokens_per_device:7d} {p.step_us_serial:10.1f} {p.step_us_dbo:10.1f} "
            f"{(p.speedup - 1) * 100:6.1f}% {p.overlap_fraction * 100:7.0f}% {p.comm_compute_ratio:13.2f}"
        )
    print()
    for phase in ("decode", "prefill"):
        phase_points = [p for p in points if p.phase == phase]
        if phase_points:
            start = pays_from(phase_points)
            where = "at no point tried" if start is None else f"from {start} tokens per device"
            print(f"{phase}: DBO pays {where}")
    print(f"\nwrote {csv_path} and {png_path}")
    return 0


def cmd_stress(args: argparse.Namespace) -> int:
    from scenarios.tools.stress import run_stress

    if args.threads < 1 or args.iterations < 1:
        raise UsageError("--threads and --iterations must be >= 1")
    progress = Progress(args.iterations, f"stress x{args.threads}", enabled=False if args.json else None)
    last = [0]

    def on_progress(i: int) -> None:
        progress.update(step=i - last[0])
        last[0] = i

    report = run_stress(
        args.threads, args.iterations, seed=args.seed, deadline_s=args.timeout, on_progress=on_progress
    )
    progress.close()
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(
            f"{report.threads} threads x {report.iterations} iterations in {report.seconds:.2f} s: "
            f"{report.requests} requests, {report.growths} slot allocations, {report.lock_cycles} lock cycles, "
            f"{report.locked_refusals} locked refusals, {report.orphaned_bytes_after} orphaned bytes at the end"
        )
        print("invariants: views inside own slot, no cross-slot overlap, slots equal after growth, "
              "no allocation while locked, no hang")
        print("PASS" if report.passed else "FAIL:\n  " + "\n  ".join(report.violations[:20]))
    return 0 if report.passed else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from scenarios.tools.bench import main as bench_main

    return bench_main(args)


def cmd_fidelity(args: argparse.Namespace) -> int:
    from scenarios.tools.fidelity import run_command

    return run_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dbo-sim", description="Dual Batch Overlap scenarios on a simulated or real GPU"
    )
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("list", help="list the scenarios").set_defaults(func=cmd_list)
    run = sub.add_parser("run", help="run scenarios (default: every default scenario on the simulated device)")
    run.add_argument("names", nargs="*", help="scenario names (see `list`)")
    _add_common(run)
    run.add_argument(
        "--ranks",
        type=_positive_int,
        default=1,
        help="run across this many local processes (gloo on 127.0.0.1), one rank each; torchrun sets the ranks itself",
    )
    run.set_defaults(func=cmd_run)
    sweep = sub.add_parser("sweep", help="DBO speedup against tokens per device (CSV + PNG)")
    _add_common(sweep)
    sweep.add_argument("--decode", type=_positive_int, nargs="*", help="decode tokens per device to try")
    sweep.add_argument("--prefill", type=_positive_int, nargs="*", help="prefill tokens per device to try")
    sweep.add_argument(
        "--layers",
        type=_positive_int,
        default=None,
        help="fewer layers than DeepSeek-V3's 61 (faster); dense and MoE layers kept in proportion",
    )
    sweep.set_defaults(func=cmd_sweep)
    stress = sub.add_parser("stress", help="concurrent workspace slot access with growth and lock/unlock")
    stress.add_argument("--threads", type=int, default=8)
    stress.add_argument("--iterations", type=int, default=2000)
    stress.add_argument("--seed", type=int, default=0)
    stress.add_argument("--timeout", type=float, default=120.0)
    stress.add_argument("--json", action="store_true")
    stress.set_defaults(func=cmd_stress)
    bench = sub.add_parser("bench", help="benchmarks, each a ratio against a baseline in the same run")
    bench.add_argument("--quick", action="store_true", help="a short smoke run (CI)")
    bench.add_argument("--out", default="out", help="folder for bench.json")
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=cmd_bench)
    fidelity = sub.add_parser(
        "fidelity", help="the simulator against published DBO/TBO and DeepEP results, side by side"
    )
    fidelity.add_argument("--quick", action="store_true", help="fewer layers and points (seconds, for CI)")
    fidelity.add_argument("--json", action="store_true", help="print the report as JSON")
    fidelity.set_defaults(func=cmd_fidelity)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except UsageError as error:
        print(f"dbo-sim: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
