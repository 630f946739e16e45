"""The options `run` and `sweep` share, and the `RunOptions` they become.

Every option is checked here, before any work: a CUDA device that is absent, an unknown
hardware profile and an output folder that cannot be written are refused as `UsageError`s.
The options themselves import nothing heavy (a parser built for `--help` stays free of torch);
the simulator's profiles and the harness are imported when the options are checked.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from scenarios.lib.choices import PROFILE_NAMES
from scenarios.lib.usage import UsageError, int_in, timeout_seconds, writable_dir

if TYPE_CHECKING:
    from scenarios.harness import RunOptions

__all__ = ["MAX_UBATCHES", "add_run_options", "clock_line", "run_options"]

# The scenarios' smallest batches split into at most this many ubatches with a real token each.
MAX_UBATCHES = 8


def add_run_options(p: argparse.ArgumentParser) -> None:
    """--ubatches, --device, --profile, --out, --no-artifacts, --timeout and --json."""
    p.add_argument(
        "--ubatches",
        "-n",
        type=int_in(2, MAX_UBATCHES),
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
        help=f"hardware profile of the simulated device: {', '.join(PROFILE_NAMES)}",
    )
    p.add_argument("--out", default="out", help="folder for traces, timelines, CSV (default: out/)")
    p.add_argument("--no-artifacts", action="store_true", help="write no trace or PNG files")
    p.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=60.0,
        help="seconds before a stuck step is ended (the serial step included)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON report per line instead of the table"
    )


def run_options(args: argparse.Namespace) -> RunOptions:
    """The parsed options as `RunOptions`, refusing what cannot run before any work."""
    from dbo.sim import profile_from_name
    from scenarios.harness import RunOptions

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


def clock_line(profile_name: str, device: str = "sim") -> str:
    """What the step times rest on: CUDA events on a real GPU; on the simulated device,
    measured kernels or the roofline alone."""
    if device != "sim":
        return f"real {device} streams: step times measured with CUDA events"
    from dbo.sim import profile_from_name

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
