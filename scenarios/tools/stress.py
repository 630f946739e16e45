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

The parser is here; the work, and torch with it, is `scenarios.tools.stress_run`, imported
by `run`, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse

from scenarios.lib.usage import int_in, positive_int, timeout_seconds

__all__ = ["MAX_LANES", "MAX_THREADS", "add_arguments", "run"]


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
    from scenarios.tools import stress_run  # torch and the work: only now

    return stress_run.run(args)
