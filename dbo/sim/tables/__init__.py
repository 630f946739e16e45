"""Measured kernel tables: what each op family cost on a real GPU, and how any shape is priced
from those measurements.

A table is a CSV with columns `op, m, n, k, groups, dtype, us, flops, bytes` (the meaning of
m/n/k/groups per op is in `PROVENANCE.md` beside the files), plus an optional JSON of host
costs. `KernelTable.estimate(family, ...)` prices a shape by interpolating log-log between
measured points, never by picking the nearest one:

- GEMMs (`mm`, `grouped_mm`): each measured weight shape is a series over rows `m`. A query is
  priced on the two series whose weight size (n*k, times groups) brackets its own, each read at
  the query's `m` and scaled by the weight-size ratio (both a weight-streaming kernel's bytes
  and a compute-bound kernel's FLOPs grow with it), then the two blended in log weight size.
- Every other family is one curve: time over FLOPs (causal attention) or over bytes moved.

Beyond the measured range a curve continues with its end slope, clamped: below the smallest
point a kernel gets cheaper no faster than linearly and never dearer (launch floors), above the
largest point time grows linearly (throughput stays at the best measured). Every estimate is
also floored by the family's best measured bandwidth and by the cheapest kernel in the table.
"""

from __future__ import annotations

import bisect
import csv
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "TABLE_DIR",
    "KernelRow",
    "KernelTable",
    "hbm_bytes",
    "interp_loglog",
    "load_table",
    "table_path",
]

TABLE_DIR = Path(__file__).resolve().parent

# Families priced by a curve over one measure: (table op, measure). "real_bytes" is the bytes
# column halved: the decode attention rows pass one tensor as keys and values (see PROVENANCE).
_CURVES: dict[str, tuple[str, str]] = {
    "sdpa_causal": ("sdpa_causal", "flops"),
    "sdpa_decode": ("sdpa_decode", "real_bytes"),
    "copy": ("copy", "bytes"),
    "elementwise": ("add", "bytes"),
    "index_select": ("index_select", "bytes"),
    "index_add": ("index_add", "bytes"),
    "norm": ("rms_norm", "bytes"),
    "sort_topk": ("router_softmax_topk256", "bytes"),
}
_SERIES = ("mm", "grouped_mm")


@dataclass(frozen=True)
class KernelRow:
    op: str
    m: int
    n: int
    k: int
    groups: int
    dtype: str
    us: float
    flops: float
    bytes: float


def interp_loglog(xs: list[float], ys: list[float], x: float) -> float:
    """y at x on the log-log polyline through (xs, ys) (xs ascending, all positive).

    Outside the points: below, the first segment's slope clamped to [0, 1]; above, slope 1."""
    if not xs:
        raise ValueError("no points to interpolate")
    if len(xs) == 1 or x <= 0:
        return ys[0] * (x / xs[0] if x > 0 and x > xs[0] else 1.0)
    lx = math.log(x)
    if x <= xs[0]:
        slope = _slope(xs[0], ys[0], xs[1], ys[1])
        return math.exp(math.log(ys[0]) + min(max(slope, 0.0), 1.0) * (lx - math.log(xs[0])))
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    i = bisect.bisect_right(xs, x) - 1
    slope = _slope(xs[i], ys[i], xs[i + 1], ys[i + 1])
    return math.exp(math.log(ys[i]) + slope * (lx - math.log(xs[i])))


def _slope(x0: float, y0: float, x1: float, y1: float) -> float:
    return (math.log(y1) - math.log(y0)) / (math.log(x1) - math.log(x0))


