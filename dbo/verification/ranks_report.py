"""What one `dbo.verify_ranks` call found: each rank's verdict and the group's, as a record.

The group is ok only when every rank's own `verify` report is ok, the ranks' collectives
paired (no `CollectiveMismatchError`) and every rank ended within the timeout. `describe()`
leads with the group verdict, then the collectives (the ranks out of step, or the hang with
each rank's history), then one line per rank and, for a failed rank, its own report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dbo.jsonsafe import json_safe

__all__ = ["RankVerdict", "RanksReport", "VerifyRanksError"]


class VerifyRanksError(AssertionError):
    """A forward failed `verify_ranks`; the message is the report's `describe()`."""

    def __init__(self, report: RanksReport) -> None:
        super().__init__(report.describe())
        self.report = report


@dataclass
class RankVerdict:
    """One rank's outcome. `report` is its `VerifyReport.to_dict()` (None when its serial
    step raised, or the rank never reported); `text` its `describe()` or what went wrong."""

    rank: int
    tokens: int | None
    ok: bool
    text: str
    report: dict[str, Any] | None = None
    error: str | None = None  # the serial step's error, or why the rank did not report

    def headline(self) -> str:
        tokens = "" if self.tokens is None else f" ({self.tokens} tokens)"
        if self.ok:
            report = self.report or {}
            return (
                f"rank {self.rank}{tokens}: OK, outputs match, {len(_races(report))} races, "
                f"speedup {report.get('speedup') or float('nan'):.2f}x"
            )
        return f"rank {self.rank}{tokens}: FAILED: {self.error or _why(self.report or {})}"


def _why(report: dict[str, Any]) -> str:
    """The first finding of a failed rank's own report."""
    if report.get("error"):
        return f"the DBO step failed: {report['error']}"
    if not report.get("outputs_match", True):
        return f"outputs differ: {report.get('mismatch') or 'values'}"
    replays = [r for r in report.get("graphs") or [] if not r.get("ok", True)]
    if replays:
        first = replays[0]
        found = first.get("problems") or [f"output differs: {first.get('mismatch')}"]
        return f"its {first.get('step')} through CUDA graphs: {found[0]}"
    return f"{len(_races(report))} race(s)"


def _races(report: dict[str, Any]) -> list[Any]:
    return [r for found in (report.get("races") or {}).values() for r in found]


@dataclass
class RanksReport:
    """The group's verdict: `ok` only when every rank is ok, the collectives paired, and no
    rank hung. `out_of_step` is the fingerprint's finding (the same on every rank), `hang`
    the explained timeout, `pids` the rank processes (all reaped when the call returns)."""

    ok: bool
    num_ranks: int
    num_ubatches: int
    device: str
    backend: str
    ranks: list[RankVerdict]
    out_of_step: str | None = None
    hang: list[str] | None = None
    pids: list[int] = field(default_factory=list)
    timeout: float = 60.0

    def describe(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        lines = [
            f"dbo.verify_ranks: {verdict} ({self.num_ranks} ranks over {self.backend}, "
            f"{self.num_ubatches} ubatches on {self.device})"
        ]
        if self.out_of_step:
            first, *rest = self.out_of_step.splitlines()
            lines.append(f"  collectives      {first}")
            lines += [f"    {line.strip()}" for line in rest]
        elif not self.hang:
            lines.append("  collectives      every rank ran the same collectives, in step")
        if self.hang:
            lines.append(f"  stopped          {self.hang[0]}")
            lines += [f"    {line.strip()}" for line in self.hang[1:]]
        for verdict_of in self.ranks:
            lines.append(f"  {verdict_of.headline()}")
            if not verdict_of.ok and verdict_of.report is not None:
                lines += [f"    {line}" for line in verdict_of.text.splitlines()[1:]]
        return "\n".join(lines)

    def raise_for_failure(self) -> None:
        """Raise `VerifyRanksError` (message: `describe()`) unless the report is ok."""
        if not self.ok:
            raise VerifyRanksError(self)

    def to_dict(self) -> dict[str, Any]:
        return json_safe(
            {
                "ok": self.ok,
                "num_ranks": self.num_ranks,
                "num_ubatches": self.num_ubatches,
                "device": self.device,
                "backend": self.backend,
                "out_of_step": self.out_of_step,
                "hang": self.hang,
                "ranks": [
                    {
                        "rank": v.rank,
                        "tokens": v.tokens,
                        "ok": v.ok,
                        "error": v.error,
                        "report": v.report,
                    }
                    for v in self.ranks
                ],
            }
        )
