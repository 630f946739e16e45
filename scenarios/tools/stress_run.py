"""The work of `dbo-sim stress`: `run_stress`, and one run's schedule: the ubatch threads
and their random requests, spread over the lanes, the locker thread, and starting, stopping
and joining all of them within the deadline (Ctrl-C included). What the threads check is
`scenarios.tools.stress_checks`.

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
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from scenarios.lib.progress import progress_bar
from scenarios.tools.stress_checks import StressChecks
from scenarios.tools.stress_report import StressReport, print_report
from workspace import WorkspaceLockedError, WorkspaceManager, use_workspace_lane
from workspace.testing import as_ubatch

__all__ = ["StressRun", "run", "run_stress"]

_DTYPES = (torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float64)
# Of the deadline, the share kept for stopping and joining the threads (at most _MAX_STOP_S):
# a stopped worker ends within one request, but a thousand of them each need the GIL once.
_STOP_SHARE = 0.2
_MAX_STOP_S = 5.0
# Past the deadline, how long a stopped thread may still take to leave its request before it
# counts as hung.
_STOP_GRACE_S = 5.0
_KEPT_VIEWS = 3  # views each thread keeps across later growths (the orphan-accounting check)
_REFUSED_WAIT_S = 0.005  # how often a refused worker looks whether the run was stopped


class StressRun(StressChecks):
    """One stress run's shared state: the manager, the report, and the threads' signals."""

    def __init__(
        self,
        manager: WorkspaceManager,
        threads: int,
        iterations: int,
        lanes: int,
        seed: int,
        on_progress: Callable[[int], None] | None,
    ) -> None:
        """A run on `manager` (a slot for each of `threads` ubatches in each of `lanes`)."""
        self.threads, self.iterations, self.lanes, self.seed = threads, iterations, lanes, seed
        self.on_progress = on_progress
        self.manager = manager
        self.report = StressReport(threads, iterations, lanes=lanes)
        # Each slot's persistent tensor as first handed out (None: not made yet); only the
        # slot's own thread writes its entry.
        self.persistent: list[torch.Tensor | None] = [None] * (threads * lanes)
        self.kept: list[list[torch.Tensor]] = [[] for _ in range(threads)]
        # Per slot, its buffer as last confirmed by the manager: (generation, start, bytes);
        # only the slot's own thread writes its entry.
        self.confirmed: list[tuple[int, int, int] | None] = [None] * (threads * lanes)
        self.record_lock = threading.Lock()
        self.stop = threading.Event()
        self.go = threading.Event()  # set once every thread has started
        # Clear while the locker holds the manager locked: a refused worker waits for it, so
        # on a loaded machine the workers' iterations do not all run out inside one locked
        # spell (a run with no unlocked request checks nothing).
        self.unlocked = threading.Event()
        self.unlocked.set()
        self.done = 0
        self.finished = [0] * threads  # iterations each worker completed
        self.allocations_while_locked = 0

    def watch_allocation(
        self, nbytes: int, allocate: Callable[[int], torch.Tensor]
    ) -> torch.Tensor:
        """The run's allocation hook: counts every slot allocation, and those made locked."""
        with self.record_lock:
            self.allocations_while_locked += self.manager.is_locked()
            self.report.growths += 1
        return allocate(nbytes)

    # -- the threads -------------------------------------------------------------------------

    def start_and_join(self, deadline_s: float) -> None:
        """Start every thread, let them go, stop them, join them: all within `deadline_s`.

        The workers are stopped early enough (`_stop_reserve`) that stopping and joining them
        fits the deadline too. They start idle and are let go together, so starting a
        thousand threads is not slowed by the ones already running. Ctrl-C at any point stops
        and joins every started thread before it propagates: none is left inside torch when
        the interpreter exits (a daemon thread there aborts the process)."""
        start = time.monotonic()
        end_at = start + deadline_s
        stop_at = end_at - _stop_reserve(deadline_s)
        started: list[threading.Thread] = []
        try:
            with _sigint_deferred():  # a thread is never left half-started
                self._start_threads(started, stop_at)
            self.go.set()
            workers = len(started) - 1  # the last one is the locker
            while self.done < workers and time.monotonic() < stop_at:
                time.sleep(min(0.05, max(stop_at - time.monotonic(), 0.0)))
        finally:
            self.stop.set()
            self.go.set()
            with _sigint_deferred():  # a second Ctrl-C while stopping must not skip the joins
                _join_all(started, end_at + _STOP_GRACE_S)
        self.report.hung_threads = sum(t.is_alive() for t in started)
        self.report.iterations_done = sum(self.finished)
        self.report.cut_short = self.report.iterations_done < self.threads * self.iterations
        self.report.seconds = time.monotonic() - start
        if self.report.hung_threads:
            self.report.violations.append(
                f"{self.report.hung_threads} thread(s) still running {_STOP_GRACE_S:g} s after "
                "the deadline; the final-state checks were skipped"
            )
        else:
            self.manager.unlock()

    def _start_threads(self, started: list[threading.Thread], stop_at: float) -> None:
        """The workers, then the locker; a deadline reached while starting starts no more
        workers (the run is then cut short)."""
        for k in range(self.threads):
            if time.monotonic() >= stop_at:
                break
            worker = threading.Thread(
                target=self.worker, args=(k,), daemon=True, name=f"stress-{k}"
            )
            worker.start()
            started.append(worker)
        locker = threading.Thread(target=self.locker, daemon=True, name="stress-locker")
        locker.start()
        started.append(locker)

    def worker(self, slot: int) -> None:
        rng = random.Random(self.seed * 1000 + slot)
        self.go.wait()
        try:
            with as_ubatch(slot):
                for i in range(self.iterations):
                    self.finished[slot] = i
                    if self.stop.is_set():
                        return
                    self._one_request(slot, rng)
                    if slot == 0:
                        self._progress(i + 1)
                self.finished[slot] = self.iterations
        finally:
            with self.record_lock:
                self.done += 1

    def _one_request(self, ubatch: int, rng: random.Random) -> None:
        lane = rng.randrange(self.lanes) if self.lanes > 1 else 0
        slot = ubatch * self.lanes + lane  # the manager's slot numbering
        pairs = _random_request(rng)
        with use_workspace_lane(lane):
            if rng.random() < 0.05:
                self.persistent_request(slot)
            try:
                views = self.manager.get_simultaneous(*pairs)
            except WorkspaceLockedError:
                with self.record_lock:
                    self.report.locked_refusals += 1
                while not self.unlocked.wait(_REFUSED_WAIT_S) and not self.stop.is_set():
                    pass  # until the locker unlocks, or the run is stopped
                return
        problems = self.check_views(slot, pairs, views)
        if problems:
            with self.record_lock:
                self.report.violations.extend(problems)
        if views and rng.random() < 0.2:  # keep a few across other threads' growths
            self.kept[ubatch] = (self.kept[ubatch] + views)[-_KEPT_VIEWS:]
        with self.record_lock:
            self.report.requests += 1

    def _progress(self, completed: int) -> None:
        if self.on_progress is not None and (completed % 50 == 0 or completed == self.iterations):
            self.on_progress(completed)  # iterations slot 0 has completed

    def locker(self) -> None:
        rng = random.Random(self.seed)
        self.go.wait()
        while not self.stop.is_set() and self.done < self.threads:
            self.unlocked.clear()
            self.manager.lock()
            time.sleep(rng.uniform(0.0005, 0.002))
            self.manager.unlock()
            self.unlocked.set()
            self.report.lock_cycles += 1
            time.sleep(rng.uniform(0.0005, 0.002))


def _stop_reserve(deadline_s: float) -> float:
    return min(_MAX_STOP_S, deadline_s * _STOP_SHARE)


@contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Ctrl-C inside the block is raised as KeyboardInterrupt when the block ends, not in the
    middle of it. Only in the main thread with Python's own SIGINT handler installed (where
    KeyboardInterrupt comes from); elsewhere the block runs as it is."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def _join_all(threads: list[threading.Thread], until: float) -> None:
    """Join each thread, waiting for all of them together at most until `until`."""
    for t in threads:
        while t.is_alive() and time.monotonic() < until:
            t.join(min(0.1, max(until - time.monotonic(), 0.0)))


def _random_request(rng: random.Random) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """1-4 small random tensors; now and then one large enough to force a growth."""
    pairs = [
        (tuple(rng.randint(0, 24) for _ in range(rng.randint(1, 3))), rng.choice(_DTYPES))
        for _ in range(rng.randint(1, 4))
    ]
    if rng.random() < 0.02:
        pairs.append(((rng.randint(1, 64) * 1024,), torch.uint8))
    return pairs


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
