"""`dbo-sim plan`: the decision, printed as engine flags, with its CSV and PNG."""

from __future__ import annotations

import csv
import io
import sys

import pytest

from dbo.sim.hardware import H800
from scenarios.cli import build_parser, main
from scenarios.tools.plan_args import parse_args
from scenarios.tools.plan_output import PhaseAnswer, engine_flags
from scenarios.tools.plan_sim import check_inputs


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--preset", "gpt-9"], "unknown preset 'gpt-9'"),
        (["--ep", "72"], "--ep 72 does not divide the 256 experts"),
        (["--skew", "zipf:x"], "--skew 'zipf:x': expected a number"),
        (["--ubatches", "5"], "--ubatches '5'"),
        (["--profile", "h999"], "unknown hardware profile"),
        (["--workers", "0"], "--workers: must be between 1 and 64"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and err.startswith("dbo-sim:")


def test_a_histogram_whose_shape_does_not_match_the_model_is_refused(tmp_path, capsys):
    path = tmp_path / "h.csv"
    path.write_text("1,2,3\n")
    assert main(["plan", "--histogram", str(path)]) == 2
    assert "3 experts per row but the model has 256" in capsys.readouterr().err


@pytest.mark.parametrize("flag,gpus", [([], H800.gpus_per_node), (["--gpus-per-node", "2"], 2)])
def test_gpus_per_node_is_the_profile_the_steps_are_recorded_and_replayed_on(tmp_path, flag, gpus):
    """One source for the group's node size: the profile's field, which `--gpus-per-node`
    sets when given (no default of the verb's own to shadow the profile)."""
    config = tmp_path / "bf16.json"
    config.write_text('{"dtype": "bfloat16"}')
    argv = ["plan", "--preset", "tiny", "--config", str(config), "--ep", "4", *flag]
    inputs = check_inputs(parse_args(build_parser(["plan"]).parse_args(argv)))
    assert inputs.profile.gpus_per_node == inputs.gpus_per_node == gpus


def test_flags_enable_dbo_from_the_threshold_of_each_phase():
    answers = [
        PhaseAnswer("decode", 64, "balanced", 128, 2, 30.0, 512),
        PhaseAnswer("prefill", 64, "balanced", None, None, -3.0, 2048),
    ]
    flags = "\n".join(engine_flags(answers))
    assert "--enable-dbo --dbo-decode-token-threshold 128" in flags
    assert "--dbo-prefill-token-threshold 1000000000" in flags
    assert "--enable-two-batch-overlap" in flags


def test_flags_recommend_the_comm_sms_the_plan_reserved():
    answers = [PhaseAnswer("prefill", 64, "balanced", 512, 2, 12.0, 4096)]
    assert "VLLM_DBO_COMM_SMS=24" in "\n".join(engine_flags(answers, comm_sms=24))
    assert "VLLM_DBO_COMM_SMS" not in "\n".join(engine_flags(answers))


def test_flags_leave_dbo_off_where_it_never_pays():
    answers = [PhaseAnswer("decode", 8, "balanced", None, None, -20.0, 16)]
    assert "leave it off" in engine_flags(answers)[0]


@pytest.mark.timeout(600)
def test_plan_prints_a_threshold_and_flags_and_writes_csv_and_png(tmp_path, capsys):
    argv = ["plan", "--preset", "deepseek-v3", "--profile", "h800", "--ep", "64"]
    argv += ["--phase", "decode", "--tokens", "32,256", "--ubatches", "2"]
    argv += ["--skew", "balanced,zipf:0.2", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "DBO pays for decode from 256 tokens per device" in out
    assert "--enable-dbo --dbo-decode-token-threshold 256" in out
    rows = list(csv.DictReader(open(tmp_path / "plan.csv")))
    assert {r["skew"] for r in rows} == {"balanced", "zipf:0.2"}
    assert {int(r["num_ubatches"]) for r in rows} == {1, 2}
    for name in ("plan.png", "plan.decode.trace.json", "plan.decode.timeline.png"):
        assert (tmp_path / name).stat().st_size > 0


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.timeout(600)
def test_plan_shows_progress_once_per_recorded_step_on_a_terminal(monkeypatch, capsys):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    argv = ["plan", "--profile", "h800", "--ep", "64", "--phase", "decode"]
    assert main([*argv, "--tokens", "32,512", "--ubatches", "2", "--skew", "balanced"]) == 0
    drawn = terminal.getvalue()
    # serial and 2 ubatches at each count; 512 does not fit, so the range stops there
    assert "plan:" in drawn and "/4 [" in drawn
    assert "decode EP 64 32 tokens serial" in drawn


@pytest.mark.timeout(600)
def test_sglang_s_decode_setup_pays_from_between_64_and_128_tokens(capsys):
    # DeepSeek-V3 on H100, EP 72 over 9 nodes with EPLB's 32 redundant experts
    argv = ["plan", "--profile", "h100", "--ep", "72", "--placement", "eplb:32"]
    argv += ["--phase", "decode", "--tokens", "64,128", "--ubatches", "2", "--skew", "balanced"]
    assert main(argv) == 0
    assert "DBO pays for decode from 128 tokens per device" in capsys.readouterr().out
