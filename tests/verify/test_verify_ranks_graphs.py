"""`dbo.verify_ranks(..., graphs=)`: each gloo rank serves its step through its own CUDA graphs,
checked against the token counts the ranks agreed on over the real group (none passed by
hand)."""

from __future__ import annotations

import pytest
import torch

import dbo
from dbo.graph_dispatch import CudagraphDispatcher, CUDAGraphMode
from dbo.sim import SimDevice
from dbo.verification.graph_runner import CUDAGraphRunner

HIDDEN = 4


def step(batch: torch.Tensor) -> torch.Tensor:
    dbo.dbo_yield()
    return batch * 2 + 1


def graphs(rank: int, world_size: int) -> CUDAGraphRunner:
    """FULL graphs for mixed batches of 2, 4 and 8 tokens, captured in the rank."""
    dispatcher = CudagraphDispatcher(CUDAGraphMode.FULL, [2, 4, 8])
    runner = CUDAGraphRunner(step, dispatcher, device=SimDevice())
    runner.capture_all(lambda key: torch.zeros(key.num_tokens, HIDDEN, dtype=torch.float64))
    return runner


def rows(count: int) -> torch.Tensor:
    return torch.arange(count * HIDDEN, dtype=torch.float64).reshape(count, HIDDEN)


@pytest.mark.timeout(60)
def test_ranks_replaying_the_agreed_size_are_clean_and_replay_full_graphs() -> None:
    report = dbo.verify_ranks(step, [rows(8), rows(8)], graphs=graphs)
    assert report.ok, report.describe()
    for verdict in report.ranks:
        (replay,) = verdict.report["graphs"]
        assert replay["mode"] == "FULL" and replay["key"]["num_tokens"] == 8


@pytest.mark.timeout(60)
def test_a_rank_replaying_another_size_is_named_with_the_count_its_peer_brought() -> None:
    # Rank 1 keys its 2 tokens as they are; rank 0's 8, learnt in the agreement, set the size.
    report = dbo.verify_ranks(step, [rows(8), rows(2)], graphs=graphs)
    assert not report.ok and report.out_of_step is None
    assert report.ranks[0].ok and not report.ranks[1].ok
    assert "DP size: the step runs a graph of 2 tokens, but the ranks agreed on 8 tokens" in (
        report.ranks[1].headline()
    )


@pytest.mark.timeout(60)
def test_a_captured_runner_is_copied_into_every_rank() -> None:
    report = dbo.verify_ranks(step, [rows(4), rows(4)], graphs=graphs(0, 1))
    assert report.ok, report.describe()


def test_graphs_of_another_type_are_refused_before_any_rank_starts() -> None:
    with pytest.raises(TypeError, match="graphs must be a CUDAGraphRunner"):
        dbo.verify_ranks(step, [rows(8), rows(8)], graphs="full")


@pytest.mark.timeout(60)
def test_a_graphs_factory_that_fails_is_the_ranks_verdict() -> None:
    def broken(rank: int, world_size: int) -> CUDAGraphRunner:
        raise RuntimeError("no capture sizes configured")

    report = dbo.verify_ranks(step, [rows(8), rows(8)], graphs=broken)
    assert not report.ok
    assert "its CUDA graphs were not ready: RuntimeError: no capture sizes configured" in (
        report.ranks[0].headline()
    )
