"""The scenarios through the CLI: verdicts, the JSON schema, artifacts, exit status."""

from __future__ import annotations

import csv
import io
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import dbo
from dbo.sim import SimDevice
from scenarios import catalog, fault_scenarios
from scenarios.cli import main
from scenarios.harness import RunOptions, new_device
from scenarios.lib.progress import progress_bar
from scenarios.model import MoEModel
from scenarios.tools import run_scenarios
from scenarios.tools.run_table import launch_bound_note
from scenarios.tools.sweep_run import SweepPoint, pays_from, run_sweep

pytestmark = pytest.mark.timeout(120)

JSON_FIELDS = {
    "scenario": str,
    "passed": bool,
    "negative": bool,
    "outputs_match": (bool, type(None)),
    "max_abs_diff": (float, type(None)),
    "races": int,
    "error": (str, type(None)),
    "caught": (str, type(None)),
    "step_us_serial": (float, type(None)),
    "step_us_dbo": (float, type(None)),
    "speedup": (float, type(None)),
    "overlap_fraction": (float, type(None)),
    "exposed_comm_us": (float, type(None)),
    "roofline_fraction": (float, type(None)),
    "workspace_peak_bytes": (int, type(None)),
    "trace": (str, type(None)),
    "timeline_png": (str, type(None)),
    "wall_s": float,
    "details": dict,
    "clock": str,
}


def _run_json(capsys, *argv: str) -> tuple[int, list[dict]]:
    code = main(["run", "--json", *argv])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    return code, [json.loads(line) for line in lines]


# Every scenario issues 5 and 6 name; all of them run by default.
NAMED_SCENARIOS = {
    "moe-decode-ll",
    "moe-prefill-ht",
    "dcp-attention",
    "fused-moe-workspace",
    "sparse-indexer",
    "mla-init-reservation",
    "elastic-ep",
    "graph-pointer-stability",
    "three-ubatches",
    "missing-wait-race",
    "yield-mismatch",
    "exception-in-ubatch",
    "locked-growth",
    "dp-disagreement",
}
NEGATIVE = {
    "missing-wait-race",
    "yield-mismatch",
    "exception-in-ubatch",
    "locked-growth",
    "dp-disagreement",
}


def _fake(name: str, seen: list | None = None, *, passed: bool = True) -> catalog.Scenario:
    """A scenario that runs nothing: records the options it was given, returns a verdict."""

    def run(opts):
        if seen is not None:
            seen.append((name, opts))
        return catalog.ScenarioResult(name, passed=passed, error=None if passed else "injected")

    return catalog.Scenario(name, "fake", run)


def test_the_catalog_holds_every_named_scenario_and_runs_all_by_default():
    assert NAMED_SCENARIOS <= set(catalog.SCENARIOS)
    assert {n for n, s in catalog.SCENARIOS.items() if s.negative} == NEGATIVE
    assert catalog.DEFAULT_SCENARIOS == list(catalog.SCENARIOS)


@pytest.mark.slow
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
    assert overlap["trace"] and Path(overlap["trace"]).is_file()
    assert overlap["outputs_match"] is True and overlap["races"] == 0
    assert overlap["step_us_serial"] > 0 and overlap["step_us_dbo"] > 0
    assert overlap["speedup"] == pytest.approx(overlap["step_us_serial"] / overlap["step_us_dbo"])
    assert reports[1]["negative"] is True


@pytest.mark.parametrize(
    "profile, word", [("h200", "calibrated"), ("h100", "calibrated"), ("b200", "UNCALIBRATED")]
)
def test_each_json_report_says_whether_its_clock_is_calibrated(capsys, profile, word):
    _, reports = _run_json(capsys, "moe-decode-ll", "--profile", profile, "--no-artifacts")
    assert reports[0]["clock"].startswith(f"simulated {profile}: {word} (")


