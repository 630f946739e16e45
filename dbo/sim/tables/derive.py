"""Kernel tables of GPUs on the same die as a measured one, derived from its measurements.

H100 SXM and H800 SXM are the GH100 die of the H200 with HBM3 at 3.35 TB/s instead of HBM3e
at 4.8 TB/s (same SMs, clocks and tensor-core peaks). A kernel keeps the share of the peaks it
reached on the measured GPU: its time is set by whichever of math or memory traffic bound it,

    t_derived = t_measured * max(f_math, f_mem * hbm_measured / hbm_target) / max(f_math, f_mem)

with f_math = achieved FLOP/s over the bf16 peak and f_mem = achieved bytes/s over the HBM
peak on the measured GPU. Compute-bound kernels (f_math > f_mem * ratio) keep their time;
memory-bound ones (every kernel without FLOPs) scale by the bandwidth ratio; the kernels in
between take the slower of the two. The derived CSVs are written by `write_derived_table`
and say so in `PROVENANCE.md`; a test checks the committed files against it.
"""

from __future__ import annotations

import csv
from pathlib import Path

from dbo.sim.tables import TABLE_DIR, KernelRow, read_rows

__all__ = ["DERIVED", "derive_row", "derived_rows", "write_derived_table"]

# target table -> (measured table, its HBM GB/s and bf16 TFLOP/s peak, target HBM GB/s)
DERIVED: dict[str, tuple[str, float, float, float]] = {
    "h100": ("h200", 4800.0, 989.0, 3350.0),
    "h800": ("h200", 4800.0, 989.0, 3350.0),
}
_COLUMNS = ("op", "m", "n", "k", "groups", "dtype", "us", "flops", "bytes", "tflops", "gbps")


def derive_row(row: KernelRow, hbm_from: float, peak_tflops: float, hbm_to: float) -> KernelRow:
    f_math = row.flops / row.us / 1e6 / peak_tflops if row.flops else 0.0
    f_mem = row.bytes / row.us / 1e3 / hbm_from if row.bytes else 0.0
    bound = max(f_math, f_mem)
    if bound <= 0:
        return row
    us = row.us * max(f_math, f_mem * hbm_from / hbm_to) / bound
    return KernelRow(row.op, row.m, row.n, row.k, row.groups, row.dtype, round(us, 3),
                     row.flops, row.bytes)  # fmt: skip


def derived_rows(name: str) -> list[KernelRow]:
    source, hbm_from, peak, hbm_to = DERIVED[name]
    rows = read_rows(TABLE_DIR / f"{source}.csv")
    return [derive_row(r, hbm_from, peak, hbm_to) for r in rows]


def write_derived_table(name: str, directory: Path = TABLE_DIR) -> Path:
    """Write `<name>.csv` (the measured table's format) from its source table."""
    path = Path(directory) / f"{name}.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(_COLUMNS)
        for r in derived_rows(name):
            tflops = round(r.flops / r.us / 1e6, 2) if r.flops else 0.0
            gbps = round(r.bytes / r.us / 1e3, 1) if r.bytes else 0.0
            writer.writerow((r.op, r.m, r.n, r.k, r.groups, r.dtype, r.us, int(r.flops),
                             int(r.bytes), tflops, gbps))  # fmt: skip
    return path
