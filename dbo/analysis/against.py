"""A DBO step against the same step run serially: faster or slower, and by how much.

One job: the comparison `dbo-sim analyze --against SERIAL_TRACE` makes. Only the two traces
together can say whether DBO paid: a DBO trace alone shows overlap and exposed comm, not what
the step would have taken on one thread. The serial step is the serial trace's step with the
DBO step's index (its last step when it has fewer); the change is DBO time / serial time - 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dbo.analysis.reader import TraceError
from dbo.analysis.report import TraceReport

__all__ = ["SerialComparison", "against_serial", "ubatch_threads"]


@dataclass(frozen=True)
class SerialComparison:
    """One DBO step's time against a serial step's."""

    serial_trace: str
    serial_step: str
    serial_us: float
    dbo_step: str
    dbo_us: float

    @property
    def change_pct(self) -> float:
        """DBO step time over the serial one, minus 1, in percent (positive: DBO slower)."""
        return (self.dbo_us / self.serial_us - 1.0) * 100.0

    def words(self) -> str:
        faster = self.change_pct < 0
        return (
            f"against serial: DBO made {self.dbo_step} {'faster' if faster else 'SLOWER'} "
            f"than serial by {abs(self.change_pct):.1f}% ({self.dbo_us:.1f} us against "
            f"{self.serial_us:.1f} us, {self.serial_trace} {self.serial_step})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "serial_trace": self.serial_trace,
            "serial_step": self.serial_step,
            "serial_us": round(self.serial_us, 3),
            "dbo_step": self.dbo_step,
            "dbo_us": round(self.dbo_us, 3),
            "change_pct": round(self.change_pct, 2),
        }


def ubatch_threads(report: TraceReport) -> int:
    """How many ubatch threads launched the trace's device work (0 or 1: a serial run)."""
    return sum(1 for t in report.threads if t["label"].startswith("ubatch"))


def against_serial(dbo: TraceReport, index: int, serial: TraceReport) -> SerialComparison:
    """Step `index` of `dbo` against the serial trace's step of the same index. TraceError
    when `serial` ran two or more ubatch threads (it is not a serial run)."""
    if ubatch_threads(serial) >= 2:
        raise TraceError(
            f"{serial.path}: ran {ubatch_threads(serial)} ubatch threads; give a serial "
            f"(one-thread) trace of the same step"
        )
    step = dbo.step(index)
    own = step.figures.label
    position = dbo.steps.index(step)
    other = serial.steps[min(position, len(serial.steps) - 1)]
    if other.figures.step_us <= 0:
        raise TraceError(f"{serial.path}: its {other.figures.label} takes no time")
    return SerialComparison(
        serial.path.name, other.figures.label, other.figures.step_us, own, step.figures.step_us
    )
