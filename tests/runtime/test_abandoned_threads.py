"""A ubatch thread the launcher abandoned (after a timeout) cannot reach any later step.

Python cannot kill a thread, so one stuck in user code past `UBatchTimeoutError` runs on once
its blocking call returns. Whatever it then does through the runtime (a `dbo_*` helper, the
forward context, the workspace) raises `dbo.UBatchAbandoned`, so it unwinds instead of writing
a slot or a registry that a later step owns.
"""

from __future__ import annotations

import threading

import pytest
import torch

import dbo
from dbo import ubatching
from workspace import current_workspace_manager, init_workspace_manager

pytestmark = pytest.mark.timeout(120)

SLOT = ((64,), torch.float32)


class _StuckThread:
    """Ubatch 0 of the first step blocks past the step's timeout; once released, it runs
    `after` (what an abandoned thread would do next) and records what that raised."""

    def __init__(self, after) -> None:
        self.release = threading.Event()
        self.finished = threading.Event()
        self.raised: list[BaseException] = []
        self.after = after

    def fn(self, i):
        if i == 0:
            self.release.wait(30)
            try:
                self.after()
            except BaseException as error:  # the test inspects it
                self.raised.append(error)
                raise
            finally:
                self.finished.set()
        dbo.dbo_yield()
        return i

    def abandon(self, device) -> None:
        with pytest.raises(dbo.UBatchTimeoutError):
            dbo.run_ubatches(self.fn, [0, 1], device=device, timeout=0.3)


def _slot_step(i: int) -> float:
    """A later step's forward: fill the ubatch's slot, yield, read it back."""
    (buf,) = current_workspace_manager().get_simultaneous(SLOT)
    buf.fill_(float(i + 1))
    dbo.dbo_yield()
    return float(buf.sum()) / buf.numel()


def test_an_abandoned_thread_never_writes_a_later_steps_workspace_slot(device):
    init_workspace_manager("cpu", num_ubatches=2)
    stop = threading.Event()

    def keep_writing_slot():
        # What the reproduction did: once free, write "its" slot while steps run.
        while not stop.is_set():
            (buf,) = current_workspace_manager().get_simultaneous(SLOT)
            buf.fill_(-1.0)

    stuck = _StuckThread(keep_writing_slot)
    stuck.abandon(device)
    stuck.release.set()
    try:
        outputs = [dbo.run_ubatches(_slot_step, [0, 1], device=device) for _ in range(300)]
    finally:
        stop.set()
    assert stuck.finished.wait(10)
    assert outputs == [[1.0, 2.0]] * 300
    assert len(stuck.raised) == 1 and isinstance(stuck.raised[0], dbo.UBatchAbandoned)


@pytest.mark.parametrize(
    "call",
    [
        dbo.dbo_yield,
        dbo.dbo_current_ubatch_id,
        dbo.dbo_enabled,
        dbo.dbo_switch_to_comm,
        dbo.dbo_yield_and_switch_from_compute_to_comm,
        dbo.current_forward_context,
        lambda: dbo.dbo_register_recv_hook(lambda: None),
        lambda: dbo.dbo_get_previous_event(lambda: None),
        lambda: current_workspace_manager(),
    ],
    ids=lambda call: getattr(call, "__name__", "call"),
)
def test_every_runtime_call_of_an_abandoned_thread_raises(device, call):
    init_workspace_manager("cpu", num_ubatches=2)
    stuck = _StuckThread(call)
    stuck.abandon(device)
    stuck.release.set()
    assert stuck.finished.wait(10)
    assert len(stuck.raised) == 1 and isinstance(stuck.raised[0], dbo.UBatchAbandoned)
    assert "abandoned" in str(stuck.raised[0])


def test_a_thread_that_outlives_the_unwind_after_a_peers_failure_is_abandoned_too(device):
    init_workspace_manager("cpu", num_ubatches=2)
    stuck = _StuckThread(current_workspace_manager)

    def fn(i):
        if i == 1:
            raise ValueError("peer failed")
        try:
            dbo.dbo_yield()  # ubatch 1 fails; this yield unwinds with StepAborted...
        finally:
            stuck.fn(i)  # ...into user code that blocks past the step's deadline

    with pytest.raises(dbo.UBatchError, match="ValueError: peer failed"):
        dbo.run_ubatches(fn, [0, 1], device=device, timeout=0.5)
    stuck.release.set()
    assert stuck.finished.wait(10)
    assert isinstance(stuck.raised[0], dbo.UBatchAbandoned)
    assert "ValueError: peer failed" in str(stuck.raised[0])  # it says which step's end


@pytest.mark.parametrize(
    "method",
    ["get_simultaneous", "try_get_simultaneous", "reserve", "available_bytes", "persistent"],
)
def test_a_manager_the_abandoned_thread_already_holds_refuses_it_too(device, method):
    manager = init_workspace_manager("cpu", num_ubatches=2)
    calls = {
        "get_simultaneous": lambda: manager.get_simultaneous(SLOT),
        "try_get_simultaneous": lambda: manager.try_get_simultaneous(SLOT),
        "reserve": lambda: manager.reserve(((1 << 20,), torch.uint8)),
        "available_bytes": manager.available_bytes,
        "persistent": lambda: manager.get_persistent("k", (4,), torch.float32),
    }
    manager.get_simultaneous(SLOT)  # warm: the hot path has this signature cached
    stuck = _StuckThread(calls[method])
    stuck.abandon(device)
    stuck.release.set()
    assert stuck.finished.wait(10)
    assert isinstance(stuck.raised[0], dbo.UBatchAbandoned)
    assert manager.slot_capacities() == [256, 256]  # reserve grew nothing


def test_an_abandoned_thread_cannot_lock_a_later_steps_workspace(device):
    manager = init_workspace_manager("cpu", num_ubatches=2)
    stuck = _StuckThread(manager.lock)
    stuck.abandon(device)
    stuck.release.set()
    assert stuck.finished.wait(10)
    assert isinstance(stuck.raised[0], dbo.UBatchAbandoned) and not manager.is_locked()


def test_an_abandoned_thread_cannot_set_the_launchers_forward_context(device):
    def set_context():
        with dbo.set_forward_context("from the abandoned thread"):
            pass

    stuck = _StuckThread(set_context)
    stuck.abandon(device)
    with dbo.set_forward_context("the launcher's"):
        stuck.release.set()
        assert stuck.finished.wait(10)
        assert dbo.current_forward_context() == "the launcher's"
    assert isinstance(stuck.raised[0], dbo.UBatchAbandoned)


def test_an_abandoned_thread_is_no_longer_counted_once_it_has_unwound(device):
    stuck = _StuckThread(dbo.dbo_yield)
    stuck.abandon(device)
    stuck.release.set()
    assert stuck.finished.wait(10)
    # its worker thread's ident may be reused by a new thread, which must not inherit the mark
    deadline = threading.Event()
    while ubatching.abandoned_thread_count() and not deadline.wait(0.01):
        pass
    assert ubatching.abandoned_thread_count() == 0
    assert dbo.run_ubatches(lambda i: dbo.dbo_current_ubatch_id(), [0, 1], device=device) == [
        0,
        1,
    ]


def test_an_abandoned_exception_cannot_be_swallowed_by_except_exception():
    assert issubclass(dbo.UBatchAbandoned, dbo.StepAborted)
    assert not issubclass(dbo.UBatchAbandoned, Exception)
