"""The adversarial order turns a race into the wrong values it would compute on a GPU: each
seeded race program of `race-check` either changes what it writes when its streams run in
the adversarial order, or is explicitly benign; the race-free twins never change."""

from __future__ import annotations

import pytest
import torch

from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from dbo.sim.reorder import run_adversarially
from scenarios.tools.race_check_run import PROGRAMS

# Races whose values do not depend on the order: x*2*3 == x*3*2, and a graph keeps the
# freed tensor alive, so the allocator does not hand its memory on while captured.
BENIGN_HERE = {"_foreach_mul_ on unordered streams", "allocator reuse, no record_stream"}


def reorder(program):
    device = SimDevice(SimOptions("h200", tensor_device="cpu"))
    return run_adversarially(device, lambda: program.body(device))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("program", [p for p in PROGRAMS if p.expect_race], ids=lambda p: p.name)
def test_each_seeded_race_changes_values_or_is_benign_here(program):
    outcome = reorder(program)
    text = outcome.describe()
    if program.name in BENIGN_HERE:
        assert not outcome.changed and "benign" in text, text
    else:
        assert outcome.changed and outcome.changes, text
        assert "the race changes values" in text and "bytes differ" in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "program", [p for p in PROGRAMS if not p.expect_race], ids=lambda p: p.name
)
def test_a_race_free_program_writes_the_same_in_any_legal_order(program):
    outcome = reorder(program)
    assert not outcome.changed, outcome.describe()
    assert "benign here" in outcome.describe()


@pytest.mark.timeout(60)
def test_the_adversarial_order_runs_the_later_side_of_a_race_first():
    outcome = reorder(PROGRAMS[0])  # a: the comm reads what compute writes, without a wait
    assert outcome.races == 2 and outcome.moved > 0


@pytest.mark.timeout(60)
def test_the_values_read_after_each_order_are_returned():
    device = SimDevice(SimOptions("h200", tensor_device="cpu"))
    program = PROGRAMS[0]
    outcome = run_adversarially(device, lambda: program.body(device), read=lambda _: "read")
    assert outcome.issue_value == outcome.adversarial_value == "read"


@pytest.mark.timeout(60)
def test_an_order_dependent_update_changes_values_and_memory_is_left_as_captured():
    device = SimDevice(SimOptions("h200", tensor_device="cpu"))
    buf = torch.arange(8.0)

    def body() -> None:
        with device.thread_scope(0):
            a, b = device.Stream("a"), device.Stream("b")
            device.set_stream(a)
            buf.mul_(2)
            device.set_stream(b)
            buf.add_(1)  # no wait: (x * 2) + 1 on issue order, (x + 1) * 2 the other way

    outcome = run_adversarially(device, body)
    assert outcome.changed and outcome.changes[0].written_by.startswith("aten::mul_")
    assert torch.equal(buf, torch.arange(8.0) * 2 + 1)  # as the captured run left it
