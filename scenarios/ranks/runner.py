"""One rank's part of a run: which scenarios can run, each half in order, outcomes via the store."""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from typing import Any

from scenarios.harness import RunOptions
from scenarios.model import preset
from scenarios.ranks import halves  # noqa: F401 - registers the scenarios' rank halves
from scenarios.ranks.records import RankEnv, RankOutcome
from scenarios.registry import SCENARIOS, RankHalf, across_ranks
from workspace import reset_workspace_manager

__all__ = [
    "check_names",
    "check_world_size",
    "collect_outcomes",
    "done_key",
    "run_rank_scenarios",
]


def check_names(names: Sequence[str]) -> list[str]:
    """The names that cannot run across ranks (empty when all can)."""
    return [n for n in names if n not in across_ranks()]


def check_world_size(world: int) -> str | None:
    """Why the rank scenarios cannot run on `world` ranks (None when they can): EP spans every
    rank and shards the tiny model's experts evenly, so the rank count must divide them."""
    experts = preset("tiny").num_experts
    if world < 1 or experts % world:
        fits = ", ".join(str(w) for w in range(1, experts + 1) if experts % w == 0)
        return (
            f"the tiny model's {experts} experts are sharded evenly over the EP ranks (EP spans "
            f"every rank), so the world size must divide {experts}: {fits}"
        )
    return None


def done_key(rank: int) -> str:
    """The store key a rank sets once every one of its outcomes is published."""
    return f"done/{rank}"


def _outcome_key(name: str, rank: int) -> str:
    return f"outcome/{name}/{rank}"


def _rank_half(name: str) -> RankHalf:
    half = SCENARIOS[name].rank
    assert half is not None, f"{name} has no rank half; check_names lets only those through"
    return half


def run_rank_scenarios(env: RankEnv, names: Sequence[str], opts: RunOptions) -> list[RankOutcome]:
    """Run this rank's half of each scenario, in order, publishing each outcome to the store.

    A scenario that raises is a failed outcome, never a crash. If it left the group broken
    (an EP abort or timeout), the remaining scenarios are reported as not run: their
    collectives could pair with the broken one's.
    """
    outcomes = []
    broken: str | None = None
    for name in names:
        start = time.monotonic()
        if broken is not None:
            outcome = RankOutcome(env.rank, passed=False, error=f"not run: {broken}")
        else:
            try:
                outcome = _rank_half(name)(env, opts)
            except Exception as error:  # noqa: BLE001 - reported as the verdict
                outcome = RankOutcome(
                    env.rank,
                    passed=False,
                    error=f"rank {env.rank}: {type(error).__name__}: {error}",
                )
                if not isinstance(error, (ValueError, TypeError)):
                    broken = (
                        f"an earlier scenario ({name}) failed on rank {env.rank} and may have "
                        "left the group broken"
                    )
            finally:
                reset_workspace_manager()
        outcome.wall_s = outcome.wall_s or time.monotonic() - start
        env.store.set(_outcome_key(name, env.rank), pickle.dumps(outcome))
        outcomes.append(outcome)
    env.store.set(done_key(env.rank), "1")
    return outcomes


def collect_outcomes(
    store: Any, names: Sequence[str], world: int
) -> dict[str, list[RankOutcome | None]]:
    """Every rank's published outcome of each scenario, by name (None: the rank sent none)."""
    table: dict[str, list[RankOutcome | None]] = {}
    for name in names:
        row: list[RankOutcome | None] = []
        for rank in range(world):
            key = _outcome_key(name, rank)
            row.append(pickle.loads(store.get(key)) if store.check([key]) else None)
        table[name] = row
    return table
