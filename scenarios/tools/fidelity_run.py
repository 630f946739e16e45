"""The work of `dbo-sim fidelity`: the simulator's rows beside the published DBO/TBO and
DeepEP results, their verdicts, and the report as a table or JSON.

One job: re-run each published experiment on the simulated device, as closely as the model
allows, and print one row per published figure (what, published, simulated, delta, whether it
is within its target, and the assumptions that produced it). `dbo-sim fidelity [--quick]
[--json]`.

The published figures (sources beside each constant below):
- SGLang two-batch overlap (TBO) on DeepSeek-V3, 96 H100 with prefill/decode disaggregation
  and large EP: prefill +27% to +35% throughput (4K-token prompts, 8K-16K tokens per device,
  DeepEP normal mode); decode -27% at 32 tokens per device and +25.5% at 256 (9 nodes, EP 72,
  DeepEP low-latency mode). Target: within 5 percentage points, sign right.
- DeepEP kernels on H800, its whole V1 tables: low-latency dispatch and combine times at EP
  8 to 256 (128 tokens, hidden 7168, top-8, FP8 dispatch, BF16 combine); normal mode
  ~153 GB/s over NVLink and 43-58 GB/s over RDMA at EP 16/32/64. Target: within 10%. Pure
  cost-model arithmetic (`dbo.sim.cost.comm_time_us`), and the all-ranks replay.
- vLLM maintainers: DBO pays only when communication outweighs GEMM time; eager decode is
  host-launch bound (GPU busy 11.8 of 55.6 ms). Target: the effects, shown (host-bound share
  high eagerly; the DBO gain changes sign as comm/GEMM crosses ~1). That a replayed graph
  removes the host time is true by construction in the simulator, so it is no row.

Nothing here sets a model constant: every number the simulator uses comes from
`dbo.sim.hardware` (datasheets, DeepEP/DeepGEMM measurements, the H200 kernel table and host
figures) or is a property of the published setup (GPU, EP size, tokens, SMs given to
communication). A row whose constant was taken, even in part, from the very figure it is
scored against is marked calibration and not counted as a hit. The whole-step rows run on
the H100 profile (no measured H100 kernels: roofline) with the host figures measured on the
H200 host (a host property: eager issue cost per op kind, Python between ops, baton passes).
A missed target is reported as missed, with what the model would need to differ in.

Each all-ranks row names its one-rank twin (the row scoring the same figure); the report
says on which figures both score the replay is further off than the one-rank formula.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from dbo.sim.hardware import H800
from scenarios.lib.fidelity_rows import (
    DEEPEP_LL_PUBLISHED,
    DEEPEP_NVLINK_PUBLISHED,
    DEEPEP_RDMA_PUBLISHED,
    FidelityReport,
    FidelityRow,
    describe_profile,
)
from scenarios.lib.progress import advance, progress_bar
from scenarios.lib.usage import Interrupted
from scenarios.tools.fidelity_kernels import deepep_ll_us, deepep_rows, normal_bandwidth_gbps
from scenarios.tools.fidelity_scale import scale_rows
from scenarios.tools.fidelity_steps import sglang_rows, vllm_rows

__all__ = [
    "DEEPEP_LL_PUBLISHED",
    "DEEPEP_NVLINK_PUBLISHED",
    "DEEPEP_RDMA_PUBLISHED",
    "FidelityRow",
    "FidelityReport",
    "deepep_ll_us",
    "normal_bandwidth_gbps",
    "deepep_rows",
    "sglang_rows",
    "vllm_rows",
    "scale_rows",
    "run_fidelity",
    "TwinComparison",
    "twin_comparisons",
    "format_table",
    "run",
]


def run_fidelity(
    quick: bool = False,
    *,
    on_point: Callable[[str], None] | None = None,
    partial: FidelityReport | None = None,
) -> FidelityReport:
    """Every published figure's row. Rows land in `partial` (a fresh report by default) as
    each group of figures finishes, so a caller interrupted midway keeps them."""
    start = time.monotonic()
    report = partial if partial is not None else FidelityReport([], {}, quick, 0.0, {})
    report.rows += deepep_rows()
    report.assumptions["H800"] = (
        describe_profile(H800) + ". DeepEP's benchmark settings (see the row)"
    )
    for part in (sglang_rows, vllm_rows, scale_rows):
        r, a, e = part(quick, on_point=on_point)
        report.rows += r
        report.assumptions.update(a)
        report.extra.update(e)
        report.seconds = time.monotonic() - start
    report.extra["all_ranks_vs_one_rank"] = [c.to_dict() for c in twin_comparisons(report.rows)]
    return report


@dataclass(frozen=True)
class TwinComparison:
    """One figure both models score: the one-rank row's miss beside the all-ranks row's."""

    key: str  # the all-ranks row
    twin: str  # the one-rank row scoring the same figure
    figure: str  # the one-rank row's words
    one_rank: float  # its delta
    all_ranks: float
    unit: str  # "%" or "pp"

    @property
    def no_worse(self) -> bool:
        return abs(self.all_ranks) <= abs(self.one_rank)

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "no_worse": self.no_worse}


def twin_comparisons(rows: list[FidelityRow]) -> list[TwinComparison]:
    """Every all-ranks row beside its one-rank twin, where both are scored (neither is a
    calibration row; a calibration row's delta is a fit, not a miss). A twin that names no
    row is a bug in the rows, refused rather than left out of the count."""
    by_key = {r.key: r for r in rows}
    out = []
    for row in (r for r in rows if r.twin):
        twin = by_key.get(row.twin)
        if twin is None:
            raise ValueError(f"fidelity row {row.key!r} names a twin {row.twin!r} that no row has")
        if row.calibration or twin.calibration or row.delta is None or twin.delta is None:
            continue
        out.append(
            TwinComparison(row.key, twin.key, twin.what, twin.delta, row.delta, row.delta_unit)
        )
    return out


# --------------------------------------------------------------------------------------------
# Output


def _fmt_value(row: FidelityRow) -> str:
    if not math.isfinite(row.simulated):
        return "-"
    if row.unit == "%":
        return f"{row.simulated:+.1f}%"
    if row.unit == "x":
        return f"{row.simulated:.2f}x"
    return f"{row.simulated:.1f} {row.unit}"


def _fmt_delta(row: FidelityRow) -> str:
    if row.delta is None or not math.isfinite(row.delta):
        return "-"
    return f"{row.delta:+.1f} {row.delta_unit}"


def format_table(report: FidelityReport) -> str:
    header = ("figure", "published", "simulated", "delta", "target", "met", "asm")
    lines_rows = [header]
    for r in report.rows:
        met = ("yes" if r.met else "NO") + (" (cal)" if r.calibration else "")
        lines_rows.append(
            (r.what, r.published, _fmt_value(r), _fmt_delta(r), r.target, met, r.assumptions)
        )
    widths = [max(len(row[i]) for row in lines_rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in lines_rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    checks = [r for r in report.rows if not r.calibration]
    hits = sum(r.hit for r in checks)
    lines.append("")
    lines.append(
        f"{hits} of {len(checks)} checked figures within target; {len(report.rows) - len(checks)} "
        f"calibration rows (a constant taken from the figure itself) shown, not counted"
        + (" (quick: reduced layers)" if report.quick else "")
    )
    lines += _twin_lines(twin_comparisons(report.rows))
    notes = [(r.what, r.note) for r in report.rows if r.note]
    if notes:
        lines.append("\nnotes:")
        lines += [f"  {what}: {note}" for what, note in notes]
    lines.append("\nassumptions (column 'asm'):")
    lines += [f"  [{k}] {v}" for k, v in report.assumptions.items()]
    sources = sorted({r.source for r in report.rows})
    lines.append("\nsources:")
    lines += [f"  {s}" for s in sources]
    return "\n".join(lines)


def _twin_lines(pairs: list[TwinComparison]) -> list[str]:
    if not pairs:
        return []
    worse = [p for p in pairs if not p.no_worse]
    lines = [
        f"\nall ranks against one rank, on the {len(pairs)} figures both score: no further off "
        f"on {len(pairs) - len(worse)}" + ("; further off on:" if worse else "")
    ]
    lines += [f"  {p.figure}: {p.all_ranks:+.1f} against {p.one_rank:+.1f} {p.unit}" for p in worse]
    return lines


def run(args: argparse.Namespace) -> int:
    """The table (or JSON). Exit status 0 whether or not every target is met: the table is the
    result; a missed target is a finding, not a failure of the command."""
    report = FidelityReport([], {}, args.quick, 0.0, {})
    bar = progress_bar(None, "fidelity", quiet=args.json, unit="point")
    try:
        with bar:
            run_fidelity(args.quick, on_point=advance(bar), partial=report)
    except KeyboardInterrupt:
        if report.rows and not args.json:
            print(format_table(report))
        raise Interrupted(
            f"{len(report.rows)} row(s) had finished"
            + (" (above)" if report.rows and not args.json else "")
        ) from None
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(format_table(report))
    return 0
