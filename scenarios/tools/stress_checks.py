"""The invariants `dbo-sim stress` checks: each view inside its own slot's buffer, a slot's
persistent tensor fixed and apart from the slots, and, once the threads are joined, the
manager's final state (no allocation while locked, a lane's slots equal, no two slots'
buffers overlapping, persistent resources and orphaned bytes counted exactly).

A mixin of the run (`scenarios.tools.stress_run.StressRun`), which holds the state named
below; a violation is a line in the run's report, never an exception.
"""

from __future__ import annotations

import gc
import threading

import torch

from scenarios.tools.stress_report import StressReport
from workspace import WorkspaceLockedError, WorkspaceManager

__all__ = ["PERSISTENT_KEY", "PERSISTENT_SHAPE", "StressChecks", "replaced_bytes_held"]

PERSISTENT_KEY = "stress-state"  # one persistent tensor per (ubatch, lane)
PERSISTENT_SHAPE = (4,)


class StressChecks:
    """The per-request checks (run by the slot's own thread) and the final verdict."""

    threads: int
    lanes: int
    manager: WorkspaceManager
    report: StressReport
    record_lock: threading.Lock
    persistent: list[torch.Tensor | None]
    kept: list[list[torch.Tensor]]
    confirmed: list[tuple[int, int, int] | None]
    allocations_while_locked: int

    def check_views(
        self, slot: int, pairs: list[tuple[tuple[int, ...], torch.dtype]], views: list[torch.Tensor]
    ) -> list[str]:
        """Each view has the shape and dtype asked for and lies wholly inside a buffer of
        `slot` (its current one, or a former one another thread's growth just replaced)."""
        problems = []
        for (shape, dtype), view in zip(pairs, views, strict=True):
            if tuple(view.shape) != shape or view.dtype != dtype:
                got = f"{tuple(view.shape)}/{view.dtype}"
                problems.append(f"slot {slot}: got {got} for {shape}/{dtype}")
            if view.numel():
                problems += self.check_placement(slot, view)
        return problems

    def check_placement(self, slot: int, view: torch.Tensor) -> list[str]:
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

    def persistent_request(self, slot: int) -> None:
        """Ask for this slot's persistent tensor (caller is in the slot's lane); check it."""
        first = self.persistent[slot]
        try:
            tensor = self.manager.get_persistent(
                PERSISTENT_KEY, PERSISTENT_SHAPE, torch.int64, zero_init=True
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
        self.check_disjoint()
        self.check_persistent()
        self.check_orphans()

    def check_disjoint(self) -> None:
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

    def check_persistent(self) -> None:
        made = sum(t is not None for t in self.persistent)
        held = self.manager.persistent_resource_count()
        if held != made:
            self.report.violations.append(
                f"the manager holds {held} persistent resources; {made} were handed out"
            )
        for slot, tensor in enumerate(self.persistent):
            if tensor is not None and tensor.tolist() != [slot] * tensor.numel():
                self.report.violations.append(f"slot {slot}: persistent contents clobbered")

    def check_orphans(self) -> None:
        """Orphans reported == replaced buffers the kept views hold; 0 once they are dropped."""
        expected = replaced_bytes_held(self.kept, self.manager)
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


def replaced_bytes_held(kept: list[list[torch.Tensor]], manager: WorkspaceManager) -> int:
    """Bytes of former slot buffers (not any slot's current one) that `kept` views hold."""
    current = {b.data_ptr for b in manager.slot_buffers() if b is not None}
    alive: dict[int, int] = {}
    for views in kept:
        for view in views:
            storage = view.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in current:
                alive[storage.data_ptr()] = storage.nbytes()
    return sum(alive.values())
