"""A new user's first hour with `dbo-sim`: mistakes refused early in one line, Ctrl-C that
keeps what finished, one CLI for every tool, verdicts that never claim more than was done."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import dbo
from dbo.sim import SimDevice
from dbo.split import split_batch
from scenarios import catalog
from scenarios.cli import VERBS, main
from scenarios.tools import gpu_check_run, sweep_run
from scenarios.tools.bench import report as bench_report
from scenarios.tools.stress_run import run_stress

# Tests here start threads: each gets this bound unless it carries its own, so a hang fails
# the test, never the whole run.
pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _fake(name: str, seen: list, *, run=None, error: str | None = None) -> catalog.Scenario:
    """A scenario that does no work: records that it ran, then runs `run` (if any)."""

    def body(opts):
        seen.append(name)
        if run is not None:
            run()
        return catalog.ScenarioResult(name, passed=error is None, error=error)

    return catalog.Scenario(name, "fake", body)


def _one_refusal(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dbo-sim: "), err
    return lines[0]


# ------------------------------------------------------------------ usage errors: one line, exit 2


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--timeout", "0"],
        ["run", "--timeout", "-1"],
        ["run", "--timeout", "inf"],
        ["run", "-n", "200"],
        ["run", "-n", "100000"],
        ["sweep", "--timeout", "-1"],
        ["sweep", "--prefill"],
        ["sweep", "--decode", "abc"],
        ["sweep", "--decode", "1"],
        ["sweep", "-n", "4", "--prefill", "3"],
        ["sweep", "--layers", "100000"],
        ["sweep", "--layers", "0"],
        ["sweep", "--decode", "10000000000"],
        ["sweep", "--prefill", "10000000000"],
        ["sweep", "--context", "10000000000"],
        ["stress", "--timeout", "nan"],
        ["stress", "--timeout", "-1"],
        ["stress", "--timeout", "0"],
        ["stress", "--iterations", "x"],
        ["no-such-verb"],
    ],
)
def test_a_bad_command_line_is_one_readable_line_and_exit_2(capsys, argv):
    assert main(argv) == 2
    line = _one_refusal(capsys)
    assert len(line) < 300 and "Traceback" not in line
    assert not re.search(r"\b_[a-z_]+\b", line), f"an internal name leaks: {line}"


def test_a_sweep_token_count_below_the_ubatch_count_names_both(capsys):
    assert main(["sweep", "-n", "4", "--decode", "16", "3"]) == 2
    line = _one_refusal(capsys)
    assert "--decode 3" in line and "4 ubatches" in line


def test_sweep_layers_beyond_the_model_are_refused_naming_the_range(capsys):
    assert main(["sweep", "--layers", "100000"]) == 2
    assert "--layers: must be between 1 and 61, got 100000" in _one_refusal(capsys)


@pytest.mark.timeout(120)
def test_a_sweep_point_past_its_timeout_is_a_failed_row_and_the_sweep_goes_on(capsys, tmp_path):
    argv = ["sweep", "--layers", "2", "--decode", "16", "--prefill", "1024", "--out", str(tmp_path)]
    assert main([*argv, "--timeout", "0.000001"]) == 1
    out, err = capsys.readouterr()
    failed = [line for line in out.splitlines() if "FAILED:" in line]
    assert [line.split()[:2] for line in failed] == [["decode", "16"], ["prefill", "1024"]]
    assert all("TimeoutError: the forward ran past" in line for line in failed)  # serial half
    assert "2 point(s) FAILED" in out and "Traceback" not in out + err


def test_sweep_prefill_without_a_value_is_refused_not_defaulted(capsys, monkeypatch):
    ran: list = []
    monkeypatch.setattr(sweep_run, "run_sweep", lambda *a, **k: ran.append(1) or [])
    assert main(["sweep", "--prefill"]) == 2
    assert "--prefill: expected at least one argument" in _one_refusal(capsys) and ran == []


# ---------------------------------------- the output folder, before any work

UNWRITABLE = "a-file/sub"  # below a plain file: no user, root included, can create it


@pytest.fixture
def unwritable(tmp_path: Path) -> Path:
    (tmp_path / "a-file").write_text("")
    return tmp_path / UNWRITABLE


def test_run_refuses_an_out_folder_it_cannot_create_before_any_scenario(
    capsys, monkeypatch, unwritable
):
    seen: list = []
    monkeypatch.setitem(catalog.SCENARIOS, "fake-a", _fake("fake-a", seen))
    assert main(["run", "fake-a", "--out", str(unwritable)]) == 2
    assert f"--out {unwritable}: cannot create or write" in _one_refusal(capsys)
    assert seen == []


@pytest.mark.parametrize(
    "verb, spied",
    [
        (["sweep"], (sweep_run, "run_sweep")),
        (["bench", "--quick"], (bench_report, "run_benchmarks")),
        (["gpu-check", "--sim-only"], (gpu_check_run, "simulate_case")),
    ],
)
def test_tools_refuse_an_out_path_they_cannot_write_before_any_work(
    capsys, monkeypatch, unwritable, verb, spied
):
    ran: list = []
    monkeypatch.setattr(*spied, lambda *a, **k: ran.append(1) or 0)
    out = unwritable / "report.json" if verb[0] == "gpu-check" else unwritable
    assert main([*verb, "--out", str(out)]) == 2
    assert "cannot create or write" in _one_refusal(capsys) and ran == []


# ------------------------------------------------------------------ readable at any size


def test_a_split_error_stays_short_for_any_ubatch_count():
    with pytest.raises(ValueError) as caught:
        split_batch([0, 64], 64, 100_000)
    assert len(str(caught.value)) < 300 and "99993 more" in str(caught.value)


def test_a_huge_scenario_error_prints_as_one_bounded_paragraph(capsys, monkeypatch):
    monkeypatch.setitem(
        catalog.SCENARIOS, "fake-a", _fake("fake-a", [], error="cut at 0, " * 30_000)
    )
    assert main(["run", "fake-a", "--no-artifacts"]) == 1
    out = capsys.readouterr().out
    assert len(out) < 5000 and "more characters" in out


# ---------------------------------------- Ctrl-C: one line, 130, results kept


def _sigint() -> None:
    # A real SIGINT to the process, as a terminal sends it, through Python's default handler.
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.timeout(30)
def test_ctrl_c_during_run_keeps_the_finished_rows_and_exits_130(capsys, monkeypatch):
    seen: list = []
    monkeypatch.setitem(catalog.SCENARIOS, "fake-a", _fake("fake-a", seen))
    monkeypatch.setitem(catalog.SCENARIOS, "fake-b", _fake("fake-b", seen, run=_sigint))
    monkeypatch.setitem(catalog.SCENARIOS, "fake-c", _fake("fake-c", seen))
    assert main(["run", "fake-a", "fake-b", "fake-c", "--no-artifacts"]) == 130
    out, err = capsys.readouterr()
    assert re.search(r"^fake-a\s+PASS", out, re.MULTILINE) and "fake-c" not in out
    assert err == "dbo-sim: interrupted; 1 of 3 scenario(s) finished; their results are above\n"
    assert seen == ["fake-a", "fake-b"]


@pytest.mark.timeout(30)
def test_ctrl_c_during_run_json_keeps_each_finished_report(capsys, monkeypatch):
    monkeypatch.setitem(catalog.SCENARIOS, "fake-a", _fake("fake-a", []))
    monkeypatch.setitem(catalog.SCENARIOS, "fake-b", _fake("fake-b", [], run=_sigint))
    assert main(["run", "--json", "fake-a", "fake-b", "--no-artifacts"]) == 130
    out, err = capsys.readouterr()
    assert [json.loads(line)["scenario"] for line in out.splitlines()] == ["fake-a"]
    assert len(err.splitlines()) == 1


@pytest.mark.timeout(60)
def test_ctrl_c_during_sweep_keeps_the_finished_points_in_the_csv(capsys, monkeypatch, tmp_path):
    real = sweep_run.compare_serial_dbo
    calls: list = []

    def interrupt_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            _sigint()
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep_run, "compare_serial_dbo", interrupt_the_second)
    argv = [
        "sweep",
        "--layers",
        "1",
        "--decode",
        "16",
        "32",
        "--prefill",
        "1024",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 130
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [r["tokens_per_device"] for r in rows] == ["16"]
    assert capsys.readouterr().err.startswith(
        "dbo-sim: interrupted; the sweep points that finished"
    )


@pytest.mark.timeout(60)
def test_ctrl_c_during_bench_keeps_the_finished_figures_in_bench_json(
    capsys, monkeypatch, tmp_path
):
    from scenarios.tools.bench import suite

    first = suite.registered()[0]
    monkeypatch.setattr(bench_report, "registered", lambda: [first, lambda plan: _sigint()])
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 130
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["interrupted"] is True
    assert doc["figures"] and {f["bench"] for f in doc["figures"]} <= set(first.names)
    out, err = capsys.readouterr()
    assert doc["figures"][0]["name"] in out
    assert len(err.splitlines()) == 1 and "figure(s) from the benchmarks that finished" in err


@pytest.mark.timeout(60)
def test_ctrl_c_during_fidelity_prints_the_rows_that_finished(capsys, monkeypatch):
    from scenarios.tools import fidelity_run

    monkeypatch.setattr(fidelity_run, "sglang_rows", lambda quick, on_point=None: _sigint())
    assert main(["fidelity", "--quick"]) == 130
    out, err = capsys.readouterr()
    assert "DeepEP" in out  # the DeepEP rows finished before the interrupt
    assert len(err.splitlines()) == 1 and "row(s) had finished" in err


@pytest.mark.timeout(30)
def test_ctrl_c_during_stress_exits_130_with_every_stress_thread_joined(capsys):
    timer = threading.Timer(0.5, _sigint)
    timer.start()
    try:
        assert main(["stress", "--threads", "4", "--iterations", "100000000"]) == 130
    finally:
        timer.cancel()
    assert capsys.readouterr().err == "dbo-sim: interrupted\n"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("stress-")]


# ------------------------------------------------------------------ stress verdicts


@pytest.mark.timeout(30)
def test_stress_cut_short_by_its_deadline_fails_and_says_how_much_ran():
    report = run_stress(2, 10**8, deadline_s=0.3)
    assert report.cut_short and not report.passed
    assert 0 < report.iterations_done < 2 * 10**8


@pytest.mark.timeout(30)
def test_stress_command_cut_short_prints_fail_not_pass(capsys):
    assert main(["stress", "--threads", "2", "--iterations", "100000000", "--timeout", "0.3"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "cut short by the 0.3 s deadline" in out and "PASS" not in out


@pytest.mark.timeout(30)
def test_stress_that_finishes_in_time_is_not_cut_short():
    report = run_stress(2, 40)
    assert report.passed and not report.cut_short and report.iterations_done == 80


# ------------------------------------------------------------------ one CLI for every tool


def test_version_names_the_project_version(capsys):
    assert main(["--version"]) == 0
    version = re.search(
        r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE
    ).group(1)
    assert capsys.readouterr().out.startswith(f"dbo-sim {version} ")


def test_list_json_describes_every_scenario(capsys):
    assert main(["list", "--json"]) == 0
    entries = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["name"] for e in entries] == list(catalog.SCENARIOS)
    for e in entries:
        scenario = catalog.SCENARIOS[e["name"]]
        assert e["kind"] == ("negative" if scenario.negative else "positive")
        assert e["summary"] == scenario.summary and e["cuda"] == scenario.cuda


@pytest.mark.timeout(60)
def test_calibrate_host_is_a_verb(capsys, tmp_path):
    argv = ["calibrate-host", "--device", "sim", "--quick", "--json", "--out", str(tmp_path / "h")]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["handoff_us"] > 0


@pytest.mark.timeout(120)
def test_gpu_check_is_a_verb_and_runs_its_simulated_half(capsys, tmp_path):
    out = tmp_path / "gpu.json"
    argv = ["gpu-check", "--sim-only", "--layers", "1", "--only", "decode", "--out", str(out)]
    assert main(argv) == 0
    assert [c["case"] for c in json.loads(out.read_text())["cases"]] == ["decode"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
@pytest.mark.parametrize("argv", [["gpu-check"], ["calibrate-host"], ["profile"]])
def test_the_gpu_verbs_say_no_cuda_gpu_the_same_way(capsys, argv):
    assert main(argv) == 2
    assert _one_refusal(capsys).startswith("dbo-sim: no CUDA GPU present: nothing to ")


def test_calibrate_host_usage_says_it_needs_a_gpu(capsys):
    assert main(["calibrate-host", "--help"]) == 0
    assert "Needs a CUDA GPU unless --device sim" in capsys.readouterr().out


# ------------------------------------------------------------------ sweep context, artifact names


def test_sweep_decode_context_matches_the_dsv3_decode_scenario():
    assert sweep_run._batch("decode", 256, sweep_run.DECODE_CONTEXT) == catalog.DSV3_DECODE


def test_sweep_prefill_points_hold_exactly_their_token_count():
    for tokens in (1024, 4096, 5000, 8192):
        assert sweep_run._batch("prefill", tokens, sweep_run.DECODE_CONTEXT).num_tokens == tokens


@pytest.mark.timeout(60)
def test_sweep_says_its_context_and_takes_context(capsys, tmp_path):
    argv = ["sweep", "--layers", "1", "--decode", "16", "--prefill", "1024", "--context", "512"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    assert "over a 512-token context each" in capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [r["context_len"] for r in rows] == ["512", "0"]


# ---------------------------------------- runtime latency of the first hour


@pytest.mark.timeout(60)
def test_the_first_fault_in_a_cold_process_does_not_import_torch_dynamo():
    code = (
        "import sys, dbo\n"
        "from dbo.sim import SimDevice\n"
        "import torch\n"
        "def fn(u):\n"
        "    x = torch.ones(4) * 2\n"
        "    dbo.dbo_yield()\n"
        "    raise ValueError('fault')\n"
        "try:\n"
        "    dbo.run_ubatches(fn, [0, 1], device=SimDevice())\n"
        "except dbo.UBatchError:\n"
        "    print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.timeout(30)
def test_the_timeout_error_does_not_wait_for_a_stuck_ubatch_to_return():
    returned = threading.Event()

    def fn(u: int) -> None:
        if u == 0:
            threading.Event().wait(0.8)  # stuck in user code well past the timeout
            returned.set()
        dbo.dbo_yield()

    with pytest.raises(dbo.UBatchTimeoutError):
        dbo.run_ubatches(fn, [0, 1], device=SimDevice(), timeout=0.2)
    assert not returned.is_set()
    returned.wait(5)  # let the abandoned thread end before the next test


def test_every_verb_is_one_row_of_the_table_and_its_tool_has_one_shape(capsys):
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    for verb in VERBS:
        assert verb.name in listed
        assert callable(verb.tool.add_arguments) and callable(verb.tool.run)
        assert not hasattr(verb.tool, "main")  # no second way in beside the CLI


# ------------------------------------------------------------------ the first hour's rough edges


@pytest.mark.timeout(60)
def test_without_the_projects_python_the_cli_is_one_line_naming_the_fix(tmp_path):
    bare = _python_without_torch()
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [*bare, "-m", "scenarios", "run"],  # `list` needs no torch: it reads scenarios.index
        capture_output=True,
        text=True,
        timeout=50,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("dbo-sim: torch is not installed for ") and "make install" in line
    assert ". .venv/bin/activate" in line


def _python_without_torch() -> list[str]:
    """The system's python3 when it lacks torch (as on a fresh machine), else this Python
    without its site-packages (-S), which lacks torch just the same."""
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if system is not None:
        probe = subprocess.run([system, "-c", "import torch"], capture_output=True, timeout=30)
        if probe.returncode != 0:
            return [system]
    return [sys.executable, "-S"]


@pytest.mark.timeout(60)
def test_calibrate_host_on_sim_says_why_launches_are_not_measured_and_what_it_wrote(
    capsys, tmp_path
):
    out = tmp_path / "costs.json"
    assert main(["calibrate-host", "--device", "sim", "--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "  -" not in text and text.count("not measured: the simulated device prices") == 2
    assert f"wrote {out}" in text
    assert json.loads(out.read_text())["handoff_us"] > 0


def test_calibrate_host_refuses_an_out_it_cannot_write_before_measuring(capsys, unwritable):
    assert main(["calibrate-host", "--device", "sim", "--out", str(unwritable / "c.json")]) == 2
    assert "cannot create or write" in _one_refusal(capsys)


@pytest.mark.timeout(120)
def test_run_window_prints_each_written_file_with_its_folder(capsys, tmp_path):
    argv = ["run", "moe-decode-ll", "--out", str(tmp_path), "--window", "0:50"]
    assert main(argv) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("windowed: ")]
    paths = line.removeprefix("windowed: ").split(", ")
    assert len(paths) == 2 and all(Path(p).parent == tmp_path and Path(p).is_file() for p in paths)


@pytest.mark.timeout(180)
def test_run_across_ranks_says_first_whether_its_clock_is_calibrated(capsys):
    assert main(["run", "--ranks", "2", "moe-prefill-ht", "--no-artifacts"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("simulated h200: calibrated (")
