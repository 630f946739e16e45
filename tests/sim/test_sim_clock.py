"""The calibrated clock: kernel-table interpolation, the op cost registry, the roofline fallback
and its reported share, the host model, and the DBO gain's sign on one GPU."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from dbo.sim import B200, H200, SimDevice
from dbo.sim.cost import ROOFLINE, OpCost, register_op_cost, unregister_op_cost
from dbo.sim.families import GEMM_OPS
from dbo.sim.options import SimOptions
from dbo.sim.report import summarize
from dbo.sim.tables import KernelRow, KernelTable, interp_loglog, load_table
from scenarios.lib.configs import check_cases
from scenarios.lib.simulate import simulate_step
from scenarios.model import Batch

pytestmark = pytest.mark.timeout(120)


def mm_row(m: int, n: int, k: int, us: float) -> KernelRow:
    return KernelRow("mm", m, n, k, 1, "bf16", us, 2.0 * m * n * k, 2.0 * (m * k + k * n + m * n))


# Two weight shapes, three row counts each; times chosen so every slope is visible.
TABLE = KernelTable(
    "test",
    [
        mm_row(16, 1024, 1024, 4.0),
        mm_row(256, 1024, 1024, 8.0),
        mm_row(4096, 1024, 1024, 128.0),
        mm_row(16, 4096, 1024, 16.0),
        mm_row(256, 4096, 1024, 32.0),
        mm_row(4096, 4096, 1024, 512.0),
        KernelRow("copy", 1 << 20, 1, 1, 1, "bf16", 2.0, 0, 4 << 20),
        KernelRow("copy", 1 << 24, 1, 1, 1, "bf16", 16.0, 0, 4 << 24),
    ],
)


# -- interpolation -------------------------------------------------------------------------------


def test_between_points_the_time_is_log_log_linear_not_the_nearest_point() -> None:
    # m = 64 is a quarter of the way from 16 to 256 in log space: 4 us * 2 ** (1 / 2)
    assert TABLE.estimate("mm", m=64, n=1024, k=1024) == pytest.approx(4.0 * 2**0.5)
    # a bytes curve the same way: the geometric middle of 4 MiB and 64 MiB
    assert TABLE.estimate("copy", nbytes=16 << 20) == pytest.approx(2.0 * 8**0.5)


def test_measured_points_are_reproduced_exactly() -> None:
    assert TABLE.estimate("mm", m=256, n=4096, k=1024) == pytest.approx(32.0)
    h200 = load_table("h200")
    for row in h200.rows:
        if row.op == "mm":
            assert h200.estimate(
                "mm", m=row.m, n=row.n, k=row.k, nbytes=row.bytes
            ) == pytest.approx(row.us)


def test_beyond_the_largest_point_time_grows_linearly_and_below_the_smallest_it_floors() -> None:
    assert TABLE.estimate("mm", m=8192, n=1024, k=1024) == pytest.approx(256.0)
    # first segment: 4 -> 8 us over 16 -> 256 rows (slope 1/4): one row is 4 * 16 ** -0.25
    assert TABLE.estimate("mm", m=1, n=1024, k=1024) == pytest.approx(2.0)
    # a curve whose first segment falls with size is clamped flat below it, never dearer
    assert interp_loglog([1.0, 2.0], [5.0, 4.0], 0.5) == pytest.approx(5.0)


def test_a_weight_size_between_two_measured_ones_blends_both_series() -> None:
    # n*k = 2M sits half-way (log) between 1M and 4M; each series scaled by the weight ratio
    lo, hi = 8.0 * 2, 32.0 / 2
    assert TABLE.estimate("mm", m=256, n=2048, k=1024) == pytest.approx(math.sqrt(lo * hi))
    # beyond every series: the nearest one, scaled by the weight ratio
    assert TABLE.estimate("mm", m=256, n=8192, k=1024) == pytest.approx(64.0)


def test_a_family_the_table_lacks_is_not_estimated() -> None:
    assert TABLE.estimate("grouped_mm", m=64, n=1024, k=1024, groups=8) is None
    assert TABLE.estimate("sort_topk", nbytes=1 << 20) is None


# -- the registry, the fallback and its share -----------------------------------------------------


def _mm(device: SimDevice, dtype: torch.dtype, m: int = 512) -> None:
    a = torch.empty(m, 4096, dtype=dtype, device="meta")
    b = torch.empty(4096, 4096, dtype=dtype, device="meta")
    with device.thread_scope(None):
        a @ b


def test_covered_ops_are_priced_by_the_table_and_others_by_the_roofline() -> None:
    d = SimDevice(SimOptions("h200", tensor_device="meta"))
    _mm(d, torch.bfloat16)
    _mm(d, torch.float32)  # the table holds bf16 GEMMs only
    table_op, roof_op = d.timeline
    assert table_op.args["cost"] == "table:mm"
    assert table_op.dur_us == pytest.approx(
        load_table("h200").estimate("mm", m=512, n=4096, k=4096, nbytes=table_op.bytes)
    )
    assert roof_op.args["cost"] == ROOFLINE and roof_op.args["fallback_us"] == roof_op.dur_us


def test_the_summary_reports_the_share_of_device_time_the_fallback_priced() -> None:
    d = SimDevice(SimOptions("h200", tensor_device="meta"))
    _mm(d, torch.bfloat16)
    _mm(d, torch.float32)
    table_op, roof_op = d.timeline
    s = summarize(d.timeline)
    assert s.fallback_fraction == pytest.approx(roof_op.dur_us / (roof_op.dur_us + table_op.dur_us))
    assert 0 < s.fallback_fraction < 1


def test_an_uncalibrated_profile_prices_every_op_by_the_roofline() -> None:
    assert H200.calibrated and not B200.calibrated
    d = SimDevice(SimOptions("b200", tensor_device="meta"))
    _mm(d, torch.bfloat16)
    assert summarize(d.timeline).fallback_fraction == 1.0


def test_a_registered_cost_wins_for_its_profile_then_for_every_profile() -> None:
    @register_op_cost(torch.ops.aten.mm, profile="h100")
    def on_h100(call, profile):
        return 123.0

    try:
        h100, h200 = (
            SimDevice(SimOptions("h100", tensor_device="meta")),
            SimDevice(SimOptions("h200", tensor_device="meta")),
        )
        _mm(h100, torch.bfloat16)
        _mm(h200, torch.bfloat16)
        assert h100.timeline[0].dur_us == 123.0 and h100.timeline[0].args["cost"] == "user:aten::mm"
        assert h200.timeline[0].args["cost"] == "table:mm"  # another profile keeps its table

        @register_op_cost("aten::mm")
        def everywhere(call, profile):
            return OpCost(7.0, "mine") if call.dtype == torch.bfloat16 else None

        h100.reset()
        h200.reset()
        _mm(h100, torch.bfloat16)
        _mm(h200, torch.bfloat16)
        _mm(h200, torch.float32)  # None: passed on, to the built-in entry, then the roofline
        assert h100.timeline[0].dur_us == 123.0  # the per-device entry still wins there
        assert [r.args["cost"] for r in h200.timeline] == ["mine", ROOFLINE]
    finally:
        unregister_op_cost("aten::mm", profile="h100")
        unregister_op_cost("aten::mm")
    d = SimDevice(SimOptions("h200", tensor_device="meta"))
    _mm(d, torch.bfloat16)
    assert d.timeline[0].args["cost"] == "table:mm"  # the built-in entry is back in charge


def test_one_list_of_gemm_ops_is_shared_by_the_device_and_the_reports() -> None:
    from dbo.sim import device

    assert device.RESERVED_SM_OPS is GEMM_OPS
    assert {"aten::mm", "aten::_grouped_mm", "aten::_scaled_mm", "aten::bmm"} <= GEMM_OPS


# -- the host model ------------------------------------------------------------------------------


def test_eager_host_cost_depends_on_the_op_kind() -> None:
    p = H200
    assert p.eager_host_us("gemm") > p.eager_host_us("elementwise") == p.launch_us
    d = SimDevice(SimOptions("h200", tensor_device="meta"))
    x = torch.empty(8, 8, dtype=torch.bfloat16, device="meta")
    with d.thread_scope(None):
        x + x
        x @ x
    add, mm = d.timeline
    assert add.start_us == pytest.approx(p.eager_host_us("elementwise"))
    assert mm.start_us - add.start_us == pytest.approx(p.eager_host_us("gemm"))


SMALL = check_cases(2)[0].config.with_(
    hidden=1024, num_heads=8, head_dim=128, num_experts=16, top_k=4, moe_inter=512
)


def test_a_launch_bound_step_is_slower_eager_than_replayed() -> None:
    batch = Batch.decode(64, 256)
    eager = simulate_step(SMALL, batch, "ll", profile="h200", num_ubatches=2, graph=False)
    replayed = simulate_step(SMALL, batch, "ll", profile="h200", num_ubatches=2, graph=True)
    assert eager.host_us == pytest.approx(eager.step_us, rel=0.01)  # the host sets the pace
    assert eager.step_us > 2 * replayed.step_us


def test_a_device_bound_step_takes_the_same_time_eager_and_replayed() -> None:
    config = SMALL.with_(
        hidden=4096, num_heads=32, num_experts=64, top_k=8, moe_inter=1024, num_layers=1
    )
    batch = Batch.prefill(4, 1024)
    eager = simulate_step(config, batch, "ht", profile="h200", num_ubatches=None, graph=False)
    replayed = simulate_step(config, batch, "ht", profile="h200", num_ubatches=None, graph=True)
    assert eager.host_us < eager.step_us
    # the same, but for the head start the first op's issue gives a replay
    assert 0 <= eager.step_us - replayed.step_us <= H200.eager_host_us("gemm")


@pytest.mark.parametrize("graph", [False, True])
def test_on_one_gpu_dbo_gains_nothing(graph: bool) -> None:
    """One GPU: dispatch and combine are local permutations, full-grid kernels that take the
    GPU in turn with compute, so the second ubatch has nothing to hide and only adds work."""
    batch = Batch.prefill(4, 512)
    serial = simulate_step(SMALL, batch, "ht", profile="h200", num_ubatches=None, graph=graph)
    ubatched = simulate_step(SMALL, batch, "ht", profile="h200", num_ubatches=2, graph=graph)
    assert ubatched.step_us > serial.step_us


def test_a_profile_replaced_with_another_launch_cost_rescales_every_kind() -> None:
    slow = replace(H200, launch_us=2 * H200.launch_us)
    assert slow.eager_host_us("gemm") == pytest.approx(2 * H200.eager_host_us("gemm"))


def _add_times(profile: str = "h200") -> list[tuple[str, float]]:
    d = SimDevice(SimOptions(profile, tensor_device="meta"))
    a = torch.ones(4, device="meta")
    with d.thread_scope(None):
        a + a  # aten::add.Tensor
        torch.ops.aten.add.Scalar(a, 1.0)
    return [(r.name, r.dur_us) for r in d.timeline]


def test_a_cost_registered_for_one_overload_by_name_prices_that_overload_only() -> None:
    register_op_cost("aten::add.Tensor")(lambda call, profile: 11.0)
    try:
        (_, tensor_us), (_, scalar_us) = _add_times()
    finally:
        unregister_op_cost("aten::add.Tensor")
    assert tensor_us == pytest.approx(11.0) and scalar_us != pytest.approx(11.0)


def test_a_cost_registered_for_an_op_name_prices_every_overload() -> None:
    register_op_cost("aten::add")(lambda call, profile: 12.0)
    try:
        assert [us for _, us in _add_times()] == pytest.approx([12.0, 12.0])
    finally:
        unregister_op_cost("aten::add")


@pytest.mark.parametrize("bad", ["aten::mmm", "aten::add.Tensorr", "nosuchlib::op"])
def test_registering_a_cost_for_an_op_torch_does_not_know_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="no op .* is registered with torch"):
        register_op_cost(bad)


def test_registering_a_cost_for_an_unknown_profile_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown hardware profile 'h2OO'.*h200"):
        register_op_cost("aten::mm", profile="h2OO")


@pytest.mark.parametrize("bad", [-5.0, math.nan, math.inf, OpCost(-1.0, "mine")])
def test_a_cost_function_returning_an_impossible_time_is_named_when_the_op_is_priced(
    bad: object,
) -> None:
    def broken(call, profile):
        return bad

    register_op_cost("aten::add")(broken)
    try:
        with pytest.raises(ValueError, match="cost function .*broken priced aten::add"):
            _add_times()
    finally:
        unregister_op_cost("aten::add")
