"""Caller attribution and the opt-in debug log (DBO_DEBUG_WORKSPACE), for the slow paths only."""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["DEBUG_ENV", "logger", "debug_enabled", "caller_info", "mb"]

DEBUG_ENV = "DBO_DEBUG_WORKSPACE"
logger = logging.getLogger("workspace")

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TRUE = {"1", "true", "yes", "on"}


def debug_enabled() -> bool:
    """Read on every call (slow paths only) so a test or an operator can flip it at run time."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in _TRUE


def caller_info() -> str:
    """'file:line:function' of the first frame outside this package, '<unknown>' if none."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        # abspath: a relative co_filename (python run from the repo) must still be recognised
        if not os.path.abspath(filename).startswith(_PACKAGE_DIR):
            return f"{os.path.basename(filename)}:{frame.f_lineno}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"


def mb(nbytes: int) -> str:
    """Bytes as MB with two decimals, the unit every workspace message uses."""
    return f"{nbytes / float(1 << 20):.2f} MB"
