"""List the scenarios: name, positive or negative (a fault it must catch), and what it runs.

It reads `scenarios.index`, the listed table, not the registry: listing imports no torch."""

from __future__ import annotations

import argparse
import json

from scenarios.index import LISTED

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per scenario and line")


def run(args: argparse.Namespace) -> int:
    """`dbo-sim list`: one line (or JSON object) per registered scenario."""
    for s in LISTED:
        kind = "negative" if s.negative else "positive"
        if args.json:
            entry = {
                "name": s.name,
                "kind": kind,
                "default": s.default,
                "cuda": s.cuda,
                "summary": s.summary,
            }
            print(json.dumps(entry))
        else:
            print(f"{s.name:24} {kind:8}  {s.summary}")
    return 0
