"""Running the registered benchmarks and reporting them: the table on stdout, `bench.json`
with the date and the machine. A missed target is printed as MISSED but does not fail the
command: benchmarks report, tests gate."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from dbo.jsonsafe import json_safe
from scenarios.lib.progress import progress_bar
from scenarios.lib.usage import Interrupted, writable_dir
from scenarios.tools.bench.figures import Figure
from scenarios.tools.bench.registry import FULL, QUICK, Plan, benchmark_names, registered
from workspace import reset_workspace_manager

SCHEMA_VERSION = 1


# Torch intra-op threads during the run. Every op timed here is small, and on a shared
# machine an OpenMP region whose second worker is descheduled waits out a whole time slice,
# which turns a tiny step's samples into outliers many times its median.
BENCH_TORCH_THREADS = 1


@contextmanager
def _bench_conditions() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(BENCH_TORCH_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_benchmarks(
    plan: Plan, progress: Any = None, figures: list[Figure] | None = None
) -> list[Figure]:
    """Every registered benchmark in order; each one's figures are appended to `figures` (a
    fresh list by default) as it finishes, so a caller interrupted midway keeps them. A
    `progress` bar (`scenarios.lib.progress.progress_bar`) advances once per benchmark."""
    figures = [] if figures is None else figures
    with _bench_conditions():
        for bench in registered():
            figures.extend(bench(plan))
            if progress is not None:
                progress.set_postfix_str(bench.label)
                progress.update()
    return figures


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "usable_cpus": affinity,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "switch_interval_s": sys.getswitchinterval(),
        "git_commit": _git_commit(),
    }


def _fmt(value: float, unit: str) -> str:
    if math.isnan(value):
        return "n/a"
    if unit in ("count", "bytes"):
        return f"{int(value)}" + (" B" if unit == "bytes" else "")
    ns = value * {"ns": 1.0, "ms": 1e6}[unit]
    for scale, suffix in ((1e9, "s"), (1e6, "ms"), (1e3, "us")):
        if ns >= scale:
            return f"{ns / scale:.3g} {suffix}"
    return f"{ns:.3g} ns"


def _fmt_ratio(figure: Figure) -> str:
    ratio = figure.ratio
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x" + (" faster" if figure.ratio_def == "baseline/ours" else "")


def format_table(figures: Sequence[Figure]) -> str:
    """name, ours, baseline (medians), ratio, target, met: one row per figure."""
    header = ("name", "ours", "baseline", "ratio", "target", "met")
    rows = [header]
    for f in figures:
        rows.append(
            (
                f.name,
                _fmt(f.ours.median, f.unit),
                "-" if f.baseline is None else _fmt(f.baseline.median, f.unit),
                _fmt_ratio(f),
                "; ".join(t.label for t in f.targets) or "-",
                {True: "yes", False: "MISSED", None: "-"}[f.met],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(figures: Sequence[Figure], plan: Plan, seconds: float) -> dict[str, Any]:
    targeted = [f for f in figures if f.met is not None]
    return {
        "schema": SCHEMA_VERSION,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": plan.quick,
        "machine": machine_info(),
        "plan": asdict(plan),
        "torch_threads_during_run": BENCH_TORCH_THREADS,
        "seconds": round(seconds, 2),
        "benchmarks": list(benchmark_names()),
        "figures": [f.to_dict() for f in figures],
        "summary": {
            "targets": len(targeted),
            "met": sum(1 for f in targeted if f.met),
            "missed": [f.name for f in targeted if not f.met],
        },
    }


def _write(
    out: Path, figures: list[Figure], plan: Plan, seconds: float, interrupted: bool = False
) -> Path:
    doc = json_safe(report(figures, plan, seconds))
    doc["interrupted"] = interrupted  # True: only the benchmarks that finished are here
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    path.write_text(json.dumps(doc, indent=2, default=str, allow_nan=False) + "\n")
    return path


def run(args: argparse.Namespace) -> int:
    """`dbo-sim bench`: run the benchmarks, print the table (or the JSON), write
    <out>/bench.json; 0 whether or not every target is met (a missed one is a finding)."""
    quick, as_json, out = args.quick, args.json, Path(args.out)
    writable_dir(out)  # before any benchmark runs
    plan = QUICK if quick else FULL
    progress = progress_bar(len(registered()), "bench", quiet=as_json, unit="benchmark")
    start = time.monotonic()
    figures: list[Figure] = []
    try:
        run_benchmarks(plan, progress, figures)
    except KeyboardInterrupt:
        progress.close()
        path = _write(out, figures, plan, time.monotonic() - start, interrupted=True)
        if figures and not as_json:
            print(format_table(figures))
        raise Interrupted(
            f"{len(figures)} figure(s) from the benchmarks that finished are in {path}"
            + (" and above" if figures and not as_json else "")
        ) from None
    finally:
        progress.close()
        reset_workspace_manager()  # leave no benchmark's workspace behind for the caller
    path = _write(out, figures, plan, time.monotonic() - start)
    doc = json.loads(path.read_text())
    if as_json:
        print(json.dumps(doc, default=str, allow_nan=False))
        return 0
    m = doc["machine"]
    print(
        f"dbo-sim bench{' --quick' if quick else ''}  {doc['date']}  {m['platform']}, "
        f"{m['cpu_count']} CPUs, Python {m['python']}, torch {m['torch']}"
    )
    print(format_table(figures))
    print(
        "ours, baseline: medians; ratio: median of per-repetition ratios, ours/baseline "
        '("faster": baseline/ours)'
    )
    summary = doc["summary"]
    print(
        f"\n{summary['met']} of {summary['targets']} targets met in {doc['seconds']:.0f} s; "
        f"wrote {path}"
    )
    for f in figures:
        if f.met is False:
            targets = "; ".join(t.label for t in f.targets)
            note = f" - {f.note}" if f.note else ""
            print(
                f"MISSED {f.name}: {targets} (ours {_fmt(f.ours.median, f.unit)}, "
                f"ratio {_fmt_ratio(f)}){note}"
            )
    return 0
