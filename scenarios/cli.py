"""The command line: `dbo-sim VERB` (also `python -m scenarios VERB`), one entry for every tool.

Every check of the command line and of the output folder happens before any work starts, and
every refusal is one line, `dbo-sim: <why>`, with exit status 2. Ctrl-C ends a verb with one
line and exit status 130; what finished before it stays printed and written (`run` and
`sweep` print and save each result as it finishes).

Every verb is one row of `VERBS`: its name, its help line, and a tool with
`add_arguments(parser)` and `run(args) -> exit status` (a module in `scenarios.tools`, or the
few verbs written here); a tool refuses a bad command line by raising `UsageError`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import torch

from dbo.sim import profile_from_name
from dbo.sim.hardware import PROFILES
from scenarios.catalog import DEFAULT_SCENARIOS, SCENARIOS, ScenarioResult, run_scenario
from scenarios.harness import RunOptions
from scenarios.ranks import launch as distributed
from scenarios.tools import analyze as analyze_tool
from scenarios.tools import bench as bench_tool
from scenarios.tools import bugs as bugs_tool
from scenarios.tools import calibrate_host, gpu_check, race_check, trace_window, verify_cli
from scenarios.tools import fidelity as fidelity_tool
from scenarios.tools import plan as plan_tool
from scenarios.tools import profile as profile_tool
from scenarios.tools import stress as stress_tool
from scenarios.tools import sweep as sweep_tool
from scenarios.tools.progress import Progress
from scenarios.tools.usage import Interrupted, UsageError, writable_dir

# The scenarios' smallest batches split into at most this many ubatches with a real token each.
MAX_UBATCHES = 8
MAX_TIMEOUT_S = 86400.0  # a day: larger values overflow the thread waits further down
MAX_STRESS_THREADS = 1024
MAX_STRESS_LANES = 64  # slots are threads x lanes; vLLM's engines use a handful of lanes
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # the shell's status for a process ended by SIGINT


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line refusal instead of a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"dbo-sim: {_one_line(message)}\n")


def _one_line(text: str, limit: int = 400) -> str:
    """`text` on one line, cut to `limit` characters with a note saying how much was cut."""
    flat = re.sub(r"\s+", " ", text).strip()
    if len(flat) <= limit:
        return flat
    return f"{flat[:limit]} ... ({len(flat) - limit} more characters)"


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high], refused in the user's words."""
    bounds = f">= {low}" if high is None else f"between {low} and {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number {bounds}, got {text!r}"
            ) from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


_positive_int = _int_in(1)
_ubatch_count = _int_in(2, MAX_UBATCHES)