def _curve(points: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Sorted, de-duplicated (x, y) lists; repeated x values are averaged in log space."""
    merged: dict[float, list[float]] = {}
    for x, y in points:
        if x > 0 and y > 0:
            merged.setdefault(x, []).append(math.log(y))
    xs = sorted(merged)
    return xs, [math.exp(sum(merged[x]) / len(merged[x])) for x in xs]


@dataclass
class KernelTable:
    """One GPU's measured kernels (and host costs), with the interpolation that prices shapes."""

    name: str
    rows: list[KernelRow]
    host: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._curves: dict[str, tuple[list[float], list[float]]] = {}
        self._best_gbps: dict[str, float] = {}
        for family, (op, measure) in _CURVES.items():
            rows = [r for r in self.rows if r.op == op]
            if rows:
                self._curves[family] = _curve([(_measure(r, measure), r.us) for r in rows])
                self._best_gbps[family] = (
                    max(
                        _measure(r, "bytes" if measure == "flops" else measure) / r.us for r in rows
                    )
                    / 1e3
                )
        # GEMM series: op -> (n, k, groups) -> (xs over m, ys); and op -> [(weight size,
        # [series of that size])] sorted, for shapes that were not measured.
        self._series: dict[str, dict[tuple[int, int, int], tuple[list[float], list[float]]]] = {}
        self._by_weight: dict[str, list[tuple[float, list[tuple[list[float], list[float]]]]]] = {}
        for op in _SERIES:
            shapes: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
            for r in self.rows:
                if r.op == op and r.dtype == "bf16":
                    shapes.setdefault((r.n, r.k, r.groups), []).append((float(r.m), r.us))
            if not shapes:
                continue
            self._series[op] = {shape: _curve(pts) for shape, pts in shapes.items()}
            weights: dict[float, list[tuple[list[float], list[float]]]] = {}
            for (n, k, g), curve in self._series[op].items():
                weights.setdefault(float(n * k * g), []).append(curve)
            self._by_weight[op] = sorted(weights.items())
            self._best_gbps[op] = max(r.bytes / r.us for r in self.rows if r.op == op) / 1e3
        self.min_us = min((r.us for r in self.rows), default=0.0)

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(sorted(set(self._curves) | set(self._series)))

    def estimate(
        self,
        family: str,
        *,
        m: float = 0,
        n: float = 0,
        k: float = 0,
        groups: float = 1,
        flops: float = 0.0,
        nbytes: float = 0.0,
    ) -> float | None:
        """Time in us of one kernel of `family`, or None where the table does not cover it.
        GEMMs take m/n/k/groups (and nbytes for the floor); curves take flops or nbytes."""
        if family in self._series:
            t = self._gemm(family, m, (int(n), int(k), int(groups)))
        elif family in self._curves:
            measure = _CURVES[family][1]
            x = flops if measure == "flops" else nbytes
            if x <= 0:
                return None
            t = interp_loglog(*self._curves[family], x)
        else:
            return None
        floor = (
            nbytes / (self._best_gbps.get(family, 0.0) * 1e3)
            if nbytes and self._best_gbps.get(family)
            else 0.0
        )
        return max(t, floor, self.min_us)

    def _gemm(self, op: str, m: float, shape: tuple[int, int, int]) -> float:
        m = max(m, 1.0)
        exact = self._series[op].get(shape)
        if exact is not None:
            return interp_loglog(*exact, m)
        by_weight = self._by_weight[op]
        weights = [w for w, _ in by_weight]
        weight = max(float(shape[0] * shape[1] * shape[2]), 1.0)
        i = bisect.bisect_left(weights, weight)
        if i < len(weights) and weights[i] == weight:
            return self._at_weight(by_weight[i][1], m)
        lo, hi = max(i - 1, 0), min(i, len(weights) - 1)
        t_lo = self._at_weight(by_weight[lo][1], m) * weight / weights[lo]
        t_hi = self._at_weight(by_weight[hi][1], m) * weight / weights[hi]
        if lo == hi:
            return t_lo
        share = (math.log(weight) - math.log(weights[lo])) / (
            math.log(weights[hi]) - math.log(weights[lo])
        )
        return math.exp((1 - share) * math.log(t_lo) + share * math.log(t_hi))

    @staticmethod
    def _at_weight(curves: list[tuple[list[float], list[float]]], m: float) -> float:
        """Several measured shapes of one weight size (n x k and k x n): their log mean."""
        return math.exp(sum(math.log(interp_loglog(*c, m)) for c in curves) / len(curves))


def _measure(row: KernelRow, what: str) -> float:
    if what == "flops":
        return row.flops
    if what == "real_bytes":
        return row.bytes / 2
    return row.bytes


def hbm_bytes(row: KernelRow) -> float:
    """The bytes a measured kernel really moved through HBM (decode attention's bytes column
    counts its one key/value tensor twice)."""
    return _measure(row, "real_bytes" if row.op == "sdpa_decode" else "bytes")


def table_path(name: str) -> Path:
    return TABLE_DIR / f"{name}.csv"


def read_rows(path: str | Path) -> list[KernelRow]:
    """The rows of a kernel-table CSV (the profiler writes this format)."""
    rows = []
    with open(path, newline="") as f:
        for rec in csv.DictReader(f):
            rows.append(
                KernelRow(
                    rec["op"],
                    int(rec["m"]),
                    int(rec["n"]),
                    int(rec["k"]),
                    int(rec["groups"]),
                    rec["dtype"],
                    float(rec["us"]),
                    float(rec["flops"]),
                    float(rec["bytes"]),
                )
            )
    return rows


@functools.cache
def load_table(name_or_path: str) -> KernelTable:
    """A shipped table by name ("h200") or a table CSV by path; a JSON of host costs named
    `<stem>-host.json` beside it is loaded with it."""
    path = Path(name_or_path)
    if path.suffix != ".csv":
        path = table_path(name_or_path)
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in TABLE_DIR.glob("*.csv")))
        raise ValueError(
            f"no kernel table {name_or_path!r} (shipped: {shipped}; or give a .csv path)"
        )
    host_path = path.with_name(f"{path.stem}-host.json")
    host = json.loads(host_path.read_text()) if host_path.is_file() else {}
    return KernelTable(path.stem, read_rows(path), host)
