"""What a launcher calls to run scenarios across ranks: the checks, a local or a torchrun launch."""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

from scenarios.harness import RunOptions
from scenarios.ranks.group import (
    RankSetupError,
    env_int,
    first_line,
    init_rank,
    launched_by_torchrun,
)
from scenarios.ranks.merge import merge_outcomes
from scenarios.ranks.processes import run_local_ranks
from scenarios.ranks.runner import (
    check_names,
    check_world_size,
    collect_outcomes,
    done_key,
    run_rank_scenarios,
)
from scenarios.registry import ScenarioResult, across_ranks

__all__ = [
    "RankSetupError",
    "across_ranks",
    "check_names",
    "check_world_size",
    "init_rank",
    "launched_by_torchrun",
    "merge_outcomes",
    "run_as_torchrun_rank",
    "run_local_ranks",
]


def run_as_torchrun_rank(names: Sequence[str], opts: RunOptions) -> list[ScenarioResult] | None:
    """This process's part of a torchrun launch: run every rank's half; rank 0 then waits for
    the others' outcomes and returns the merged results, the other ranks return None."""
    unknown = check_names(names)
    if unknown:
        raise ValueError(
            f"scenario(s) {unknown} run in one process; across ranks: {sorted(across_ranks())}"
        )
    bad_world = check_world_size(env_int("WORLD_SIZE"))
    if bad_world:
        raise RankSetupError(f"WORLD_SIZE={os.environ['WORLD_SIZE']}: {bad_world}")
    env = init_rank(opts)
    run_rank_scenarios(env, names, opts)
    if env.rank != 0:
        return None
    missing = ""
    try:
        env.store.wait(
            [done_key(r) for r in range(env.world)],
            timedelta(seconds=opts.timeout_s * (len(names) + 1)),
        )
    except Exception as error:  # noqa: BLE001 - the missing ranks are reported below
        missing = first_line(error)
    table = collect_outcomes(env.store, names, env.world)
    return [merge_outcomes(name, table[name], opts, missing=missing) for name in names]
