"""The `run` table: fixed-width rows printed as scenarios finish, and the note under it.

Widths are fixed up front so that each row prints the moment its scenario finishes; a wider
cell just pushes its row's later cells right.
"""

from __future__ import annotations

from collections.abc import Sequence

from scenarios.catalog import ScenarioResult

__all__ = ["Table", "launch_bound_note"]

_HEADER = (
    "scenario",
    "verdict",
    "match",
    "races",
    "serial us",
    "dbo us",
    "speedup",
    "overlap",
    "roofline",
    "ws peak",
    "caught",
)
_WIDTHS = (0, len("PASS (fault caught)"), 5, 5, 9, 9, 7, 7, 8, 10, len("caught"))


def _fmt(value: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{suffix}"


def _fmt_bytes(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / 1024:.0f} KiB"


class Table:
    """The run table for `names`: `header()` once, then `row(result)` per scenario."""

    def __init__(self, names: Sequence[str]) -> None:
        self.widths = (max(len(_HEADER[0]), *map(len, names)), *_WIDTHS[1:])

    def _line(self, cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, self.widths)).rstrip()

    def header(self) -> str:
        return self._line(_HEADER) + "\n" + "  ".join("-" * w for w in self.widths)

    def row(self, r: ScenarioResult) -> str:
        verdict = ("PASS" if r.passed else "FAIL") + (
            " (fault caught)" if r.negative and r.passed else ""
        )
        return self._line(
            (
                r.scenario,
                verdict,
                "-" if r.outputs_match is None else ("yes" if r.outputs_match else "NO"),
                str(r.races),
                _fmt(r.step_us_serial, ".1f"),
                _fmt(r.step_us_dbo, ".1f"),
                _fmt(r.speedup, ".2f", suffix="x"),
                _fmt(r.overlap_fraction, ".0f", 100, "%"),
                _fmt(r.roofline_fraction, ".0f", 100, "%"),
                _fmt_bytes(r.workspace_peak_bytes),
                r.caught or "-",  # last: a long one pushes nothing right
            )
        )


def launch_bound_note(results: Sequence[ScenarioResult]) -> str | None:
    """Why a value-checked scenario shows DBO slower than serial, when one does (None: none
    does): its step is too small for overlap to pay."""
    slow = [
        r.scenario
        for r in results
        if not r.negative
        and r.outputs_match is not None
        and r.speedup is not None
        and r.speedup < 1.0
    ]
    if not slow:
        return None
    return (
        f"note: {', '.join(slow)} below 1x by design: value checks on a tiny model, "
        "launch-bound (the host's op launches and baton handoffs outweigh the little "
        "communication there is to hide); the dsv3-* rows show DBO at size"
    )
