"""What every `dbo-sim` verb shares about a bad command line: the `UsageError` it raises, the
argparse types that refuse a bad number in the user's words, and the checks that an output
path can be written, all done before any work starts.

It lives beside the tools, not in `scenarios.cli`, so that a tool can refuse in the CLI's own
words without importing the CLI that imports it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "Interrupted",
    "MAX_TIMEOUT_S",
    "finite_float",
    "UsageError",
    "int_in",
    "one_line",
    "positive_int",
    "read_json_file",
    "read_text_file",
    "timeout_seconds",
    "writable_dir",
    "writable_file",
]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # the shell's status for a process ended by SIGINT
MAX_TIMEOUT_S = 86400.0  # a day: larger values overflow the thread waits further down


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


def one_line(text: str, limit: int = 400) -> str:
    """`text` on one line, cut to `limit` characters with a note saying how much was cut."""
    flat = re.sub(r"\s+", " ", text).strip()
    if len(flat) <= limit:
        return flat
    return f"{flat[:limit]} ... ({len(flat) - limit} more characters)"


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high], refused in the user's words."""
    bounds = f">= {low}" if high is None else f"between {low} and {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number {bounds}, got {text!r}"
            ) from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


positive_int = int_in(1)

# A decimal number as people write one, ASCII only: float() also takes "nan", "inf", "1_0"
# and other scripts' digits, none of which a command line means.
_DECIMAL = re.compile(r"[+-]?([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][+-]?[0-9]+)?")


def finite_float(text: str, low: float, high: float, *, above_low: bool = False) -> float:
    """`text` as a finite decimal in [low, high] (in (low, high] with `above_low`); ValueError
    in the user's words otherwise."""
    value = float(text) if _DECIMAL.fullmatch(text.strip()) else math.nan
    low_ok = value > low if above_low else value >= low
    if not (math.isfinite(value) and low_ok and value <= high):
        side = "above" if above_low else "at least"
        raise ValueError(f"expected a number {side} {low:g} and at most {high:g}, got {text!r}")
    return value


def timeout_seconds(text: str) -> float:
    """An argparse type: seconds, finite, above zero and at most a day."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(
            f"expected seconds above 0 and at most {MAX_TIMEOUT_S:.0f}, got {text!r}"
        )
    return value


MAX_JSON_BYTES = 64 << 20  # a configuration or histogram file; a larger one is not one


def read_json_file(path: Path, flag: str) -> object:
    """The JSON value in the file at `path`, or a `UsageError` in one line: no such file, too
    large, not text, not JSON, or nested past Python's recursion limit (refused as such)."""
    text = read_text_file(path, flag)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(
            f"{flag} {path}: not JSON ({error.msg} at character {error.pos})"
        ) from None
    except RecursionError:
        raise UsageError(f"{flag} {path}: JSON nested too deeply to be a configuration") from None


def read_text_file(path: Path, flag: str, max_bytes: int = MAX_JSON_BYTES) -> str:
    """The text of a small input file, or a `UsageError` saying why it cannot be read."""
    try:
        if not path.is_file():
            raise UsageError(f"{flag} {path}: no such file")
        if path.stat().st_size > max_bytes:
            raise UsageError(f"{flag} {path}: larger than {max_bytes >> 20} MB; not an input file")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{flag} {path}: not a UTF-8 text file") from None
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot read it ({error.strerror})") from None
