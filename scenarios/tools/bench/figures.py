"""The records a benchmark returns: samples (`Stats`), goals (`Target`) and table rows
(`Figure`), each ratio taken between ours and a baseline sampled in the same run."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dbo.jsonsafe import finite_or_none


@dataclass(frozen=True)
class Stats:
    """Samples of one quantity, in the figure's unit, in the order they were taken."""

    median: float
    min: float
    max: float
    samples: int
    values: tuple[float, ...] = ()

    @staticmethod
    def of(values: Sequence[float]) -> Stats:
        if not values:
            raise ValueError("Stats.of needs at least one sample")
        median = statistics.median(values)
        return Stats(median, min(values), max(values), len(values), tuple(values))

    @staticmethod
    def exact(value: float) -> Stats:
        """A count or a size: one value, no spread."""
        return Stats(value, value, value, 1)


@dataclass(frozen=True)
class Target:
    """A goal for a figure: `on` ("ratio" or "ours") `op` ("<=", ">=", "==") `value`."""

    on: str
    op: str
    value: float
    label: str  # as the table shows it

    def met(self, ours: float, ratio: float | None) -> bool:
        x = ours if self.on == "ours" else ratio
        if x is None or math.isnan(x):
            return False
        if self.op == "<=":
            return x <= self.value
        if self.op == ">=":
            return x >= self.value
        return x == self.value


@dataclass
class Figure:
    """One row of the table: ours against a baseline, their ratio, and the targets."""

    bench: str  # one of the registered benchmark names
    name: str
    what: str  # exactly what one sample measures
    unit: str  # "ns", "ms", "bytes" or "count"
    ours: Stats
    baseline: Stats | None = None
    baseline_what: str = ""
    ratio_def: str = "ours/baseline"  # or "baseline/ours" (a speedup)
    targets: list[Target] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def paired(self) -> bool:
        """Ours and the baseline were sampled in lockstep (rep i of each taken together)."""
        return (
            self.baseline is not None
            and len(self.ours.values) > 1
            and len(self.ours.values) == len(self.baseline.values)
        )

    @property
    def ratio(self) -> float | None:
        """The median of per-repetition ratios when paired, else the ratio of medians.

        Pairing matters on a shared machine: it drifts between phases (the baton's floor
        alone changes several-fold as the peer core sleeps or not), and both samples of a
        pair sit in the same phase, while two medians may not.
        """
        if self.baseline is None:
            return None
        if self.paired:
            pairs = zip(self.ours.values, self.baseline.values, strict=True)
            return statistics.median(_divide(a, b, self.ratio_def) for a, b in pairs)
        return _divide(self.ours.median, self.baseline.median, self.ratio_def)

    @property
    def met(self) -> bool | None:
        """None when the figure has no target (it informs, it does not judge)."""
        if not self.targets:
            return None
        return all(t.met(self.ours.median, self.ratio) for t in self.targets)

    def to_dict(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "name": self.name,
            "what": self.what,
            "unit": self.unit,
            "ours": _stats_dict(self.ours),
            "baseline": None if self.baseline is None else _stats_dict(self.baseline),
            "baseline_what": self.baseline_what,
            "ratio": finite_or_none(self.ratio),
            "ratio_def": self.ratio_def,
            "ratio_paired": self.paired,
            "targets": [asdict(t) for t in self.targets],
            "target": "; ".join(t.label for t in self.targets) or None,
            "met": self.met,
            "extra": self.extra,
            "note": self.note,
        }


def _divide(ours: float, baseline: float, ratio_def: str) -> float:
    a, b = (baseline, ours) if ratio_def == "baseline/ours" else (ours, baseline)
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


def _stats_dict(stats: Stats) -> dict[str, Any]:
    return {k: finite_or_none(v) if isinstance(v, float) else v for k, v in asdict(stats).items()}
