"""dbo.analyze_trace on the real H200 profiler traces shipped in tests/fixtures (see its
PROVENANCE.md), each figure checked against the raw events or the shipped H200 profile."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import dbo
from dbo.analysis import TraceError, TraceReport, analyze_trace, classify_kernel
from dbo.analysis import reader as reader_module
from dbo.analysis.reader import read_trace
from dbo.sim.tables import __file__ as tables_init

FIXTURES = Path(__file__).parent.parent / "fixtures"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def fixture(name: str) -> Path:
    return FIXTURES / f"{name}.json.gz"


def raw_events(name: str) -> list[dict]:
    with gzip.open(fixture(name), "rt") as f:
        return json.load(f)["traceEvents"]


def union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def reference_window(events: list[dict]) -> tuple[float, float]:
    """The whole trace as one step: from the first launch of device work to its last end."""
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    corr = {e["args"]["correlation"] for e in device}
    launches = [
        e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and e.get("args", {}).get("correlation") in corr
    ]
    return min(launches + [e["ts"] for e in device]), max(e["ts"] + e["dur"] for e in device)


def test_dbo_analyze_trace_is_the_analysis_entry_point() -> None:
    # The facade imports it plainly (tests/house/test_import_orders.py: in any import order).
    assert dbo.analyze_trace is analyze_trace
    assert dbo.TraceReport is TraceReport


def test_decode_dbo_host_bound_share_is_the_device_idle_share_of_the_raw_trace() -> None:
    events = raw_events("decode-dbo")
    lo, hi = reference_window(events)
    busy = union_length(
        [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_CATS]
    )
    expected = (hi - lo - busy) / (hi - lo)
    (step,) = analyze_trace(fixture("decode-dbo")).steps
    assert step.figures.summary.host_bound_fraction == pytest.approx(expected, abs=1e-6)
    assert expected > 0.4  # eager DBO decode on one GPU waits on its two launching threads
    assert any(v.startswith("host-bound: ") for v in step.verdict)


def test_decode_dbo_ran_everything_on_one_stream_and_says_no_overlap_was_possible() -> None:
    report = analyze_trace(fixture("decode-dbo"))
    assert list(report.streams.values()) == ["compute"]
    assert [t["label"] for t in report.threads] == ["ubatch 0", "ubatch 1"]
    (step,) = report.steps
    assert step.figures.summary.comm_us == 0
    assert "no overlap possible" in step.verdict[0]


def test_prefill_dbo_side_by_side_rates_are_those_of_the_shipped_h200_profile() -> None:
    stored = json.loads((Path(tables_init).parent / "h200-host.json").read_text())
    (step,) = analyze_trace(fixture("prefill-dbo")).steps
    sbs = step.side_by_side
    assert sbs.rates() == stored["overlap_rates"]  # compute 0.574, comm stream 0.237
    assert sum(r.kernels for r in sbs.roles.values()) == stored["overlap_kernels"]
    assert round(sbs.shared_us, 1) == stored["overlap_shared_us"]
    assert sbs.roles["full_grid"].slowdown > sbs.roles["compute"].slowdown > 1.0


def test_prefill_dbo_overlap_is_comm_stream_time_under_compute_stream_time() -> None:
    events = [e for e in raw_events("prefill-dbo") if e.get("cat") in DEVICE_CATS]
    lo, hi = reference_window(raw_events("prefill-dbo"))
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["args"]["stream"] == 29]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["args"]["stream"] == 33]
    hidden = union_length(compute) + union_length(comm) - union_length(compute + comm)
    report = analyze_trace(fixture("prefill-dbo"))
    assert report.streams == {"29": "compute", "33": "comm"}
    s = report.steps[0].figures.summary
    # The raw timestamps are ~5e12 us: float64 leaves them ~1e-3 us apart, hence rel=1e-5.
    assert s.comm_us == pytest.approx(union_length(comm), rel=1e-5)
    assert s.overlap_fraction == pytest.approx(hidden / union_length(comm), rel=1e-5)
    assert s.exposed_comm_us == pytest.approx(union_length(comm) - hidden, rel=1e-5)
    assert s.step_us == pytest.approx(hi - lo, rel=1e-5)


def test_a_serial_trace_has_one_launching_thread_and_nothing_to_overlap() -> None:
    report = analyze_trace(fixture("prefill-serial"))
    assert report.streams == {"7": "compute"}
    assert [t["label"] for t in report.threads] == ["other"]
    (step,) = report.steps
    assert step.figures.handoffs == 0
    assert "nothing to overlap" in step.verdict[0]


def test_host_activity_during_device_idle_adds_up_to_the_idle_time_for_every_thread() -> None:
    (step,) = analyze_trace(fixture("prefill-serial")).steps
    f = step.figures
    idle = f.compute_idle_us - f.idle_under_comm_us
    assert f.host_in_idle
    for cats in f.host_in_idle.values():
        assert sum(cats.values()) == pytest.approx(idle)
    # the serial trace records CPU ops: some of the idle time is spent inside them
    assert next(iter(f.host_in_idle.values()))["cpu_op"] > 0


def test_two_unmarked_steps_are_cut_into_equal_halves_with_four_layers_each() -> None:
    report = analyze_trace(fixture("decode-dbo"), steps=2)
    first, second = report.steps
    ops = [sum(t.launches for t in s.figures.threads) for s in report.steps]
    assert ops[0] == ops[1] == 280  # the 560 device ops of the trace, half each
    assert len(first.layers) == len(second.layers) == 4  # the model has 4 layers
    assert second.figures.start_us >= first.figures.end_us


def test_baton_hand_offs_between_ubatch_threads_are_counted() -> None:
    (step,) = analyze_trace(fixture("decode-dbo")).steps
    assert step.figures.handoffs > 8  # at least one per layer per ubatch
    assert step.figures.handoff_us > 0


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
        (
            "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel"
            "13GemmUniversalINS5_17GroupProblemShapeIN4cute5tupleIJiiiEEEEE",
            "grouped_gemm",
        ),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
        (
            "void at::native::indexFuncLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
            "true, at::native::(anonymous namespace)::ReduceAdd>",
            "scatter",
        ),
        ("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*)", "gather"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "comm"),
        ("void deep_ep::internode_ll::dispatch<true, 3, 7168>(void*)", "comm"),
        ("Memcpy DtoD (Device -> Device)", "memcpy"),
        ("void at::native::sbtopk::gatherTopK<c10::BFloat16, unsigned int, 2, false>", "sort_topk"),
    ],
)
def test_kernels_are_classified_by_what_they_do(name: str, cls: str) -> None:
    assert classify_kernel(name) == cls


def test_the_reader_decodes_events_that_straddle_its_chunks(monkeypatch) -> None:
    whole = raw_events("decode-serial")
    monkeypatch.setattr(reader_module, "_CHUNK", 97)
    raw = read_trace(fixture("decode-serial"))
    assert raw.events == whole
    assert raw.fields["deviceProperties"][0]["name"] == "NVIDIA H200"


def _write(path: Path, text: str, gz: bool = False) -> Path:
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def test_a_file_that_is_not_json_is_not_a_profiler_trace(tmp_path) -> None:
    with pytest.raises(TraceError, match="not a profiler trace"):
        analyze_trace(_write(tmp_path / "notes.json", "hello"))


def test_json_without_trace_events_is_not_a_profiler_trace(tmp_path) -> None:
    with pytest.raises(TraceError, match="without traceEvents"):
        analyze_trace(_write(tmp_path / "x.json", '{"a": 1}'))


def test_a_cpu_only_profile_has_no_gpu_activity_to_analyze(tmp_path) -> None:
    events = [e for e in raw_events("decode-serial") if e.get("cat") not in DEVICE_CATS]
    path = _write(tmp_path / "cpu.json.gz", json.dumps({"traceEvents": events}), gz=True)
    with pytest.raises(TraceError, match="no GPU activity"):
        analyze_trace(path)


def test_a_truncated_gz_is_refused_as_cut_short(tmp_path) -> None:
    data = fixture("decode-dbo").read_bytes()
    path = tmp_path / "cut.json.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="cut short"):
        analyze_trace(path)


def test_a_json_text_cut_inside_the_events_is_refused(tmp_path) -> None:
    text = json.dumps({"traceEvents": raw_events("decode-dbo")})
    with pytest.raises(TraceError, match="cut short|invalid JSON"):
        analyze_trace(_write(tmp_path / "cut.json", text[: len(text) // 2]))


def test_dbo_exports_analyze_trace_and_its_report() -> None:
    report = dbo.analyze_trace(fixture("decode-serial"))
    assert isinstance(report, dbo.TraceReport)
    assert json.loads(json.dumps(report.to_dict()))["device"] == "NVIDIA H200"


def test_the_fixtures_reproduce_the_host_costs_the_h200_profile_was_derived_with() -> None:
    from dbo.analysis.calibration import host_costs_from_traces, overlap_rates_from_traces

    stored = json.loads((Path(tables_init).parent / "h200-host.json").read_text())
    dbo_traces = [fixture("prefill-dbo"), fixture("decode-dbo")]
    serial = [fixture("prefill-serial"), fixture("decode-serial")]
    # 7.6 us: the H200 host's unprofiled eager op, as dbo/sim/tables/PROVENANCE.md records
    derived = host_costs_from_traces(serial, dbo_traces, bare_op_us=7.6)
    derived.update(overlap_rates_from_traces(dbo_traces))
    assert derived == stored
