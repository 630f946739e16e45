"""Concurrent slot access: many ubatch threads hammer the workspace while another locks and unlocks.

Threads act as ubatches (`workspace.testing.as_ubatch`) and call the workspace without the
runtime's baton, which is harsher than DBO (where one thread runs at a time). With `lanes` > 1
each request goes to a random lane (`use_workspace_lane`), so there is one slot per (ubatch,
lane); now and then a thread asks for its (ubatch, lane)'s persistent tensor
(`get_persistent`), and it keeps a few views across later growths. The checks are
invariants, not "no exception":
- every view lies wholly inside the buffer that was its own (ubatch, lane) slot when it was
  returned;
- no returned view overlaps a buffer that belonged to another slot;
- every growth resizes one slot per ubatch, of one lane; at the end a lane's slots are equal;
- no slot buffer is allocated while the manager is locked;
- a persistent tensor never moves, keeps its contents and lies in no slot buffer; a new one is
  refused while locked (counted), and the manager holds exactly the ones handed out;
- the orphaned bytes the manager reports equal, exactly, the replaced buffers the kept views
  still hold alive, and fall to zero once those views are dropped;
- every thread finishes (joined with a deadline);
- every thread does all its iterations: a run cut short by its deadline fails (`cut_short`),
  since it checked less than it was asked to.

An interrupt (Ctrl-C) stops and joins every thread before it propagates, so that no thread is
inside torch when the interpreter exits.
"""

from __future__ import annotations

import gc
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workspace import WorkspaceLockedError, WorkspaceManager, use_workspace_lane
from workspace.testing import as_ubatch, watch_allocations

_DTYPES = (torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float64)
_STOP_JOIN_S = 5.0  # a stopped worker ends within one iteration; longer than this is a hang
_PERSISTENT_KEY = "stress-state"  # one persistent tensor per (ubatch, lane)
_PERSISTENT_SHAPE = (4,)
_KEPT_VIEWS = 3  # views each thread keeps across later growths (the orphan-accounting check)


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
    with watch_allocations(run.manager, run.on_allocate):
        run.start_and_join(deadline_s)
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
        self.record_lock = threading.Lock()
        self.stop = threading.Event()
        self.done = 0
        self.finished = [0] * threads  # iterations each worker completed
        self.allocations_while_locked = 0

    def on_allocate(self, nbytes: int) -> None:
        with self.record_lock:
            self.allocations_while_locked += self.manager.is_locked()
            self.report.growths += 1

    # -- the threads -------------------------------------------------------------------------

    def start_and_join(self, deadline_s: float) -> None:
        start = time.monotonic()
        workers = [
            threading.Thread(target=self.worker, args=(k,), daemon=True, name=f"stress-{k}")
            for k in range(self.threads)
        ]
        lock_thread = threading.Thread(target=self.locker, daemon=True, name="stress-locker")
        for t in workers:
            t.start()
        lock_thread.start()
        try:
            for t in workers:
                # Short joins: an interrupt is noticed at once, whichever thread took the signal.
                while t.is_alive() and time.monotonic() - start < deadline_s:
                    t.join(min(0.1, max(deadline_s - (time.monotonic() - start), 0.0)))
            self.report.cut_short = any(t.is_alive() for t in workers)
        finally:
            # Also on Ctrl-C: every worker stops at its next iteration and is joined, so none is
            # inside torch when the interpreter exits (a daemon thread there aborts the process).
            self.stop.set()
            for t in [*workers, lock_thread]:
                t.join(_STOP_JOIN_S)
        alive = sum(t.is_alive() for t in workers) + int(lock_thread.is_alive())
        self.report.hung_threads = alive
        self.report.iterations_done = sum(self.finished)
        self.report.seconds = time.monotonic() - start
        self.manager.unlock()

    def worker(self, slot: int) -> None:
        rng = random.Random(self.seed * 1000 + slot)
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
                return
        _check_views(self.manager, slot, pairs, views, self.report, self.record_lock)
        if views and rng.random() < 0.2:  # keep a few across other threads' growths
            self.kept[ubatch] = (self.kept[ubatch] + views)[-_KEPT_VIEWS:]
        with self.record_lock:
            self.report.requests += 1

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
        while not self.stop.is_set() and self.done < self.threads:
            self.manager.lock()
            time.sleep(rng.uniform(0.0005, 0.002))
            self.manager.unlock()
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
        self._check_persistent()
        self._check_orphans()

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


def _check_views(
    manager: WorkspaceManager, slot: int, pairs, views, report: StressReport, lock: threading.Lock
) -> None:
    # Another thread may grow every slot between the call and this check: then the views sit
    # in a former buffer of this slot (an orphan), which `describe_buffer` still identifies.
    others = [b for b in manager.slot_buffers() if b is not None and b.slot != slot]
    problems = []
    for (shape, dtype), view in zip(pairs, views, strict=True):
        if tuple(view.shape) != shape or view.dtype != dtype:
            got = f"{tuple(view.shape)}/{view.dtype}"
            problems.append(f"slot {slot}: got {got} for {shape}/{dtype}")
        if view.numel() == 0:
            continue
        lo = view.data_ptr()
        hi = lo + view.numel() * view.element_size()
        info = manager.describe_buffer(lo)
        if info is None or info.slot != slot:
            problems.append(
                f"slot {slot}: view at {lo:#x} is not in a buffer of slot {slot} ({info})"
            )
        elif hi > info.data_ptr + info.nbytes:
            problems.append(f"slot {slot}: view [{lo:#x}, {hi:#x}) runs past its buffer")
        for other in others:
            if lo < other.data_ptr + other.nbytes and other.data_ptr < hi:
                problems.append(f"slot {slot}: view overlaps slot {other.slot}'s buffer")
    if problems:
        with lock:
            report.violations.extend(problems)
