"""SGLang's two-batch overlap splitting a prefill of prompt lengths [100, 2000] at the request
boundary nearest half the tokens (#6328): one ubatch gets 100 tokens, the other 2000, so
nothing of the heavy one overlaps. Judged on the simulated H200 by a DeepSeek-V3-shaped step:
the DBO gain decides (a split that loses time, or most of what the balanced split gains, is
caught), and the per-ubatch compute times say why. The fix cuts inside the long request at the
token midpoint (SGLang's two-chunk split)."""

from __future__ import annotations

from dataclasses import dataclass

from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from dbo.sim.records import COMPUTE
from dbo.split import UBatchSlice, maybe_create_ubatch_slices
from scenarios.bugs.registry import Verdict, bug_pair
from scenarios.harness import measure
from scenarios.model import Batch, MoEModel, preset
from scenarios.steps import prepare, serial_step, ubatched_step
from workspace import reset_workspace_manager

PROMPTS = (100, 2000)
LAYERS = 2  # enough for the overlap to show; the heavy ubatch's share does not change
MIN_GAIN = 1.05  # a fixed split must gain at least this much over the serial step
LOST_SHARE = 0.5  # a split keeping under this share of the fixed split's gain is the bug


def _slices(buggy: bool) -> list[UBatchSlice]:
    total = sum(PROMPTS)
    if buggy:  # the request boundary nearest total / 2: after request 0
        return [
            UBatchSlice(slice(0, 1), slice(0, PROMPTS[0])),
            UBatchSlice(slice(1, 2), slice(PROMPTS[0], total)),
        ]
    slices, _ = maybe_create_ubatch_slices(True, list(PROMPTS), total, len(PROMPTS), 2)
    return slices


def _compute_us(records, ubatch: int) -> float:
    return sum(r.dur_us for r in records if r.kind == COMPUTE and r.ubatch == ubatch)


@dataclass(frozen=True)
class Timeline:
    """One split's simulated step: the DBO gain (serial step time over ubatched step time)
    and each ubatch's compute time."""

    gain: float
    compute_us: list[float]

    def describe(self) -> str:
        heavy = self.compute_us.index(max(self.compute_us))
        light = 1 - heavy
        ratio = self.compute_us[heavy] / max(self.compute_us[light], 1e-9)
        return (
            f"DBO gain {self.gain:.2f}x: ubatch {heavy}'s compute is {ratio:.1f}x ubatch "
            f"{light}'s ({self.compute_us[heavy]:.0f} vs {self.compute_us[light]:.0f} us)"
        )


def simulated_timeline(buggy: bool) -> Timeline:
    """The simulated H200 step of a DeepSeek-V3-shaped prefill, split the buggy or the
    fixed way."""
    config = preset("deepseek-v3", num_layers=LAYERS, num_dense_layers=0)
    batch = Batch((0, PROMPTS[0], sum(PROMPTS)), (0, 0))
    model = MoEModel(config, batch)
    x = model.inputs()
    device = SimDevice(SimOptions("h200", tensor_device="meta"))
    serial = serial_step(model, x, device, mode="ht")
    dbo_step = ubatched_step(model, x, device, mode="ht", slices=_slices(buggy))
    prepare(device.torch_device, 2, [serial.output, dbo_step.output])
    try:
        serial_us = measure(serial.output, device).step_us
        run = measure(dbo_step.output, device)
    finally:
        reset_workspace_manager()  # the next entry (or dbo.verify) makes its own
    gain = serial_us / run.step_us if run.step_us > 0 else float("nan")
    return Timeline(gain, [_compute_us(run.records, k) for k in range(2)])


@bug_pair(
    "sglang-6328-unbalanced-prefill",
    engine="SGLang",
    ref="sglang#6328",
    cause="a prefill of prompt lengths [100, 2000] is split at a request boundary, leaving "
    "one ubatch 20x the other's tokens, so its compute has nothing to overlap with "
    "(performance)",
    caught_by="the simulated timeline (DBO gain)",
    evidence="ubatch 1's compute is",
)
def unbalanced_prefill() -> tuple[Verdict, Verdict]:
    buggy, fixed = simulated_timeline(True), simulated_timeline(False)
    # A split that loses time, or gives up most of what a balanced split gains, is the bug;
    # a fix must gain.
    lost = buggy.gain < 1.0 or buggy.gain - 1.0 < LOST_SHARE * (fixed.gain - 1.0)
    against = f"; the token-midpoint split gains {fixed.gain:.2f}x"
    caught = Verdict(lost, "the simulated timeline", buggy.describe() + against)
    clean = Verdict(fixed.gain < MIN_GAIN, "the simulated timeline", fixed.describe())
    return caught, clean


__all__ = ["Timeline", "simulated_timeline", "unbalanced_prefill"]
