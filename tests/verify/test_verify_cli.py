"""`dbo-sim verify MODULE:FORWARD --inputs MODULE:FACTORY`, on a module written to a temp
folder: exit 0 when ok, 1 when not, 2 (one line) on a bad command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap

import pytest
import torch

from scenarios.cli import main
from scenarios.tools import verify_cli
from workspace import reset_workspace_manager

USER_MODULE = textwrap.dedent(
    """
    import torch
    import dbo

    def forward(x):
        h = torch.tanh(x)
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        with dbo.current_device().comm_region("dispatch", nbytes=h.numel() * 4):
            out = h * 2
        dbo.dbo_switch_to_compute_sync()
        return out

    def racy_forward(x):
        h = torch.tanh(x)
        dbo.dbo_yield()
        dbo.dbo_switch_to_comm()  # no wait for the compute stream
        with dbo.current_device().comm_region("dispatch", nbytes=h.numel() * 4):
            out = h * 2
        dbo.dbo_switch_to_compute_sync()
        return out

    def make_batch():
        return torch.randn(8, 4, generator=torch.Generator().manual_seed(0))

    def broken_batch():
        raise RuntimeError("no data")

    def broken_forward(x):
        raise RuntimeError("model bug")

    not_callable = 3
    """
)


def run_cli(argv: list[str]) -> int:
    """dbo-sim's exit status: what main returns, or what argparse exits with."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_model.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the verb may add the module's folder
    monkeypatch.delitem(sys.modules, "user_model", raising=False)
    reset_workspace_manager()
    yield tmp_path / "user_model.py"
    reset_workspace_manager()


