"""The README's "Verify your own model" examples run as written: the CLI verb and the pytest
plugin's example test on `examples/my_moe.py`, a model written outside `scenarios/`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import dbo
from examples.my_moe import MyMoE, make_batch
from scenarios.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_the_example_model_verifies_ok_from_one_call():
    report = dbo.verify(MyMoE().forward, make_batch(), num_ubatches=2)
    assert report.ok, report.describe()
    assert report.yield_counts == [6, 6]  # three per layer, two layers


@pytest.mark.timeout(60)
def test_the_ep_layer_at_size_gains_from_dbo_on_the_simulated_h200():
    from examples.ep_moe import forward_at_size, make_batch_at_size

    report = dbo.verify(forward_at_size, make_batch_at_size())
    assert report.ok, report.describe()
    assert report.speedup > 1.0, report.describe()  # virtual time: the same on every machine


@pytest.mark.timeout(60)
def test_the_readme_verify_command_passes_on_the_example(capsys):
    argv = ["verify", "examples.my_moe:forward", "--inputs", "examples.my_moe:make_batch"]
    assert main(argv) == 0
    assert "dbo.verify: OK" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_the_readme_example_test_passes_under_pytest():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "dbo.verification.pytest_plugin",
            "examples/test_my_moe.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
