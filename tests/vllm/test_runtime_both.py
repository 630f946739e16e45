"""vLLM 0.33's own ring (`make_ubatch_contexts`, `UBatchContext`) driving a step on the
simulated GPU, and `dbo.verify(runtime="both")` comparing it with dbo-sim's ring."""

from __future__ import annotations

import threading

import pytest
import torch

import dbo
from dbo.errors import UBatchError
from dbo.sim import SimDevice
from dbo.ubatch_context import token_offsets_of
from dbo.verification.vllm_runtime import run_vllm_ubatches
from examples import ep_moe, my_moe

W = torch.randn(64, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64) / 8


def low_latency_forward(x: torch.Tensor) -> torch.Tensor:
    """A low-latency send whose arrival a recv hook waits on, run when the ubatch resumes."""
    device = dbo.current_device()
    h = torch.tanh(x @ W)
    with device.comm_region("dispatch", nbytes=h.numel() * 8, mode="ll") as handle:
        recv = h * 1.0
    dbo.dbo_register_recv_hook(lambda: handle.event.wait())
    dbo.dbo_yield()
    dbo.dbo_maybe_run_recv_hook()
    return x + recv @ W


def ll_batch() -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("example", [my_moe, ep_moe], ids=["my_moe", "ep_moe"])
def test_vllms_ring_and_dbos_run_the_examples_alike(example):
    report = dbo.verify(example.forward, example.make_batch(), runtime="both")
    assert report.runtime_differences == []
    assert report.ok, report.describe()


@pytest.mark.timeout(120)
def test_vllms_ring_and_dbos_run_recv_hooks_alike():
    report = dbo.verify(low_latency_forward, ll_batch(), runtime="both")
    assert report.runtime_differences == [], report.describe()


@pytest.mark.timeout(120)
def test_a_missing_event_wait_in_vllms_ring_is_reported(monkeypatch):
    from vllm.v1.worker import ubatching

    monkeypatch.setattr(ubatching.UBatchContext, "_wait_comm_done", lambda self: None)
    report = dbo.verify(my_moe.forward, my_moe.make_batch(), runtime="both")
    assert not report.ok
    assert any("dbo did wait" in line for line in report.runtime_differences)


@pytest.mark.timeout(120)
def test_a_recv_hook_run_early_in_vllms_ring_is_reported(monkeypatch):
    from vllm.v1.worker import ubatching

    honest = ubatching.UBatchContext._cpu_yield

    def hook_first(self):
        self.maybe_run_recv_hook()  # the planted bug: the pending hook runs before the yield
        honest(self)

    monkeypatch.setattr(ubatching.UBatchContext, "_cpu_yield", hook_first)
    report = dbo.verify(low_latency_forward, ll_batch(), runtime="both")
    assert not report.ok
    assert report.runtime_differences, report.describe()


@pytest.mark.timeout(60)
def test_a_failing_ubatch_ends_vllms_ring_with_an_error_and_no_thread_left():
    def forward(x):
        if dbo.dbo_current_ubatch_id() == 1:
            raise ValueError("ubatch 1 broke")
        dbo.dbo_yield()
        return x

    before = threading.active_count()
    x = torch.ones(4, 2)
    with pytest.raises(UBatchError, match="ubatch 1 of 2 failed"):
        run_vllm_ubatches(forward, [x[:2], x[2:]], device=SimDevice(), timeout=10)
    assert threading.active_count() == before


@pytest.mark.timeout(60)
def test_vllms_ring_passes_each_ubatch_its_token_offset():
    from vllm.v1.worker import ubatching

    x = torch.arange(10.0).reshape(10, 1)
    outs = run_vllm_ubatches(
        lambda piece: ubatching.dbo_current_ubatch_token_offset(),
        [x[:3], x[3:]],
        device=SimDevice(),
    )
    assert outs == [0, 3]


@pytest.mark.timeout(60)
def test_dbos_ring_passes_the_same_token_offsets_as_vllms():
    from vllm.v1.worker import ubatching

    x = torch.arange(10.0).reshape(10, 1)
    pieces = [x[:3], x[3:7], x[7:]]
    theirs = run_vllm_ubatches(
        lambda piece: ubatching.dbo_current_ubatch_token_offset(), pieces, device=SimDevice()
    )
    ours = dbo.run_ubatches(
        lambda piece: dbo.dbo_current_ubatch_token_offset(),
        pieces,
        device=SimDevice(),
        token_offsets=token_offsets_of(pieces),
    )
    assert ours == theirs == [0, 3, 7]


@pytest.mark.timeout(60)
def test_a_step_vllms_ring_would_hang_on_times_out_and_leaves_no_thread_behind():
    """Ubatch 1 yields once more than ubatch 0: under vLLM's launcher it waits forever for a
    baton nobody passes. Here the step times out, and the parked thread is woken and unwinds."""

    def forward(x):
        dbo.dbo_yield()
        if dbo.dbo_current_ubatch_id() == 1:
            dbo.dbo_yield()
        return x

    before = threading.active_count()
    x = torch.ones(4, 2)
    with pytest.raises(dbo.UBatchTimeoutError, match="did not finish"):
        run_vllm_ubatches(forward, [x[:2], x[2:]], device=SimDevice(), timeout=1.0)
    for thread in threading.enumerate():
        if thread.name.startswith("vllm-ubatch-"):
            thread.join(10)
    assert threading.active_count() == before
    # The ring's slots are free again: the next step runs.
    assert len(run_vllm_ubatches(lambda piece: piece, [x[:2], x[2:]], device=SimDevice())) == 2
