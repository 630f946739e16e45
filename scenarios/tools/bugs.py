"""`dbo-sim bugs`: the corpus of real DBO bugs, each buggy variant caught and each fixed one
clean (`scenarios.bugs`; docs/bugs.md).

`dbo-sim bugs` lists and runs every entry, `dbo-sim bugs NAME...` the named ones, `--list`
only lists them, `--json` prints one object per entry. Exit status 0 when every entry run
holds (buggy caught with a message naming its cause, fixed clean), 1 otherwise.

The parser is here; the work, and torch with it, is `scenarios.tools.bugs_run`, imported
by `run`, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse

__all__ = ["DESCRIPTION", "add_arguments", "run"]


DESCRIPTION = (
    "Run the corpus of real DBO bugs from vLLM's and SGLang's trackers: each buggy variant "
    "must be caught naming its cause, each fixed variant must pass."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", metavar="NAME", help="entries to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the entries without running")
    parser.add_argument("--json", action="store_true", help="one JSON object per entry")


def run(args: argparse.Namespace) -> int:
    from scenarios.tools import bugs_run  # torch and the work: only now

    return bugs_run.run(args)
