"""The README's example test: run with `pytest examples/test_my_moe.py` where dbo-sim is
installed (its pytest plugin gives the fixtures), or add
`-p dbo.verification.pytest_plugin` elsewhere."""

import pytest

from examples.my_moe import MyMoE, make_batch


def test_my_moe_overlaps_correctly(dbo_verify, sim_device):
    report = dbo_verify(MyMoE().forward, make_batch(), device=sim_device)
    assert report.ok  # dbo_verify has already failed the test, with the report, if not


@pytest.mark.parametrize("dbo_workspace", [3], indirect=True)  # 3 slots, reset after the test
def test_three_ubatches(dbo_verify, dbo_workspace):
    # A GEMM over a third of the rows may block its sums differently: allow last-bit noise.
    dbo_verify(MyMoE().forward, make_batch(), num_ubatches=3, atol=1e-9)
