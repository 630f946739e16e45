"""What one simulated device reports: its placed ops, the races found, event waits and host
ranges, numbered in placement order.

`DeviceLog` is the sink the device, the race checker and the host ranges write to; the
reports (`dbo.sim.summary`, `trace`, `window`, `plot`) read its lists through the device.
`reset()` starts a new measurement. The timeline itself is a `dbo.sim.record_log.RecordLog`,
which keeps host-track records as numbers until the timeline is read.
"""

from __future__ import annotations

import threading
import warnings

from dbo.sim.cost import ROOFLINE
from dbo.sim.options import SimOptions
from dbo.sim.races import MAX_REPORTS, RaceError
from dbo.sim.record_log import RecordLog
from dbo.sim.records import EventWait, HostRange, OpRecord, RaceReport
from dbo.sim.state import PlannedOp, ThreadState
from dbo.sim.timeline import Span, slowdown_args

__all__ = ["DeviceLog"]


class DeviceLog:
    """The records of one device (see the module docstring); `seq` numbers every placed op,
    recorded or not, so an event wait can name the op that follows it."""

    def __init__(self, options: SimOptions, lock: threading.RLock) -> None:
        self.rank = int(options.rank)
        self._lock = lock  # the device's: records are added under it
        self.keep = options.record_timeline  # False: count ops, keep no timeline
        self.race_action = options.race_action
        self.reset()

    def reset(self) -> None:
        """Nothing placed, nothing reported (a new measurement)."""
        self.seq = 0
        self.records = RecordLog(self.rank, self._lock, keep=self.keep)
        self.races: list[RaceReport] = []
        # For the reports only (flow arrows, named host ranges).
        self.event_waits: list[EventWait] = []
        self.host_ranges: list[HostRange] = []

    def add_op(
        self,
        op: PlannedOp,
        span: Span,
        *,
        ubatch: int | None,
        stream: str,
        issue_us: float,
        replayed: bool,
    ) -> OpRecord:
        """The record of `op`, issued at `issue_us` and placed at `span` on `stream`; its
        trace args gain its slowdowns."""
        args = dict(op.args)
        args.update(slowdown_args(span, compute=op.compute))
        if args.get("cost") == ROOFLINE:
            args["fallback_us"] = span.end - span.start
        return self._append(
            OpRecord(
                seq=self.seq,
                name=op.name,
                kind=op.kind,
                rank=self.rank,
                ubatch=ubatch,
                stream=stream,
                issue_us=issue_us,
                start_us=span.start,
                end_us=span.end,
                flops=op.flops,
                bytes=op.nbytes,
                replayed=replayed,
                args=args,
            )
        )

    @property
    def timeline(self) -> list[OpRecord]:
        """Every record since the last reset, in issue order (`dbo.sim.record_log`)."""
        return self.records.read()

    def add_host(
        self, name: str, kind: str, start: float, end: float, thread: ThreadState, on: str = ""
    ) -> None:
        """A host-track record (a sync, a baton pass, a graph launch), made when the timeline
        is read; `on`: what a host sync waited on."""
        self.records.note_host(name, kind, self.seq, thread, start, end, on)
        self.seq += 1

    def _append(self, record: OpRecord) -> OpRecord:
        self.seq += 1
        self.records.append(record)
        return record

    def add_wait(self, ubatch: int | None, on: str, time_us: float, stream: str) -> None:
        """`stream` waited on an event recorded on `on` at `time_us`."""
        if self.keep:
            self.event_waits.append(EventWait(self.rank, ubatch, on, time_us, stream, self.seq))

    def on_race(self, report: RaceReport) -> None:
        """The race checker's sink: keep the report, then raise or warn as asked."""
        if len(self.races) >= MAX_REPORTS:
            return
        self.races.append(report)
        if self.race_action == "raise":
            raise RaceError(report)
        if self.race_action == "warn":
            # The checker's frame, as if it warned itself (sink, report, check).
            warnings.warn(report.describe(), RuntimeWarning, stacklevel=3)

    def on_host_range(
        self, name: str, start_us: float, end_us: float, ubatch: int | None, source: str
    ) -> None:
        """The sink of every thread's closed host ranges."""
        if self.keep:
            self.host_ranges.append(HostRange(self.rank, ubatch, name, start_us, end_us, source))