def _timeout(text: str) -> float:
    """An argparse type: seconds, finite, above zero and at most a day."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(
            f"expected seconds above 0 and at most {MAX_TIMEOUT_S:.0f}, got {text!r}"
        )
    return value


def _version() -> str:
    try:
        return importlib.metadata.version("dbo-sim")
    except importlib.metadata.PackageNotFoundError:
        # Run from a source tree that was never installed: read the project file beside it.
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        text = pyproject.read_text() if pyproject.is_file() else ""
        found = re.search(r'^version = "([^"]+)"', text, re.MULTILINE)
        return found.group(1) if found else "unknown"


def _options(args: argparse.Namespace) -> RunOptions:
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError(
                "--device cuda needs a CUDA GPU, and none is present here; use --device sim"
            )

    try:
        profile_from_name(args.profile)  # a clear error for an unknown profile, before any work
    except ValueError as error:
        raise UsageError(f"--profile: {error}") from None
    if not args.no_artifacts:
        writable_dir(Path(args.out))
    return RunOptions(
        num_ubatches=args.ubatches,
        device=args.device,
        profile=args.profile,
        out_dir=None if args.no_artifacts else Path(args.out),
        timeout_s=args.timeout,
    )


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ubatches",
        "-n",
        type=_ubatch_count,
        default=2,
        help=f"ubatches per step (2 to {MAX_UBATCHES}; default 2)",
    )
    p.add_argument(
        "--device",
        choices=["sim", "cuda"],
        default="sim",
        help="simulated GPU (default) or real CUDA streams",
    )
    p.add_argument(
        "--profile",
        default="h200",
        help=f"hardware profile of the simulated device: {', '.join(PROFILES)}",
    )
    p.add_argument("--out", default="out", help="folder for traces, timelines, CSV (default: out/)")
    p.add_argument("--no-artifacts", action="store_true", help="write no trace or PNG files")
    p.add_argument(
        "--timeout", type=_timeout, default=60.0, help="seconds before a stuck step is ended"
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON report per line instead of the table"
    )


def _fmt(value: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{suffix}"


def _fmt_bytes(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / 1024:.0f} KiB"


_HEADER = (
    "scenario", "verdict", "match", "races", "serial us", "dbo us", "speedup", "overlap",
    "roofline", "ws peak",
)  # fmt: skip
# Widths fixed up front so that rows print as their scenarios finish; a wider cell just
# pushes its row's later cells right.
_WIDTHS = (0, len("PASS (fault caught)"), 5, 5, 9, 9, 7, 7, 8, 10)


def _clock_line(profile_name: str) -> str:
    """What the step times rest on: measured kernels, or the roofline alone."""
    profile = profile_from_name(profile_name)
    if profile.kernels_derived:
        return (
            f"simulated {profile.name}: calibrated (kernels derived from the "
            f"{profile.extra['kernels_derived_from']} table, not measured on this GPU)"
        )
    if profile.calibrated:
        return (
            f"simulated {profile.name}: calibrated (measured kernel table; the 'roofline' column "
            f"is the share of device time no measured kernel covered)"
        )
    return (
        f"simulated {profile.name}: UNCALIBRATED (no measured kernels: every op priced by the "
        f"roofline, step times are estimates)"
    )


class _Table:
    """The run table, printed a row at a time (flushed), so an interrupt keeps finished rows."""

    def __init__(self, names: Sequence[str]) -> None:
        self.widths = (max(len(_HEADER[0]), *map(len, names)), *_WIDTHS[1:])

    def _line(self, cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, self.widths)).rstrip()

    def header(self) -> str:
        return self._line(_HEADER) + "\n" + "  ".join("-" * w for w in self.widths)

    def row(self, r: ScenarioResult) -> str:
        verdict = ("PASS" if r.passed else "FAIL") + (
            " (fault caught)" if r.negative and r.passed else ""
        )
        return self._line(
            (
                r.scenario,
                verdict,
                "-" if r.outputs_match is None else ("yes" if r.outputs_match else "NO"),
                str(r.races),
                _fmt(r.step_us_serial, ".1f"),
                _fmt(r.step_us_dbo, ".1f"),
                _fmt(r.speedup, ".2f", suffix="x"),
                _fmt(r.overlap_fraction, ".0f", 100, "%"),
                _fmt(r.roofline_fraction, ".0f", 100, "%"),
                _fmt_bytes(r.workspace_peak_bytes),
            )
        )


def cmd_list(args: argparse.Namespace) -> int:
    for name, s in SCENARIOS.items():
        kind = "negative" if s.negative else "positive"
        if args.json:
            entry = {"name": name, "kind": kind, "default": name in DEFAULT_SCENARIOS,
                     "cuda": s.cuda, "summary": s.summary}  # fmt: skip
            print(json.dumps(entry))
        else:
            print(f"{name:24} {kind:8}  {s.summary}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    across_ranks = args.ranks > 1 or distributed.launched_by_torchrun()
    names = args.names or [
        n
        for n in DEFAULT_SCENARIOS
        if (not across_ranks or SCENARIOS[n].rank is not None)
        and (args.device == "sim" or SCENARIOS[n].cuda)
    ]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise UsageError(f"unknown scenario(s) {', '.join(unknown)}; `dbo-sim list` shows them")
    sim_only = [n for n in names if args.device != "sim" and not SCENARIOS[n].cuda]
    if sim_only and not across_ranks:
        raise UsageError(
            f"{', '.join(sim_only)}: simulator-only (race checker, graph replay or meta tensors); "
            f"run with --device sim"
        )
    if across_ranks:
        return _run_across_ranks(args, names, distributed)
    opts = _options(args)
    table = _Table(names)
    if not args.json:
        print(_clock_line(args.profile), flush=True)
        print(table.header(), flush=True)
    results: list[ScenarioResult] = []
    try:
        for name in names:
            result = run_scenario(name, opts)
            results.append(result)
            if args.json:
                print(json.dumps(result.to_dict(), default=str), flush=True)
            else:
                print(table.row(result), flush=True)
    except KeyboardInterrupt:
        kept = f" in {opts.out_dir}/" if opts.out_dir is not None and results else ""
        raise Interrupted(
            f"{len(results)} of {len(names)} scenario(s) finished; their results are above"
            f"{' and their traces' + kept if kept else ''}"
        ) from None
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
        raise UsageError(
            "--ranks starts local processes itself; under torchrun drop it (torchrun sets the "
            "ranks)"
        )
    if not torchrun:
        bad_world = distributed.check_world_size(args.ranks)
        if bad_world:
            raise UsageError(f"--ranks {args.ranks}: {bad_world}")
    opts = _options(args)
    table = _Table(names)
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
    if not args.json:
        print(table.header())
    for result in results:
        line = json.dumps(result.to_dict(), default=str) if args.json else table.row(result)
        print(line, flush=True)
    return _report(args, opts, results)


def _report(args: argparse.Namespace, opts: RunOptions, results: Sequence[ScenarioResult]) -> int:
    windowed = trace_window.write_windowed(results, getattr(args, "window", None))
    if not args.json:
        for r in results:
            if not r.passed:
                # One readable paragraph whatever the error's size; --json keeps the full text.
                print(f"\n{r.scenario} FAILED: {_one_line(r.error or '', 2000)}")
        passed = sum(r.passed for r in results)
        print(f"\n{passed} passed, {len(results) - passed} failed")
        if opts.out_dir is not None:
            print(f"traces (open in https://ui.perfetto.dev) and timelines in {opts.out_dir}/")
        if windowed:
            print(f"windowed: {', '.join(Path(p).name for p in windowed)}")
    return 0 if all(r.passed for r in results) else 1


def cmd_sweep(args: argparse.Namespace) -> int:
    decode = args.decode or sweep_tool.DECODE_TOKENS
    prefill = args.prefill or sweep_tool.PREFILL_TOKENS
    problem = sweep_tool.check_points(decode, prefill, args.ubatches)
    if problem is not None:
        raise UsageError(problem)
    opts = _options(args)
    out = Path(args.out)
    writable_dir(out)
    sink = sweep_tool.CsvSink(out / "sweep.csv")
    if not args.json:
        layers = f"{args.layers} of 61 layers" if args.layers else "61 layers"
        print(
            f"DeepSeek-V3 ({layers}), {args.ubatches} ubatches; decode: one-token requests over a "
            f"{args.context}-token context each (--context); prefill: "
            f"{sweep_tool.describe_prefill(prefill)}"
        )
        print(
            f"{'phase':8} {'tokens':>7} {'serial us':>10} {'dbo us':>10} {'gain':>7} "
            f"{'overlap':>8} {'comm/compute':>13}"
        )

    def on_point(p: sweep_tool.SweepPoint) -> None:
        sink.write(p)
        if args.json:
            print(json.dumps(p.to_dict()), flush=True)
            return
        print(
            f"{p.phase:8} {p.tokens_per_device:7d} {p.step_us_serial:10.1f} {p.step_us_dbo:10.1f} "
            f"{(p.speedup - 1) * 100:6.1f}% {p.overlap_fraction * 100:7.0f}% "
            f"{p.comm_compute_ratio:13.2f}",
            flush=True,
        )

    points: list[sweep_tool.SweepPoint] = []
    try:
        points = sweep_tool.run_sweep(
            opts,
            decode_tokens=decode,
            prefill_tokens=prefill,
            num_layers=args.layers,
            context_len=args.context,
            on_point=on_point,
        )
    except KeyboardInterrupt:
        raise Interrupted(f"the sweep points that finished are above and in {sink.path}") from None
    finally:
        sink.close()
    png_path = sweep_tool.plot_sweep(out / "sweep.png", points)
    if args.json:
        return 0
    print()
    for phase in ("decode", "prefill"):
        phase_points = [p for p in points if p.phase == phase]
        if phase_points:
            start = sweep_tool.pays_from(phase_points)
            where = "at no point tried" if start is None else f"from {start} tokens per device"
            print(f"{phase}: DBO pays {where}")
    print(f"\nwrote {sink.path} and {png_path}")
    return 0


def cmd_stress(args: argparse.Namespace) -> int:
    progress = Progress(
        args.iterations, f"stress x{args.threads}", enabled=False if args.json else None
    )
    last = [0]

    def on_progress(i: int) -> None:
        progress.update(step=i - last[0])
        last[0] = i

    try:
        report = stress_tool.run_stress(
            args.threads,
            args.iterations,
            lanes=args.lanes,
            seed=args.seed,
            deadline_s=args.timeout,
            on_progress=on_progress,
        )
    finally:
        progress.close()
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(
            f"{report.threads} threads x {report.iterations} iterations x {report.lanes} "
            "lane(s) in "
            f"{report.seconds:.2f} s: {report.requests} requests, {report.growths} slot "
            "allocations, "
            f"{report.lock_cycles} lock cycles, {report.locked_refusals} locked refusals, "
            f"{report.persistent_requests} persistent requests ({report.persistent_refusals} "
            "refused "
            f"while locked), {report.orphaned_bytes_kept} orphaned bytes held by kept views"
        )
        print(
            "invariants: views inside own slot, no cross-slot overlap, a lane's slots equal after "
            "growth, no allocation while locked, persistent tensors fixed, orphans counted "
            "exactly, no hang"
        )
        problems = list(report.violations[:20])
        if report.cut_short:
            problems.insert(
                0,
                f"cut short by the {args.timeout:g} s deadline after {report.iterations_done} of "
                f"{report.threads * report.iterations} iterations; give a longer --timeout or "
                "fewer "
                f"--iterations",
            )
        print("PASS" if report.passed else "FAIL:\n  " + "\n  ".join(problems))
    return 0 if report.passed else 1


def _list_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per scenario and line")


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", help="scenario names (see `list`)")
    _add_common(p)
    p.add_argument(
        "--ranks",
        type=_positive_int,
        default=1,
        help="run across this many local processes (gloo on 127.0.0.1), one rank each; "
        "torchrun sets the ranks itself",
    )
    trace_window.add_argument(p)


def _sweep_arguments(p: argparse.ArgumentParser) -> None:
    _add_common(p)
    p.add_argument(
        "--decode", type=_positive_int, nargs="+", help="decode tokens per device to try"
    )
    p.add_argument(
        "--prefill", type=_positive_int, nargs="+", help="prefill tokens per device to try"
    )
    p.add_argument(
        "--context",
        type=_positive_int,
        default=sweep_tool.DECODE_CONTEXT,
        help=f"KV-cache tokens per decode request (default {sweep_tool.DECODE_CONTEXT}, "
        "as dsv3-decode-ll)",
    )
    p.add_argument(
        "--layers",
        type=_positive_int,
        default=None,
        help="fewer layers than DeepSeek-V3's 61 (faster); dense and MoE layers kept in proportion",
    )


def _stress_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=_int_in(1, MAX_STRESS_THREADS),
        default=8,
        help="ubatch threads (default 8)",
    )
    p.add_argument("--iterations", type=_positive_int, default=2000, help="requests per thread")
    p.add_argument(
        "--lanes",
        type=_int_in(1, MAX_STRESS_LANES),
        default=1,
        help="workspace lanes each thread spreads its requests over (default 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout",
        type=_timeout,
        default=120.0,
        help="seconds for the whole run; a run cut short by it fails (default 120)",
    )
    p.add_argument("--json", action="store_true")


@dataclass(frozen=True)
class _Local:
    """A verb written in this module, shaped like a tool module: `add_arguments` and `run`."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    DESCRIPTION: str | None = None


