"""The simulated device's timeline: its records in issue order, the host-track ones kept as
numbers until the timeline is read.

Every `dbo_yield` tells the device (`on_handoff`), which charges the host `handoff_us` and draws
a HANDOFF record on the host track. Building that record (an `OpRecord` and its args dict) on
the yield itself made the simulated baton pass markedly slower than the runtime's own: work on
the ring's critical path, and two objects per pass that the garbage collector tracks, which
the timeline keeps, growing the oldest generation until a full collection sweeps the whole
process. The model is unchanged: a host record (a baton pass, a graph launch, a host sync) is
noted as one tuple of numbers and shared strings, which the collector soon stops tracking, and
`read` makes the same records, at their issue positions, when someone reads the timeline.
"""

from __future__ import annotations

import bisect
import heapq
import threading
from typing import Any

from dbo.sim.records import OpRecord

__all__ = ["RecordLog"]


class RecordLog:
    """One device's records since its last reset: placed ops as records, host-track records
    as plain tuples until `read`."""

    def __init__(self, rank: int, lock: threading.RLock, *, keep: bool = True) -> None:
        self._rank = rank
        self._lock = lock  # the device's: records are added under it
        self._keep = keep  # False: nothing is kept (a device made with record_timeline=False)
        self._records: list[OpRecord] = []
        # (seq, name, kind, ubatch, start, end, replayed, on): numbers and shared strings only,
        # so the collector stops tracking each tuple at its first pass and never promotes it.
        self._host: list[tuple] = []

    def append(self, record: OpRecord) -> None:
        if self._keep:
            self._records.append(record)

    def note_host(
        self, name: str, kind: str, seq: int, state: Any, start: float, end: float, on: str
    ) -> None:
        """A host-track record of the thread whose `state` (a ThreadState) is given; `on`:
        what a host sync waited on ("" for the others)."""
        if self._keep:
            self._host.append((seq, name, kind, state.ubatch, start, end, state.replaying, on))

    def read(self) -> list[OpRecord]:
        """Every record in issue order: the noted host records made and merged in, in place
        (one list for the log's life, so holders of it see them), then forgotten."""
        with self._lock:
            if self._host:
                self._merge_host_records()
            return self._records

    def _merge_host_records(self) -> None:
        made = [
            OpRecord(
                seq=seq,
                name=name,
                kind=kind,
                rank=self._rank,
                ubatch=ubatch,
                stream="host",
                issue_us=start,
                start_us=start,
                end_us=end,
                replayed=replayed,
                args={"on": on} if on else {},
            )
            for seq, name, kind, ubatch, start, end, replayed, on in self._host
        ]
        self._host.clear()
        # Only the records placed since the first noted one interleave with them.
        first = bisect.bisect_left(self._records, made[0].seq, key=_seq)
        self._records[first:] = heapq.merge(self._records[first:], made, key=_seq)


def _seq(record: OpRecord) -> int:
    return record.seq
