"""Race reports grouped by cause: one entry per pair of racing ops and the ordering edge
that is missing between them, with the number of byte ranges it covers and the fix.

A step with one missing wait usually races on many byte ranges (every layer, every tensor
the unordered op touches); listing each `RaceReport` buries the one line a developer needs:
which wait, or which `dbo.record_stream(tensor, stream)` call, is missing. The grouping
reads only the reports' public fields, so it serves the simulator's checker and anything
else producing `RaceReport`s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dbo.sim.records import OpSite, RaceReport

__all__ = ["RaceCause", "group_races"]

RECORD_STREAM = "dbo.record_stream(tensor, stream)"


@dataclass(frozen=True)
class RaceCause:
    """The races that one missing ordering edge between two ops causes."""

    first: OpSite  # the earlier access of the first race in the group
    second: OpSite  # the access not ordered after it
    reused_after_free: bool  # the first access was to memory freed and handed on meanwhile
    freed_at: str | None  # where the freed tensor was allocated (reuse only)
    ranges: int  # how many byte ranges (race reports) the cause accounts for
    nbytes: int  # bytes both accesses of each range touch, summed
    races: tuple[RaceReport, ...]

    @property
    def ubatches(self) -> list[int | None]:
        """The ubatches whose accesses race here (the same code races in each of them)."""
        found = {s.ubatch for r in self.races for s in (r.first, r.second)}
        return sorted(found, key=lambda u: -1 if u is None else u)

    @property
    def origin(self) -> str | None:
        """Where the missing wait belongs, when the later op's thread moved onto its stream
        with a plain switch (`dbo.switch_notes`): "dbo_switch_to_comm() at file:line:fn"."""
        if self.reused_after_free or not self.second.switched_at:
            return None
        return self.second.switched_at

    @property
    def missing(self) -> str:
        """The ordering edge that is missing, in words."""
        if self.reused_after_free:
            return (
                f"the free of the tensor is not ordered after its use on stream "
                f"{self.first.stream!r}"
            )
        return f"stream {self.second.stream!r} does not wait for stream {self.first.stream!r}"

    @property
    def fix(self) -> str:
        """What to add to order the pair."""
        first, second = self.first, self.second
        if self.origin is not None:
            call = self.origin.split("(", 1)[0]
            return (
                f"make {call}() there {call}_sync(): it records an event on the stream it "
                f"leaves and makes stream {second.stream!r} wait on it, so {second.op} is "
                f"ordered after {first.op}"
            )
        if self.reused_after_free:
            where = f" allocated at {self.freed_at}" if self.freed_at else ""
            return (
                f"call {RECORD_STREAM} with stream {first.stream!r} on the tensor{where} "
                f"before freeing it, or make stream {second.stream!r} wait for "
                f"{first.stream!r} before the memory is reused"
            )
        text = (
            f"record an event on stream {first.stream!r} after {first.op} and make stream "
            f"{second.stream!r} wait on it before {second.op} (stream.wait_event(event); in a "
            f"ubatch, a dbo_yield_and_switch_* or *_sync switch instead of the plain one)"
        )
        if any(
            r.first.ubatch is not None
            and r.second.ubatch is not None
            and r.first.ubatch != r.second.ubatch
            for r in self.races
        ):
            text += "; or give each ubatch its own buffer (a workspace slot per ubatch)"
        return text

    def describe(self) -> str:
        """The op pair, then the origin (the plain switch, when there was one), the missing
        edge and the fix."""
        lines = [
            f"{self.ranges} byte range(s), {self.nbytes} bytes, {_ubatches(self.ubatches)}: "
            f"{_site(self.first)} and {_site(self.second)}",
        ]
        if self.origin is not None:
            lines.append(
                f"  origin:  {self.origin} moved onto stream {self.second.stream!r} without a wait"
            )
        lines += [f"  missing: {self.missing}", f"  fix:     {self.fix}"]
        return "\n".join(lines)


def _ubatches(ubatches: list[int | None]) -> str:
    if ubatches == [None]:
        return "outside ubatches"
    return f"ubatch{'es' if len(ubatches) > 1 else ''} {', '.join(map(str, ubatches))}"


def _site(site: OpSite) -> str:
    rw = "writes" if site.is_write else "reads"
    at = f" at {site.stack[-1]}" if site.stack else ""
    return f"{site.op} (stream {site.stream!r}) {rw}{at}"


def _overlap(race: RaceReport) -> int:
    a, b = race.first, race.second
    return max(0, min(a.end, b.end) - max(a.start, b.start))


def _key(race: RaceReport) -> tuple:
    def site(s: OpSite) -> tuple:
        return (s.op, s.stream, s.is_write, s.stack[-1] if s.stack else "")

    reuse = race.freed_allocation is not None
    freed_at = race.freed_allocation[-1] if race.freed_allocation else None
    return (*site(race.first), *site(race.second), reuse, freed_at)


def group_races(races: Iterable[RaceReport]) -> list[RaceCause]:
    """One `RaceCause` per (op pair, missing edge), in the order each was first found: the
    same two lines of code racing in several ubatches (or layers) are one cause."""
    groups: dict[tuple, list[RaceReport]] = {}
    for race in races:
        groups.setdefault(_key(race), []).append(race)
    causes = []
    for members in groups.values():
        head = members[0]
        freed = head.freed_allocation
        causes.append(
            RaceCause(
                first=head.first,
                second=head.second,
                reused_after_free=freed is not None,
                freed_at=freed[-1] if freed else None,
                ranges=len(members),
                nbytes=sum(_overlap(r) for r in members),
                races=tuple(members),
            )
        )
    return causes
