"""Argument checks shared by the runtime, the simulator and the workspace: one wording for
every integer argument, and the proof that an output folder can be written."""

from __future__ import annotations

import operator
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

# vLLM's words for the common bounds, so handlers and tests matching them keep working.
_WORDS = {0: " (non-negative)", 1: " (at least one)"}


def as_int(name: str, value: Any, *, minimum: int = 0) -> int:
    """`value` as an int >= `minimum`; bools are refused because True passing as 1 hides a
    mix-up, and numpy/torch integer scalars pass through `operator.index`."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got a bool ({value!r})")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if count < minimum:
        raise ValueError(f"{name} must be >= {minimum}{_WORDS.get(minimum, '')}, got {count}")
    return count


def writable_folder(name: str, folder: str | Path) -> Path:
    """Make `folder` if needed and write a scratch file in it, so that a folder that cannot
    hold the output is refused before the work that would fill it. Permission bits alone do
    not say it (root passes `os.access` under /proc, where nothing can be made)."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name}={str(folder)!r} is a file; name a folder for the output")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        why = error.strerror or type(error).__name__
        raise ValueError(
            f"{name}={str(folder)!r}: cannot create or write this folder ({why}); name "
            f"a folder you can write"
        ) from None
    return path
