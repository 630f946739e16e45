"""`dbo-sim stress`'s report: what a run counted and what it found broken (`StressReport`),
and how the verb prints it."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["INVARIANTS", "StressReport", "print_report"]

INVARIANTS = (
    "invariants: views inside own slot, no cross-slot overlap, a lane's slots equal after "
    "growth, no allocation while locked, persistent tensors fixed, orphans counted exactly, "
    "no hang"
)


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


def print_report(report: StressReport, timeout_s: float) -> None:
    print(
        f"{report.threads} threads x {report.iterations} iterations x {report.lanes} lane(s) in "
        f"{report.seconds:.2f} s: {report.requests} requests, {report.growths} slot "
        f"allocations, {report.lock_cycles} lock cycles, {report.locked_refusals} locked "
        f"refusals, {report.persistent_requests} persistent requests "
        f"({report.persistent_refusals} refused while locked), {report.orphaned_bytes_kept} "
        "orphaned bytes held by kept views"
    )
    print(INVARIANTS)
    problems = list(report.violations[:20])
    if report.cut_short:
        problems.insert(
            0,
            f"cut short by the {timeout_s:g} s deadline after {report.iterations_done} of "
            f"{report.threads * report.iterations} iterations; give a longer --timeout or "
            "fewer --iterations",
        )
    print("PASS" if report.passed else "FAIL:\n  " + "\n  ".join(problems))
