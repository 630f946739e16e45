"""The errors a ubatched step can end with (each names the ubatch(es) at fault), and the
unwinds that end a ubatch thread whose step is over without it."""

from __future__ import annotations

import threading

__all__ = [
    "UBatchError",
    "YieldMismatchError",
    "UBatchTimeoutError",
    "StepAborted",
    "ReadyBarrierBroken",
    "UBatchAbandoned",
    "describe_error",
]


class UBatchError(RuntimeError):
    """A ubatched step failed. `ubatch_id` is the ubatch at fault (None when several are);
    the original exception, if any, is chained as `__cause__`."""

    def __init__(self, message: str, *, ubatch_id: int | None = None) -> None:
        super().__init__(message)
        self.ubatch_id = ubatch_id


class YieldMismatchError(UBatchError):
    """Ubatches yielded a different number of times; `yield_counts[i]` is ubatch i's."""

    def __init__(self, message: str, *, yield_counts: list[int]) -> None:
        super().__init__(message, ubatch_id=None)
        self.yield_counts = yield_counts


class UBatchTimeoutError(UBatchError):
    """The step did not finish in time; `stacks[i]` is ubatch i's formatted stack."""

    def __init__(self, message: str, *, stacks: dict[int, str]) -> None:
        super().__init__(message, ubatch_id=None)
        self.stacks = stacks


class StepAborted(BaseException):
    """Unwinds a ubatch thread whose step ended without it: a peer failed, or the launcher
    gave up. Raised by the runtime inside the thread (at its next yield, or as it waits for
    the baton) and caught by the runtime's own thread loop, so the caller of `run_ubatches`
    never sees it; the step's error is the one raised there. A BaseException so that user
    code's `except Exception` cannot swallow it and run on with a dead ring. Raised by user
    code while the step is live, it is a failure like any other."""


class ReadyBarrierBroken(StepAborted, threading.BrokenBarrierError):
    """The unwind of a ubatch still waiting at the ready barrier when its step failed: a
    `StepAborted` that is also the `threading.BrokenBarrierError` vLLM's launcher protocol
    gives there, so threads written against vLLM (`with ctx: ...` inside their own
    `try/except BrokenBarrierError`) keep working."""


class UBatchAbandoned(StepAborted):
    """Raised in a thread the launcher abandoned, at its next `dbo_*`, forward-context or
    workspace call.

    Python cannot stop a thread: one stuck in user code past `UBatchTimeoutError` (or past the
    unwind that follows another ubatch's failure) runs on once its blocking call returns.
    Everything it then does through the runtime raises this, so it unwinds instead of
    writing the workspace slot, the forward context or the ring of a later step. What it
    does without the runtime (memory it already holds, its own globals) cannot be stopped.
    The runtime's thread loop catches it; a thread of your own should let it propagate.
    """


def describe_error(error: BaseException) -> str:
    """`Type: message` for any exception, never raising: the runtime formats the user's
    exceptions on its failure path, where a `__str__` or `__repr__` that raises must not
    replace the failure being reported (nor kill the thread reporting it)."""
    try:
        name = type(error).__name__
    except BaseException:  # noqa: BLE001 - a metaclass may break even this
        name = "exception"
    for render in (str, repr):
        try:
            text = render(error)
        except BaseException:  # noqa: BLE001, S112 - a failure falls through to the next form
            continue
        if isinstance(text, str):
            text = str.__str__(text)  # a str subclass could override formatting too
            return f"{name}: {text}" if text else name
    return f"{name}: <unprintable: its __str__ and __repr__ raise>"
