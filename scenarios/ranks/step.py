"""One rank's DBO step: its device, its EP group, and a measured step opened by the EP handshake."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dbo.comm import EPGroup
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from dbo.split import UBatchSlice
from dbo.streams import CudaDevice, Device
from scenarios.harness import RunOptions, StepRun, measure
from scenarios.model import ModelConfig, MoEModel, preset
from scenarios.ranks.records import RankEnv
from scenarios.steps import prepare, serial_step, ubatched_step

__all__ = ["TOLERANCE", "ep_group_for", "rank_device", "run_rank_step", "tiny_config"]

# Float64 on both sides: a rank's step must reproduce its single-process run to rounding.
TOLERANCE = 1e-9


def rank_device(env: RankEnv, opts: RunOptions, tensor_device: str = "cpu") -> Device:
    """This rank's device: a simulated GPU labelled with the rank, or its own CUDA device."""
    if opts.device == "sim":
        return SimDevice(SimOptions(opts.profile, rank=env.rank, tensor_device=tensor_device))
    return CudaDevice(env.local_rank)


def tiny_config(env: RankEnv) -> ModelConfig:
    """The tiny model with EP spanning the ranks (each owns num_experts / world experts); under
    --device cuda the rank's tensors live on its own GPU, so the all-to-all runs over NCCL."""
    config = preset("tiny", ep_size=env.world)
    if env.cuda_group is not None:
        config = config.with_(tensor_device=f"cuda:{env.local_rank}")
    return config


def ep_group_for(env: RankEnv, config: ModelConfig, opts: RunOptions) -> EPGroup:
    """The EP group over every rank: CUDA tensors travel over the NCCL group, CPU ones over gloo."""
    group = env.cuda_group if config.tensor_device.startswith("cuda") else env.group
    return EPGroup(group, num_experts=config.num_experts, store=env.store, timeout_s=opts.timeout_s)


def run_rank_step(
    model: MoEModel,
    x: torch.Tensor,
    *,
    device: Device,
    ep: EPGroup,
    slices: Sequence[UBatchSlice] | None,
    mode: str,
    timeout_s: float,
    warmups: int = 1,
) -> StepRun:
    """`harness.run_step` for one rank of several: warm up, lock the workspace, measure; each
    step opened by the EP handshake (`ep.step`), ubatched over `slices` (None: serially)."""
    if slices is None:
        run = serial_step(model, x, device, mode=mode)
    else:
        run = ubatched_step(model, x, device, mode=mode, slices=slices, timeout_s=timeout_s)

    def step() -> torch.Tensor:
        with ep.step(run.num_ubatches):
            return run.output()

    prepare(device.torch_device, run.num_ubatches, [step], rounds=warmups)
    return measure(step, device)
