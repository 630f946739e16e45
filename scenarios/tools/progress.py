"""A dependency-free progress bar on stderr, silent when stderr is not a terminal or in --json."""

from __future__ import annotations

import sys
import time
from typing import IO


class Progress:
    """`update(note)` per finished item redraws one line: label, bar, done/total, elapsed, note.
    `enabled=None` draws only when `stream` (default stderr) is a terminal."""

    def __init__(
        self, total: int, label: str, *, stream: IO[str] | None = None, enabled: bool | None = None
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done = 0
        self.start = time.monotonic()

    def update(self, note: str = "", step: int = 1) -> None:
        self.done += step
        if not self.enabled:
            return
        width = 28
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "-" * (width - filled)
        elapsed = time.monotonic() - self.start
        self.stream.write(
            f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {note[:40]:<40}"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
