"""The records rank processes share: a rank's place in the run and its outcome of one scenario."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dbo.sim.records import OpRecord, RaceReport

__all__ = ["RankEnv", "RankOutcome"]


@dataclass
class RankEnv:
    """One rank's place in the run. `group` carries the EP all-to-all for CPU tensors (gloo);
    `cuda_group` is the NCCL group when every rank has a GPU; `cpu_group` the gloo group the
    DP agreement uses; `store` (namespaced) carries outcomes and EP aborts."""

    rank: int
    world: int
    local_rank: int
    store: Any
    group: Any
    cpu_group: Any
    cuda_group: Any = None


@dataclass
class RankOutcome:
    """One rank's half of one scenario, as sent to the reporter (pickled through the store)."""

    rank: int
    passed: bool
    error: str | None = None
    outputs_match: bool | None = None
    max_abs_diff: float | None = None
    races: list[RaceReport] = field(default_factory=list)
    serial_records: list[OpRecord] = field(default_factory=list)
    dbo_records: list[OpRecord] = field(default_factory=list)
    # Drawn in the trace when there are no dbo_records, never summarised as a step time: what
    # a negative scenario ran (dp-disagreement: the agreed step).
    trace_records: list[OpRecord] = field(default_factory=list)
    workspace_peak_bytes: int | None = None
    wall_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
