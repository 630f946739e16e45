"""Which device a thread uses, and the runtime on real CUDA streams.

The device-selection tests run everywhere; the CUDA ones carry `needs_cuda` and are skipped
cleanly (with the reason) on a machine without a GPU.
"""

from __future__ import annotations

import threading

import pytest
import torch

import dbo
from dbo.devices import resolve_device
from dbo.sim import SimDevice
from dbo.streams import CudaDevice

pytestmark = pytest.mark.timeout(120)


def needs_cuda(test):
    """Marked `cuda` (select with -m cuda) and skipped, with the reason, without a GPU."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.cuda(skip(test))


# ------------------------------------------------------------------ device selection


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize(
    "make", [CudaDevice, lambda: resolve_device("cuda")], ids=["CudaDevice", "resolve-cuda"]
)
def test_cuda_without_a_gpu_says_to_use_the_simulated_device(make):
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU.*device='sim'"):
        make()


def test_a_malformed_cuda_index_is_a_value_error_naming_the_device():
    with pytest.raises(ValueError, match=r"'cuda:x'.*index"):
        resolve_device("cuda:x")


def test_resolve_device_passes_a_device_through_and_makes_a_sim_on_request():
    d = SimDevice()
    assert resolve_device(d) is d
    assert isinstance(resolve_device("sim"), SimDevice)


def test_use_device_is_per_thread_and_restored_after_the_block():
    mine, other = SimDevice(), SimDevice()
    seen = []
    with dbo.use_device(mine):
        t = threading.Thread(target=lambda: seen.append(dbo.current_device()))
        t.start()
        t.join(5)
        assert dbo.current_device() is mine
        with dbo.use_device(other):
            assert dbo.current_device() is other
        assert dbo.current_device() is mine
    assert seen == [dbo.get_default_device()]
    assert dbo.current_device() is dbo.get_default_device()


def test_stream_context_restores_the_stream_when_the_block_raises():
    d = SimDevice()
    before, s = d.current_stream(), d.Stream("s")
    with pytest.raises(ValueError):
        with dbo.stream_context(s):
            assert d.current_stream() is s
            raise ValueError("inside")
    assert d.current_stream() is before


def test_use_device_and_set_default_device_refuse_a_non_device():
    with pytest.raises(TypeError, match="Device"):
        with dbo.use_device("sim"):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError, match="Device"):
        dbo.set_default_device("sim")  # type: ignore[arg-type]


# ------------------------------------------------------------------ real CUDA streams


@needs_cuda
def test_cuda_device_current_stream_is_the_one_set():
    device = CudaDevice()
    s = device.Stream("s")
    with dbo.stream_context(s):
        assert device.current_stream() is s
        assert torch.cuda.current_stream() == s.raw


@needs_cuda
def test_ubatched_step_on_cuda_streams_matches_serial():
    device = CudaDevice()
    w = torch.randn(512, 512, device="cuda")

    def fn(x):
        y = x @ w
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        y = y * 2  # stands in for dispatch on the comm stream
        dbo.dbo_yield_and_switch_from_comm_to_compute()
        return y @ w

    xs = [torch.randn(64, 512, device="cuda") for _ in range(2)]
    outs = dbo.run_ubatches(fn, xs, device=device)
    torch.cuda.synchronize()
    for x, o in zip(xs, outs):
        torch.testing.assert_close(o, ((x @ w) * 2) @ w)


@needs_cuda
def test_ubatched_step_captures_into_a_cuda_graph_and_replays():
    device = CudaDevice()
    w = torch.randn(256, 256, device="cuda")
    xs = [torch.randn(32, 256, device="cuda") for _ in range(2)]

    def fn(x):
        y = x @ w
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        y = y + 1
        dbo.dbo_yield_and_switch_from_comm_to_compute()
        return y @ w

    dbo.run_ubatches(fn, xs, device=device)  # warm-up outside capture (allocator, kernels)
    torch.cuda.synchronize()
    graph = device.graph()
    outs = dbo.run_ubatches(fn, xs, device=device, graph=graph)
    for x in xs:
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for x, o in zip(xs, outs):
        torch.testing.assert_close(o, ((x @ w) + 1) @ w)
