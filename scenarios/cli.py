"""The command line: `dbo-sim VERB` (also `python -m scenarios VERB`), one entry for every tool.

This module only dispatches. Every verb is one row of `VERBS`: its name, its help line, and a
tool module in `scenarios.tools` with `add_arguments(parser)` and `run(args) -> exit status`,
imported only when that verb runs or shows its help: `dbo-sim --help`, `dbo-sim list` and
`dbo-sim VERB --help` load no other verb (and most of them no torch).
Every check of the command line and of the output folder happens before any work starts, and
every refusal is one line, `dbo-sim: <why>`, with exit status 2 (argparse's own refusals too,
through `_Parser`; a tool refuses by raising `UsageError`). Ctrl-C ends a verb with one line
and exit status 130; what finished before it stays printed and written.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from scenarios.lib.usage import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    Interrupted,
    UsageError,
    one_line,
)

__all__ = ["VERBS", "Verb", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line refusal instead of a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"dbo-sim: {one_line(message)}\n")


def _version() -> str:
    try:
        return importlib.metadata.version("dbo-sim")
    except importlib.metadata.PackageNotFoundError:
        # Run from a source tree that was never installed: read the project file beside it.
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        text = pyproject.read_text() if pyproject.is_file() else ""
        found = re.search(r'^version = "([^"]+)"', text, re.MULTILINE)
        return found.group(1) if found else "unknown"


@dataclass(frozen=True)
class Verb:
    """One `dbo-sim` verb: its name, its line in `dbo-sim --help`, and what it runs: the tool
    module `scenarios.tools.<module>`, with `add_arguments(parser)` and `run(args) -> int`,
    imported on first use. Its `--help` description is the tool's DESCRIPTION, else the first
    line of its docstring."""

    name: str
    help: str
    module: str

    @property
    def tool(self) -> ModuleType:
        return importlib.import_module(f"scenarios.tools.{self.module}")

    def description(self) -> str | None:
        described = getattr(self.tool, "DESCRIPTION", None)
        if described:
            return described
        return (self.tool.__doc__ or "").strip().splitlines()[0] or None


# Every verb, in `dbo-sim --help` order.
VERBS: tuple[Verb, ...] = (
    Verb("list", "list the scenarios", "list_scenarios"),
    Verb("run", "run scenarios (default: every default scenario on the simulated device)", "run"),
    Verb("sweep", "DBO speedup against tokens per device (CSV + PNG)", "sweep"),
    Verb("stress", "concurrent workspace slot access with growth and lock/unlock", "stress"),
    Verb(
        "plan",
        "should DBO be on for your deployment: gain, ubatches, token threshold, engine flags",
        "plan",
    ),
    Verb("bench", "benchmarks, each a ratio against a baseline in the same run", "bench"),
    Verb(
        "fidelity",
        "the simulator against published DBO/TBO and DeepEP results, side by side",
        "fidelity",
    ),
    Verb("profile", "time this GPU's kernels into a table the simulator loads (CUDA)", "profile"),
    Verb(
        "verify",
        "verify your own forward under DBO (serial vs ubatched, races, errors)",
        "verify_cli",
    ),
    Verb(
        "gpu-check",
        "real CUDA streams against the simulated H200 (needs a GPU, or --sim-only)",
        "gpu_check",
    ),
    Verb(
        "calibrate-host",
        "this host's launch and handoff costs, for a profile (needs a GPU, or --device sim)",
        "calibrate_host",
    ),
    Verb(
        "race-check",
        "seeded race programs: the simulator's checker and torch's CSAN side by side",
        "race_check",
    ),
    Verb("bugs", "real DBO bugs from vLLM's and SGLang's trackers, each caught", "bugs"),
    Verb("analyze", "what a real GPU profiler trace says DBO did (report, PNG, trace)", "analyze"),
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `only`, every verb listed but only that one's arguments
    read (and its tool imported): what running one verb needs ("" for none of them)."""
    parser = _Parser(
        prog="dbo-sim", description="Dual Batch Overlap scenarios on a simulated or real GPU"
    )
    version = f"dbo-sim {_version()} (torch {_torch_version()})"
    parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command")
    for verb in VERBS:
        if only is not None and verb.name != only:
            sub.add_parser(verb.name, help=verb.help)
            continue
        verb_parser = sub.add_parser(verb.name, help=verb.help, description=verb.description())
        verb.tool.add_arguments(verb_parser)
        verb_parser.set_defaults(func=verb.tool.run)
    return parser


def _torch_version() -> str:
    # Read from the installed distribution: importing torch for a version line takes seconds.
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one verb; returns the exit status (2 usage, 130 interrupted)."""
    try:
        return _parse_and_run(list(sys.argv[1:] if argv is None else argv))
    except UsageError as error:
        _say(one_line(str(error)))
        return EXIT_USAGE
    except Interrupted as interrupted:
        _say(f"interrupted; {interrupted}")
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # also while the parser is being built
        _say("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`dbo-sim list --json | head -1`): not an error worth a
        # traceback; stdout goes to /dev/null so the interpreter's final flush is quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _parse_and_run(argv: list[str]) -> int:
    names = {verb.name for verb in VERBS}
    parser = build_parser(only=argv[0] if argv and argv[0] in names else "")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or a refusal already printed
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    return args.func(args)


def _say(line: str) -> None:
    sys.stdout.flush()  # so the line lands after every result printed before it
    print(f"dbo-sim: {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
