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
import gc
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from scenarios.lib.progress import progress_bar
from scenarios.lib.usage import int_in, positive_int, timeout_seconds
from workspace import WorkspaceLockedError, WorkspaceManager, use_workspace_lane
from workspace.testing import as_ubatch

_DTYPES = (torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float64)
# Of the deadline, the share kept for stopping and joining the threads (at most _MAX_STOP_S):
# a stopped worker ends within one request, but a thousand of them each need the GIL once.
_STOP_SHARE = 0.2
_MAX_STOP_S = 5.0
# Past the deadline, how long a stopped thread may still take to leave its request before it
# counts as hung.
_STOP_GRACE_S = 5.0
_PERSISTENT_KEY = "stress-state"  # one persistent tensor per (ubatch, lane)
_PERSISTENT_SHAPE = (4,)
_KEPT_VIEWS = 3  # views each thread keeps across later growths (the orphan-accounting check)
_REFUSED_WAIT_S = 0.005  # how often a refused worker looks whether the run was stopped


@dataclass
class StressReport:
    threads: int
    iterations: int
    requests: int = 0
    growths: int = 0
    locked_refusals: int = 0
    lock_cycles: int = 0
    violations: list[str] = field(default_factory=list)
    hung_threads: int = 0
    seconds: float = 0.0
    final_capacities: list[int] = field(default_factory=list)
    orphaned_bytes_after: int = 0
    iterations_done: int = 0  # over all threads; threads * iterations unless cut short
    cut_short: bool = False  # the deadline passed before every thread finished
    lanes: int = 1
    persistent_requests: int = 0
    persistent_refusals: int = 0  # a new persistent tensor asked for while locked
    orphaned_bytes_kept: int = 0  # replaced buffers the kept views held alive at the end

    @property
    def passed(self) -> bool:
        return not self.violations and self.hung_threads == 0 and not self.cut_short

    def to_dict(self) -> dict:
        return {**self.__dict__, "passed": self.passed, "violations": self.violations[:20]}


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
    run = _StressRun(threads, iterations, lanes, seed, on_progress)
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


