"""Many steps of random but matching yield patterns give the serial run's outputs."""

from __future__ import annotations

import random

import pytest
import torch

import dbo
from dbo import ubatching
from dbo.sim import SimDevice

_HELPERS = {
    "yield": lambda: dbo.dbo_yield(),
    "to_comm": lambda: dbo.dbo_yield_and_switch_from_compute_to_comm(),
    "to_compute": lambda: dbo.dbo_yield_and_switch_from_comm_to_compute(),
}


def _random_schedule(rng: random.Random, phases: int) -> list[str]:
    """A legal sequence of yields: the switch helpers must alternate compute -> comm."""
    schedule, on_comm = [], False
    for _ in range(phases):
        choices = ["yield", "to_compute" if on_comm else "to_comm"]
        pick = rng.choice(choices)
        on_comm = {"yield": on_comm, "to_comm": True, "to_compute": False}[pick]
        schedule.append(pick)
    if on_comm:
        schedule.append("to_compute")
    return schedule


def _work(x: torch.Tensor, schedule: list[str]) -> torch.Tensor:
    for k, helper in enumerate(schedule):
        x = x * 1.5 + k  # a different op per phase, so a misordered phase shows in the value
        _HELPERS[helper]()
    return x.sum(dim=1, keepdim=True) - x


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num", [2, 3, 4])
def test_thousand_random_steps_match_the_serial_run(num):
    rng = random.Random(1234 + num)
    device = SimDevice(check_races=False)
    for _ in range(1000):
        schedule = _random_schedule(rng, rng.randint(0, 4))
        inputs = [torch.randn(rng.randint(1, 4), 3, dtype=torch.float64) for _ in range(num)]
        serial = [_work(x, schedule) for x in inputs]
        outs = dbo.run_ubatches(lambda x: _work(x, schedule), inputs, device=device)
        assert all(torch.equal(o, s) for o, s in zip(outs, serial))
        assert not ubatching._THREAD_ID_TO_CONTEXT
