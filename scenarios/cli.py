"""The command line: `dbo-sim VERB` (also `python -m scenarios VERB`), one entry for every tool.

This module only dispatches. Every verb is one row of `VERBS`: its name, its help line, and a
tool module in `scenarios.tools` with `add_arguments(parser)` and `run(args) -> exit status`,
imported only when that verb runs or shows its help: `dbo-sim --help`, `dbo-sim list` and
`dbo-sim VERB --help` load no other verb, and no torch: a verb's module is its parser, and
its `run` imports the work.
Every check of the command line and of the output folder happens before any work starts, and
every refusal is one line, `dbo-sim: <why>`, with exit status 2 (argparse's own refusals too,
through `_Parser`; a tool refuses by raising `UsageError`). Ctrl-C ends a verb with one line
and exit status 130; what finished before it stays printed and written.

Nothing here imports torch (`--version` reads its installed version): `dbo-sim --help`, a
verb's `--help` and a verb whose tool checks its options before importing heavy things answer
in a fraction of a second.
"""

from __future__ import annotations

import argparse
import importlib
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

__all__ = ["GLOSSARY", "VERBS", "Verb", "build_parser", "main"]

# Every verb's --help ends by pointing here: the words its output prints (LL/HT,
# roofline-priced, full-grid, untraced, padded, cal, ...) are explained once, on one page.
GLOSSARY = "docs/glossary.md"
_EPILOG = (
    f"The terms in the output (LL/HT, roofline-priced, full-grid, untraced, padded, cal) are "
    f"explained in {GLOSSARY} of the dbo-sim repository."
)


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line refusal instead of a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"dbo-sim: {one_line(message)}\n")


def _installed(name: str) -> str | None:
    import importlib.metadata  # a tenth of a second: only for --version

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _version() -> str:
    found = _installed("dbo-sim")
    if found is None:
        # Run from a source tree that was never installed: read the project file beside it.
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        text = pyproject.read_text() if pyproject.is_file() else ""
        match = re.search(r'^version = "([^"]+)"', text, re.MULTILINE)
        found = match.group(1) if match else "unknown"
    return f"dbo-sim {found} (torch {_installed('torch') or 'not installed'})"


class _Version(argparse.Action):
    """`--version`, its text looked up only when asked for."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(_version())  # on stdout, as argparse's own version action prints it
        parser.exit(0)


@dataclass(frozen=True)
class Verb:
    """One `dbo-sim` verb: its name, its line in `dbo-sim --help`, and what it runs: a tool
    module in `scenarios.tools` (`module`, imported on first use as `tool`) with
    `add_arguments(parser)` and `run(args) -> int`. Its `--help` description is the tool's
    DESCRIPTION, else the first line of its docstring."""

    name: str
    help: str
    module: str  # the tool's module name in scenarios.tools

    @property
    def tool(self) -> ModuleType:
        return importlib.import_module(f"scenarios.tools.{self.module}")

    def description(self) -> str | None:
        described = getattr(self.tool, "DESCRIPTION", None)
        if described:
            return described
        # The docstring's first paragraph, whole (its first line may end mid-sentence).
        doc = (self.tool.__doc__ or "").strip().split("\n\n")[0]
        return " ".join(doc.split()) or None


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


def build_parser(verbs: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser. Only the tools of `verbs` (None: every verb) are imported and given
    their options; the others are listed by name and help line."""
    parser = _Parser(
        prog="dbo-sim",
        description="Dual Batch Overlap scenarios on a simulated or real GPU",
        epilog=_EPILOG,
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command")
    for verb in VERBS:
        if verbs is not None and verb.name not in verbs:
            sub.add_parser(verb.name, help=verb.help)
            continue
        verb_parser = sub.add_parser(
            verb.name, help=verb.help, description=verb.description(), epilog=_EPILOG
        )
        verb.tool.add_arguments(verb_parser)
        verb_parser.set_defaults(func=verb.tool.run)
    return parser


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
    named = next((a for a in argv if not a.startswith("-")), None)  # the verb, if any
    parser = build_parser([named] if named else [])
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