class _StressRun:
    """One stress run's shared state: the manager, the report, and the threads' signals."""

    def __init__(
        self,
        threads: int,
        iterations: int,
        lanes: int,
        seed: int,
        on_progress: Callable[[int], None] | None,
    ) -> None:
        self.threads, self.iterations, self.lanes, self.seed = threads, iterations, lanes, seed
        self.on_progress = on_progress
        self.manager = WorkspaceManager("cpu", num_ubatches=threads, num_lanes=lanes)
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
                self._persistent_request(slot)
            try:
                views = self.manager.get_simultaneous(*pairs)
            except WorkspaceLockedError:
                with self.record_lock:
                    self.report.locked_refusals += 1
                while not self.unlocked.wait(_REFUSED_WAIT_S) and not self.stop.is_set():
                    pass  # until the locker unlocks, or the run is stopped
                return
        problems = self._check_views(slot, pairs, views)
        if problems:
            with self.record_lock:
                self.report.violations.extend(problems)
        if views and rng.random() < 0.2:  # keep a few across other threads' growths
            self.kept[ubatch] = (self.kept[ubatch] + views)[-_KEPT_VIEWS:]
        with self.record_lock:
            self.report.requests += 1

    def _check_views(self, slot: int, pairs, views) -> list[str]:
        """Each view has the shape and dtype asked for and lies wholly inside a buffer of
        `slot` (its current one, or a former one another thread's growth just replaced)."""
        problems = []
        for (shape, dtype), view in zip(pairs, views, strict=True):
            if tuple(view.shape) != shape or view.dtype != dtype:
                got = f"{tuple(view.shape)}/{view.dtype}"
                problems.append(f"slot {slot}: got {got} for {shape}/{dtype}")
            if view.numel():
                problems += self._check_placement(slot, view)
        return problems

    def _check_placement(self, slot: int, view: torch.Tensor) -> list[str]:
        lo = view.data_ptr()
        hi = lo + view.numel() * view.element_size()
        # The fast path: the view's storage is the buffer this slot's thread already confirmed
        # for the slot's current generation. Two live allocations never share a start, so it
        # is that buffer. Otherwise ask the manager (a scan of every slot) and remember.
        generation = self.manager.slot_generation(slot)
        confirmed = self.confirmed[slot]
        start = view.untyped_storage().data_ptr()
        if confirmed is not None and confirmed[:2] == (generation, start):
            end = start + confirmed[2]
            return (
                [] if hi <= end else [f"slot {slot}: view [{lo:#x}, {hi:#x}) runs past its buffer"]
            )
        info = self.manager.describe_buffer(lo)
        if info is None or info.slot != slot:
            return [f"slot {slot}: view at {lo:#x} is not in a buffer of slot {slot} ({info})"]
        if hi > info.data_ptr + info.nbytes:
            return [f"slot {slot}: view [{lo:#x}, {hi:#x}) runs past its buffer"]
        if info.live and info.generation == generation and info.data_ptr == start:
            self.confirmed[slot] = (generation, start, info.nbytes)
        return []

    def _persistent_request(self, slot: int) -> None:
        """Ask for this slot's persistent tensor (caller is in the slot's lane); check it."""
        first = self.persistent[slot]
        try:
            tensor = self.manager.get_persistent(
                _PERSISTENT_KEY, _PERSISTENT_SHAPE, torch.int64, zero_init=True
            )
        except WorkspaceLockedError:
            with self.record_lock:
                if first is None:
                    self.report.persistent_refusals += 1
                else:
                    self.report.violations.append(
                        f"slot {slot}: its existing persistent tensor was refused while locked"
                    )
            return
        problems = []
        if first is None:
            tensor.fill_(slot)  # a mark that only this slot's thread writes
            self.persistent[slot] = tensor
        elif tensor is not first:
            problems.append(f"slot {slot}: its persistent tensor was replaced")
        if tensor.tolist() != [slot] * tensor.numel():
            problems.append(f"slot {slot}: persistent contents clobbered: {tensor.tolist()}")
        owner = self.manager.describe_buffer(tensor.data_ptr())
        if owner is not None and owner.still_allocated:  # a freed one's range may be reused
            problems.append(f"slot {slot}: its persistent tensor lies in {owner.label}'s buffer")
        with self.record_lock:
            self.report.persistent_requests += 1
            self.report.violations.extend(problems)

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

    # -- the verdict -------------------------------------------------------------------------

    def check_final_state(self) -> None:
        report, manager = self.report, self.manager
        if self.allocations_while_locked:
            report.violations.append(
                f"{self.allocations_while_locked} slot allocation(s) while locked"
            )
        caps = manager.slot_capacities()
        report.final_capacities = caps
        for lane in range(self.lanes):
            if len(set(caps[lane :: self.lanes])) != 1:
                report.violations.append(
                    f"lane {lane}'s slots unequal at the end: {caps[lane :: self.lanes]}"
                )
        for growth in manager.growth_history():
            if growth.num_slots != self.threads or not 0 <= growth.lane < self.lanes:
                report.violations.append(
                    f"a growth from {growth.caller} resized {growth.num_slots} of "
                    f"{self.threads} slots of lane {growth.lane}"
                )
        self._check_disjoint()
        self._check_persistent()
        self._check_orphans()

    def _check_disjoint(self) -> None:
        """No two slots' buffers share a byte. Checked once, at the end, for every slot: with
        each view inside its own slot's buffer, this is what makes views of different slots
        disjoint (a per-request scan of every slot would cost more than the request)."""
        buffers = sorted(
            (b for b in self.manager.slot_buffers() if b is not None), key=lambda b: b.data_ptr
        )
        for a, b in zip(buffers, buffers[1:]):
            if b.data_ptr < a.data_ptr + a.nbytes:
                self.report.violations.append(
                    f"slot {a.slot}'s buffer overlaps slot {b.slot}'s buffer"
                )

    def _check_persistent(self) -> None:
        made = sum(t is not None for t in self.persistent)
        held = self.manager.persistent_resource_count()
        if held != made:
            self.report.violations.append(
                f"the manager holds {held} persistent resources; {made} were handed out"
            )
        for slot, tensor in enumerate(self.persistent):
            if tensor is not None and tensor.tolist() != [slot] * tensor.numel():
                self.report.violations.append(f"slot {slot}: persistent contents clobbered")

    def _check_orphans(self) -> None:
        """Orphans reported == replaced buffers the kept views hold; 0 once they are dropped."""
        expected = _replaced_bytes_held(self.kept, self.manager)
        reported = self.manager.orphaned_bytes()
        self.report.orphaned_bytes_kept = expected
        if reported != expected:
            self.report.violations.append(
                f"{reported} orphaned bytes reported while the kept views hold {expected}"
            )
        self.kept = []
        gc.collect()
        self.report.orphaned_bytes_after = self.manager.orphaned_bytes()
        if self.report.orphaned_bytes_after:
            self.report.violations.append(
                f"{self.report.orphaned_bytes_after} orphaned bytes after every view was dropped"
            )


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