@pytest.mark.timeout(60)
def test_a_correct_forward_exits_0_with_the_report(user_module, capsys):
    code = run_cli(["verify", "user_model:forward", "--inputs", "user_model:make_batch"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "dbo.verify: OK (2 ubatches on sim)" in out


@pytest.mark.timeout(60)
def test_a_racy_forward_exits_1(user_module, capsys):
    code = run_cli(["verify", "user_model:racy_forward", "--inputs", "user_model:make_batch"])
    assert code == 1
    assert "missing: stream 'comm' does not wait for stream 'compute'" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_a_forward_that_raises_serially_exits_1_with_its_traceback(user_module, capsys):
    code = run_cli(["verify", "user_model:broken_forward", "--inputs", "user_model:make_batch"])
    err = capsys.readouterr().err
    assert code == 1
    assert "the serial forward raised" in err and "RuntimeError: model bug" in err


@pytest.mark.timeout(60)
def test_json_report_and_artifacts_from_a_py_path(user_module, tmp_path, capsys):
    path = str(user_module)
    code = run_cli(
        [
            "verify",
            f"{path}:forward",
            "--inputs",
            f"{path}:make_batch",
            "-n",
            "3",
            "--json",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["ok"] is True and report["num_ubatches"] == 3
    assert (tmp_path / "out" / "verify.trace.json").is_file()
    assert (tmp_path / "out" / "verify.png").is_file()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["user_model:forward"], "--inputs"),
        (["user_model", "--inputs", "user_model:make_batch"], "MODULE:NAME"),
        (["no_such_module:forward", "--inputs", "user_model:make_batch"], "cannot import"),
        (["user_model:nothing", "--inputs", "user_model:make_batch"], "no attribute"),
        (["user_model:not_callable", "--inputs", "user_model:make_batch"], "not a callable"),
        (["user_model:forward", "--inputs", "user_model:broken_batch"], "no data"),
        (["user_model:forward", "--inputs", "user_model:make_batch", "-n", "1"], ">= 2"),
        (["user_model:forward", "--inputs", "user_model:make_batch", "--atol", "nan"], "atol"),
        (["missing.py:forward", "--inputs", "user_model:make_batch"], "no such file"),
        (
            [
                "user_model:forward",
                "--inputs",
                "user_model:make_batch",
                "--window",
                "9:3",
                "--out",
                "o",
            ],
            "after its start",
        ),
        (
            ["user_model:forward", "--inputs", "user_model:make_batch", "--window", "1:5"],
            "give --out",
        ),
    ],
)
def test_a_bad_command_line_exits_2_with_one_line(user_module, capsys, argv, message):
    code = run_cli(["verify", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("dbo-sim: ") and err.count("\n") == 1
    assert message in err


@pytest.mark.timeout(60)
def test_window_narrows_the_trace(user_module, tmp_path, capsys):
    code = run_cli(
        [
            "verify",
            "user_model:forward",
            "--inputs",
            "user_model:make_batch",
            "--out",
            str(tmp_path / "w"),
            "--window",
            "0:5",
        ]
    )
    assert code == 0
    trace = json.loads((tmp_path / "w" / "verify.trace.json").read_text())
    assert trace["otherData"]["window_us"] == [0.0, 5.0]
    assert all(e["ts"] <= 5.0 for e in trace["traceEvents"] if e["ph"] == "X")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_a_bad_command_line(user_module, capsys):
    code = run_cli(
        ["verify", "user_model:forward", "--inputs", "user_model:make_batch", "--device", "cuda"]
    )
    assert code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_the_tool_runs_from_any_parser_its_arguments_were_added_to(user_module, capsys):
    parser = argparse.ArgumentParser()
    verify_cli.add_arguments(parser)
    args = parser.parse_args(["user_model:forward", "--inputs", "user_model:make_batch"])
    assert verify_cli.run(args) == 0
    assert "ok" in capsys.readouterr().out.lower()


BROKEN_IMPORT = "import no_such_package_anywhere\n\ndef forward(x):\n    return x\n"
EXITS_AT_IMPORT = "import sys\n\nsys.exit(3)\n\ndef forward(x):\n    return x\n"


def one_line_exit_2(argv: list[str], capsys) -> str:
    code = run_cli(["verify", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("dbo-sim: ") and err.count("\n") == 1, err
    return err


@pytest.mark.timeout(60)
def test_a_py_file_whose_import_fails_is_one_line(user_module, tmp_path, capsys):
    (tmp_path / "broken.py").write_text(BROKEN_IMPORT)
    err = one_line_exit_2(
        [str(tmp_path / "broken.py") + ":forward", "--inputs", "user_model:make_batch"], capsys
    )
    assert "no_such_package_anywhere" in err


@pytest.mark.timeout(60)
def test_a_module_calling_sys_exit_at_import_is_refused_in_one_line(user_module, tmp_path, capsys):
    (tmp_path / "exits.py").write_text(EXITS_AT_IMPORT)
    err = one_line_exit_2(["exits:forward", "--inputs", "user_model:make_batch"], capsys)
    assert "sys.exit(3)" in err and "__main__" in err


@pytest.mark.timeout(60)
def test_out_naming_an_existing_file_is_refused_before_any_work(user_module, tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    err = one_line_exit_2(
        ["user_model:broken_forward", "--inputs", "user_model:make_batch", "--out", "taken"],
        capsys,
    )
    assert "--out" in err and "is a file" in err  # refused before the forward could raise


@pytest.mark.timeout(60)
def test_an_unwritable_out_is_refused_before_any_work(user_module, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    err = one_line_exit_2(
        ["user_model:broken_forward", "--inputs", "user_model:make_batch", "--out", "file/sub"],
        capsys,
    )
    assert "--out" in err and "cannot" in err


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a /proc file system")
def test_an_out_under_proc_is_refused_before_the_forward_runs(user_module, capsys):
    # Root passes os.access there, yet nothing can be made: only a real write says so.
    err = one_line_exit_2(
        ["user_model:broken_forward", "--inputs", "user_model:make_batch", "--out", "/proc/dbo/x"],
        capsys,
    )
    assert "--out" in err and "cannot" in err  # broken_forward never ran


@pytest.mark.timeout(60)
def test_race_order_adversarial_shows_what_the_race_changes(user_module, capsys):
    code = run_cli(
        [
            "verify",
            "user_model:racy_forward",
            "--inputs",
            "user_model:make_batch",
            "--race-order",
            "adversarial",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "adversarial order" in out and "the race changes values" in out


@pytest.mark.timeout(60)
def test_race_order_adversarial_on_cuda_is_a_bad_command_line(user_module, capsys):
    argv = ["user_model:forward", "--inputs", "user_model:make_batch", "--race-order"]
    err = one_line_exit_2([*argv, "adversarial", "--device", "cuda"], capsys)
    assert "adversarial" in err or "CUDA" in err


HANGS_SERIALLY = (
    "import threading\n\nimport dbo\n\nRELEASE = threading.Event()\n\n\n"
    "def forward(x):\n    if not dbo.dbo_enabled():\n        RELEASE.wait(10)\n    return x\n"
)


@pytest.mark.timeout(60)
def test_a_serial_run_past_the_timeout_exits_1_saying_where_it_hangs(user_module, tmp_path, capsys):
    (tmp_path / "hangs.py").write_text(HANGS_SERIALLY)
    try:
        code = run_cli(
            ["verify", "hangs:forward", "--inputs", "user_model:make_batch", "--timeout", "0.5"]
        )
    finally:
        sys.modules["hangs"].RELEASE.set()
    err = capsys.readouterr().err
    assert code == 1
    assert "did not finish within 0.5 s" in err and "hangs.py" in err
    assert "Traceback" not in err


RANKS_MODULE = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    def forward(x):
        out = torch.ones(2)
        dist.all_reduce(out)
        return x * out.sum()

    def skips_when_idle(x):
        return x if x.shape[0] == 0 else forward(x)

    def batches(rank, world_size):
        return torch.ones(6 if rank == 0 else 0, 4)
    """
)


@pytest.mark.timeout(60)
def test_ranks_verifies_on_gloo_ranks_and_names_a_skipped_collective(tmp_path, capsys):
    (tmp_path / "user_ranks.py").write_text(RANKS_MODULE)
    model = str(tmp_path / "user_ranks.py")
    ok = run_cli(["verify", f"{model}:forward", "--inputs", f"{model}:batches", "--ranks", "2"])
    assert ok == 0 and "dbo.verify_ranks: OK (2 ranks over gloo" in capsys.readouterr().out
    argv = ["verify", f"{model}:skips_when_idle", "--inputs", f"{model}:batches", "--ranks", "2"]
    assert run_cli(argv) == 1
    assert "rank 1 has begun step 2 (DBO)" in capsys.readouterr().out


def test_ranks_below_two_is_a_bad_command_line(user_module, capsys):
    argv = ["verify", "user_model:forward", "--inputs", "user_model:make_batch", "--ranks", "1"]
    assert run_cli(argv) == 2
    assert "--ranks: must be >= 2" in capsys.readouterr().err
