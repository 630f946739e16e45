"""Kernel tables of GPUs on the same die as a measured one, derived from its measurements.

H100 SXM and H800 SXM are the GH100 die of the H200 with HBM3 at 3.35 TB/s instead of HBM3e
at 4.8 TB/s (same SMs, clocks, caches and tensor-core peaks). Only the part of a kernel's time
that HBM traffic provably takes is rescaled. Of a measured time t, the launch floor (the
table's cheapest kernel: ramp-up and tail that any kernel pays) is kept; of the rest, the
traffic needs at least t_mem = bytes / hbm_measured (clamped to it) and the math at least
t_math = flops / bf16 peak. Whatever remains above the larger of the two (latency chains,
sorting, poor access patterns: work no faster HBM speeds up) is kept too:

    t_derived = t + max(0, max(t_math, t_mem * hbm_measured / hbm_target) - max(t_math, t_mem))

So a launch-bound kernel keeps its time (a 4 KB copy's traffic is a nanosecond), a kernel at
the HBM peak scales by the bandwidth ratio, one between scales by the share of its time it
spent at peak bandwidth (a lower bound: a kernel at 70% of peak may lose slightly more on the
slower part), and a compute-bound kernel keeps its time until the slower memory overtakes
its math. The derived CSVs are written by `write_derived_table` and say so in
`PROVENANCE.md`; a test checks the committed files against it.
"""

from __future__ import annotations

import csv
from pathlib import Path

from dbo.sim.tables import TABLE_DIR, KernelRow, hbm_bytes, read_rows

__all__ = ["DERIVED", "derive_row", "derived_rows", "write_derived_table"]

# target table -> (measured table, its HBM GB/s and bf16 TFLOP/s peak, target HBM GB/s)
DERIVED: dict[str, tuple[str, float, float, float]] = {
    "h100": ("h200", 4800.0, 989.0, 3350.0),
    "h800": ("h200", 4800.0, 989.0, 3350.0),
}
_COLUMNS = ("op", "m", "n", "k", "groups", "dtype", "us", "flops", "bytes", "tflops", "gbps")


def derive_row(
    row: KernelRow, hbm_from: float, peak_tflops: float, hbm_to: float, floor_us: float = 0.0
) -> KernelRow:
    """`row` on a GPU of the same die with `hbm_to` GB/s of HBM (`floor_us`: the launch floor
    no bandwidth changes)."""
    variable = max(row.us - floor_us, 0.0)
    t_mem = min(hbm_bytes(row) / hbm_from / 1e3, variable)
    t_math = min(row.flops / peak_tflops / 1e6, variable)
    bound = max(t_math, t_mem)
    us = row.us + max(0.0, max(t_math, t_mem * hbm_from / hbm_to) - bound)
    return KernelRow(
        row.op, row.m, row.n, row.k, row.groups, row.dtype, round(us, 3), row.flops, row.bytes
    )


def derived_rows(name: str) -> list[KernelRow]:
    source, hbm_from, peak, hbm_to = DERIVED[name]
    rows = read_rows(TABLE_DIR / f"{source}.csv")
    floor = min(r.us for r in rows)
    return [derive_row(r, hbm_from, peak, hbm_to, floor) for r in rows]


def write_derived_table(name: str, directory: Path = TABLE_DIR) -> Path:
    """Write `<name>.csv` (the measured table's format) from its source table."""
    path = Path(directory) / f"{name}.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(_COLUMNS)
        for r in derived_rows(name):
            tflops = round(r.flops / r.us / 1e6, 2) if r.flops else 0.0
            gbps = round(r.bytes / r.us / 1e3, 1) if r.bytes else 0.0
            writer.writerow(
                (
                    r.op,
                    r.m,
                    r.n,
                    r.k,
                    r.groups,
                    r.dtype,
                    r.us,
                    int(r.flops),
                    int(r.bytes),
                    tflops,
                    gbps,
                )
            )
    return path
