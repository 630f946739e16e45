"""`dbo-sim analyze TRACE`: what a real GPU profiler trace says DBO did.

One job: the command line of `dbo.analyze_trace`. It prints the report (a row per step, the
chosen step in full, the verdict) or, with `--json`, the report as one JSON object, and writes
beside it, for the chosen step, the simulator's PNG timeline and a normalised Chrome trace
(streams named compute/comm, kernels coloured by class):

    dbo-sim analyze prefill-dbo.json.gz --steps 2 [--out out] [--step -1]
    dbo-sim analyze prefill-dbo.json.gz --steps 2 --against prefill-serial.json.gz
    dbo-sim analyze trace.json --window layers=0:2        # two layers drawn and reported
    dbo-sim analyze trace.json.gz --steps 2 --against-sim gpu-check --sim-mode prefill

Bad input (no such file, not a profiler trace, a CPU-only profile, a truncated `.gz`, a step
or window the trace does not have) is one line, exit status 2, and nothing written. The
options are checked before torch and the analysis are imported
(`scenarios.tools.analyze_run` does the work), so a refusal is immediate.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from scenarios.lib.usage import UsageError, int_in, writable_dir

__all__ = ["MAX_STEPS", "add_arguments", "run"]

MAX_STEPS = 100_000  # --steps: far above a profiler trace's steps; bounds what is allocated


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", help="a torch.profiler Chrome trace (.json[.gz])")
    p.add_argument("--out", default="out", help="folder for the PNG and trace (default: out/)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument(
        "--step", type=int, default=-1, help="the step drawn and shown in full (default: last)"
    )
    p.add_argument(
        "--steps",
        type=int_in(1, MAX_STEPS),
        default=None,
        metavar="N",
        help="cut a trace of N identical unmarked steps into N equal steps",
    )
    p.add_argument(
        "--window",
        default=None,
        metavar="START:END|layers=A:B",
        help="report and draw only microseconds START to END of the step, or layers A to B-1",
    )
    p.add_argument("--no-artifacts", action="store_true", help="write no PNG or trace")
    p.add_argument(
        "--against",
        metavar="SERIAL_TRACE",
        type=Path,
        default=None,
        help="a trace of the same step run serially (one thread; cut by the same --steps): "
        "says by how much DBO was faster or slower",
    )
    p.add_argument(
        "--against-sim",
        metavar="CONFIG",
        default=None,
        help="simulate this configuration (gpu-check, a scenarios.model preset, or a JSON "
        "file) beside the trace",
    )
    p.add_argument("--sim-mode", choices=("prefill", "decode"), help="the step's kind (needed)")
    p.add_argument("--sim-tokens", type=int_in(1, 1 << 20), help="tokens in the simulated step")
    p.add_argument("--sim-profile", default=None, help="simulator profile (default: the GPU's)")


def check_args(args: argparse.Namespace) -> None:
    """What can be refused without reading a trace or importing torch."""
    for flag, path in (("", Path(args.trace)), ("--against ", args.against)):
        if path is not None and not path.is_file():
            raise UsageError(f"{flag}{path}: no such trace file")
    if not args.no_artifacts:
        _check_out(Path(args.out))
    if args.against_sim is not None and args.sim_mode is None:
        raise UsageError("--against-sim needs --sim-mode prefill or decode (the step's kind)")


def _check_out(out: Path) -> None:
    """`out` can be written, checked without creating it: a refused trace leaves nothing."""
    if out.exists():
        writable_dir(out)
        return
    parent = next(p for p in out.absolute().parents if p.exists())
    try:  # a folder made and removed at once: what the write will need (/proc passes access())
        os.rmdir(tempfile.mkdtemp(dir=parent))
    except OSError as error:
        why = error.strerror or type(error).__name__
        raise UsageError(
            f"--out {out}: cannot create this folder in {parent} ({why}); choose another"
        ) from None


def run(args: argparse.Namespace) -> int:
    """`dbo-sim analyze`: the report, the PNG and the normalised trace of one step."""
    check_args(args)
    from scenarios.tools import analyze_run  # torch and the analysis: only now

    return analyze_run.analyze(args)
