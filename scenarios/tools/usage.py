"""What every `dbo-sim` verb shares about a bad command line: the `UsageError` it raises and
the checks that an output path can be written, both done before any work starts.

It lives beside the tools, not in `scenarios.cli`, so that a tool can refuse in the CLI's own
words without importing the CLI that imports it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

__all__ = ["Interrupted", "UsageError", "writable_dir", "writable_file"]


class UsageError(Exception):
    """A bad command line: the CLI prints it after "dbo-sim: " and exits 2."""


class Interrupted(Exception):
    """Ctrl-C during a verb: the message says what had finished and where it is kept; the CLI
    prints it on one line and exits 130."""


def writable_dir(path: Path, flag: str = "--out", shown: Path | None = None) -> None:
    """Create `path` if needed and prove a file can be written there, before any work."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        why = error.strerror or type(error).__name__
        where = "this folder" if shown is None else f"its folder {path}"
        raise UsageError(
            f"{flag} {shown or path}: cannot create or write {where} ({why}); choose another"
        ) from None


def writable_file(path: Path, flag: str = "--out") -> None:
    """`path` can be written as a file: its folder is writable and it is not a folder."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    writable_dir(path.parent, flag, shown=path)
