"""The work of `dbo-sim bugs`: list the chosen entries of the corpus, or run each and print
its verdict as it finishes.
"""

from __future__ import annotations

import argparse
import json

from scenarios.bugs.catalog import BUGS, Bug, BugResult, run_bug
from scenarios.lib.usage import UsageError

__all__ = ["run"]


def _selected(names: list[str]) -> list[Bug]:
    unknown = [n for n in names if n not in BUGS]
    if unknown:
        raise UsageError(
            f"unknown bug {unknown[0]!r}; `dbo-sim bugs --list` shows the {len(BUGS)} entries"
        )
    chosen = names or sorted(BUGS, key=lambda n: (BUGS[n].engine != "vLLM", BUGS[n].ref))
    return [BUGS[n] for n in chosen]


def _row(result: BugResult) -> str:
    b = result.bug
    verdict = "ok  " if result.passed else "FAIL"
    lines = [
        f"{verdict} {b.name}  ({b.engine} {b.ref}, {result.wall_s:.1f} s)",
        f"     cause   {b.cause}",
        f"     buggy   {'caught' if result.buggy.caught else 'NOT CAUGHT'} by "
        f"{result.buggy.by}: {result.buggy.message}",
        f"     fixed   {'clean' if not result.fixed.caught else 'FLAGGED'}: {result.fixed.message}",
    ]
    if result.buggy.caught and not result.names_cause:
        lines.append(f"     the message does not name the cause (expected {b.evidence!r})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    entries = _selected(list(args.names))
    if args.list:
        for b in entries:
            if args.json:
                fields = dict(bug=b.name, engine=b.engine, ref=b.ref, cause=b.cause)
                print(json.dumps({**fields, "caught_by": b.caught_by, "ranks": b.ranks}))
            else:
                where = "in-process" if b.ranks == 1 else f"{b.ranks} ranks"
                head = f"{b.name:48s} {b.engine:11s} {b.ref:26s} {where:10s}"
                print(f"{head} caught by {b.caught_by}")
        return 0
    results = []
    for b in entries:
        result = run_bug(b)
        results.append(result)
        print(json.dumps(result.to_dict()) if args.json else _row(result), flush=True)
    if not args.json:
        held = sum(r.passed for r in results)
        multi = sum(r.bug.ranks > 1 for r in results)
        print(f"{held} of {len(results)} entries hold ({multi} of them on real ranks)")
    return 0 if all(r.passed for r in results) else 1
