"""Progress on stderr for the verbs that can run long, drawn by tqdm.

A bar is drawn only where someone watches: never with `--json` (`quiet`), never when stderr
is not a terminal (a pipe, a file, CI, a test's captured stream). Results keep going to stdout
through `emit`, which lifts a live bar off the screen while it prints, so a table and its bar
share one terminal without tearing. A tool that runs long makes one bar for its whole run:

    with progress_bar(len(points), "sweep", quiet=args.json, unit="point") as bar:
        for point in points:
            emit(row(work(point)))
            bar.set_postfix_str(name_of(point))
            bar.update()

tqdm was chosen over rich for what these verbs need and nothing more: one small,
dependency-free package that draws a bar on a stream, updates it from any thread under its own
lock, and prints around it (`tqdm.write`); rich brings a rendering stack the tools have no
other use for.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import IO

from tqdm import tqdm

__all__ = ["advance", "emit", "progress_bar"]


class _Bar(tqdm):
    # No monitor thread: every bar here is updated as work finishes, and a helper thread
    # alive after a verb would be one more thread for the interpreter to outlive.
    monitor_interval = 0


def progress_bar(
    total: int | None,
    label: str,
    *,
    quiet: bool = False,
    unit: str = "it",
    stream: IO[str] | None = None,
) -> tqdm:
    """A bar of `total` steps (None: a count without an end) named `label`, on `stream`
    (default stderr); disabled when `quiet` or when the stream is not a terminal. Use it as a
    context manager, or call `close()`: the bar then leaves the screen."""
    stream = sys.stderr if stream is None else stream
    on_terminal = bool(getattr(stream, "isatty", lambda: False)())
    return _Bar(
        total=total,
        desc=label,
        unit=unit,
        file=stream,
        disable=quiet or not on_terminal,
        leave=False,
        dynamic_ncols=True,
    )


def emit(line: str) -> None:
    """Print `line` to stdout and flush it (so an interrupt keeps it), clearing any live bar
    while it prints and redrawing the bar below it."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def advance(bar: tqdm) -> Callable[[str], None]:
    """A callback for work that reports each finished part by name: it names the part on the
    bar and moves the bar one step."""

    def on_part(what: str) -> None:
        bar.set_postfix_str(what)
        bar.update()

    return on_part
