"""H100 and H800 kernel tables derived from the measured H200 table."""

from __future__ import annotations

import pytest

from dbo.sim.cost import kernel_table
from dbo.sim.hardware import H100, H200, H800
from dbo.sim.tables import TABLE_DIR, KernelRow, read_rows
from dbo.sim.tables.derive import derive_row, write_derived_table


@pytest.mark.parametrize("name", ["h100", "h800"])
def test_the_shipped_derived_tables_are_what_the_derivation_writes(name, tmp_path):
    written = write_derived_table(name, tmp_path)
    assert written.read_text() == (TABLE_DIR / f"{name}.csv").read_text()


RATIO = 4800.0 / 3350.0


def test_a_compute_bound_kernel_keeps_its_time():
    big = KernelRow("mm", 4096, 4096, 4096, 1, "bf16", 177.0, 1.37e11, 1.0e8)
    assert derive_row(big, 4800.0, 989.0, 3350.0, 1.35).us == pytest.approx(177.0)


def test_a_bandwidth_bound_kernel_scales_by_the_hbm_ratio():
    # 288 MB in 60 us: the H200's HBM peak, so all of the time past the floor is traffic
    copy = KernelRow("copy", 1 << 26, 0, 0, 1, "bf16", 60.0, 0.0, 4800.0 * 60.0 * 1e3)
    derived = derive_row(copy, 4800.0, 989.0, 3350.0, 1.35).us
    assert derived == pytest.approx(1.35 + (60.0 - 1.35) * RATIO, abs=1e-3)
    assert derived / 60.0 == pytest.approx(RATIO, rel=0.01)


def test_a_launch_bound_kernel_keeps_its_time():
    tiny_copy = KernelRow("copy", 1024, 1, 1, 1, "bf16", 1.352, 0.0, 4096.0)
    assert derive_row(tiny_copy, 4800.0, 989.0, 3350.0, 1.352).us == pytest.approx(1.352)


def test_a_kernel_far_below_the_hbm_peak_keeps_nearly_its_time():
    # fp32 softmax + top-8 of 256 at ~100 GB/s: its time is the sort, not the traffic
    topk = KernelRow("router_softmax_topk256", 32768, 256, 8, 1, "fp32", 479.181, 0.0, 50331648)
    assert derive_row(topk, 4800.0, 989.0, 3350.0, 1.352).us == pytest.approx(479.181, rel=0.02)


@pytest.mark.parametrize(
    ("op", "m", "keeps"),
    [("copy", 1024, True), ("router_softmax_topk256", 128, True), ("copy", 67108864, False)],
)
def test_the_shipped_h100_table_rescales_only_traffic_bound_kernels(op, m, keeps):
    def us(name):
        return next(r.us for r in read_rows(TABLE_DIR / f"{name}.csv") if r.op == op and r.m == m)

    ratio = us("h100") / us("h200")
    assert ratio == pytest.approx(1.0, abs=0.01) if keeps else ratio > 1.3


@pytest.mark.parametrize("profile", [H100, H800])
def test_h100_and_h800_price_from_a_derived_table_and_say_so(profile):
    assert profile.calibrated and profile.kernels_derived
    assert "derived from the h200 table" in profile.kernel_source
    decode_gemm = kernel_table(profile).estimate("mm", m=16, n=4096, k=4096)
    assert decode_gemm > kernel_table(H200).estimate("mm", m=16, n=4096, k=4096)