def _replaced_bytes_held(kept: list[list[torch.Tensor]], manager: WorkspaceManager) -> int:
    """Bytes of former slot buffers (not any slot's current one) that `kept` views hold."""
    current = {b.data_ptr for b in manager.slot_buffers() if b is not None}
    alive: dict[int, int] = {}
    for views in kept:
        for view in views:
            storage = view.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in current:
                alive[storage.data_ptr()] = storage.nbytes()
    return sum(alive.values())


def _random_request(rng: random.Random) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """1-4 small random tensors; now and then one large enough to force a growth."""
    pairs = [
        (tuple(rng.randint(0, 24) for _ in range(rng.randint(1, 3))), rng.choice(_DTYPES))
        for _ in range(rng.randint(1, 4))
    ]
    if rng.random() < 0.02:
        pairs.append(((rng.randint(1, 64) * 1024,), torch.uint8))
    return pairs


# --------------------------------------------------------------------------------------------
# The verb: `dbo-sim stress`

MAX_THREADS = 1024
MAX_LANES = 64  # slots are threads x lanes; vLLM's engines use a handful of lanes
_INVARIANTS = (
    "invariants: views inside own slot, no cross-slot overlap, a lane's slots equal after "
    "growth, no allocation while locked, persistent tensors fixed, orphans counted exactly, "
    "no hang"
)


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
        _print_report(report, args.timeout)
    if report.hung_threads:
        # A thread that did not stop is inside a call it cannot be pulled out of (a workspace
        # growth, a torch op), and an interpreter that exits under it aborts the process.
        # Leave at once, the report printed: the deadline holds and the exit status is 1.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0 if report.passed else 1


def _print_report(report: StressReport, timeout_s: float) -> None:
    print(
        f"{report.threads} threads x {report.iterations} iterations x {report.lanes} lane(s) in "
        f"{report.seconds:.2f} s: {report.requests} requests, {report.growths} slot "
        f"allocations, {report.lock_cycles} lock cycles, {report.locked_refusals} locked "
        f"refusals, {report.persistent_requests} persistent requests "
        f"({report.persistent_refusals} refused while locked), {report.orphaned_bytes_kept} "
        "orphaned bytes held by kept views"
    )
    print(_INVARIANTS)
    problems = list(report.violations[:20])
    if report.cut_short:
        problems.insert(
            0,
            f"cut short by the {timeout_s:g} s deadline after {report.iterations_done} of "
            f"{report.threads * report.iterations} iterations; give a longer --timeout or "
            "fewer --iterations",
        )
    print("PASS" if report.passed else "FAIL:\n  " + "\n  ".join(problems))
