"""Where the calling thread last moved onto a stream without ordering it: a thread-local note
the runtime's plain switches leave, and race reports read.

A plain `dbo_switch_to_comm()` (or `dbo_switch_to_compute()`) records no event and makes the
stream it moves to wait for nothing, so work issued next there is not ordered after the
ubatch's work on the stream it left. When that work races, the racing ops are where the race
surfaced; the fix belongs at the switch (its `*_sync` twin). Every ordered switch clears the
note, so it names only a switch the thread is still standing on. The simulator's race checker
reads it on the thread that issues the racing op, the one that switched; it lives outside
`dbo.sim` so that the runtime never imports the simulator.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["PlainSwitch", "note_switch", "last_plain_switch"]

_NOTE = threading.local()


@dataclass(frozen=True, slots=True)
class PlainSwitch:
    """A switch onto `stream` that made it wait for nothing."""

    stream: str  # the stream's name
    call: str  # the helper the user called, "dbo_switch_to_comm"
    site: str  # where it was called, "file:line:function"

    def describe(self) -> str:
        return f"{self.call}() at {self.site}"


def note_switch(switch: PlainSwitch | None) -> None:
    """Note the calling thread's latest switch: a plain one, or None for an ordered one."""
    _NOTE.switch = switch


def last_plain_switch() -> PlainSwitch | None:
    """The calling thread's plain switch it still stands on, if any."""
    return getattr(_NOTE, "switch", None)
