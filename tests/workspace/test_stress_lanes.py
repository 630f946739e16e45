"""`dbo-sim stress --lanes N`: the stress workers spread requests over workspace lanes, ask for
persistent tensors and keep views across growths, and the run checks the invariants that go
with them (a slot per (ubatch, lane), persistent tensors fixed, orphans counted exactly)."""

from __future__ import annotations

import json

import pytest
import torch

from scenarios.cli import main
from scenarios.tools import stress_run
from workspace import use_workspace_lane


@pytest.mark.timeout(60)
def test_stress_with_lanes_passes_and_grows_every_lane_with_slots_equal_within_each(capsys):
    assert main(["stress", "--threads", "4", "--lanes", "3", "--iterations", "200", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["lanes"] == 3 and report["violations"] == []
    caps = report["final_capacities"]
    assert len(caps) == 4 * 3
    assert all(len(set(caps[lane::3])) == 1 and caps[lane] > 0 for lane in range(3))
    assert report["persistent_requests"] > 0


@pytest.mark.timeout(60)
def test_stress_text_report_names_the_lanes_and_passes(capsys):
    assert main(["stress", "--threads", "2", "--lanes", "2", "--iterations", "50"]) == 0
    out = capsys.readouterr().out
    assert "2 threads x 50 iterations x 2 lane(s)" in out and out.rstrip().endswith("PASS")


@pytest.mark.parametrize("value", ["0", "-1", "65", "x", "1.5"])
def test_a_bad_lane_count_is_a_usage_error_before_any_work(capsys, monkeypatch, value):
    ran = []
    monkeypatch.setattr(stress_run, "run_stress", lambda *a, **k: ran.append(1))
    assert main(["stress", "--lanes", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dbo-sim: argument --lanes:") and ran == []


def test_run_stress_refuses_zero_lanes_before_any_work():
    with pytest.raises(ValueError, match="lanes must be >= 1"):
        stress_run.run_stress(2, 10, lanes=0)


@pytest.mark.timeout(60)
def test_stress_fails_when_requests_ignore_the_callers_lane(monkeypatch):
    class LaneBlind(stress_run.WorkspaceManager):
        """Serves every request from lane 0, whatever lane the caller is in."""

        def get_simultaneous(self, *pairs):
            with use_workspace_lane(0):
                return super().get_simultaneous(*pairs)

    monkeypatch.setattr(stress_run, "WorkspaceManager", LaneBlind)
    report = stress_run.run_stress(2, 100, lanes=2)
    assert not report.passed
    assert any("is not in a buffer of slot" in v for v in report.violations)


@pytest.mark.timeout(60)
def test_stress_fails_when_a_persistent_tensor_moves(monkeypatch):
    class Forgetful(stress_run.WorkspaceManager):
        """Makes a new persistent tensor on every request."""

        def get_persistent(self, key, shape, dtype, *, zero_init=False):
            return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr(stress_run, "WorkspaceManager", Forgetful)
    report = stress_run.run_stress(2, 300, lanes=2)
    assert not report.passed
    assert any("persistent tensor was replaced" in v for v in report.violations)


@pytest.mark.timeout(60)
def test_stress_fails_when_orphans_are_miscounted(monkeypatch):
    class Miscounting(stress_run.WorkspaceManager):
        def orphaned_bytes(self):
            return super().orphaned_bytes() + 256

    monkeypatch.setattr(stress_run, "WorkspaceManager", Miscounting)
    report = stress_run.run_stress(2, 50, lanes=2)
    assert not report.passed
    assert any("orphaned bytes reported while the kept views hold" in v for v in report.violations)
