"""What `make` installs and what the test run prints: `make run` takes only what running
needs (the dev extra, with HTA's pandas and jupyterlab, is for `make test` and `make lint`),
and the suite's output carries no third-party deprecation noise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def make_dry_run(target: str, tmp_path: Path) -> str:
    """The commands `make TARGET` would run on a machine with no venv yet (`make -n`)."""
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target, f"VENV={tmp_path / 'venv'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@needs_make
def test_make_run_installs_no_dev_extra(tmp_path):
    commands = make_dry_run("run", tmp_path)
    assert "pip install" in commands and "-e ." in commands
    assert "[dev]" not in commands


@needs_make
@pytest.mark.parametrize("target", ["test", "lint"])
def test_make_test_and_lint_install_the_dev_extra(tmp_path, target):
    assert '-e ".[dev]"' in make_dry_run(target, tmp_path)


@pytest.mark.timeout(120)
def test_htas_pandas_deprecations_are_not_printed():
    pytest.importorskip("hta.trace_analysis", reason="HTA is in the dev extra")
    one = "tests/analysis/test_analyze_hta.py::test_idle_time_agrees_with_htas_temporal_breakdown"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{one}[prefill-dbo]"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "warning" not in done.stdout.lower(), done.stdout
