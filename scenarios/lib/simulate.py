"""One whole model step on a fresh simulated device, as an engine runs it, and its times: what
`fidelity`, `gpu-check` and the tests share (`simulate_step`, `step_gain`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dbo.sim import SimDevice
from dbo.sim.families import GEMM_OPS
from dbo.sim.hardware import HardwareProfile
from dbo.sim.options import EngineKnobs, SimOptions
from dbo.sim.records import COMM, COMPUTE, OpRecord
from dbo.sim.report import summarize
from scenarios.model import Batch, ModelConfig, MoEModel
from scenarios.steps import prepare, serial_step, ubatched_step
from workspace import reset_workspace_manager

__all__ = ["StepTimes", "simulate_step", "step_gain", "step_times"]


@dataclass(frozen=True)
class StepTimes:
    """One simulated step (a summary of its records)."""

    step_us: float
    compute_us: float
    comm_us: float
    exposed_comm_us: float
    host_bound_fraction: float
    gemm_us: float  # summed device time of the GEMM kernels
    num_ops: int
    # Host time the step itself took to issue (launches, baton passes, one graph launch when
    # replayed), without the final wait for the device: when it is under step_us the host
    # stays ahead of the device, and removing launch costs (graph replay) cannot shorten it.
    host_us: float = 0.0
    fallback_fraction: float = 0.0  # share of device-op time priced by the roofline


def step_times(records: Sequence[OpRecord], host_us: float = 0.0) -> StepTimes:
    s = summarize(records)
    gemm = sum(r.end_us - r.start_us for r in records if r.kind == COMPUTE and r.name in GEMM_OPS)
    ops = sum(1 for r in records if r.kind in (COMPUTE, COMM))
    return StepTimes(
        s.step_us,
        s.compute_us,
        s.comm_us,
        s.exposed_comm_us,
        s.host_bound_fraction,
        gemm,
        ops,
        host_us,
        s.fallback_fraction,
    )


def simulate_step(
    config: ModelConfig,
    batch: Batch,
    mode: str,
    *,
    profile: str | HardwareProfile,
    num_ubatches: int | None,
    graph: bool = False,
    timeout_s: float = 300.0,
    engine: EngineKnobs | None = None,
) -> StepTimes:
    """One step of `config` (shapes only) on a fresh simulated device: serial when
    `num_ubatches` is None, else DBO. As an engine runs it: an eager warm-up, the workspace
    locked, then the measured step, eager or (graph=True) captured once and replayed."""
    if config.tensor_device != "meta":
        config = config.with_(tensor_device="meta")
    device = SimDevice(SimOptions(profile, tensor_device="meta", engine=engine or EngineKnobs()))
    model = MoEModel(config, batch)
    x = model.inputs()
    if num_ubatches is None:
        step = serial_step(model, x, device, mode=mode)
    else:
        step = ubatched_step(
            model, x, device, mode=mode, num_ubatches=num_ubatches, timeout_s=timeout_s
        )
    try:
        prepare(device.torch_device, step.num_ubatches, [step])
        device.synchronize()
        if graph:
            g = device.graph()
            step.capture(g)
            device.synchronize()
            device.reset()
            g.replay()
        else:
            device.reset()
            step()
        host_us = device.host_time_us  # the clocks started at 0 with the reset
        device.synchronize()
        return step_times(device.timeline, host_us)
    finally:
        reset_workspace_manager()


def step_gain(
    config: ModelConfig,
    batch: Batch,
    mode: str,
    *,
    profile: Any,
    graph: bool,
    engine: EngineKnobs | None = None,
) -> tuple[float, StepTimes, StepTimes]:
    """The DBO step's gain over the serial one, in percent, and both steps' times."""
    serial = simulate_step(
        config, batch, mode, profile=profile, num_ubatches=None, graph=graph, engine=engine
    )
    ubatched = simulate_step(
        config, batch, mode, profile=profile, num_ubatches=2, graph=graph, engine=engine
    )
    return (serial.step_us / ubatched.step_us - 1.0) * 100.0, serial, ubatched
