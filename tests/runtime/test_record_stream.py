"""`dbo.record_stream`: one call tells any device's caching allocator that a stream uses a
tensor, so user code needs no branch between CUDA and the simulator."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

import dbo
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions


def _free_while_comm_reads(record: str) -> SimDevice:
    """Free a tensor the comm stream still reads, then allocate its size on compute; `record`:
    "" (no record_stream), "current" (the current stream, on the thread's device) or "given"
    (the comm stream passed, no thread device set)."""
    d = SimDevice(SimOptions("h200", tensor_device="cpu"))
    compute, comm = d.Stream("compute"), d.Stream("comm")
    x = torch.randn(256)
    with dbo.use_device(d) if record == "current" else nullcontext(), d.thread_scope(0):
        d.set_stream(compute)
        y = x * 2
        comm.wait_event(compute.record_event())
        d.set_stream(comm)
        y.sum()  # the comm stream reads y
        if record == "current":
            dbo.record_stream(y)
        elif record == "given":
            dbo.record_stream(y, comm)
        d.set_stream(compute)
        del y
        z = x + 1  # handed y's block by the allocator
        del z
    return d


def test_without_record_stream_the_simulated_allocators_reuse_races() -> None:
    assert len(_free_while_comm_reads("").races) == 1


def test_record_stream_on_the_current_stream_orders_the_simulated_allocators_reuse() -> None:
    assert _free_while_comm_reads("current").races == []


def test_record_stream_goes_to_the_device_of_the_stream_given() -> None:
    assert _free_while_comm_reads("given").races == []


def test_record_stream_refuses_what_is_not_a_dbo_stream() -> None:
    with pytest.raises(TypeError, match="dbo Stream"):
        dbo.record_stream(torch.zeros(1), "comm")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch.Tensor"):
        dbo.record_stream([1.0], SimDevice().Stream())  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_record_stream_reaches_torch_on_cuda() -> None:
    device = dbo.CudaDevice()
    side = device.Stream("side")
    t = torch.empty(1024, device=device.torch_device)
    with dbo.use_device(device):
        dbo.record_stream(t, side)
        dbo.record_stream(t)  # the current stream
    device.synchronize()
