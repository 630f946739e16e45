"""`python -m scenarios bench --quick` runs to the end and writes a complete bench.json.

Timing is never asserted: the figures are reports, and CI machines are noisy.
"""

from __future__ import annotations

import json

import pytest

from scenarios.bench import BENCHMARKS
from scenarios.cli import main

# Figures that carry the project's targets; a quick run must report each of them.
TARGETED = (
    "workspace.get_simultaneous.locked.n1",
    "workspace.get_simultaneous.locked.n3",
    "workspace.get_simultaneous.locked.n8",
    "workspace.allocations.slot",
    "workspace.allocations.storage",
    "baton.dbo_yield",
    "sim.deepseek_v3_step",
    "scaling.orphaned_bytes",
)


def _no_constants(name: str) -> None:
    raise ValueError(f"bench.json holds {name}, which is not JSON")


@pytest.mark.timeout(300)
def test_bench_quick_writes_every_benchmark(tmp_path, capsys):
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 0

    doc = json.loads((tmp_path / "bench.json").read_text(), parse_constant=_no_constants)
    assert {"schema", "date", "quick", "machine", "plan", "seconds", "benchmarks", "figures", "summary"} <= set(doc)
    assert doc["quick"] is True
    assert {"platform", "cpu_count", "python", "torch"} <= set(doc["machine"])

    figures = doc["figures"]
    assert {f["bench"] for f in figures} == set(BENCHMARKS)
    names = [f["name"] for f in figures]
    assert len(names) == len(set(names))
    assert set(TARGETED) <= set(names)
    for f in figures:
        assert {"ours", "baseline", "ratio", "target", "met", "what", "unit"} <= set(f)
        assert {"median", "min", "max", "samples"} <= set(f["ours"])
        assert f["met"] in (True, False, None)
        assert (f["met"] is None) == (not f["targets"])

    summary = doc["summary"]
    assert summary["targets"] == sum(f["met"] is not None for f in figures)
    assert set(summary["missed"]) == {f["name"] for f in figures if f["met"] is False}

    table = capsys.readouterr().out
    assert all(name in table for name in names)
