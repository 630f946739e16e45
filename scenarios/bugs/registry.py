"""The bug corpus's registry: each entry a real DBO bug from vLLM's or SGLang's tracker,
rebuilt small, with its buggy and its fixed variant.

An entry is one decorated function `check(buggy: bool) -> Verdict` (`@bug`) that builds its
step the buggy or the fixed way and hands it to the tool that should catch the bug
(`dbo.verify`, the runner, the ubatch-metadata checker, the DP agreement, the simulated
timeline). It passes when
the buggy variant is caught with a message containing the entry's `evidence` (the words that
name the cause) and the fixed variant is not caught. An entry whose two variants share one
costly setup (a process group) registers `run() -> (buggy, fixed)` with `@bug_pair`. Adding a
bug is one decorated function in a module of `scenarios.bugs`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BUGS", "Bug", "BugResult", "Verdict", "bug", "bug_pair", "run_bug"]


@dataclass(frozen=True)
class Verdict:
    """What the catching tool said about one variant: `caught`, by which tool, and its
    message (its first finding)."""

    caught: bool
    by: str
    message: str


Check = Callable[[bool], Verdict]
Pair = Callable[[], tuple[Verdict, Verdict]]


@dataclass(frozen=True)
class Bug:
    """A registered bug. `ref` is the issue/PR it is rebuilt from (e.g. "vllm#48659"),
    `cause` its one-line cause, `caught_by` the tool expected to catch it, `evidence` the
    words the catching message must contain, `ranks` how many rank processes it runs on
    (1: in-process)."""

    name: str
    engine: str
    ref: str
    cause: str
    caught_by: str
    evidence: str
    run: Pair  # (buggy verdict, fixed verdict)
    ranks: int = 1


@dataclass(frozen=True)
class BugResult:
    """One entry run: both verdicts, and whether the entry holds (buggy caught naming its
    cause, fixed clean)."""

    bug: Bug
    buggy: Verdict
    fixed: Verdict
    wall_s: float

    @property
    def names_cause(self) -> bool:
        return self.bug.evidence.lower() in self.buggy.message.lower()

    @property
    def passed(self) -> bool:
        return self.buggy.caught and self.names_cause and not self.fixed.caught

    def to_dict(self) -> dict:
        b = self.bug
        return {
            "bug": b.name,
            "engine": b.engine,
            "ref": b.ref,
            "cause": b.cause,
            "caught_by": b.caught_by,
            "ranks": b.ranks,
            "passed": self.passed,
            "buggy": self.buggy.__dict__,
            "fixed": self.fixed.__dict__,
            "names_cause": self.names_cause,
            "wall_s": self.wall_s,
        }


BUGS: dict[str, Bug] = {}


def _register(name: str, fields: dict, run: Pair) -> None:
    if name in BUGS:
        raise ValueError(f"bug {name!r} is registered twice; pick another name")
    BUGS[name] = Bug(name, run=run, **fields)


def bug(
    name: str,
    *,
    engine: str,
    ref: str,
    cause: str,
    caught_by: str,
    evidence: str,
    ranks: int = 1,
) -> Callable[[Check], Check]:
    """Register `check(buggy) -> Verdict` as bug `name` (the buggy variant runs first)."""
    fields = dict(
        engine=engine, ref=ref, cause=cause, caught_by=caught_by, evidence=evidence, ranks=ranks
    )

    def register(check: Check) -> Check:
        _register(name, fields, lambda: (check(True), check(False)))
        return check

    return register


def bug_pair(
    name: str,
    *,
    engine: str,
    ref: str,
    cause: str,
    caught_by: str,
    evidence: str,
    ranks: int = 1,
) -> Callable[[Pair], Pair]:
    """Register `run() -> (buggy verdict, fixed verdict)` as bug `name`."""
    fields = dict(
        engine=engine, ref=ref, cause=cause, caught_by=caught_by, evidence=evidence, ranks=ranks
    )

    def register(run: Pair) -> Pair:
        _register(name, fields, run)
        return run

    return register


def run_bug(entry: Bug) -> BugResult:
    """Run both variants of `entry`. An entry that fails to run (its own error, a rank
    process that dies) is a result that does not hold, with the error as both messages."""
    start = time.perf_counter()
    try:
        buggy, fixed = entry.run()
    except Exception as error:  # noqa: BLE001 - reported as the entry's result
        broken = Verdict(False, "the entry itself", f"{type(error).__name__}: {error}")
        buggy, fixed = broken, broken
    return BugResult(entry, buggy, fixed, time.perf_counter() - start)
