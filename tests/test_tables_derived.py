"""H100 and H800 kernel tables derived from the measured H200 table."""

from __future__ import annotations

import pytest

from dbo.sim.cost import kernel_table
from dbo.sim.hardware import H100, H200, H800
from dbo.sim.tables import TABLE_DIR, KernelRow
from dbo.sim.tables.derive import derive_row, write_derived_table


@pytest.mark.parametrize("name", ["h100", "h800"])
def test_the_shipped_derived_tables_are_what_the_derivation_writes(name, tmp_path):
    written = write_derived_table(name, tmp_path)
    assert written.read_text() == (TABLE_DIR / f"{name}.csv").read_text()


def test_a_compute_bound_kernel_keeps_its_time():
    big = KernelRow("mm", 4096, 4096, 4096, 1, "bf16", 177.0, 1.37e11, 1.0e8)
    assert derive_row(big, 4800.0, 989.0, 3350.0).us == pytest.approx(177.0)


def test_a_memory_bound_kernel_scales_by_the_hbm_ratio():
    copy = KernelRow("copy", 1 << 26, 0, 0, 1, "bf16", 60.0, 0.0, 2.5e8)
    assert derive_row(copy, 4800.0, 989.0, 3350.0).us == pytest.approx(60.0 * 4800 / 3350, abs=1e-3)


@pytest.mark.parametrize("profile", [H100, H800])
def test_h100_and_h800_price_from_a_derived_table_and_say_so(profile):
    assert profile.calibrated and profile.kernels_derived
    assert "derived from the h200 table" in profile.kernel_source
    decode_gemm = kernel_table(profile).estimate("mm", m=16, n=4096, k=4096)
    assert decode_gemm > kernel_table(H200).estimate("mm", m=16, n=4096, k=4096)
