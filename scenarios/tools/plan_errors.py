"""How far off the replay is known to be near a `plan` answer: its error on the published rows.

One job: pick, from the stored `dbo-sim fidelity --json` run (`scenarios.lib.fidelity_rows`
reads it), the all-ranks rows (`scale-*`: the same replay `plan` runs) nearest
an answer, and say by how much the replay missed them. Nearest: for decode, DeepEP's
low-latency kernel rows at the EP size closest to the answer's (on a log scale) and SGLang's
TBO decode gains; for prefill, DeepEP's normal-kernel bandwidth rows and SGLang's TBO prefill
gain. Each kind gives its largest miss: kernel rows in percent of the published figure, gain
rows in percentage points.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from scenarios.lib.fidelity_rows import load_rows

__all__ = ["ErrorBar", "error_bars"]

# Row key prefixes (after "scale-") per phase: the kernels the phase runs, its step gain.
NEAREST = {
    "decode": ("deepep-ll-", "sglang-decode-"),
    "prefill": ("deepep-normal-", "sglang-prefill-"),
}
INTRANODE_EP = 8  # a row without an EP size in its key ran inside one node


@dataclass(frozen=True)
class ErrorBar:
    """The replay's largest miss on one kind of published row near an answer."""

    delta: float  # simulated - published: % of the published figure, or pp for a gain
    unit: str  # "%" or "pp"
    row: str  # the fidelity row's key
    what: str  # the row's words
    calibration: bool  # a constant was read off this row: a fit, not a check

    def describe(self) -> str:
        cal = " (calibration row)" if self.calibration else ""
        return f"{self.delta:+.0f}{'%' if self.unit == '%' else ' pp'} on {self.what}{cal}"


def _ep(key: str) -> int:
    found = re.search(r"ep(\d+)", key)
    return int(found.group(1)) if found else INTRANODE_EP


def _worst(rows: list[dict], ep: int) -> ErrorBar | None:
    scored = [r for r in rows if isinstance(r.get("delta"), int | float)]
    if not scored:
        return None
    nearest = min(abs(math.log(_ep(r["key"]) / ep)) for r in scored)
    near = [r for r in scored if abs(math.log(_ep(r["key"]) / ep)) == nearest]
    worst = max(near, key=lambda r: abs(r["delta"]))
    return ErrorBar(
        float(worst["delta"]),
        "pp" if worst.get("delta_unit") == "pp" else "%",
        worst["key"],
        str(worst.get("what", worst["key"])).replace(", all ranks", ""),
        bool(worst.get("calibration")),
    )


def error_bars(phase: str, ep: int, rows: list[dict] | None = None) -> list[ErrorBar]:
    """The replay's largest misses near a `phase` answer at EP `ep`: kernels, then gain."""
    rows = load_rows() if rows is None else rows
    bars = []
    for prefix in NEAREST.get(phase, ()):
        kind = [r for r in rows if r["key"].startswith(f"scale-{prefix}")]
        bar = _worst(kind, ep)
        if bar is not None:
            bars.append(bar)
    return bars
