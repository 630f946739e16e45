"""The negative scenarios: each injects a fault and passes only when it is caught with the
right error, promptly, with nothing left registered."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import dbo
from scenarios.harness import (
    RunOptions,
    new_device,
    run_step,
    write_artifacts,
)
from scenarios.model import Batch, MoEModel, preset
from scenarios.overlap_scenarios import TINY_PREFILL
from scenarios.ranks.processes import run_local_ranks
from scenarios.registry import ScenarioResult, caught_line, scenario
from scenarios.steps import ubatched_step
from scenarios.verdicts import fresh_device, registries_empty, with_artifacts
from workspace import (
    WorkspaceLockedError,
)


class NoWaitModel(MoEModel):
    """The seeded bug: switch to the comm stream without waiting for this ubatch's compute."""

    def _yield_to_comm(self) -> None:
        dbo.dbo_yield()
        dbo.dbo_switch_to_comm()


@scenario(
    "missing-wait-race",
    "Negative: dispatch switches to the comm stream without waiting for compute; the race "
    "checker must "
    "report it",
    negative=True,
)
def _missing_wait(opts: RunOptions) -> ScenarioResult:
    device = new_device(opts)
    model = NoWaitModel(preset("tiny"), TINY_PREFILL)
    run = run_step(
        model,
        model.inputs(),
        device=device,
        num_ubatches=opts.num_ubatches,
        mode="ht",
        timeout_s=opts.timeout_s,
    )
    caught = [
        r
        for r in run.races
        if r.second.op.endswith("dispatch") and r.second.stream.startswith("comm")
    ]
    result = ScenarioResult(
        "missing-wait-race",
        passed=bool(caught),
        negative=True,
        races=len(run.races),
        error=None if caught else "the missing wait was not reported as a race",
        caught=caught_line(
            f"{len(caught)} race(s): {caught[0].second.op} on stream "
            f"{caught[0].second.stream!r} does not wait for {caught[0].first.op}"
        )
        if caught
        else None,
        details={"first_race": caught[0].describe() if caught else None},
    )
    if opts.out_dir is not None:
        result.trace, result.timeline_png = write_artifacts(
            "missing-wait-race", run, opts, caught=result.caught
        )
    return result


_PROMPT_S = 5.0  # a caught fault must end the step within this (or the step timeout, if less)


def _expect_failure(
    name: str,
    opts: RunOptions,
    fn: Callable[[int], Any],
    expected: type[BaseException],
    check: Callable[[BaseException], bool],
) -> ScenarioResult:
    """Run `fn` as a ubatched step; pass only if it raised `expected`, `check` accepts the
    error, it ended promptly and the runtime's registries are empty afterwards."""
    device, _ = fresh_device(opts)
    start = time.monotonic()
    caught: BaseException | None = None
    try:
        dbo.run_ubatches(fn, list(range(opts.num_ubatches)), device=device, timeout=opts.timeout_s)
    except BaseException as error:  # noqa: BLE001 - the fault under test
        caught = error
    elapsed = time.monotonic() - start
    prompt = elapsed < min(_PROMPT_S, opts.timeout_s)
    ok = isinstance(caught, expected) and check(caught) and registries_empty() and prompt
    got = f"{type(caught).__name__}: {caught}" if caught is not None else "no error"
    result = ScenarioResult(
        name,
        passed=ok,
        negative=True,
        error=None
        if ok
        else (
            f"expected {expected.__name__} within {_PROMPT_S:g} s with empty registries, got {got} "
            f"after {elapsed:.2f} s"
        ),
        caught=None if caught is None else caught_line(got),
        details={
            "caught": got if caught is not None else None,
            "seconds": round(elapsed, 3),
            "threads_alive": threading.active_count(),
        },
    )
    return with_artifacts(result, device, opts, caught)


@scenario(
    "yield-mismatch",
    "Negative: one ubatch yields once more than the others; a YieldMismatchError must name "
    "every count",
    negative=True,
    cuda=True,
)
def _yield_mismatch(opts: RunOptions) -> ScenarioResult:
    def fn(u: int) -> None:
        for _ in range(3 + (1 if u == 0 else 0)):
            dbo.dbo_yield()

    def names_every_count(error: BaseException) -> bool:
        return all(f"ubatch {i}:" in str(error) for i in range(opts.num_ubatches))

    return _expect_failure("yield-mismatch", opts, fn, dbo.YieldMismatchError, names_every_count)


@scenario(
    "exception-in-ubatch",
    "Negative: the last ubatch raises mid-step; every peer is released and one UBatchError "
    "names it",
    negative=True,
    cuda=True,
)
def _exception_in_ubatch(opts: RunOptions) -> ScenarioResult:
    last = opts.num_ubatches - 1

    def fn(u: int) -> None:
        dbo.dbo_yield()
        if u == last:
            raise RuntimeError("expert kernel failed")
        dbo.dbo_yield()

    def names_the_raiser(error: BaseException) -> bool:
        return getattr(error, "ubatch_id", None) == last and isinstance(
            error.__cause__, RuntimeError
        )

    return _expect_failure("exception-in-ubatch", opts, fn, dbo.UBatchError, names_the_raiser)


@scenario(
    "locked-growth",
    "Negative: after warm-up and lock, a larger batch needs more workspace; the error names the "
    "caller "
    "and both sizes",
    negative=True,
)
def _locked_growth(opts: RunOptions) -> ScenarioResult:
    device = new_device(opts)
    small = MoEModel(preset("tiny"), Batch.decode(64, 16))
    run_step(
        small,
        small.inputs(),
        device=device,
        num_ubatches=opts.num_ubatches,
        mode="ll",
        timeout_s=opts.timeout_s,
    )
    # run_step left the workspace warmed for 64 tokens and locked; now 128 tokens arrive.
    big = MoEModel(preset("tiny"), Batch.decode(128, 16))
    step = ubatched_step(
        big,
        big.inputs(),
        device,
        mode="ll",
        num_ubatches=opts.num_ubatches,
        timeout_s=opts.timeout_s,
    )
    caught: BaseException | None = None
    try:
        step()
    except dbo.UBatchError as error:
        caught = error.__cause__
    message = str(caught)
    ok = (
        isinstance(caught, WorkspaceLockedError)
        and "model.py" in message  # the caller, outside the manager
        and "MB" in message  # both sizes
        and registries_empty()
    )
    result = ScenarioResult(
        "locked-growth",
        passed=ok,
        negative=True,
        error=None if ok else f"expected WorkspaceLockedError naming model.py, got {caught!r}",
        caught=None if caught is None else caught_line(f"{type(caught).__name__}: {message}"),
        details={"caught": message if caught is not None else None},
    )
    return with_artifacts(result, device, opts, caught)


@scenario(
    "dp-disagreement",
    "Negative, 2 processes (or --ranks N): DP ranks decide ubatching alone (2 vs 1 ubatches); "
    "the EP step "
    "handshake must stop every rank with an error naming each rank's count, and the agreed step "
    "must then run",
    negative=True,
)
def _dp_disagreement(opts: RunOptions) -> ScenarioResult:
    return run_local_ranks(["dp-disagreement"], opts, ranks=2)[0]
