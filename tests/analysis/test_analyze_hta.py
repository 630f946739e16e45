"""Our figures against Meta's Holistic Trace Analysis (HTA, the dev extra) on the shipped H200
traces. HTA reads timestamps as whole microseconds (it floors `ts` and `dur`) and counts as
communication only kernels named like NCCL's, so each comparison runs on a copy of the trace
made comparable in exactly that way; docs/analyze.md says why the raw figures differ."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from dbo.analysis import classify_kernel
from dbo.analysis.analyze import load_timeline, step_report
from dbo.sim.summary import intersect_intervals, total_length, union_intervals

hta = pytest.importorskip("hta.trace_analysis", reason="HTA is in the dev extra")

FIXTURES = Path(__file__).parent.parent / "fixtures"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
NAMES = ("prefill-serial", "prefill-dbo", "decode-serial", "decode-dbo")


def comparable_copy(name: str, folder: Path, *, nccl_comm: bool = False) -> Path:
    """The fixture with device timestamps floored to whole microseconds (as HTA reads them)
    and, with `nccl_comm`, the comm stream's kernels renamed as NCCL kernels."""
    with gzip.open(FIXTURES / f"{name}.json.gz", "rt") as f:
        data = json.load(f)
    for e in data["traceEvents"]:
        if e.get("cat") in DEVICE_CATS:
            e["ts"], e["dur"] = math.floor(e["ts"]), math.floor(e["dur"])
            if nccl_comm and e["args"].get("stream") == 33:
                e["name"] = f"ncclDevKernel_SendRecv {e['name'][:40]}"
    folder.mkdir()
    path = folder / "rank-0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(data, f)
    return path


def device_span_report(path: Path):
    """Our report over HTA's window: the first device op's start to the last one's end."""
    timeline, _ = load_timeline(path)
    lo = min(r.start_us for r in timeline.records)
    hi = max(r.end_us for r in timeline.records)
    return timeline, step_report(timeline, timeline.steps[0], (lo, hi)), hi - lo


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_idle_time_agrees_with_htas_temporal_breakdown(tmp_path, name) -> None:
    path = comparable_copy(name, tmp_path / "t")
    theirs = hta.TraceAnalysis(trace_dir=str(path.parent)).get_temporal_breakdown(visualize=False)
    _, report, span = device_span_report(path)
    assert span == pytest.approx(theirs["kernel_time(us)"][0])
    ours_idle = span * report.figures.summary.host_bound_fraction
    assert ours_idle == pytest.approx(theirs["idle_time(us)"][0], abs=0.5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_kernel_time_per_class_agrees_with_htas_kernel_breakdown(tmp_path, name) -> None:
    path = comparable_copy(name, tmp_path / "t")
    analysis = hta.TraceAnalysis(trace_dir=str(path.parent))
    _, per_kernel = analysis.get_gpu_kernel_breakdown(
        visualize=False, num_kernels=100_000, include_memory_kernels=True
    )
    theirs: dict[str, float] = {}
    for kernel, us in zip(per_kernel["name"], per_kernel["sum (us)"]):
        theirs[classify_kernel(kernel)] = theirs.get(classify_kernel(kernel), 0.0) + us
    timeline, _, _ = device_span_report(path)
    ours: dict[str, float] = {}
    for r in timeline.records:
        ours[r.args["class"]] = ours.get(r.args["class"], 0.0) + r.dur_us
    assert ours.keys() == theirs.keys()
    for cls, us in theirs.items():
        assert ours[cls] == pytest.approx(us, abs=0.5), cls


@pytest.mark.timeout(120)
def test_comm_overlap_agrees_with_hta_once_copies_are_left_out_of_compute(tmp_path) -> None:
    path = comparable_copy("prefill-dbo", tmp_path / "t", nccl_comm=True)
    theirs = hta.TraceAnalysis(trace_dir=str(path.parent)).get_comm_comp_overlap(visualize=False)
    timeline, report, _ = device_span_report(path)
    comm = union_intervals((r.start_us, r.end_us) for r in timeline.records if r.kind == "comm")
    kernels = union_intervals(
        (r.start_us, r.end_us)
        for r in timeline.records
        if r.kind == "compute" and r.args["class"] not in ("memcpy", "memset")
    )
    without_copies = total_length(intersect_intervals(comm, kernels)) / total_length(comm)
    assert 100 * without_copies == pytest.approx(theirs["comp_comm_overlap_pctg"][0], abs=0.01)
    # ours counts a copy on the compute stream as compute, so it hides a little more comm
    assert report.figures.summary.overlap_fraction > without_copies
