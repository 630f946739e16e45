"""Measure this host's launch and handoff costs, the two host numbers of a hardware profile.

`dbo-sim calibrate-host` times, on the machine it runs on (a CUDA GPU by default; `--device sim`
measures the handoff alone, on any machine):
- `launch_us`: host time of one eager torch op from Python (a tiny elementwise kernel and a
  small cuBLAS matmul; the profile's value is a typical model op between the two);
- `handoff_us`: host time of one `dbo_yield` between two ubatch threads, through
  `dbo.run_ubatches` on the given device.

On a GPU it uses `dbo.CudaDevice`; without one it can still measure the handoff on the
simulated device (`--device sim`), which has no real launches to time (its launch rows say
so). The H200 profile's host costs came from this measurement on an H200 host (the values are
in `dbo.sim.hardware`). The result is written as JSON to `--out` (default
`out/host-costs.json`, checked writable before anything is measured); use it with
`dataclasses.replace(profile, launch_us=..., handoff_us=...)` or a device's
`SimOptions(overrides=ProfileOverrides(launch_us=..., handoff_us=...))`.

The parser is here; the work, and torch with it, is `scenarios.tools.calibrate_host_run`, imported
by `run`, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse

__all__ = ["DEFAULT_OUT", "DESCRIPTION", "add_arguments", "run"]


DESCRIPTION = __doc__.splitlines()[0] + " Needs a CUDA GPU unless --device sim."


DEFAULT_OUT = "out/host-costs.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=["cuda", "sim"],
        default="cuda",
        help="where to measure: cuda (default; needs a GPU) or sim (the handoff alone)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"JSON file the result is written to ({DEFAULT_OUT})"
    )


def run(args: argparse.Namespace) -> int:
    from scenarios.tools import calibrate_host_run  # torch and the work: only now

    return calibrate_host_run.run(args)
