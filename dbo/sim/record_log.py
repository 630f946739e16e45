"""The simulated device's timeline: its records in issue order, the host-track ones kept as
numbers until the timeline is read.

Every `dbo_yield` tells the device (`on_handoff`), which charges the host `handoff_us` and draws
a HANDOFF record on the host track. Building that record (an `OpRecord` and its args dict) on
the yield itself made the simulated baton pass markedly slower than the runtime's own: work on
the ring's critical path, and two objects per pass that the garbage collector tracks, which
the timeline keeps, growing the oldest generation until a full collection sweeps the whole
process. The model is unchanged: a host record (a baton pass, a graph launch, a host sync) is
noted as numbers in typed arrays, no object per record, and `read` makes the same records, at
their issue positions, when someone reads the timeline.
"""

from __future__ import annotations

import bisect
import heapq
import threading
from array import array
from typing import Any

from dbo.sim.records import OpRecord

__all__ = ["RecordLog"]

_NO_UBATCH = -1  # a record made outside any ubatch (an int array has no None)


class RecordLog:
    """One device's records since its last reset: placed ops as records, host-track records
    as columns (seq, name, ubatch, start, end, replayed, what it waited on) until `read`."""

    def __init__(self, rank: int, lock: threading.RLock, *, keep: bool = True) -> None:
        self._rank = rank
        self._lock = lock  # the device's: records are added under it
        self._keep = keep  # False: nothing is kept (a device made with record_timeline=False)
        self._records: list[OpRecord] = []
        self._seq = array("q")
        self._ubatch = array("q")
        self._start = array("d")
        self._end = array("d")
        self._replayed = array("b")
        self._names: list[tuple[str, str]] = []  # (name, kind): a few shared strings
        self._on: list[str] = []  # a host sync's "on" ("" for the others)

    def append(self, record: OpRecord) -> None:
        if self._keep:
            self._records.append(record)

    def note_host(
        self, name: str, kind: str, seq: int, state: Any, start: float, end: float, on: str
    ) -> None:
        """A host-track record of the thread whose `state` (a ThreadState) is given."""
        if not self._keep:
            return
        ubatch = state.ubatch
        self._seq.append(seq)
        self._ubatch.append(_NO_UBATCH if ubatch is None else ubatch)
        self._start.append(start)
        self._end.append(end)
        self._replayed.append(state.replaying)
        self._names.append((name, kind))
        self._on.append(on)

    def read(self) -> list[OpRecord]:
        """Every record in issue order: the noted host records made and merged in, in place
        (one list for the log's life, so holders of it see them), then forgotten."""
        with self._lock:
            if self._seq:
                self._merge_host_records()
            return self._records

    def _merge_host_records(self) -> None:
        made = [
            OpRecord(
                seq=seq,
                name=name,
                kind=kind,
                rank=self._rank,
                stream="host",
                issue_us=start,
                ubatch=None if ubatch == _NO_UBATCH else ubatch,
                start_us=start,
                end_us=end,
                replayed=bool(replayed),
                args={"on": on} if on else {},
            )
            for seq, (name, kind), ubatch, start, end, replayed, on in zip(
                self._seq,
                self._names,
                self._ubatch,
                self._start,
                self._end,
                self._replayed,
                self._on,
            )
        ]
        # Only the records placed since the first noted one interleave with them.
        first = bisect.bisect_left(self._records, made[0].seq, key=_seq)
        self._records[first:] = heapq.merge(self._records[first:], made, key=_seq)
        for column in (self._seq, self._ubatch, self._start, self._end, self._replayed):
            del column[:]
        self._names.clear()
        self._on.clear()


def _seq(record: OpRecord) -> int:
    return record.seq