def test_run_writes_a_trace_and_a_timeline_per_scenario(capsys, tmp_path):
    code, (report,) = _run_json(capsys, "moe-decode-ll", "--out", str(tmp_path))
    assert code == 0
    trace = json.loads((tmp_path / "moe-decode-ll.n2.r1.trace.json").read_text())
    names = {
        e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    assert any(n.startswith("compute") for n in names)
    assert (tmp_path / "moe-decode-ll.n2.r1.png").read_bytes().startswith(b"\x89PNG")
    assert report["trace"].endswith("moe-decode-ll.n2.r1.trace.json")


def test_artifact_names_carry_the_ubatch_and_rank_counts(capsys, tmp_path):
    for n in ("2", "3"):
        code, _ = _run_json(capsys, "dcp-attention", "-n", n, "--out", str(tmp_path))
        assert code == 0
    names = sorted(p.name for p in tmp_path.glob("*.trace.json"))
    assert names == ["dcp-attention.n2.r1.trace.json", "dcp-attention.n3.r1.trace.json"]


def test_every_json_field_is_documented_in_the_readme():
    readme = (Path(catalog.__file__).resolve().parent.parent / "docs/scenarios.md").read_text()
    section = readme[readme.index("### JSON report") :]
    documented = set(re.findall(r"`([a-z_]+)`", section[: section.index("\n#", 1)]))
    assert set(JSON_FIELDS) <= documented


def test_negative_scenarios_write_a_trace_and_timeline_of_what_ran(capsys, tmp_path):
    code, reports = _run_json(
        capsys, "yield-mismatch", "exception-in-ubatch", "locked-growth", "--out", str(tmp_path)
    )
    assert code == 0
    for report in reports:
        name = report["scenario"]
        assert report["trace"] == str(tmp_path / f"{name}.n2.r1.trace.json")
        events = json.loads(Path(report["trace"]).read_text())["traceEvents"]
        assert any(e.get("ph") == "X" for e in events), name
        assert Path(report["timeline_png"]).read_bytes().startswith(b"\x89PNG")


def test_table_shows_every_column_the_issue_asks_for(capsys):
    assert main(["run", "dcp-attention", "--no-artifacts"]) == 0
    header = capsys.readouterr().out.splitlines()[1].split()
    for column in (
        "scenario",
        "verdict",
        "match",
        "races",
        "serial",
        "dbo",
        "speedup",
        "overlap",
        "roofline",
        "peak",
    ):
        assert column in header


@pytest.mark.parametrize(
    ("profile", "word"), [("h200", "calibrated"), ("h100", "derived"), ("b200", "UNCALIBRATED")]
)
def test_run_says_first_whether_its_clock_is_calibrated(capsys, profile, word):
    assert main(["run", "dcp-attention", "--no-artifacts", "--profile", profile]) == 0
    assert word in capsys.readouterr().out.splitlines()[0].split()


def test_json_report_gives_the_roofline_share_of_the_dbo_run(capsys):
    code, (report,) = _run_json(capsys, "moe-decode-ll", "--profile", "h100", "--no-artifacts")
    assert code == 0 and 0.0 < report["roofline_fraction"] <= 1.0


def test_run_without_names_runs_every_default_scenario(capsys, monkeypatch):
    seen: list = []
    for name in ("fake-a", "fake-b", "fake-c"):
        monkeypatch.setitem(catalog.SCENARIOS, name, _fake(name, seen))
    monkeypatch.setattr(run_scenarios, "DEFAULT_SCENARIOS", ["fake-a", "fake-c"])
    assert main(["run", "--no-artifacts"]) == 0
    assert [name for name, _ in seen] == ["fake-a", "fake-c"]


def test_run_options_reach_each_scenario(capsys, monkeypatch, tmp_path):
    seen: list = []
    monkeypatch.setitem(catalog.SCENARIOS, "fake-a", _fake("fake-a", seen))
    argv = [
        "run",
        "fake-a",
        "-n",
        "3",
        "--profile",
        "h800",
        "--out",
        str(tmp_path),
        "--timeout",
        "7",
    ]
    assert main(argv) == 0
    ((_, opts),) = seen
    assert (opts.num_ubatches, opts.device, opts.profile, opts.out_dir, opts.timeout_s) == (
        3,
        "sim",
        "h800",
        tmp_path,
        7.0,
    )
    device = new_device(opts)
    assert isinstance(device, SimDevice) and device.profile.name == "h800"


def test_an_unknown_profile_is_a_usage_error(capsys):
    assert main(["run", "moe-decode-ll", "--profile", "h999"]) == 2
    err = capsys.readouterr().err
    assert "unknown hardware profile 'h999'" in err and "Traceback" not in err


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU"
)
def test_device_cuda_without_a_gpu_is_a_usage_error(capsys):
    assert main(["run", "moe-decode-ll", "--device", "cuda"]) == 2
    assert "--device cuda needs a CUDA GPU" in capsys.readouterr().err


