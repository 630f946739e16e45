"""Read a Chrome trace file (`.json` or `.json.gz`) as a stream of its events.

One job: turn a file written by `torch.profiler`'s `export_chrome_trace` (the format vLLM's and
SGLang's profilers write, and the one `dbo-sim run` writes) into its events and top-level
fields, without holding the file's text in memory. A profiler trace of a long run is hundreds
of MB of JSON, and `json.load` would keep the whole text plus every event (flow arrows,
metadata, CPU ops nobody asked about) at once. Here the text is decoded in chunks: the
top-level object's fields are decoded one by one, and the `traceEvents` array element by
element (`json.JSONDecoder.raw_decode` on a buffer that never holds more than a chunk plus one
event), so memory holds only what the caller's `select` keeps of each event.

Every way a file can fail to be a trace raises `TraceError` with one line saying what was
wrong: not JSON, JSON without `traceEvents`, a truncated `.gz`, a cut-off JSON text, or a
value nested deeper than Python decodes. One event that cannot be read is not the file's
fault: `select` raises `MalformedEvent` and the event is skipped and counted (`skipped`).
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["MalformedEvent", "RawTrace", "Select", "TraceError", "read_trace"]

_CHUNK = 1 << 20  # characters decoded per read: large enough that few events straddle reads
_WHITESPACE = " \t\n\r"
# A value still undecoded after this many characters is broken JSON, not a long one: stop
# reading instead of pulling the rest of a large file into the buffer.
_MAX_VALUE = 1 << 28


Select = Callable[[dict[str, Any]], "dict[str, Any] | None"]


class TraceError(ValueError):
    """A file that cannot be analyzed as a profiler trace; the message is one line."""


class MalformedEvent(ValueError):
    """Raised by a `select` for one event it cannot read; the message is the reason, the
    reader counts the event under it and reads on."""


@dataclass
class RawTrace:
    """What was kept of a trace: its events (those the filter accepted, in file order), its
    other top-level fields (`deviceProperties`, `otherData`, ...), and how many events the
    file held in all, and the events skipped as malformed, counted by reason."""

    path: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)
    total_events: int = 0
    skipped: Counter[str] = field(default_factory=Counter)


class _Stream:
    """A text buffer over a file that decodes JSON values one at a time."""

    def __init__(self, f: IO[str]) -> None:
        self.f = f
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.decoder = json.JSONDecoder()

    def _more(self) -> bool:
        if self.eof:
            return False
        chunk = self.f.read(_CHUNK)
        if not chunk:
            self.eof = True
            return False
        self.buf = self.buf[self.pos :] + chunk
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next non-whitespace character ('' at the end of the text)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WHITESPACE:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._more():
                return ""

    def expect(self, char: str, where: str) -> None:
        found = self.peek()
        if found != char:
            shown = repr(found) if found else "the end of the file"
            raise TraceError(f"expected {char!r} {where}, found {shown}")
        self.pos += 1

    def value(self) -> Any:
        """Decode the next JSON value, reading more text while the buffer cuts it off."""
        self.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as error:
                # A value cut by the end of the buffer fails near its end: read on. Anything
                # else, or a failure with the whole file read, is a broken text.
                if len(self.buf) - self.pos < _MAX_VALUE and self._more():
                    continue
                raise TraceError(f"invalid JSON ({error.msg} at character {error.pos})") from None
            except RecursionError:
                raise TraceError(
                    f"a JSON value nested too deeply to decode (at character {self.pos})"
                ) from None
            # A number at the very end of the buffer may continue in the next chunk.
            if end == len(self.buf) and not self.eof and self._more():
                continue
            self.pos = end
            return value


def _opener(path: Path) -> Callable[[], IO[str]]:
    if path.suffix == ".gz":
        return lambda: gzip.open(path, "rt", encoding="utf-8")
    return lambda: open(path, encoding="utf-8")


def read_trace(path: str | Path, select: Select = lambda e: e) -> RawTrace:
    """The events of the trace at `path` as `select` keeps them (it returns the event, a
    slimmer copy, or None to drop it), and the trace's other top-level fields. Accepts the
    object form (`{"traceEvents": [...], ...}`) and the bare-array form."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    out = RawTrace(path)
    try:
        with _opener(path)() as f:
            _parse(_Stream(f), out, select)
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:
        raise TraceError(f"{path}: the compressed file is damaged or cut short ({error})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file (not a Chrome trace)") from None
    except OSError as error:  # unreadable (permissions, a device): the file, not a bug
        raise TraceError(f"{path}: cannot read it ({error.strerror or error})") from None
    except TraceError as error:
        raise TraceError(f"{path}: not a profiler trace: {error}") from None
    return out


def _parse(s: _Stream, out: RawTrace, select: Select) -> None:
    first = s.peek()
    if first == "[":
        _events(s, out, select)
    elif first == "{":
        s.pos += 1
        seen_events = False
        while s.peek() != "}":
            key = s.value()
            if not isinstance(key, str):
                raise TraceError("an object key is not a string")
            s.expect(":", f"after the key {key!r}")
            if key == "traceEvents":
                if s.peek() != "[":
                    raise TraceError("traceEvents is not an array")
                _events(s, out, select)
                seen_events = True
            else:
                out.fields[key] = s.value()
            if s.peek() == ",":
                s.pos += 1
        s.pos += 1
        if not seen_events:
            raise TraceError("a JSON object without traceEvents")
    else:
        shown = repr(first) if first else "an empty file"
        raise TraceError(f"expected a JSON object or array, found {shown}")


def _events(s: _Stream, out: RawTrace, select: Select) -> None:
    s.expect("[", "at the start of traceEvents")
    while True:
        nxt = s.peek()
        if nxt == "]":
            s.pos += 1
            return
        if nxt == "":
            raise TraceError("the event list is cut short (the file ends inside it)")
        event = s.value()
        out.total_events += 1
        try:
            if not isinstance(event, dict):
                raise MalformedEvent("an event that is not a JSON object")
            kept = select(event)
        except MalformedEvent as bad:
            out.skipped[str(bad)] += 1
            kept = None
        if kept is not None:
            out.events.append(kept)
        after = s.peek()
        if after == ",":
            s.pos += 1
        elif after != "]":
            shown = repr(after) if after else "the end of the file"
            raise TraceError(f"expected ',' or ']' between events, found {shown}")
