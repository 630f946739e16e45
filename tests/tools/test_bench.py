"""`python -m scenarios bench --quick` runs to the end and writes a complete bench.json.

Timing is never asserted: the figures are reports, and CI machines are noisy.
"""

from __future__ import annotations

import json

import pytest
import torch

from scenarios.cli import main
from scenarios.tools.bench.figures import Figure, Stats
from scenarios.tools.bench.suite import BENCHMARKS

# Figures that carry the project's targets; a quick run must report each of them.
TARGETED = (
    "workspace.get_simultaneous.locked.n1",
    "workspace.get_simultaneous.locked.n3",
    "workspace.get_simultaneous.locked.n8",
    "workspace.allocations.slot",
    "workspace.allocations.storage",
    "baton.dbo_yield",
    "baton.dbo_yield.sim",
    "baton.sim_accounting",
    "sim.deepseek_v3_step",
    "scaling.orphaned_bytes",
)


def _no_constants(name: str) -> None:
    raise ValueError(f"bench.json holds {name}, which is not JSON")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_quick_writes_every_benchmark(tmp_path, capsys):
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 0

    doc = json.loads((tmp_path / "bench.json").read_text(), parse_constant=_no_constants)
    assert {
        "schema",
        "date",
        "quick",
        "machine",
        "plan",
        "seconds",
        "benchmarks",
        "figures",
        "summary",
    } <= set(doc)
    assert doc["quick"] is True
    assert {"platform", "cpu_count", "python", "torch"} <= set(doc["machine"])

    figures = doc["figures"]
    assert {f["bench"] for f in figures} == set(BENCHMARKS)
    names = [f["name"] for f in figures]
    assert len(names) == len(set(names))
    assert set(TARGETED) <= set(names)
    for f in figures:
        assert {"ours", "baseline", "ratio", "target", "met", "what", "unit"} <= set(f)
        assert {"median", "min", "max", "samples"} <= set(f["ours"])
        assert f["met"] in (True, False, None)
        assert (f["met"] is None) == (not f["targets"])

    summary = doc["summary"]
    assert summary["targets"] == sum(f["met"] is not None for f in figures)
    assert set(summary["missed"]) == {f["name"] for f in figures if f["met"] is False}

    table = capsys.readouterr().out
    assert all(name in table for name in names)


# --------------------------------------------------------------------------------------------
# The measuring instruments themselves (no timing)


def test_per_call_baseline_lays_out_the_same_views_as_the_workspace_manager():
    from scenarios.tools.bench.baselines import PerCallWorkspace, moe_request
    from workspace import WorkspaceManager

    request = moe_request(8)
    ours = WorkspaceManager("cpu", 2).get_simultaneous(*request)
    plain = PerCallWorkspace("cpu", 2).get_simultaneous(*request)
    assert [(v.shape, v.dtype) for v in ours] == [(v.shape, v.dtype) for v in plain]
    offsets = [v.data_ptr() - ours[0].data_ptr() for v in ours]
    assert offsets == [v.data_ptr() - plain[0].data_ptr() for v in plain]


def test_per_call_baseline_grows_every_slot_and_refuses_growth_when_locked():
    from scenarios.tools.bench.baselines import PerCallWorkspace

    plain = PerCallWorkspace("cpu", 3)
    plain.get_simultaneous(((1000,), torch.uint8))
    assert [s.numel() for s in plain.slots] == [1024, 1024, 1024]
    plain.locked = True
    plain.get_simultaneous(((1024,), torch.uint8))  # fits
    with pytest.raises(AssertionError, match="locked"):
        plain.get_simultaneous(((1025,), torch.uint8))


def test_the_storage_allocation_counter_sees_an_allocation():
    # The zero-allocation figure means something only if the counter can count.
    from scenarios.tools.bench.workspace import _storage_allocations

    assert _storage_allocations(lambda: torch.empty(1 << 16)) >= 1
    x = torch.zeros(16)
    assert _storage_allocations(lambda: x.add_(x)) == 0  # in place, no scalar to wrap


