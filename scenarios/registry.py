"""The one scenario registry: every scenario's name, summary, kind, and the halves it runs as.

A scenario runs in one process (`run(opts) -> ScenarioResult`, registered with `@scenario`),
across ranks (`rank(env, opts) -> RankOutcome`, one rank's half, registered with
`@rank_scenario`), or both under one name. Negative scenarios pass when the fault they inject
is caught. Adding a scenario is one decorated function in `scenarios.catalog` (one process)
or `scenarios.ranks.halves` (its half on each rank).

The listing order is the order of the one-process registrations, so a scenario whose rank
half registers first still lists where its one-process half stands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dbo.jsonsafe import json_safe
from scenarios.harness import RunOptions
from scenarios.ranks.records import RankEnv, RankOutcome

__all__ = [
    "ScenarioResult",
    "Scenario",
    "SCENARIOS",
    "scenario",
    "rank_scenario",
    "across_ranks",
    "caught_line",
]

# A caught fault is named in the run table's last cell and in its PNG's title: long enough for
# the error's type and what it says first, short enough for one line.
CAUGHT_CHARS = 100


def caught_line(text: str) -> str:
    """What caught a negative scenario's fault, on one line: the first line of `text`, cut."""
    first = text.strip().splitlines()[0] if text.strip() else text
    return first if len(first) <= CAUGHT_CHARS else first[: CAUGHT_CHARS - 3] + "..."


@dataclass
class ScenarioResult:
    """One scenario's verdict; `to_dict()` is the `--json` schema (see README)."""

    scenario: str
    passed: bool
    negative: bool = False
    outputs_match: bool | None = None
    max_abs_diff: float | None = None
    races: int = 0
    error: str | None = None
    caught: str | None = None  # a negative scenario: what caught its fault, on one line
    step_us_serial: float | None = None
    step_us_dbo: float | None = None
    speedup: float | None = None
    overlap_fraction: float | None = None
    exposed_comm_us: float | None = None
    # Share of the DBO run's device-op time no measured kernel covered (priced by the roofline).
    roofline_fraction: float | None = None
    workspace_peak_bytes: int | None = None
    trace: str | None = None
    timeline_png: str | None = None
    wall_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return json_safe(dict(self.__dict__))


RunHalf = Callable[[RunOptions], ScenarioResult]
RankHalf = Callable[[RankEnv, RunOptions], RankOutcome]


@dataclass(frozen=True)
class Scenario:
    """A registered scenario. `run` is None for one that only runs across ranks; `rank` is
    None for one that only runs in one process."""

    name: str
    summary: str
    run: RunHalf | None = None
    negative: bool = False
    default: bool = True
    cuda: bool = False  # also meaningful on real CUDA streams (the rest need the simulator)
    rank: RankHalf | None = None


SCENARIOS: dict[str, Scenario] = {}


def scenario(
    name: str,
    summary: str,
    *,
    negative: bool = False,
    default: bool = True,
    cuda: bool = False,
) -> Callable[[RunHalf], RunHalf]:
    """Register `fn(opts) -> ScenarioResult` as the one-process run of scenario `name`."""

    def register(fn: RunHalf) -> RunHalf:
        known = SCENARIOS.pop(name, None)
        if known is not None and known.run is not None:
            raise ValueError(f"scenario {name!r} is registered twice; pick another name")
        rank = known.rank if known is not None else None
        _check_negative(name, known, negative)
        SCENARIOS[name] = Scenario(name, summary, fn, negative, default, cuda, rank)
        return fn

    return register


def rank_scenario(
    name: str, *, negative: bool = False, summary: str = ""
) -> Callable[[RankHalf], RankHalf]:
    """Register `fn(env, opts) -> RankOutcome` as one rank's half of scenario `name`.

    `negative` is stated here too: a rank process may never import the one-process half,
    and the merged verdict needs it. `summary` is the listing's line of a scenario that has
    no one-process half."""

    def register(fn: RankHalf) -> RankHalf:
        known = SCENARIOS.get(name)
        if known is not None and known.rank is not None:
            raise ValueError(f"scenario {name!r} has two rank halves; pick another name")
        _check_negative(name, known, negative)
        if known is None:
            SCENARIOS[name] = Scenario(name, summary, negative=negative, rank=fn)
        else:
            SCENARIOS[name] = replace(known, rank=fn)
        return fn

    return register


def _check_negative(name: str, known: Scenario | None, negative: bool) -> None:
    if known is not None and known.negative != negative:
        raise ValueError(
            f"scenario {name!r}: its one-process and rank halves disagree on negative=; "
            f"state the same on both registrations"
        )


def across_ranks() -> list[str]:
    """The scenarios that run across ranks (with a rank half), in listing order."""
    return [name for name, s in SCENARIOS.items() if s.rank is not None]
