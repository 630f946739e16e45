"""The EP group's shape has one source: the recording. Its size is the group the step's
all-to-alls were issued over, its GPUs per node the recording profile's; the replay reads both
from the program, so neither can be given beside it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dbo.sim import SimDevice
from dbo.sim.cluster import simulate_cluster
from dbo.sim.cluster_program import StreamProgram, record_program
from dbo.sim.hardware import H800, HardwareProfile
from dbo.sim.options import SimOptions
from dbo.sim.routing import balanced, contiguous
from scenarios.lib.cluster_step import StepSpec
from scenarios.model import preset


def _exchange(*ep_sizes: int, profile: HardwareProfile = H800, mode: str = "ht") -> StreamProgram:
    """A step of one dispatch per EP size given, each followed by a GEMM, recorded."""
    device = SimDevice(SimOptions(profile, tensor_device="meta"))
    a = torch.empty(256, 1024, device="meta", dtype=torch.bfloat16)
    w = torch.empty(1024, 1024, device="meta", dtype=torch.bfloat16)

    def step() -> None:
        with device.thread_scope(0):
            for ep in ep_sizes:
                with device.comm_region("dispatch", nbytes=4_000_000, mode=mode, ep_size=ep):
                    pass
                a @ w

    return record_program(step, device)


@pytest.mark.parametrize("ep", [8, 16, 64])
def test_a_program_is_as_large_as_the_group_its_all_to_alls_spanned(ep):
    assert _exchange(ep).ep_size == ep


def test_a_step_whose_exchange_never_leaves_the_gpu_is_one_rank():
    assert _exchange().ep_size == 1


def test_a_step_exchanging_over_two_group_sizes_is_refused_at_recording():
    with pytest.raises(ValueError, match=r"span EP sizes \[8, 16\]"):
        _exchange(8, 16)


def test_the_ep_size_and_gpus_per_node_cannot_be_given_beside_the_recording():
    """The old second roads: `record_program(ep_size=)` and `StepSpec(gpus_per_node=)`
    could disagree with what the step was priced at; neither is accepted any more."""
    with pytest.raises(TypeError, match="ep_size"):
        record_program(lambda: None, SimDevice(SimOptions(H800)), ep_size=8)
    with pytest.raises(TypeError, match="gpus_per_node"):
        StepSpec(preset("tiny"), "decode", 16, None, H800, gpus_per_node=4)
    with pytest.raises(TypeError, match="gpus_per_node"):
        simulate_cluster(_exchange(16), balanced(1, 256), contiguous(256, 16), gpus_per_node=4)


def test_a_placement_over_another_rank_count_is_refused_before_the_replay():
    with pytest.raises(ValueError, match="over 8 ranks, but the step was recorded .* EP 16"):
        simulate_cluster(_exchange(16), balanced(1, 256), contiguous(256, 8))


@pytest.mark.parametrize("gpus_per_node,crosses", [(8, False), (4, True)])
def test_the_replay_s_nodes_are_the_recording_profile_s(gpus_per_node, crosses):
    program = _exchange(8, profile=replace(H800, gpus_per_node=gpus_per_node))
    result = simulate_cluster(program, balanced(1, 256, 8), contiguous(256, 8))
    assert result.gpus_per_node == gpus_per_node
    assert (result.collectives[0].rdma_mb > 0).all() == crosses