def test_a_paired_ratio_is_the_median_of_per_repetition_ratios():
    from scenarios.tools.bench.figures import Figure, Stats, Target

    figure = Figure(
        bench="baton",
        name="x",
        what="x",
        unit="ns",
        ours=Stats.of([10.0, 40.0, 12.0]),
        baseline=Stats.of([10.0, 20.0, 10.0]),
        targets=[Target("ratio", "<=", 1.1, "<= 1.1x")],
    )
    assert figure.paired and figure.ratio == pytest.approx(1.2)  # median of 1.0, 2.0, 1.2
    assert figure.met is False
    speedup = Figure(
        bench="x",
        name="y",
        what="y",
        unit="ns",
        ours=Stats.exact(2.0),
        baseline=Stats.exact(10.0),
        ratio_def="baseline/ours",
        targets=[Target("ratio", ">=", 5.0, ">= 5x")],
    )
    assert not speedup.paired and speedup.ratio == 5.0 and speedup.met is True
    assert Figure(bench="x", name="z", what="z", unit="count", ours=Stats.exact(0)).met is None


def test_a_benchmark_name_registered_twice_is_refused():
    from scenarios.tools.bench.registry import benchmark

    with pytest.raises(ValueError, match="registered twice"):
        benchmark("baton")(lambda plan: [])


def test_a_benchmark_returning_a_figure_of_another_name_is_refused():
    from scenarios.tools.bench.registry import QUICK, Benchmark

    stray = Figure(bench="elsewhere", name="x", what="x", unit="count", ours=Stats.exact(0))
    with pytest.raises(RuntimeError, match="elsewhere"):
        Benchmark("mine", ("mine",), lambda plan: [stray])(QUICK)


def test_every_benchmark_is_registered_once_in_run_order():
    from scenarios.tools.bench.registry import registered

    assert [n for b in registered() for n in b.names] == list(BENCHMARKS)
    assert BENCHMARKS[0].startswith("workspace.") and BENCHMARKS[-1].startswith("scaling.")


_AFFINITY = pytest.mark.skipif(
    not hasattr(__import__("os"), "sched_setaffinity"), reason="no thread affinity here"
)


@_AFFINITY
@pytest.mark.timeout(30)
def test_pinning_runs_the_calling_thread_on_one_cpu_and_gives_its_cpus_back():
    import os

    from scenarios.tools.bench.baton import _one_core_cpu, _pinned

    everywhere = os.sched_getaffinity(0)
    with _pinned(_one_core_cpu()):
        inside = os.sched_getaffinity(0)
    assert inside == {min(everywhere)}
    assert os.sched_getaffinity(0) == everywhere


@_AFFINITY
@pytest.mark.timeout(30)
def test_a_one_core_baton_sample_leaves_the_pooled_ubatch_threads_unpinned():
    import os

    import dbo
    from scenarios.tools.bench.baselines import NullDevice
    from scenarios.tools.bench.baton import _dbo_pingpong, _one_core_cpu

    assert _dbo_pingpong(NullDevice(), 3, _one_core_cpu())() > 0
    after = dbo.run_ubatches(lambda _: os.sched_getaffinity(0), [None, None], device=NullDevice())
    assert after == [os.sched_getaffinity(0)] * 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_cluster_wall_bench_reports_replay_and_record_plus_replay_against_the_2s_target():
    from scenarios.tools.bench.cluster import WALL_TARGET_MS, bench_cluster_wall
    from scenarios.tools.bench.registry import QUICK

    figures = {f.name: f for f in bench_cluster_wall(QUICK)}
    assert set(figures) == {
        "cluster.ep256_decode",
        "cluster.ep256_decode.record_replay",
        "cluster.ep32_prefill",
        "cluster.ep32_prefill.record_replay",
    }
    for name in ("cluster.ep256_decode", "cluster.ep32_prefill"):
        end_to_end = figures[f"{name}.record_replay"]
        assert [(t.on, t.op, t.value) for t in end_to_end.targets] == [
            ("ours", "<=", WALL_TARGET_MS)
        ]
        # one rank's interception is inside the end-to-end figure and not in the replay's
        assert end_to_end.ours.median > figures[name].ours.median
