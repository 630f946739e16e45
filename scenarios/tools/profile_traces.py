"""Host costs and overlap rates of a profile, from `torch.profiler` Chrome traces of eager
serial and DBO steps (`dbo-sim profile --host-from-trace`): what a trace says about the host
(op launches, Python between ops, the baton pass) and about two streams' kernels side by side.
"""

from __future__ import annotations

import bisect
import gzip
import itertools
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dbo.sim.cost import host_family

__all__ = ["host_costs_from_traces", "overlap_rates_from_traces"]


_LAUNCHES = (
    "cudaLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchKernelExC",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
)
_GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST_NAMES = {
    "aten::matmul": "gemm",
    "aten::linear": "gemm",
    "aten::scaled_dot_product_attention": "attention",
}


def _events(path: str | Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


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
    """The serial traces' top-level ops, tallied: durations of the launching ones per host
    kind, the profiled `aten::add`s, and the time that launches nothing (gaps, views)."""

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
    """The median launch gap across ubatch threads minus the median one within a thread."""
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


def _gpu_work(path: str | Path) -> list[dict]:
    """A trace's device activity (kernels, copies, memsets), in start order."""
    return sorted((e for e in _events(path) if e.get("cat") in _GPU_WORK), key=lambda e: e["ts"])


def _cross_stream_overlap(work: Sequence[dict]) -> list[float]:
    """Per entry of `work` (sorted by start): time it shares with work on other streams."""
    out = []
    for i, e in enumerate(work):
        start, end = e["ts"], e["ts"] + e["dur"]
        shared = 0.0
        for other in itertools.chain(reversed(work[:i]), work[i + 1 :]):
            if other["tid"] != e["tid"]:
                shared += max(0.0, min(end, other["ts"] + other["dur"]) - max(start, other["ts"]))
        out.append(shared)
    return out


def overlap_rates_from_traces(dbo_traces: Sequence[str | Path]) -> dict:
    """How fast a kernel progresses while a kernel on another stream runs, from eager DBO
    traces (`HardwareProfile.overlap_rates`). The rules, fixed before looking at any step time:

    - Roles: in each trace the stream with the most kernels is the compute stream
      ("compute"); kernels on any other stream are the local comm ops ("full_grid").
    - A kernel's signature is its name, grid and block. Its solo time is a duration of the
      same signature that shared no time with another stream; kernels of one signature can run
      different shapes, so the solo time taken is the largest one not above the kernel's own
      duration (it never overstates a slowdown). A kernel with no such duration is left out.
    - Per role, over its kernels that shared time with another stream: rate = 1 - (sum of
      duration minus solo time) / (sum of shared time), clamped to [0.01, 1]. 1: a neighbour
      costs nothing; near 0: the kernel stands still while the neighbour runs. Empty when
      neither role has such a kernel (steps without a comm stream).
    """
    excess = {"compute": 0.0, "full_grid": 0.0}
    shared = {"compute": 0.0, "full_grid": 0.0}
    counted = 0
    for path in dbo_traces:
        work = _gpu_work(path)
        kernels = [e for e in work if e.get("cat") == "kernel"]
        if not kernels:
            continue
        counts: dict[Any, int] = {}
        for e in kernels:
            counts[e["tid"]] = counts.get(e["tid"], 0) + 1
        compute_stream = max(counts, key=counts.__getitem__)
        solo: dict[tuple, list[float]] = {}
        overlapped = []
        for e, o in zip(work, _cross_stream_overlap(work)):
            if e.get("cat") != "kernel":
                continue
            args = e.get("args", {})
            sig = (e["name"], str(args.get("grid")), str(args.get("block")))
            if o > 0:
                overlapped.append((e, o, sig))
            else:
                solo.setdefault(sig, []).append(e["dur"])
        for e, o, sig in overlapped:
            below = [d for d in solo.get(sig, ()) if d <= e["dur"]]
            if not below:
                continue
            role = "compute" if e["tid"] == compute_stream else "full_grid"
            excess[role] += e["dur"] - max(below)
            shared[role] += o
            counted += 1
    if not all(shared.values()):
        return {}  # nothing ran beside a neighbour: no rate to measure, turns stay free
    rates = {r: round(min(1.0, max(0.01, 1.0 - excess[r] / shared[r])), 3) for r in excess}
    return {
        "overlap_rates": rates,
        "overlap_kernels": counted,
        "overlap_shared_us": round(sum(shared.values()) / 2, 1),
    }
