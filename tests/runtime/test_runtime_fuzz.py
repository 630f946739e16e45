"""Random faults, many steps: whatever a ubatch does wrong, the step ends with one clear error.

Each step draws a ubatch count, a legal yield schedule shared by every ubatch and, for some
ubatches, a fault at a random phase: raising one of several exception kinds (BaseExceptions,
ones whose `__str__` or `__repr__` raise, the user's own `UBatchError`, the runtime's private
unwind), returning early, yielding once more, a recv hook that raises, a nested step, or user
code that outlasts the timeout. Some ubatches also swallow every exception (`except
BaseException`) and return. The invariants, checked on every step:

- a step without faults returns every ubatch's output;
- a step with a fault raises exactly one error, a `UBatchError`: a `UBatchTimeoutError` only if
  some ubatch was stuck, a `YieldMismatchError` only if some ubatch returned early or yielded
  once more, otherwise one naming the ubatch in whose thread its `__cause__` (the very object
  the fault raised) was raised; no output comes back for a failed step;
- nothing stays registered, and at the end no ubatch thread is left but the pool's idle ones.

`DBO_FUZZ_STEPS` (default 200) and `DBO_FUZZ_SEED` set the run; the seed, the counts and the
outcomes are printed (`pytest -s`), and a failure names the step's seed, which replays it alone.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import dbo
from dbo import ubatching, workers
from dbo.errors import StepAborted
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions

STEPS = int(os.environ.get("DBO_FUZZ_STEPS", "200"))
SEED = int(os.environ.get("DBO_FUZZ_SEED", "20261130"))
# A step with a stuck ubatch gets a short timeout, every other step a long one: a loaded
# machine must not turn a healthy step into a timeout.
_STUCK_TIMEOUT_S = 0.15
_STUCK_FOR_S = 0.3
_TIMEOUT_S = 20.0

_HELPERS: dict[str, Callable[[], None]] = {
    "yield": dbo.dbo_yield,
    "to_comm": dbo.dbo_yield_and_switch_from_compute_to_comm,
    "to_compute": dbo.dbo_yield_and_switch_from_comm_to_compute,
}


# ------------------------------------------------------------------ exceptions to raise


class _UnprintableError(Exception):
    def __str__(self) -> str:
        raise _UnprintableError()


class _NoText(Exception):
    def __str__(self) -> str:
        raise AttributeError("no message field")

    def __repr__(self) -> str:
        raise AttributeError("no message field")


class _Custom(BaseException):
    pass


_KINDS: dict[str, Callable[[], BaseException]] = {
    "ValueError": lambda: ValueError("bad value"),
    "KeyboardInterrupt": KeyboardInterrupt,
    "SystemExit": lambda: SystemExit(2),
    "GeneratorExit": GeneratorExit,
    "custom BaseException": _Custom,
    "str raises": _UnprintableError,
    "str and repr raise": _NoText,
    "user UBatchError": lambda: dbo.UBatchError("the model's own"),
    "private unwind": StepAborted,
}

_FAULTS = ("raise", "early_return", "extra_yield", "hook", "nested", "stuck")
_MISMATCH_FAULTS = {"early_return", "extra_yield"}


# ------------------------------------------------------------------ one step's plan


@dataclass
class _UBatchPlan:
    fault: str | None = None
    at: int = 0  # the phase before which the fault happens
    kind: str = "ValueError"
    swallow: bool = False  # wraps the body in `except BaseException: return`


@dataclass
class _StepPlan:
    seed: int
    schedule: list[str]
    ubatches: list[_UBatchPlan]
    # id(exception) -> (the ubatch whose thread raised it, the exception, kept alive)
    raised_in: dict[int, tuple[int, BaseException]] = field(default_factory=dict)

    @property
    def faults(self) -> set[str]:
        """The faults that must fail the step: an early return or an extra yield only when
        the yield counts then differ (every ubatch returning early alike is a legal step)."""
        faults = {u.fault for u in self.ubatches if u.fault is not None}
        if len(set(self.yield_counts())) == 1:
            faults -= _MISMATCH_FAULTS
        return faults

    def yield_counts(self) -> list[int]:
        full = len(self.schedule)
        return [
            u.at if u.fault == "early_return" else full + (u.fault == "extra_yield")
            for u in self.ubatches
        ]

    def outputs(self) -> list[Any]:
        return [
            ("returned early", i) if u.fault == "early_return" else (i, len(self.schedule))
            for i, u in enumerate(self.ubatches)
        ]

    def describe(self) -> str:
        return f"step seed {self.seed}: schedule {self.schedule}, ubatches {self.ubatches}"


def _schedule(rng: random.Random) -> list[str]:
    """Legal yields: the switch helpers alternate compute -> comm and end on compute."""
    schedule, on_comm = [], False
    for _ in range(rng.randint(0, 4)):
        pick = rng.choice(["yield", "to_compute" if on_comm else "to_comm"])
        on_comm = {"yield": on_comm, "to_comm": True, "to_compute": False}[pick]
        schedule.append(pick)
    if on_comm:
        schedule.append("to_compute")
    return schedule


def _plan(seed: int) -> _StepPlan:
    rng = random.Random(seed)
    num = rng.randint(2, 4)
    schedule = _schedule(rng)
    ubatches = [_UBatchPlan(swallow=rng.random() < 0.1) for _ in range(num)]
    if rng.random() < 0.6:  # some steps run clean, to check the outputs too
        for u in rng.sample(ubatches, rng.randint(1, min(2, num))):
            choices = [f for f in _FAULTS if f != "early_return" or schedule]
            # Raises spread over many kinds; stuck steps cost a timeout each.
            weights = [{"raise": 12, "stuck": 1}.get(f, 6) for f in choices]
            u.fault = rng.choices(choices, weights)[0]
            u.at = rng.randint(0, len(schedule) - (1 if u.fault == "early_return" else 0))
            u.kind = rng.choice(sorted(_KINDS))
    return _StepPlan(seed, schedule, ubatches)


# ------------------------------------------------------------------ one ubatch's body


def _record(plan: _StepPlan, error: BaseException) -> BaseException:
    plan.raised_in[id(error)] = (dbo.dbo_current_ubatch_id(), error)
    return error


def _fault(plan: _StepPlan, me: _UBatchPlan, device: SimDevice) -> Any:
    """Do ubatch `me`'s fault; returns a value to return early with, else None."""
    if me.fault == "raise":
        raise _record(plan, _KINDS[me.kind]())
    if me.fault == "early_return":
        return ("returned early", dbo.dbo_current_ubatch_id())
    if me.fault == "stuck":
        time.sleep(_STUCK_FOR_S)
    elif me.fault == "hook":
        kind = me.kind

        def hook() -> None:
            raise _record(plan, _KINDS[kind]())

        try:
            dbo.dbo_register_recv_hook(hook)  # refused if the next ubatch has finished
        except RuntimeError as error:
            raise _record(plan, error) from None
    elif me.fault == "nested":
        try:
            dbo.run_ubatches(lambda x: x, [0, 1], device=device)
        except RuntimeError as error:
            raise _record(plan, error) from None
    return None


