"""Many steps of random but matching yield patterns: the ubatches' phases interleave as the
ring says, and the outputs equal the serial run's."""

from __future__ import annotations

import random

import pytest
import torch

import dbo
from dbo import ubatching
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions

# Tests here start threads: each gets this bound unless it carries its own, so a hang fails
# the test, never the whole run.
pytestmark = pytest.mark.timeout(120)

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


def _work(
    x: torch.Tensor, schedule: list[str], log: list | None = None, ubatch: int = 0
) -> torch.Tensor:
    """Phase k of `schedule` ends in its yield helper; `log` hears (ubatch, phase) as each
    phase runs (the last phase, after the last yield, included)."""
    for k, helper in enumerate(schedule):
        if log is not None:
            log.append((ubatch, k))
        x = x * 1.5 + k
        _HELPERS[helper]()
    if log is not None:
        log.append((ubatch, len(schedule)))
    return x.sum(dim=1, keepdim=True) - x


def _ring_order(num: int, schedule: list[str]) -> list[tuple[int, int]]:
    """One baton round a ring: every phase runs in ubatch 0, 1, ..., N-1 before the next."""
    return [(u, k) for k in range(len(schedule) + 1) for u in range(num)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num", [2, 3, 4])
def test_thousand_random_steps_follow_the_ring_and_match_the_serial_run(num):
    rng = random.Random(1234 + num)
    device = SimDevice(SimOptions(check_races=False))
    for _ in range(1000):
        schedule = _random_schedule(rng, rng.randint(0, 4))
        inputs = [torch.randn(rng.randint(1, 4), 3, dtype=torch.float64) for _ in range(num)]
        serial = [_work(x, schedule) for x in inputs]
        log: list = []
        outs = dbo.run_ubatches(
            lambda ux, schedule=schedule, log=log: _work(ux[1], schedule, log, ux[0]),
            list(enumerate(inputs)),
            device=device,
        )
        assert log == _ring_order(num, schedule), schedule
        assert all(torch.equal(o, s) for o, s in zip(outs, serial))
        assert not ubatching.ubatch_step_active()
