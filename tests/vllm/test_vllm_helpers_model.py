"""A user's model that imports its dbo_* helpers from vLLM 0.33's own module verifies on the
simulated GPU, under vLLM's ring, with the race checker (the example in docs/vllm-parity.md)."""

from __future__ import annotations

import pytest
import torch

import dbo

ubatching = pytest.importorskip(
    "vllm.v1.worker.ubatching", reason="vLLM 0.33 is not installed: make vllm-oracle"
)
dbo_switch_to_comm = ubatching.dbo_switch_to_comm
dbo_switch_to_compute_sync = ubatching.dbo_switch_to_compute_sync
dbo_yield = ubatching.dbo_yield
dbo_yield_and_switch_from_comm_to_compute = ubatching.dbo_yield_and_switch_from_comm_to_compute
dbo_yield_and_switch_from_compute_to_comm = ubatching.dbo_yield_and_switch_from_compute_to_comm

W = torch.randn(128, 128, generator=torch.Generator().manual_seed(0), dtype=torch.float64) / 12


def forward(x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ W)
    dbo_yield_and_switch_from_compute_to_comm()
    with dbo.current_device().comm_region("dispatch", nbytes=h.numel() * 8):
        sent = h * 1.0
    dbo_yield_and_switch_from_comm_to_compute()
    y = sent @ W
    with dbo.current_device().comm_region("combine", nbytes=y.numel() * 8):
        back = y * 1.0
    dbo_switch_to_compute_sync()
    return x + back


def racy_forward(x: torch.Tensor) -> torch.Tensor:
    """The comm stream reads h without the compute-done wait: a race the checker reports."""
    h = torch.tanh(x @ W)
    dbo_yield()
    dbo_switch_to_comm()
    sent = h * 1.0
    dbo_switch_to_compute_sync()
    return x + sent


def batch() -> torch.Tensor:
    return torch.randn(32, 128, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@pytest.mark.timeout(120)
def test_a_model_on_vllms_helpers_verifies_under_vllms_ring():
    report = dbo.verify(forward, batch(), runtime="vllm")
    assert report.ok, report.describe()
    assert report.runtime == "vllm" and report.comm_us > 0


@pytest.mark.timeout(120)
def test_a_race_in_a_model_on_vllms_helpers_is_reported():
    report = dbo.verify(racy_forward, batch(), runtime="vllm")
    assert not report.ok
    assert report.races.ubatched
