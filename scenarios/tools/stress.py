"""Concurrent slot access: many ubatch threads hammer the workspace while another locks and unlocks.

Threads act as ubatches (`workspace.testing.as_ubatch`) and call the workspace without the
runtime's baton, which is harsher than DBO (where one thread runs at a time). With `lanes` > 1
each request goes to a random lane (`use_workspace_lane`), so there is one slot per (ubatch,
lane); now and then a thread asks for its (ubatch, lane)'s persistent tensor
(`get_persistent`), and it keeps a few views across later growths. The checks are
invariants, not "no exception":
- every view lies wholly inside the buffer that was its own (ubatch, lane) slot when it was
  returned;
- no two slots' buffers overlap (so no view overlaps another slot's buffer); checked once at
  the end over every slot, since a scan of every slot per request would cost more than the
  request at a thousand threads;
- every growth resizes one slot per ubatch, of one lane; at the end a lane's slots are equal;
- no slot buffer is allocated while the manager is locked;
- a persistent tensor never moves, keeps its contents and lies in no slot buffer; a new one is
  refused while locked (counted), and the manager holds exactly the ones handed out;
- the orphaned bytes the manager reports equal, exactly, the replaced buffers the kept views
  still hold alive, and fall to zero once those views are dropped;
- every thread finishes (joined within the deadline);
- every thread does all its iterations: a run cut short by its deadline fails (`cut_short`),
  since it checked less than it was asked to.

The deadline holds for the whole run: starting the threads, the requests, and stopping and
joining them. An interrupt (Ctrl-C), thread start included, stops and joins every thread
before it propagates, so that no thread is inside torch when the interpreter exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from scenarios.lib.progress import progress_bar
from scenarios.lib.usage import int_in, positive_int, timeout_seconds
from scenarios.tools.stress_report import StressReport, print_report
from scenarios.tools.stress_run import StressRun
from workspace import WorkspaceManager

__all__ = ["StressReport", "add_arguments", "run", "run_stress"]


def run_stress(
    threads: int = 8,
    iterations: int = 2000,
    *,
    lanes: int = 1,
    seed: int = 0,
    deadline_s: float = 60.0,
    on_progress: Callable[[int], None] | None = None,
) -> StressReport:
    """`threads` ubatch threads make `iterations` random requests each, spread over `lanes`
    workspace lanes, while a locker thread locks and unlocks the manager; `on_progress(n)`
    hears how many iterations thread 0 has done (every 50, and at the end)."""
    if threads < 1 or iterations < 1 or lanes < 1:
        raise ValueError(
            f"threads, iterations and lanes must be >= 1, got {threads}, {iterations} and {lanes}"
        )
    manager = WorkspaceManager("cpu", num_ubatches=threads, num_lanes=lanes)
    run = StressRun(manager, threads, iterations, lanes, seed, on_progress)
    hook = run.manager.allocation_hook(run.watch_allocation)
    hook.__enter__()
    try:
        run.start_and_join(deadline_s)
    finally:
        # Taking the hook out waits for the manager's lock, which a hung thread's growth
        # holds: leave it in then (the manager is this run's own), so the deadline holds.
        if not run.report.hung_threads:
            hook.__exit__(None, None, None)
    if not run.report.hung_threads:  # a thread still running would race the checks
        run.check_final_state()
    return run.report


# --------------------------------------------------------------------------------------------
# The verb: `dbo-sim stress`

MAX_THREADS = 1024
MAX_LANES = 64  # slots are threads x lanes; vLLM's engines use a handful of lanes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=int_in(1, MAX_THREADS),
        default=8,
        help="ubatch threads (default 8)",
    )
    p.add_argument("--iterations", type=positive_int, default=2000, help="requests per thread")
    p.add_argument(
        "--lanes",
        type=int_in(1, MAX_LANES),
        default=1,
        help="workspace lanes each thread spreads its requests over (default 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=120.0,
        help="seconds for the whole run, thread start and stop included; a run cut short by "
        "it fails (default 120)",
    )
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    """`dbo-sim stress`: the counts, the invariants checked, then PASS or FAIL and why."""
    with progress_bar(
        args.iterations, f"stress x{args.threads}", quiet=args.json, unit="iteration"
    ) as bar:
        done = [0]

        def on_progress(completed: int) -> None:
            bar.update(completed - done[0])
            done[0] = completed

        report = run_stress(
            args.threads,
            args.iterations,
            lanes=args.lanes,
            seed=args.seed,
            deadline_s=args.timeout,
            on_progress=on_progress,
        )
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print_report(report, args.timeout)
    if report.hung_threads:
        # A thread that did not stop is inside a call it cannot be pulled out of (a workspace
        # growth, a torch op), and an interpreter that exits under it aborts the process.
        # Leave at once, the report printed: the deadline holds and the exit status is 1.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0 if report.passed else 1