@dataclass(frozen=True)
class Verb:
    """One `dbo-sim` verb: its name, its line in `dbo-sim --help`, and what it runs: a tool
    module (or a `_Local`) with `add_arguments(parser)` and `run(args) -> int`, looked up when
    the parser is built. Its `--help` description is the tool's DESCRIPTION, else the first
    line of its docstring."""

    name: str
    help: str
    tool: Any

    def description(self) -> str | None:
        described = getattr(self.tool, "DESCRIPTION", None)
        if described or not isinstance(self.tool, ModuleType):
            return described
        return (self.tool.__doc__ or "").strip().splitlines()[0] or None


# Every verb, in `dbo-sim --help` order.
VERBS: tuple[Verb, ...] = (
    Verb("list", "list the scenarios", _Local(_list_arguments, cmd_list)),
    Verb(
        "run",
        "run scenarios (default: every default scenario on the simulated device)",
        _Local(_run_arguments, cmd_run),
    ),
    Verb(
        "sweep",
        "DBO speedup against tokens per device (CSV + PNG)",
        _Local(_sweep_arguments, cmd_sweep),
    ),
    Verb(
        "stress",
        "concurrent workspace slot access with growth and lock/unlock",
        _Local(_stress_arguments, cmd_stress),
    ),
    Verb(
        "plan",
        "should DBO be on for your deployment: gain, ubatches, token threshold, engine flags",
        plan_tool,
    ),
    Verb("bench", "benchmarks, each a ratio against a baseline in the same run", bench_tool),
    Verb(
        "fidelity",
        "the simulator against published DBO/TBO and DeepEP results, side by side",
        fidelity_tool,
    ),
    Verb(
        "profile", "time this GPU's kernels into a table the simulator loads (CUDA)", profile_tool
    ),
    Verb(
        "verify",
        "verify your own forward under DBO (serial vs ubatched, races, errors)",
        verify_cli,
    ),
    Verb(
        "gpu-check",
        "real CUDA streams against the simulated H200 (needs a GPU, or --sim-only)",
        gpu_check,
    ),
    Verb(
        "calibrate-host",
        "this host's launch and handoff costs, for a profile (needs a GPU, or --device sim)",
        calibrate_host,
    ),
    Verb(
        "analyze", "what a real GPU profiler trace says DBO did (report, PNG, trace)", analyze_tool
    ),
    Verb(
        "race-check",
        "seeded race programs: the simulator's checker and torch's CSAN side by side",
        race_check,
    ),
    Verb("bugs", "real DBO bugs from vLLM's and SGLang's trackers, each caught", bugs_tool),
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dbo-sim", description="Dual Batch Overlap scenarios on a simulated or real GPU"
    )
    version = f"dbo-sim {_version()} (torch {torch.__version__})"
    parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command")
    for verb in VERBS:
        verb_parser = sub.add_parser(verb.name, help=verb.help, description=verb.description())
        verb.tool.add_arguments(verb_parser)
        verb_parser.set_defaults(func=verb.tool.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one verb; returns the exit status (2 usage, 130 interrupted)."""
    try:
        return _parse_and_run(list(sys.argv[1:] if argv is None else argv))
    except UsageError as error:
        _say(_one_line(str(error)))
        return EXIT_USAGE
    except Interrupted as interrupted:
        _say(f"interrupted; {interrupted}")
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # also while the parser is being built
        _say("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`dbo-sim list --json | head -1`): not an error worth a
        # traceback; stdout goes to /dev/null so the interpreter's final flush is quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _parse_and_run(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or a refusal already printed
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    return args.func(args)


def _say(line: str) -> None:
    sys.stdout.flush()  # so the line lands after every result printed before it
    print(f"dbo-sim: {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
