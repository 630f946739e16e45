"""SGLang's two-batch overlap splitting a prefill of prompt lengths [100, 2000] at the request
boundary nearest half the tokens (#6328): one ubatch gets 100 tokens, the other 2000, so
nothing of the heavy one overlaps. Judged on the simulated H200 by a DeepSeek-V3-shaped step:
the per-ubatch compute time and the DBO gain. The fix cuts inside the long request at the
token midpoint (SGLang's two-chunk split)."""

from __future__ import annotations

from dbo.sim import SimDevice
from dbo.sim.records import COMPUTE
from dbo.split import UBatchSlice, maybe_create_ubatch_slices
from scenarios.bugs.registry import Verdict, bug
from scenarios.harness import measure
from scenarios.model import Batch, MoEModel, preset
from scenarios.steps import prepare, serial_step, ubatched_step
from workspace import reset_workspace_manager

PROMPTS = (100, 2000)
LAYERS = 2  # enough for the overlap to show; the heavy ubatch's share does not change
IMBALANCE = 2.0  # a ubatch with this many times the other's compute cannot be hidden


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


@bug(
    "sglang-6328-unbalanced-prefill",
    engine="SGLang",
    ref="sglang#6328",
    cause="a prefill of prompt lengths [100, 2000] is split at a request boundary, leaving "
    "one ubatch 20x the other's tokens, so its compute has nothing to overlap with "
    "(performance)",
    caught_by="the simulated timeline (per-ubatch compute, DBO gain)",
    evidence="heavier",
)
def unbalanced_prefill(buggy: bool) -> Verdict:
    config = preset("deepseek-v3", num_layers=LAYERS, num_dense_layers=0)
    batch = Batch((0, PROMPTS[0], sum(PROMPTS)), (0, 0))
    model = MoEModel(config, batch)
    x = model.inputs()
    device = SimDevice("h200", tensor_device="meta")
    serial = serial_step(model, x, device, mode="ht")
    dbo_step = ubatched_step(model, x, device, mode="ht", slices=_slices(buggy))
    prepare(device.torch_device, 2, [serial.output, dbo_step.output])
    try:
        serial_us = measure(serial.output, device).step_us
        run = measure(dbo_step.output, device)
    finally:
        reset_workspace_manager()  # the next entry (or dbo.verify) makes its own
    per = [_compute_us(run.records, k) for k in range(2)]
    ratio = max(per) / max(min(per), 1e-9)
    gain = serial_us / run.step_us if run.step_us > 0 else float("nan")
    heavy = per.index(max(per))
    caught = ratio > IMBALANCE
    balance = f"ubatch {heavy} is {ratio:.1f}x heavier" if caught else "balanced"
    message = (
        f"{balance} in compute ({per[0]:.0f} vs {per[1]:.0f} us per ubatch); simulated DBO "
        f"gain {gain:.2f}x"
    )
    return Verdict(caught, "the simulated timeline", message)


__all__ = ["unbalanced_prefill"]
