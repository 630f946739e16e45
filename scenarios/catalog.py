"""The scenarios: each runs a workload or a fault and returns one verdict.

A positive scenario passes when outputs match the serial run, no race is reported, and its own
memory relation holds. A negative scenario injects a fault and passes only when the fault is
caught with the right error, promptly, with nothing left registered. The scenarios live in
three modules, imported here in the order `dbo-sim list` shows them: `overlap_scenarios`
(the MoE workload, tiny and DeepSeek-V3 size), `workspace_scenarios` (vLLM's workspace
consumers, graphs and elastic EP) and `fault_scenarios` (the negative ones).
"""

from __future__ import annotations

import time

# Imported for their registrations, in the catalog's order (which `list` and `run` keep).
# isort: off
from scenarios import overlap_scenarios  # noqa: F401
from scenarios import workspace_scenarios  # noqa: F401
from scenarios import fault_scenarios  # noqa: F401

# isort: on
from scenarios.harness import RunOptions
from scenarios.overlap_scenarios import DSV3_DECODE, DSV3_PREFILL, TINY_DECODE, TINY_PREFILL
from scenarios.registry import SCENARIOS, Scenario, ScenarioResult, scenario
from scenarios.verdicts import result_from_comparison
from workspace import reset_workspace_manager

__all__ = [
    "DEFAULT_SCENARIOS",
    "DSV3_DECODE",
    "DSV3_PREFILL",
    "SCENARIOS",
    "Scenario",
    "ScenarioResult",
    "TINY_DECODE",
    "TINY_PREFILL",
    "result_from_comparison",
    "run_scenario",
    "scenario",
]


def run_scenario(name: str, opts: RunOptions) -> ScenarioResult:
    """Run one scenario; an unexpected exception is a failed verdict, never a crash."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; `dbo-sim list` shows them")
    run = SCENARIOS[name].run
    if run is None:
        raise ValueError(f"scenario {name!r} runs only across ranks; pass --ranks N")
    start = time.monotonic()
    try:
        result = run(opts)
    except Exception as error:  # noqa: BLE001 - reported as the verdict
        result = ScenarioResult(
            name,
            passed=False,
            negative=SCENARIOS[name].negative,
            error=f"{type(error).__name__}: {error}",
        )
    finally:
        reset_workspace_manager()
    result.wall_s = time.monotonic() - start
    return result


DEFAULT_SCENARIOS = [name for name, s in SCENARIOS.items() if s.default and s.run is not None]
