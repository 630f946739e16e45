"""User stacks for race reports: the innermost frames of the user's code that issued an op.

Frames of torch, of `dbo.sim` itself and of stdlib context plumbing never show. The ubatch
runtime's frames (files registered in `dbo.frames`) are the same in every report, so they show
only when nothing of the user's is on the stack. Capture is raw tuples, cheap enough for every
op; formatting happens only when a race is reported.
"""

from __future__ import annotations

import os
import sys

import torch

from dbo.frames import runtime_files

__all__ = ["Stack", "format_stack", "user_stack"]

# Raw frames, innermost last: (file, line, function).
Stack = tuple[tuple[str, int, str], ...]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SIM_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SKIP_FILES = ("threading.py", "contextlib.py", "weakref.py")


def user_stack(depth: int = 4, skip: int = 1) -> Stack:
    """The innermost `depth` frames of the user's code (outside torch, dbo.sim, the ubatch
    runtime and stdlib context plumbing), as raw (file, line, function) tuples, innermost
    last; the innermost runtime frame alone when no user frame is on the stack. Raw so that
    capturing stays cheap; format only when a race is reported."""
    runtime_set = runtime_files()
    frames: list[tuple[str, int, str]] = []
    runtime: tuple[str, int, str] | None = None
    f = sys._getframe(skip)
    while f is not None and len(frames) < depth:
        filename = f.f_code.co_filename
        if filename in runtime_set:
            if runtime is None:
                runtime = (filename, f.f_lineno, f.f_code.co_name)
        elif not (filename.startswith((_TORCH_DIR, _SIM_DIR)) or filename.endswith(_SKIP_FILES)):
            frames.append((filename, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    if not frames and runtime is not None:
        return (runtime,)
    frames.reverse()
    return tuple(frames)


def format_stack(raw: Stack | None) -> tuple[str, ...]:
    """Raw frames as "file:line:function", files under the working directory made relative."""
    cwd = os.getcwd()
    return tuple(
        f"{os.path.relpath(fn) if fn.startswith(cwd) else fn}:{ln}:{name}"
        for fn, ln, name in (raw or ())
    )
