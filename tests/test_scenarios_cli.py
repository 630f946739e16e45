"""The scenarios through the CLI: verdicts, the JSON schema, artifacts, exit status."""

from __future__ import annotations

import csv
import json

import pytest

import scenarios.catalog as catalog
from scenarios.cli import main

pytestmark = pytest.mark.timeout(120)

JSON_FIELDS = {
    "scenario": str,
    "passed": bool,
    "negative": bool,
    "outputs_match": (bool, type(None)),
    "max_abs_diff": (float, type(None)),
    "races": int,
    "error": (str, type(None)),
    "step_us_serial": (float, type(None)),
    "step_us_dbo": (float, type(None)),
    "speedup": (float, type(None)),
    "overlap_fraction": (float, type(None)),
    "exposed_comm_us": (float, type(None)),
    "workspace_peak_bytes": (int, type(None)),
    "trace": (str, type(None)),
    "timeline_png": (str, type(None)),
    "wall_s": float,
    "details": dict,
}


def _run_json(capsys, *argv: str) -> tuple[int, list[dict]]:
    code = main(["run", "--json", *argv])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    return code, [json.loads(line) for line in lines]


@pytest.mark.parametrize("name", list(catalog.SCENARIOS))
def test_every_scenario_passes_through_the_cli(capsys, name):
    code, reports = _run_json(capsys, name, "--no-artifacts")
    assert [r["scenario"] for r in reports] == [name]
    assert reports[0]["passed"], reports[0]["error"]
    assert code == 0


def test_json_report_follows_the_documented_schema(capsys, tmp_path):
    code, reports = _run_json(capsys, "moe-prefill-ht", "yield-mismatch", "--out", str(tmp_path))
    assert code == 0 and len(reports) == 2
    for report in reports:
        assert set(report) == set(JSON_FIELDS)
        for key, kind in JSON_FIELDS.items():
            assert isinstance(report[key], kind), (key, report[key])
    overlap = reports[0]
    assert overlap["outputs_match"] is True and overlap["races"] == 0
    assert overlap["step_us_serial"] > 0 and overlap["step_us_dbo"] > 0
    assert overlap["speedup"] == pytest.approx(overlap["step_us_serial"] / overlap["step_us_dbo"])
    assert reports[1]["negative"] is True


def test_run_writes_a_trace_and_a_timeline_per_scenario(capsys, tmp_path):
    code, (report,) = _run_json(capsys, "moe-decode-ll", "--out", str(tmp_path))
    assert code == 0
    trace = json.loads((tmp_path / "moe-decode-ll.trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M" and e["name"] == "thread_name"}
    assert any(n.startswith("compute") for n in names)
    assert (tmp_path / "moe-decode-ll.png").read_bytes().startswith(b"\x89PNG")
    assert report["trace"].endswith("moe-decode-ll.trace.json")


def test_table_output_and_exit_status_when_a_scenario_fails(capsys, monkeypatch):
    def broken(opts):
        return catalog.ScenarioResult("moe-decode-ll", passed=False, error="injected")

    monkeypatch.setitem(catalog.SCENARIOS, "moe-decode-ll", catalog.Scenario("moe-decode-ll", "x", broken))
    code = main(["run", "moe-decode-ll", "dcp-attention", "--no-artifacts"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out and "PASS" in out and "injected" in out
    assert "1 passed, 1 failed" in out


def test_a_scenario_that_raises_is_a_failed_verdict_not_a_crash(capsys, monkeypatch):
    def explode(opts):
        raise RuntimeError("scenario bug")

    monkeypatch.setitem(catalog.SCENARIOS, "dcp-attention", catalog.Scenario("dcp-attention", "x", explode))
    code, (report,) = _run_json(capsys, "dcp-attention", "--no-artifacts")
    assert code == 1 and report["passed"] is False and "scenario bug" in report["error"]


def test_missing_wait_scenario_fails_if_the_wait_is_present(capsys, monkeypatch):
    # Without the seeded bug nothing races, and the negative scenario must then fail.
    monkeypatch.setattr(catalog._NoWaitModel, "_yield_to_comm", catalog.MoEModel._yield_to_comm)
    code, (report,) = _run_json(capsys, "missing-wait-race", "--no-artifacts")
    assert code == 1 and report["passed"] is False and report["races"] == 0


def test_locked_growth_scenario_fails_if_lock_does_not_hold(capsys, monkeypatch):
    monkeypatch.setattr("scenarios.harness.lock_workspace", lambda: None)
    code, (report,) = _run_json(capsys, "locked-growth", "--no-artifacts")
    assert code == 1 and report["passed"] is False


def test_unknown_scenario_is_a_usage_error(capsys):
    assert main(["run", "no-such-scenario"]) == 2
    assert "unknown scenario" in capsys.readouterr().err


def test_list_names_every_scenario(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in catalog.SCENARIOS:
        assert name in out


def test_three_ubatches_option_is_honoured(capsys):
    code, (report,) = _run_json(capsys, "moe-prefill-ht", "-n", "3", "--no-artifacts")
    assert code == 0 and report["passed"]


def test_bad_ubatch_count_is_a_usage_error(capsys):
    assert main(["run", "moe-prefill-ht", "-n", "1"]) == 2
    assert "--ubatches must be >= 2" in capsys.readouterr().err


def test_sweep_writes_csv_and_plot(capsys, tmp_path):
    code = main(["sweep", "--layers", "2", "--decode", "32", "--prefill", "1024", "--out", str(tmp_path)])
    assert code == 0
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [(r["phase"], r["tokens_per_device"]) for r in rows] == [("decode", "32"), ("prefill", "1024")]
    assert all(float(r["step_us_serial"]) > 0 and float(r["step_us_dbo"]) > 0 for r in rows)
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")


def test_stress_command_reports_invariants(capsys):
    code = main(["stress", "--threads", "8", "--iterations", "300", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] is True
    assert report["threads"] == 8 and report["requests"] > 0 and report["violations"] == []
