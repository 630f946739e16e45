"""`dbo-sim analyze`: the report, its artifacts, bad input, and the round trip of a simulated
step through torch.profiler's trace form (and through dbo-sim's own)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from dbo.analysis import analyze_trace
from dbo.analysis.profiler_form import write_profiler_trace
from dbo.sim.summary import summarize
from dbo.sim.trace_read import runs_from_trace
from scenarios.cli import main as cli_main

FIXTURES = Path(__file__).parent.parent / "fixtures"
PREFILL_DBO = str(FIXTURES / "prefill-dbo.json.gz")


def test_analyze_prints_the_report_and_writes_the_png_and_a_normalised_trace(
    tmp_path, capsys
) -> None:
    assert cli_main(["analyze", PREFILL_DBO, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "verdict:" in out and "side by side" in out and "layers (8" in out
    png = tmp_path / "prefill-dbo.analyze.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((tmp_path / "prefill-dbo.analyze.trace.json").read_text())
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"compute", "comm"} <= threads
    kernels = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "class" in e["args"]]
    assert kernels and all("cname" in e for e in kernels)
    assert {e["args"]["class"] for e in kernels} >= {"grouped_gemm", "scatter", "attention"}


def test_the_normalised_trace_reads_back_to_the_same_figures(tmp_path, capsys) -> None:
    assert cli_main(["analyze", PREFILL_DBO, "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    real = analyze_trace(PREFILL_DBO).steps[0].figures.summary
    again = analyze_trace(tmp_path / "prefill-dbo.analyze.trace.json").steps[0].figures.summary
    assert again.compute_us == pytest.approx(real.compute_us)
    assert again.comm_us == pytest.approx(real.comm_us)
    assert again.overlap_fraction == pytest.approx(real.overlap_fraction)


def test_json_prints_one_object_with_every_step(tmp_path, capsys) -> None:
    args = ["analyze", PREFILL_DBO, "--json", "--steps", "2", "--no-artifacts"]
    assert cli_main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["label"] for s in report["steps"]] == ["step 0", "step 1"]
    assert report["steps"][1]["side_by_side"]["roles"]["compute"]["kernels"] > 0
    assert report["written"] == []


def test_a_layer_window_reports_only_those_layers(tmp_path, capsys) -> None:
    args = ["analyze", PREFILL_DBO, "--json", "--out", str(tmp_path)]
    assert cli_main(args) == 0
    whole = json.loads(capsys.readouterr().out)["steps"][0]
    assert cli_main([*args, "--window", "layers=0:2"]) == 0
    part = json.loads(capsys.readouterr().out)["steps"][0]
    layers = whole["layers"]
    assert part["step_us"] == pytest.approx(layers[2]["start_us"] - layers[0]["start_us"])


def _one_line_refusal(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("dbo-sim: ")
    return captured.err


def _cpu_only(path: Path) -> Path:
    with gzip.open(FIXTURES / "decode-serial.json.gz", "rt") as f:
        data = json.load(f)
    data["traceEvents"] = [e for e in data["traceEvents"] if e.get("cat") == "cpu_op"]
    with gzip.open(path, "wt") as f:
        json.dump(data, f)
    return path


def _truncated(path: Path) -> Path:
    data = (FIXTURES / "decode-dbo.json.gz").read_bytes()
    path.write_bytes(data[: len(data) // 3])
    return path


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: (p / "n.json").write_text("not json") and p / "n.json", "not a profiler trace"),
        (lambda p: _cpu_only(p / "cpu.json.gz"), "no GPU activity"),
        (lambda p: _truncated(p / "cut.json.gz"), "cut short"),
        (lambda p: p / "missing.json", "no such trace file"),
    ],
    ids=["not-a-trace", "cpu-only", "truncated-gz", "missing"],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, make, why) -> None:
    trace = make(tmp_path)
    out = tmp_path / "out"
    assert cli_main(["analyze", str(trace), "--out", str(out)]) == 2
    assert why in _one_line_refusal(capsys)
    assert not out.exists()


def test_a_step_the_trace_does_not_have_is_refused(tmp_path, capsys) -> None:
    assert cli_main(["analyze", PREFILL_DBO, "--step", "3", "--out", str(tmp_path)]) == 2
    assert "1 step" in _one_line_refusal(capsys)
    assert not any(tmp_path.iterdir())


def test_against_sim_needs_the_step_kind_before_any_work(tmp_path, capsys) -> None:
    args = ["analyze", PREFILL_DBO, "--against-sim", "gpu-check", "--out", str(tmp_path)]
    assert cli_main(args) == 2
    assert "--sim-mode" in _one_line_refusal(capsys)


def test_against_sim_refuses_a_configuration_that_names_nothing(tmp_path, capsys) -> None:
    args = ["analyze", PREFILL_DBO, "--against-sim", "no-such", "--sim-mode", "prefill"]
    assert cli_main([*args, "--no-artifacts"]) == 2
    assert "neither a configuration" in _one_line_refusal(capsys)


@pytest.mark.timeout(300)
def test_against_sim_sets_the_simulated_step_beside_the_real_one(capsys) -> None:
    args = ["analyze", str(FIXTURES / "decode-dbo.json.gz"), "--steps", "2", "--no-artifacts"]
    assert cli_main([*args, "--json", "--against-sim", "gpu-check", "--sim-mode", "decode"]) == 0
    rows = json.loads(capsys.readouterr().out)["against_sim"]
    whats = [r["what"] for r in rows]
    assert "step" in whats and "stream compute busy" in whats and "class grouped_gemm" in whats
    sized = [abs(r["delta"]) for r in rows if r["unit"] == "us"]
    assert sized == sorted(sized, reverse=True)  # the largest disagreement first
    step = next(r for r in rows if r["what"] == "step")
    assert step["real"] > 0 and step["sim"] > 0


def _run_json(tmp_path: Path, capsys, scenario: str) -> dict:
    assert cli_main(["run", scenario, "--json", "--out", str(tmp_path)]) == 0
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    return line


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_simulated_step_in_profiler_form_analyzes_to_the_simulators_summary(
    tmp_path, capsys
) -> None:
    line = _run_json(tmp_path, capsys, "dsv3-prefill-ht")  # a step with real overlap
    (run,) = runs_from_trace(json.loads(Path(line["trace"]).read_text()))
    report = analyze_trace(write_profiler_trace(run.records, tmp_path / "profiled.json"))
    assert report.source == "torch.profiler"
    assert sorted(report.streams.values()) == ["comm", "compute"]
    (step,) = report.steps
    assert step.figures.label == "ProfilerStep#0"
    assert [t.label for t in step.figures.threads] == ["ubatch 0", "ubatch 1"]
    s, sim = step.figures.summary, summarize(run.records)
    assert s.step_us == pytest.approx(line["step_us_dbo"], rel=0.01)
    assert s.compute_us == pytest.approx(sim.compute_us, rel=0.01)
    assert s.comm_us == pytest.approx(sim.comm_us, rel=0.01)
    assert line["overlap_fraction"] > 0.1
    assert s.overlap_fraction == pytest.approx(line["overlap_fraction"], rel=0.01)
    assert s.exposed_comm_us == pytest.approx(line["exposed_comm_us"], rel=0.01)


@pytest.mark.timeout(300)
def test_a_trace_in_dbo_sims_own_format_analyzes_to_its_summary(tmp_path, capsys) -> None:
    line = _run_json(tmp_path, capsys, "moe-prefill-ht")
    report = analyze_trace(line["trace"])
    assert report.source == "dbo-sim"
    (step,) = report.steps
    s = step.figures.summary
    assert s.step_us == pytest.approx(line["step_us_dbo"], rel=0.01)
    assert s.exposed_comm_us == pytest.approx(line["exposed_comm_us"], rel=0.01)
    assert s.overlap_fraction == pytest.approx(line["overlap_fraction"], abs=0.01)
    assert [t.label for t in step.figures.threads] == ["ubatch 0", "ubatch 1"]
