"""Concurrent slot access: many ubatch threads hammer the workspace while another locks and unlocks.

Threads register themselves as ubatches directly in `dbo.ubatching._THREAD_ID_TO_CONTEXT` and
call the workspace without the runtime's baton, which is harsher than DBO (where one thread
runs at a time). The checks are invariants, not "no exception":
- every view lies wholly inside the buffer that was its own thread's slot when it was returned;
- no returned view overlaps a buffer that belonged to another slot;
- after every growth all slots have equal capacity;
- no slot buffer is allocated while the manager is locked;
- every thread finishes (joined with a deadline);
- every thread does all its iterations: a run cut short by its deadline fails (`cut_short`),
  since it checked less than it was asked to.

An interrupt (Ctrl-C) stops and joins every thread before it propagates, so that no thread is
inside torch when the interpreter exits.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dbo import ubatching
from workspace import WorkspaceLockedError, WorkspaceManager

_DTYPES = (torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float64)
_STOP_JOIN_S = 5.0  # a stopped worker ends within one iteration; longer than this is a hang


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

    @property
    def passed(self) -> bool:
        return not self.violations and self.hung_threads == 0 and not self.cut_short

    def to_dict(self) -> dict:
        return {**self.__dict__, "passed": self.passed, "violations": self.violations[:20]}


def run_stress(
    threads: int = 8,
    iterations: int = 2000,
    *,
    seed: int = 0,
    deadline_s: float = 60.0,
    on_progress: Callable[[int], None] | None = None,
) -> StressReport:
    """`threads` ubatch threads make `iterations` random requests each while a locker thread
    locks and unlocks the manager; `on_progress(n)` hears how many iterations thread 0 has
    done (every 50, and at the end)."""
    if threads < 1 or iterations < 1:
        raise ValueError(f"threads and iterations must be >= 1, got {threads} and {iterations}")
    manager = WorkspaceManager("cpu", num_ubatches=threads)
    report = StressReport(threads, iterations)
    record_lock = threading.Lock()
    locked_window = threading.Event()  # set while the locker holds the manager locked
    allocations_while_locked = [0]
    original_allocate = manager._allocate

    def allocate(nbytes: int) -> torch.Tensor:
        if manager.is_locked():
            allocations_while_locked[0] += 1
        buffer = original_allocate(nbytes)
        with record_lock:
            report.growths += 1
        return buffer

    manager._allocate = allocate  # type: ignore[method-assign]
    stop = threading.Event()
    done = [0]
    finished = [0] * threads  # iterations each worker completed

    def worker(slot: int) -> None:
        ubatching._THREAD_ID_TO_CONTEXT[threading.get_ident()] = slot
        rng = random.Random(seed * 1000 + slot)
        try:
            for i in range(iterations):
                finished[slot] = i
                if stop.is_set():
                    return
                pairs = [
                    (tuple(rng.randint(0, 24) for _ in range(rng.randint(1, 3))), rng.choice(_DTYPES))
                    for _ in range(rng.randint(1, 4))
                ]
                if rng.random() < 0.02:  # now and then a request large enough to force growth
                    pairs.append(((rng.randint(1, 64) * 1024,), torch.uint8))
                try:
                    views = manager.get_simultaneous(*pairs)
                except WorkspaceLockedError:
                    with record_lock:
                        report.locked_refusals += 1
                    continue
                _check_views(manager, slot, pairs, views, report, record_lock)
                with record_lock:
                    report.requests += 1
                if on_progress is not None and slot == 0 and ((i + 1) % 50 == 0 or i + 1 == iterations):
                    on_progress(i + 1)  # iterations slot 0 has completed
            finished[slot] = iterations
        finally:
            ubatching._THREAD_ID_TO_CONTEXT.pop(threading.get_ident(), None)
            with record_lock:
                done[0] += 1

    def locker() -> None:
        rng = random.Random(seed)
        while not stop.is_set() and done[0] < threads:
            manager.lock()
            locked_window.set()
            time.sleep(rng.uniform(0.0005, 0.002))
            locked_window.clear()
            manager.unlock()
            report.lock_cycles += 1
            time.sleep(rng.uniform(0.0005, 0.002))

    start = time.monotonic()
    workers = [
        threading.Thread(target=worker, args=(k,), daemon=True, name=f"stress-{k}") for k in range(threads)
    ]
    lock_thread = threading.Thread(target=locker, daemon=True, name="stress-locker")
    for t in workers:
        t.start()
    lock_thread.start()
    try:
        for t in workers:
            # Short joins: an interrupt is noticed at once, whichever thread took the signal.
            while t.is_alive() and time.monotonic() - start < deadline_s:
                t.join(min(0.1, max(deadline_s - (time.monotonic() - start), 0.0)))
        report.cut_short = any(t.is_alive() for t in workers)
    finally:
        # Also on Ctrl-C: every worker stops at its next iteration and is joined, so none is
        # inside torch when the interpreter exits (a daemon thread there aborts the process).
        stop.set()
        for t in [*workers, lock_thread]:
            t.join(_STOP_JOIN_S)
    report.hung_threads = sum(t.is_alive() for t in workers) + int(lock_thread.is_alive())
    report.iterations_done = sum(finished)
    report.seconds = time.monotonic() - start
    manager.unlock()
    if allocations_while_locked[0]:
        report.violations.append(f"{allocations_while_locked[0]} slot allocation(s) while locked")
    caps = manager.slot_capacities()
    report.final_capacities = caps
    if len(set(caps)) != 1:
        report.violations.append(f"slots unequal at the end: {caps}")
    for growth in manager.growth_history():
        if growth.num_slots != threads:
            report.violations.append(
                f"a growth from {growth.caller} resized {growth.num_slots} of {threads} slots"
            )
    report.orphaned_bytes_after = manager.orphaned_bytes()
    return report


def _check_views(
    manager: WorkspaceManager, slot: int, pairs, views, report: StressReport, lock: threading.Lock
) -> None:
    # Another thread may grow every slot between the call and this check: then the views sit
    # in a former buffer of this slot (an orphan), which `describe_buffer` still identifies.
    others = [b for b in manager.slot_buffers() if b is not None and b.slot != slot]
    problems = []
    for (shape, dtype), view in zip(pairs, views):
        if tuple(view.shape) != shape or view.dtype != dtype:
            problems.append(f"slot {slot}: got {tuple(view.shape)}/{view.dtype} for {shape}/{dtype}")
        if view.numel() == 0:
            continue
        lo = view.data_ptr()
        hi = lo + view.numel() * view.element_size()
        info = manager.describe_buffer(lo)
        if info is None or info.slot != slot:
            problems.append(f"slot {slot}: view at {lo:#x} is not in a buffer of slot {slot} ({info})")
        elif hi > info.data_ptr + info.nbytes:
            problems.append(f"slot {slot}: view [{lo:#x}, {hi:#x}) runs past its buffer")
        for other in others:
            if lo < other.data_ptr + other.nbytes and other.data_ptr < hi:
                problems.append(f"slot {slot}: view overlaps slot {other.slot}'s buffer")
    if problems:
        with lock:
            report.violations.extend(problems)
