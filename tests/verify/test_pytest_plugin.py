"""The pytest plugin, as a user meets it: a test file of their own, run by pytest in a
subprocess with the plugin loaded, gets the fixtures without copying anything."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

USER_TESTS = textwrap.dedent(
    """
    import pytest
    import torch

    import dbo
    from dbo.sim import SimDevice
    from workspace import current_workspace_manager, is_workspace_manager_initialized


    def forward(x, wait=True):
        h = x @ torch.eye(x.shape[1], dtype=x.dtype)
        if wait:
            dbo.dbo_yield_and_switch_from_compute_to_comm()
        else:
            dbo.dbo_yield()
            dbo.dbo_switch_to_comm()
        with dbo.current_device().comm_region("dispatch", nbytes=h.numel() * 4):
            out = h * 2
        dbo.dbo_switch_to_compute_sync()
        return out


    def test_sim_device_is_fresh(sim_device):
        assert isinstance(sim_device, SimDevice) and sim_device.timeline == []


    def test_dbo_workspace_defaults_to_two_slots(dbo_workspace):
        assert current_workspace_manager() is dbo_workspace
        assert dbo_workspace.num_ubatches == 2


    @pytest.mark.parametrize("dbo_workspace", [3], indirect=True)
    def test_dbo_workspace_takes_the_count_indirectly(dbo_workspace):
        assert dbo_workspace.num_ubatches == 3


    def test_dbo_workspace_is_reset_after_each_test():
        assert not is_workspace_manager_initialized()


    def test_dbo_verify_passes_a_correct_forward(dbo_verify, sim_device):
        report = dbo_verify(forward, torch.randn(8, 4), device=sim_device)
        assert report.ok


    def test_dbo_verify_fails_a_racy_forward(dbo_verify):
        dbo_verify(lambda x: forward(x, wait=False), torch.randn(8, 4))
    """
)


def run_user_tests(tmp_path: Path) -> subprocess.CompletedProcess:
    (tmp_path / "test_user_model.py").write_text(USER_TESTS)
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "dbo.verification.pytest_plugin",
            "-p",
            "no:cacheprovider",
            "-rA",
            "-q",
            "test_user_model.py",
        ],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.fixture(scope="module")
def user_run(tmp_path_factory) -> subprocess.CompletedProcess:
    return run_user_tests(tmp_path_factory.mktemp("user"))


def outcome(run: subprocess.CompletedProcess, test: str) -> str | None:
    for line in run.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1].startswith(f"test_user_model.py::{test}"):
            return parts[0]
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "test",
    [
        "test_sim_device_is_fresh",
        "test_dbo_workspace_defaults_to_two_slots",
        "test_dbo_workspace_takes_the_count_indirectly",
        "test_dbo_workspace_is_reset_after_each_test",
        "test_dbo_verify_passes_a_correct_forward",
    ],
)
def test_fixture_works_in_a_users_test_file(user_run, test):
    assert outcome(user_run, test) == "PASSED", user_run.stdout + user_run.stderr


@pytest.mark.timeout(120)
def test_dbo_verify_fails_the_users_test_with_the_description(user_run):
    assert outcome(user_run, "test_dbo_verify_fails_a_racy_forward") == "FAILED"
    assert "dbo.verify: FAILED" in user_run.stdout
    assert "in 1 cause(s)" in user_run.stdout  # the races grouped by the one missing wait
    assert "missing: stream 'comm' does not wait for stream 'compute'" in user_run.stdout
    assert "origin:  dbo_switch_to_comm() at test_user_model.py:" in user_run.stdout
    assert "fix:     make dbo_switch_to_comm() there dbo_switch_to_comm_sync()" in user_run.stdout
    assert "Race on storage" in user_run.stdout  # and the first race in full, with stacks
    assert user_run.returncode == 1


def test_the_plugin_is_declared_as_a_pytest11_entry_point():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    entry_points = project["project"]["entry-points"]["pytest11"]
    # Named as the module, so `-p dbo.verification.pytest_plugin` and the entry point are one
    # plugin.
    assert entry_points == {"dbo.verification.pytest_plugin": "dbo.verification.pytest_plugin"}


def test_the_installed_entry_point_loads_the_plugin_module():
    from importlib.metadata import entry_points

    found = [
        ep for ep in entry_points(group="pytest11") if ep.value == "dbo.verification.pytest_plugin"
    ]
    if not found:
        pytest.skip("dbo-sim is not installed in this environment (run `make test`)")
    import dbo.verification.pytest_plugin

    assert found[0].load() is dbo.verification.pytest_plugin
