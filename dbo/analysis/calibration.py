"""The simulator's host costs and overlap rates, derived from real profiler traces.

One job: the figures `dbo-sim profile --host-from-trace` writes into a profile's
`-host.json` (`HardwareProfile` host costs and `overlap_rates`), from eager serial and DBO
`torch.profiler` traces. The traces are read by `dbo.analysis.reader` (streamed); the overlap
rates are the side-by-side figures of `dbo.analysis.sidebyside` summed over the traces.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dbo.analysis.events import slim_event
from dbo.analysis.reader import read_trace
from dbo.analysis.sidebyside import RoleOverlap, side_by_side
from dbo.analysis.timeline import build_timeline
from dbo.sim.families import host_family

__all__ = ["host_costs_from_traces", "overlap_rates_from_traces"]

_LAUNCHES = (
    "cudaLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchKernelExC",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
)
_HOST_NAMES = {
    "aten::matmul": "gemm",
    "aten::linear": "gemm",
    "aten::scaled_dot_product_attention": "attention",
}


def _events(path: str | Path) -> list[dict]:
    return read_trace(path).events


def host_costs_from_traces(
    serial: Sequence[str | Path], dbo_traces: Sequence[str | Path], *, bare_op_us: float
) -> dict:
    """Host figures of a profile from eager profiler traces (one thread for serial steps, two
    ubatch threads for DBO steps). The rules, fixed before looking at any step time:

    - Ops: the top-level `cpu_op`s of the serial traces that launch work (a runtime launch,
      memcpy or memset inside them) are the ops the simulator places; their mean duration per
      host kind, relative to elementwise ones, is `host_op_scale`.
    - The profiler's own cost: a profiled op pays for its recorded events. `bare_op_us`, the
      unprofiled host time of one tiny eager op (calibrate_host's add_ loop), over the profiled
      mean of the same op (aten::add) gives the factor that takes the profiler out of op
      durations; the elementwise launch_us is that factor times the profiled elementwise mean.
    - Python between ops: the gaps between top-level ops plus the ops that launch nothing
      (views; profiler factor applied), per launching op: `python_us`.
    - Baton pass: in the DBO traces, the median gap between consecutive launches on different
      ubatch threads minus the median gap between consecutive launches on one thread:
      `handoff_us`.
    """
    ops = _SerialOps()
    for path in serial:
        ops.add_trace(_events(path))
    if not ops.launching or not ops.adds or "elementwise" not in ops.per_kind:
        raise ValueError(
            "the serial traces hold no launching top-level ops (record CPU and CUDA activity)"
        )
    factor = bare_op_us / statistics.mean(ops.adds)
    elementwise = statistics.mean(ops.per_kind["elementwise"])
    out = {
        "launch_us": round(factor * elementwise, 2),
        "python_us": round((ops.gaps + factor * ops.views) / ops.launching, 2),
        "host_op_scale": {
            k: round(statistics.mean(v) / elementwise, 3) for k, v in sorted(ops.per_kind.items())
        },
        "profiler_factor": round(factor, 4),
        "ops": ops.launching,
    }
    handoff = _handoff_us(dbo_traces)
    if handoff is not None:
        out["handoff_us"] = round(handoff, 1)
    return out


class _SerialOps:
    """The top-level CPU ops of serial traces, accumulated trace by trace."""

    def __init__(self) -> None:
        self.per_kind: dict[str, list[float]] = {}
        self.adds: list[float] = []
        self.gaps = self.views = 0.0
        self.launching = 0

    def add_trace(self, events: list[dict]) -> None:
        ops = sorted(
            (e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["ts"], -e["dur"])
        )
        launches = sorted(e["ts"] for e in events if e.get("name") in _LAUNCHES)
        top: list[dict] = []
        end = float("-inf")
        for e in ops:
            if e["ts"] >= end:
                top.append(e)
                end = e["ts"] + e["dur"]
        for i, e in enumerate(top):
            n = bisect.bisect_left(launches, e["ts"] + e["dur"]) - bisect.bisect_left(
                launches, e["ts"]
            )
            if n:
                self.launching += 1
                kind = _HOST_NAMES.get(e["name"]) or host_family(e["name"])
                self.per_kind.setdefault(kind, []).append(e["dur"])
            else:
                self.views += e["dur"]
            if e["name"] == "aten::add":
                self.adds.append(e["dur"])
            if i + 1 < len(top):
                gap = top[i + 1]["ts"] - (e["ts"] + e["dur"])
                if gap < 1000:  # longer: between steps, not between ops
                    self.gaps += gap


def _handoff_us(dbo_traces: Sequence[str | Path]) -> float | None:
    """The baton pass: median gap across a switch of launching thread minus the median gap
    between two launches of one thread, over the two threads that launch the most."""
    switch: list[float] = []
    inner: list[float] = []
    for path in dbo_traces:
        launches = sorted(
            (e for e in _events(path) if e.get("name") in _LAUNCHES), key=lambda e: e["ts"]
        )
        counts: dict[Any, int] = {}
        for e in launches:
            counts[e["tid"]] = counts.get(e["tid"], 0) + 1
        ubatch_threads = sorted(counts, key=counts.get)[-2:]  # the two that issue the step
        launches = [e for e in launches if e["tid"] in ubatch_threads]
        for a, b in itertools.pairwise(launches):
            (inner if a["tid"] == b["tid"] else switch).append(b["ts"] - a["ts"])
    return statistics.median(switch) - statistics.median(inner) if switch and inner else None


def overlap_rates_from_traces(dbo_traces: Sequence[str | Path]) -> dict:
    """How fast a kernel progresses while a kernel on another stream runs, from eager DBO
    traces (`HardwareProfile.overlap_rates`): the side-by-side figures of each trace
    (`dbo.analysis.sidebyside`, where the rules are) summed over the traces, per role.
    Empty when neither role has a kernel that shared time (steps without a comm stream)."""
    roles = {"compute": RoleOverlap(), "full_grid": RoleOverlap()}
    for path in dbo_traces:
        sbs = side_by_side(build_timeline(read_trace(path, slim_event)).records)
        for role, figures in sbs.roles.items():
            total = roles[role]
            total.kernels += figures.kernels
            total.shared_us += figures.shared_us
            total.duration_us += figures.duration_us
            total.solo_us += figures.solo_us
    if not all(r.shared_us for r in roles.values()):
        return {}  # nothing ran beside a neighbour: no rate to measure, turns stay free
    return {
        "overlap_rates": {k: round(r.rate, 3) for k, r in roles.items() if r.rate is not None},
        "overlap_kernels": sum(r.kernels for r in roles.values()),
        "overlap_shared_us": round(sum(r.shared_us for r in roles.values()) / 2, 1),
    }