def _body(plan: _StepPlan, device: SimDevice) -> Callable[[int], Any]:
    def run(i: int) -> Any:
        me = plan.ubatches[i]
        for k, helper in enumerate(plan.schedule):
            if me.fault is not None and me.at == k:
                early = _fault(plan, me, device)
                if early is not None:
                    return early
            _HELPERS[helper]()
            dbo.dbo_maybe_run_recv_hook()
        if me.fault is not None and me.at == len(plan.schedule):
            _fault(plan, me, device)
        if me.fault == "extra_yield":
            dbo.dbo_yield()
        return (i, len(plan.schedule))

    def fn(i: int) -> Any:
        if not plan.ubatches[i].swallow:
            return run(i)
        try:
            return run(i)
        except BaseException as error:
            if id(error) in plan.raised_in:
                raise  # an injected fault: swallowing it would be a legitimate recovery
            return "swallowed"  # the runtime's unwind or a mismatch: the misbehaviour under test

    return fn


# ------------------------------------------------------------------ the checks


def _check_failure(plan: _StepPlan, error: BaseException) -> str:
    """Raise AssertionError unless `error` is what the plan allows; returns its kind."""
    where = plan.describe()
    assert isinstance(error, dbo.UBatchError), f"{where}: raised {type(error).__name__}"
    if isinstance(error, dbo.UBatchTimeoutError):
        assert "stuck" in plan.faults, f"{where}: timed out without a stuck ubatch"
        assert set(error.stacks) == set(range(len(plan.ubatches))), where
        return "UBatchTimeoutError"
    if isinstance(error, dbo.YieldMismatchError):
        assert plan.faults & _MISMATCH_FAULTS, f"{where}: mismatch without one: {error}"
        assert error.ubatch_id is None and len(error.yield_counts) == len(plan.ubatches), where
        return "YieldMismatchError"
    cause = error.__cause__
    assert cause is not None, f"{where}: {error} has no cause"
    assert id(cause) in plan.raised_in, f"{where}: cause {type(cause).__name__} not injected"
    assert error.ubatch_id == plan.raised_in[id(cause)][0], f"{where}: wrong ubatch named"
    assert f"ubatch {error.ubatch_id} raised {type(cause).__name__}" in str(error), where
    return "UBatchError"


def _worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dbo-ubatch-worker")]


@pytest.mark.timeout(max(60, STEPS))
def test_random_faults_always_end_the_step_with_one_clear_error():
    device = SimDevice(SimOptions(check_races=False))
    outcomes: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for n in range(STEPS):
        plan = _plan(SEED * 1_000_003 + n)
        kinds.update(
            f"{u.fault}:{u.kind}" if u.fault == "raise" else str(u.fault)
            for u in plan.ubatches
            if u.fault
        )
        timeout = _STUCK_TIMEOUT_S if "stuck" in plan.faults else _TIMEOUT_S
        try:
            outputs = dbo.run_ubatches(
                _body(plan, device), list(range(len(plan.ubatches))), device=device, timeout=timeout
            )
        except BaseException as error:  # noqa: BLE001 - checked against the plan
            outcomes[_check_failure(plan, error)] += 1
        else:
            assert not plan.faults, f"{plan.describe()}: returned {outputs}"
            assert outputs == plan.outputs(), plan.describe()
            outcomes["returned"] += 1
        assert not ubatching.ubatch_step_active(), f"{plan.describe()}: registries not empty"
    print(
        f"\nruntime fuzz: seed {SEED}, {STEPS} steps, outcomes {dict(outcomes)}, "
        f"faults {dict(sorted(kinds.items()))}"
    )
    # Threads left behind by stuck ubatches end once their sleep returns; none lingers.
    give_up = time.monotonic() + 5.0
    while len(_worker_threads()) > workers.idle_worker_count() and time.monotonic() < give_up:
        time.sleep(0.05)
    assert len(_worker_threads()) == workers.idle_worker_count()
    assert sum(outcomes.values()) == STEPS and outcomes["returned"] > 0
