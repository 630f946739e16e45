"""The runtime on real CUDA streams: skipped cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

import dbo
from dbo.streams import CudaDevice

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_cuda_device_current_stream_is_the_one_set():
    device = CudaDevice()
    s = device.Stream("s")
    with dbo.stream_context(s):
        assert device.current_stream() is s
        assert torch.cuda.current_stream() == s.raw


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