def test_a_simulator_only_scenario_on_cuda_is_refused_naming_it(capsys):
    assert main(["run", "dcp-attention", "--device", "cuda"]) == 2
    assert "dcp-attention: simulator-only" in capsys.readouterr().err


class _Terminal(io.StringIO):
    """A captured stream that says it is a terminal, as a user's stderr is."""

    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_on_a_terminal():
    stream = _Terminal()
    with progress_bar(2, "scenarios", stream=stream, unit="scenario") as bar:
        bar.set_postfix_str("first")
        for _ in range(2):
            bar.update()
            bar.refresh()  # tqdm redraws at most every 0.1 s; a test is quicker than that
    drawn = stream.getvalue()
    assert "scenarios" in drawn and "1/2" in drawn and "2/2" in drawn and "first" in drawn


def test_progress_bar_is_silent_off_a_terminal_and_in_json_mode(capsys, monkeypatch):
    off_terminal = io.StringIO()  # a StringIO is not a terminal
    quiet = _Terminal()
    for stream, bar in (
        (off_terminal, progress_bar(3, "x", stream=off_terminal)),
        (quiet, progress_bar(3, "x", stream=quiet, quiet=True)),
    ):
        bar.update()
        bar.close()
        assert stream.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert main(["stress", "--threads", "2", "--iterations", "60", "--json"]) == 0
    assert sys.stderr.getvalue() == ""
    assert main(["stress", "--threads", "2", "--iterations", "60"]) == 0
    assert "stress x2" in sys.stderr.getvalue()  # the same run, on a terminal, draws


