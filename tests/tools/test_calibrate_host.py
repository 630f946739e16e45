"""The host-cost calibration command: runs on the simulated device, refuses CUDA without a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from scenarios.cli import main

pytestmark = pytest.mark.timeout(60)


def test_sim_calibration_measures_a_handoff_and_no_launches(capsys, tmp_path):
    argv = ["calibrate-host", "--device", "sim", "--quick", "--json", "--out", str(tmp_path / "c")]
    assert main(argv) == 0
    costs = json.loads(capsys.readouterr().out)
    assert costs["device"] == "sim"
    assert costs["handoff_us"] > 0
    assert costs["elementwise_launch_us"] is None and costs["matmul_launch_us"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_calibration_without_a_gpu_says_so_and_exits_2(capsys):
    assert main(["calibrate-host", "--device", "cuda"]) == 2
    assert "no CUDA GPU present" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_calibration_measures_launches_and_a_handoff(capsys, tmp_path):
    argv = ["calibrate-host", "--device", "cuda", "--quick", "--json", "--out", str(tmp_path / "c")]
    assert main(argv) == 0
    costs = json.loads(capsys.readouterr().out)
    assert (
        costs["elementwise_launch_us"] > 0
        and costs["matmul_launch_us"] > 0
        and costs["handoff_us"] > 0
    )
