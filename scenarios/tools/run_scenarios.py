"""The work of `dbo-sim run`: run the chosen scenarios here or across rank processes, print
one verdict row per scenario as it finishes, and write the windowed traces.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from scenarios.catalog import DEFAULT_SCENARIOS, SCENARIOS, ScenarioResult, run_scenario
from scenarios.harness import RunOptions
from scenarios.lib import trace_window
from scenarios.lib.progress import emit, progress_bar
from scenarios.lib.usage import Interrupted, UsageError, one_line
from scenarios.ranks import launch as distributed
from scenarios.tools.common import clock_line, run_options
from scenarios.tools.run_table import Table, launch_bound_note

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """`dbo-sim run`: 0 when every scenario passed, 1 when one failed."""
    across_ranks = args.ranks > 1 or distributed.launched_by_torchrun()
    names = _chosen(args, across_ranks)
    if across_ranks:
        return _run_across_ranks(args, names)
    opts = run_options(args)
    table = Table(names)
    clock = clock_line(args.profile, args.device)
    if not args.json:
        emit(clock)
        emit(table.header())
    results: list[ScenarioResult] = []
    try:
        with progress_bar(len(names), "run", quiet=args.json, unit="scenario") as bar:
            for name in names:
                bar.set_postfix_str(name)
                result = run_scenario(name, opts)
                results.append(result)
                emit(_json_line(result, clock) if args.json else table.row(result))
                bar.update()
    except KeyboardInterrupt:
        kept = f" in {opts.out_dir}/" if opts.out_dir is not None and results else ""
        raise Interrupted(
            f"{len(results)} of {len(names)} scenario(s) finished; their results are above"
            f"{' and their traces' + kept if kept else ''}"
        ) from None
    return _report(args, opts, results)


def _chosen(args: argparse.Namespace, across_ranks: bool) -> list[str]:
    """The scenarios to run: the named ones, checked, or every default one that fits."""
    names = args.names or [
        n
        for n in DEFAULT_SCENARIOS
        if (not across_ranks or SCENARIOS[n].rank is not None)
        and (args.device == "sim" or SCENARIOS[n].cuda)
    ]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise UsageError(f"unknown scenario(s) {', '.join(unknown)}; `dbo-sim list` shows them")
    sim_only = [n for n in names if args.device != "sim" and not SCENARIOS[n].cuda]
    if sim_only and not across_ranks:
        raise UsageError(
            f"{', '.join(sim_only)}: simulator-only (race checker, graph replay or meta tensors); "
            f"run with --device sim"
        )
    return names


def _json_line(result: ScenarioResult, clock: str) -> str:
    """One scenario's JSON object, carrying what its step times rest on (`clock`)."""
    return json.dumps({**result.to_dict(), "clock": clock}, default=str)


def _run_across_ranks(args: argparse.Namespace, names: Sequence[str]) -> int:
    """`--ranks N` (local processes) or a torchrun launch: one merged result per scenario."""
    torchrun = _check_ranks(args, names)
    opts = run_options(args)
    table = Table(names)
    clock = clock_line(args.profile, args.device)
    if torchrun:
        try:
            results = distributed.run_as_torchrun_rank(names, opts)
        except distributed.RankSetupError as error:
            print(f"dbo-sim: {error}", file=sys.stderr)
            return 1
        if results is None:
            return 0  # rank 0 reports for every rank
    else:
        results = distributed.run_local_ranks(names, opts, args.ranks)
    if not args.json:
        emit(clock)
        emit(table.header())
    for result in results:
        emit(_json_line(result, clock) if args.json else table.row(result))
    return _report(args, opts, results)


def _check_ranks(args: argparse.Namespace, names: Sequence[str]) -> bool:
    """Refuse what cannot run across ranks; returns whether torchrun launched this process."""
    single = distributed.check_names(names)
    if single:
        raise UsageError(
            f"scenario(s) {', '.join(single)} run in one process; across ranks choose from "
            f"{', '.join(distributed.across_ranks())}"
        )
    torchrun = distributed.launched_by_torchrun()
    if torchrun and args.ranks > 1:
        raise UsageError(
            "--ranks starts local processes itself; under torchrun drop it (torchrun sets the "
            "ranks)"
        )
    if not torchrun:
        bad_world = distributed.check_world_size(args.ranks)
        if bad_world:
            raise UsageError(f"--ranks {args.ranks}: {bad_world}")
    return torchrun


def _report(args: argparse.Namespace, opts: RunOptions, results: Sequence[ScenarioResult]) -> int:
    """What follows the rows: why the small steps lose, each failure, the tally, the files."""
    windowed = trace_window.write_windowed(results, getattr(args, "window", None))
    if not args.json:
        note = launch_bound_note(results)
        if note:
            print(note)
        for r in results:
            if not r.passed:
                # One readable paragraph whatever the error's size; --json keeps the full text.
                print(f"\n{r.scenario} FAILED: {one_line(r.error or '', 2000)}")
        passed = sum(r.passed for r in results)
        print(f"\n{passed} passed, {len(results) - passed} failed")
        if opts.out_dir is not None:
            print(f"traces (open in https://ui.perfetto.dev) and timelines in {opts.out_dir}/")
        if windowed:
            print(f"windowed: {', '.join(windowed)}")
    return 0 if all(r.passed for r in results) else 1
