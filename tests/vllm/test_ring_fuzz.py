"""vLLM 0.33's ring and dbo-sim's on random programs of dbo_* calls: the same outputs, op order
between hand-offs, stream per op, events recorded and waited, recv hooks run in the same
places (`dbo.verification.runtimes.compare_runtimes`)."""

from __future__ import annotations

import functools
import random

import pytest
import torch

import dbo
from dbo.runner import merge_outputs
from dbo.sim import SimDevice
from dbo.verification import split_inputs
from dbo.verification.runtimes import compare_runtimes

pytest.importorskip(
    "vllm.v1.worker.ubatching", reason="vLLM 0.33 is not installed: make vllm-oracle"
)

W = torch.randn(16, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64) / 4


def random_program(rng: random.Random) -> list[str]:
    """Legal calls only: the yield-and-switch helpers on the stream they expect, and a recv
    hook never registered while the target's previous one may still be pending."""
    program, on_comm, hook_before = [], False, False
    for _ in range(rng.randint(3, 12)):
        choices = ["compute_op", "comm_op", "yield"]
        choices.append("yield_comm_to_compute" if on_comm else "yield_compute_to_comm")
        choices += ["switch_to_compute_sync" if on_comm else "switch_to_comm_sync"]
        if not hook_before:
            choices.append("hook")
        step = rng.choice(choices)
        program.append(step)
        if step in ("yield_compute_to_comm", "switch_to_comm_sync"):
            on_comm = True
        if step in ("yield_comm_to_compute", "switch_to_compute_sync"):
            on_comm = False
        hook_before = step == "hook" or (hook_before and "yield" not in step)
    return program


HELPERS = {
    "yield": dbo.dbo_yield,
    "yield_compute_to_comm": dbo.dbo_yield_and_switch_from_compute_to_comm,
    "yield_comm_to_compute": dbo.dbo_yield_and_switch_from_comm_to_compute,
    "switch_to_comm_sync": dbo.dbo_switch_to_comm_sync,
    "switch_to_compute_sync": dbo.dbo_switch_to_compute_sync,
}


def run_program(program: list[str], x: torch.Tensor) -> torch.Tensor:
    device = dbo.current_device()
    for step in program:
        if step == "compute_op":
            x = torch.tanh(x @ W)
        elif step == "comm_op":
            with device.comm_region("dispatch", nbytes=x.numel() * 8):
                x = x * 1.0
        elif step == "hook":
            with device.comm_region("send", nbytes=x.numel() * 8, mode="ll") as handle:
                x = x + 1.0
            dbo.dbo_register_recv_hook(lambda h=handle: h.event.wait())
            dbo.dbo_yield()
            dbo.dbo_maybe_run_recv_hook()
        else:
            HELPERS[step]()
    return x


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", range(8))
def test_both_rings_run_a_random_program_alike(seed):
    rng = random.Random(seed)
    program = random_program(rng)
    batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    n = rng.choice([2, 3])
    differences = compare_runtimes(
        lambda x: run_program(program, x),
        batch,
        lambda b: split_inputs(b, n),
        merge_outputs,
        SimDevice(),
        timeout=20.0,
    )
    assert differences == [], (program, n)


@pytest.mark.timeout(120)
def test_the_random_programs_run_to_the_end_under_both_rings():
    """The comparison above is of finished steps: the programs must not fail."""
    from dbo.verification.vllm_runtime import run_vllm_ubatches

    x = torch.ones(4, 16, dtype=torch.float64)
    for seed in range(8):
        program = random_program(random.Random(seed))
        for run in (run_vllm_ubatches, dbo.run_ubatches):
            step = functools.partial(run_program, program)
            outputs = run(step, [x[:2], x[2:]], device=SimDevice())
            assert len(outputs) == 2
