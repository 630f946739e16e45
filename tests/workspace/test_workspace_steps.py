"""Labelled runs (`workspace.workspace_step`): a growth records which run it served, and a
locked workspace's refusal names the run that sized the slots and the run that needs more."""

from __future__ import annotations

import pytest
import torch

import dbo
import workspace
from workspace import WorkspaceLockedError, workspace_step

HIDDEN = 16384  # 64 KiB a token: 8 tokens make 0.50 MB


def _scratch(rows: torch.Tensor) -> torch.Tensor:
    (buffer,) = workspace.current_workspace_manager().get_simultaneous(
        ((rows.shape[0], HIDDEN), torch.float32)
    )
    buffer.zero_()
    return rows + 1


@pytest.fixture
def manager():
    yield workspace.init_workspace_manager("cpu", 2)
    workspace.reset_workspace_manager()


@pytest.mark.timeout(30)
def test_a_growth_records_the_labelled_run_it_served(manager) -> None:
    x = torch.zeros(16)
    with workspace_step("profile run", num_tokens=16, num_ubatches=2):
        dbo.run_ubatches(_scratch, [x[:8], x[8:]], device="sim")
    (growth,) = manager.growth_history()
    assert growth.step == "the profile run (ubatched: 2 ubatches, 16 tokens)"


def test_an_unlabelled_serial_growth_says_so(manager) -> None:
    _scratch(torch.zeros(4))
    assert manager.growth_history()[-1].step == "an unlabelled serial run"


@pytest.mark.timeout(30)
def test_a_serial_fallback_after_a_ubatched_profile_run_is_named_as_such(manager) -> None:
    x = torch.zeros(16)
    with workspace_step("profile run", num_tokens=16, num_ubatches=2):
        dbo.run_ubatches(_scratch, [x[:8], x[8:]], device="sim")
    workspace.lock_workspace()
    with workspace_step("step", num_tokens=16), pytest.raises(WorkspaceLockedError) as caught:
        _scratch(x)
    text = str(caught.value)
    assert "sized to 0.50 MB by the profile run (ubatched: 2 ubatches, 16 tokens)" in text
    assert "and the step (serial, 16 tokens) needs 1.00 MB" in text
    assert "falls back from DBO to serial" in text


def test_a_refusal_with_no_growth_before_the_lock_says_none_grew(manager) -> None:
    workspace.lock_workspace()
    with pytest.raises(WorkspaceLockedError, match="no run grew these slots before the lock"):
        _scratch(torch.zeros(4))


def test_a_step_label_must_be_a_name() -> None:
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        with workspace_step(""):
            pass