def test_table_output_and_exit_status_when_a_scenario_fails(capsys, monkeypatch):
    def broken(opts):
        return catalog.ScenarioResult("moe-decode-ll", passed=False, error="injected")

    monkeypatch.setitem(
        catalog.SCENARIOS, "moe-decode-ll", catalog.Scenario("moe-decode-ll", "x", broken)
    )
    code = main(["run", "moe-decode-ll", "dcp-attention", "--no-artifacts"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out and "PASS" in out and "injected" in out
    assert "1 passed, 1 failed" in out


def test_a_scenario_that_raises_is_a_failed_verdict_not_a_crash(capsys, monkeypatch):
    def explode(opts):
        raise RuntimeError("scenario bug")

    monkeypatch.setitem(
        catalog.SCENARIOS, "dcp-attention", catalog.Scenario("dcp-attention", "x", explode)
    )
    code, (report,) = _run_json(capsys, "dcp-attention", "--no-artifacts")
    assert code == 1 and report["passed"] is False and "scenario bug" in report["error"]


def test_missing_wait_scenario_fails_if_the_wait_is_present(capsys, monkeypatch):
    # Without the seeded bug nothing races, and the negative scenario must then fail.
    monkeypatch.setattr(fault_scenarios.NoWaitModel, "_yield_to_comm", MoEModel._yield_to_comm)
    code, (report,) = _run_json(capsys, "missing-wait-race", "--no-artifacts")
    assert code == 1 and report["passed"] is False and report["races"] == 0


def test_yield_mismatch_scenario_fails_if_the_runtime_does_not_raise(capsys, monkeypatch):
    monkeypatch.setattr(dbo, "run_ubatches", lambda fn, inputs, **kw: [None] * len(inputs))
    code, (report,) = _run_json(capsys, "yield-mismatch", "--no-artifacts")
    assert code == 1 and report["passed"] is False and "got no error" in report["error"]


def test_exception_scenario_fails_if_the_error_names_the_wrong_ubatch(capsys, monkeypatch):
    def wrong(fn, inputs, **kw):
        try:
            raise RuntimeError("expert kernel failed")
        except RuntimeError as cause:
            raise dbo.UBatchError("ubatch 0 raised", ubatch_id=0) from cause

    monkeypatch.setattr(dbo, "run_ubatches", wrong)
    code, (report,) = _run_json(capsys, "exception-in-ubatch", "--no-artifacts")
    assert code == 1 and report["passed"] is False


def test_low_latency_scenario_fails_if_the_recv_hook_does_not_wait(capsys, monkeypatch):
    def receive_without_waiting(arrival):
        if dbo.dbo_enabled():
            dbo.dbo_register_recv_hook(lambda: None)
            dbo.dbo_yield()

    monkeypatch.setattr(MoEModel, "_receive", staticmethod(receive_without_waiting))
    code, (report,) = _run_json(capsys, "moe-decode-ll", "--no-artifacts")
    assert code == 1 and report["passed"] is False and report["races"] > 0
    assert "comm::dispatch" in report["error"]


def test_elastic_ep_scenario_fails_if_a_stale_graph_replays(capsys, monkeypatch):
    # Without the workspace registered as a buffer owner, replay cannot see the stale pointers.
    monkeypatch.setattr(SimDevice, "add_buffer_owner", lambda self, owner: None)
    code, (report,) = _run_json(capsys, "elastic-ep", "--no-artifacts")
    assert code == 1 and report["passed"] is False and "stale graph refused" in report["error"]


def test_a_positive_scenario_fails_if_its_measured_step_allocates(capsys, monkeypatch):
    from scenarios import harness

    monkeypatch.setattr(harness, "_count_allocations", lambda fn: (fn(), 1))
    code, (report,) = _run_json(capsys, "moe-prefill-ht", "--no-artifacts")
    assert (
        code == 1
        and report["passed"] is False
        and "1 workspace allocation(s) after lock" in report["error"]
    )


def test_locked_growth_scenario_fails_if_lock_does_not_hold(capsys, monkeypatch):
    monkeypatch.setattr("scenarios.steps.lock_workspace", lambda: None)
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
    assert "--ubatches/-n: must be between 2 and 8, got 1" in capsys.readouterr().err


def test_sweep_writes_csv_and_plot(capsys, tmp_path):
    # On the calibrated H200 clock an eager 1024-token DBO prefill is host-bound; 2048 pays.
    code = main(
        ["sweep", "--layers", "2", "--decode", "32", "--prefill", "2048", "--out", str(tmp_path)]
    )
    assert code == 0
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [(r["phase"], r["tokens_per_device"]) for r in rows] == [
        ("decode", "32"),
        ("prefill", "2048"),
    ]
    assert all(float(r["step_us_serial"]) > 0 and float(r["step_us_dbo"]) > 0 for r in rows)
    for r in rows:
        assert float(r["comm_compute_ratio"]) == pytest.approx(
            float(r["comm_us"]) / float(r["compute_us"])
        )
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert (
        "decode: DBO pays at no point tried" in out and "prefill: DBO pays from 2048 tokens" in out
    )


def test_sweep_shows_dbo_losing_on_small_decode_and_paying_on_large_prefill():
    # Virtual time: deterministic, not a timed assertion.
    small, large = run_sweep(
        RunOptions(), decode_tokens=(16,), prefill_tokens=(8192,), num_layers=2
    )
    assert small.phase == "decode" and small.speedup < 1.0
    assert large.phase == "prefill" and large.speedup > 1.0
    assert small.comm_compute_ratio < large.comm_compute_ratio


def test_pays_from_is_the_start_of_the_winning_tail():
    def point(tokens: int, speedup: float) -> SweepPoint:
        return SweepPoint("decode", tokens, 1.0, 1.0 / speedup, speedup, 0.0, 0.0, 0.0, 1.0)

    assert pays_from([point(16, 0.5), point(64, 1.1), point(32, 0.9), point(128, 1.2)]) == 64
    assert pays_from([point(16, 1.1), point(32, 0.9), point(64, 1.2)]) == 64  # not an early fluke
    assert pays_from([point(16, 1.1), point(32, 0.9)]) is None
    assert pays_from([]) is None


def test_stress_command_reports_invariants(capsys):
    code = main(["stress", "--threads", "8", "--iterations", "300", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] is True
    assert report["threads"] == 8 and report["requests"] > 0 and report["violations"] == []


def test_stress_text_report_names_the_invariants_and_passes(capsys):
    assert main(["stress", "--threads", "2", "--iterations", "50"]) == 0
    out = capsys.readouterr().out
    assert (
        "2 threads x 50 iterations" in out
        and "invariants:" in out
        and out.rstrip().endswith("PASS")
    )


def test_stress_fails_when_a_view_lies_outside_its_slot(capsys, monkeypatch):
    from scenarios.tools import stress_run

    class Leaky(stress_run.WorkspaceManager):
        """Hands out fresh tensors instead of views into the caller's slot."""

        def get_simultaneous(self, *pairs):
            views = super().get_simultaneous(*pairs)
            return [torch.empty(v.shape, dtype=v.dtype) for v in views]

    monkeypatch.setattr(stress_run, "WorkspaceManager", Leaky)
    assert main(["stress", "--threads", "2", "--iterations", "20", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False and "is not in a buffer of slot" in report["violations"][0]


def test_stress_refuses_a_zero_thread_count(capsys):
    assert main(["stress", "--threads", "0"]) == 2
    assert (
        capsys.readouterr().err
        == "dbo-sim: argument --threads: must be between 1 and 1024, got 0\n"
    )


def test_stress_progress_ends_at_the_iteration_count():
    from scenarios.tools import stress_run

    heard: list = []
    report = stress_run.run_stress(2, 120, on_progress=heard.append)
    assert report.passed and heard == [50, 100, 120]


def test_a_reduced_sweep_model_keeps_its_dense_to_moe_mix():
    from scenarios.model import preset
    from scenarios.tools.sweep_run import reduced

    full = preset("deepseek-v3")
    assert [reduced(full, n).num_dense_layers for n in (1, 2, 20, 61)] == [0, 0, 1, 3]
    assert reduced(full, 2).num_layers == 2


_RACE_RED = (0xE4, 0x1A, 0x1C)  # dbo.sim.plot's colour for races and a failed step's stop


def _marked_pixels(png: str) -> int:
    import matplotlib.image

    rgb = matplotlib.image.imread(png)[..., :3] * 255
    return int((abs(rgb - _RACE_RED) < 4).all(axis=-1).sum())


@pytest.mark.parametrize("name", ["missing-wait-race", "exception-in-ubatch", "yield-mismatch"])
def test_a_negative_scenarios_png_marks_its_fault(capsys, tmp_path, name):
    code, (report,) = _run_json(capsys, name, "--out", str(tmp_path))
    assert code == 0 and report["passed"]
    assert _marked_pixels(report["timeline_png"]) > 20


def test_a_positive_scenarios_png_has_no_fault_mark(capsys, tmp_path):
    code, (report,) = _run_json(capsys, "moe-decode-ll", "--out", str(tmp_path))
    assert code == 0 and _marked_pixels(report["timeline_png"]) == 0


def test_the_run_table_says_why_a_tiny_value_check_is_slower_under_dbo(capsys):
    assert main(["run", "moe-decode-ll", "--no-artifacts"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "moe-decode-ll" in notes[0] and "launch-bound" in notes[0]


def test_no_launch_bound_note_when_every_value_check_gains():
    gains = catalog.ScenarioResult("x", passed=True, outputs_match=True, speedup=1.2)
    timing_only = catalog.ScenarioResult("y", passed=True, speedup=0.8)  # meta: no values
    assert launch_bound_note([gains, timing_only]) is None
