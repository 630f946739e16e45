"""The workspace's test hooks: a plain thread acting as a ubatch, and watched allocations."""

from __future__ import annotations

import threading

import pytest
import torch

from dbo import dbo_current_ubatch_id
from dbo.ubatching import ubatch_step_active
from workspace import WorkspaceManager
from workspace.testing import as_ubatch, watch_allocations


@pytest.mark.timeout(10)
def test_a_thread_acting_as_a_ubatch_gets_its_slot_and_leaves_no_registration():
    seen: list[int] = []

    def body() -> None:
        with as_ubatch(2):
            seen.append(dbo_current_ubatch_id())
        seen.append(dbo_current_ubatch_id())

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(timeout=5)
    assert seen == [2, 0]
    assert not ubatch_step_active()


def test_watched_allocations_see_each_attempt_before_it_is_made():
    manager = WorkspaceManager("cpu", 2)
    seen: list[tuple[int, list[int]]] = []

    def on_allocate(nbytes: int) -> None:
        seen.append((nbytes, manager.slot_capacities()))

    with watch_allocations(manager, on_allocate):
        manager.get_simultaneous(((1000,), torch.uint8))
    manager.get_simultaneous(((5000,), torch.uint8))  # outside the block: not seen
    assert [n for n, _ in seen] == [1024, 1024]  # one per slot, aligned
    assert seen[0][1] == [0, 0]  # called before the first buffer exists
