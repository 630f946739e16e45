"""What dbo-sim finds in vLLM 0.33, each wrong by vLLM's own contract, shown against the
installed release (bounded: every thread started here ends here). docs/vllm-parity.md lists
them; dbo-sim's counterparts do not have them (tests/runtime, tests/workspace)."""

from __future__ import annotations

import threading

import pytest
import torch

from dbo.sim import SimDevice, cuda_facade

ubatching = pytest.importorskip(
    "vllm.v1.worker.ubatching", reason="vLLM 0.33 is not installed: make vllm-oracle"
)
vllm_workspace = pytest.importorskip("vllm.v1.worker.workspace")


@pytest.mark.timeout(60)
def test_vllms_ring_hangs_when_a_ubatch_fails_mid_step():
    """One ubatch raises; its peer yields to it and is never woken (V1's and V2's launchers
    join it with no timeout). Released here by hand after the bounded wait."""
    device = SimDevice()
    with cuda_facade(device):
        compute, comm = device.ubatch_streams()
        barrier = threading.Barrier(3)
        ctxs = ubatching.make_ubatch_contexts(2, compute, comm, [None, None], barrier)
        errors: list[BaseException] = []

        def run(ctx):
            try:
                with ctx:
                    if ctx.id == 0:
                        raise ValueError("ubatch 0 broke")
                    ubatching.dbo_yield()  # hands the baton to ubatch 0, which is gone
            except ValueError as error:
                errors.append(error)

        threads = [threading.Thread(target=run, args=(ctx,), daemon=True) for ctx in ctxs]
        for t in threads:
            t.start()
        barrier.wait()
        ctxs[0].cpu_wait_event.set()
        threads[0].join(10)
        threads[1].join(1.0)
        hung = threads[1].is_alive()
        ctxs[1].cpu_wait_event.set()  # release it: this test leaves no thread behind
        threads[1].join(10)
    assert hung and len(errors) == 1
    assert not any(t.is_alive() for t in threads)


def test_vllms_workspace_fails_a_zero_byte_request_on_a_never_grown_slot():
    """get_simultaneous of an empty shape should return empty views; on a slot that never
    grew, vLLM 0.33 slices None (TypeError)."""
    manager = vllm_workspace.WorkspaceManager(torch.device("cpu"), num_ubatches=2)
    with pytest.raises(TypeError):
        manager.get_simultaneous(((0,), torch.float32))
