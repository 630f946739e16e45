"""`import dbo` leaves the simulator unloaded until a simulated device is first resolved."""

import subprocess
import sys

import pytest

_STATE = (
    "import sys, torch; "
    "print('dbo.sim' in sys.modules, 'dbo.sim.intercept' in sys.modules, "
    "hasattr(torch.cuda.nvtx.range_push, '__wrapped__'))"
)


def _run(code: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.split()


@pytest.mark.timeout(150)
def test_import_dbo_loads_no_simulator_modes_or_nvtx_hooks() -> None:
    assert _run(f"import dbo; {_STATE}") == ["False", "False", "False"]


@pytest.mark.timeout(150)
def test_resolving_a_simulated_device_loads_the_simulator() -> None:
    code = f"import dbo, dbo.devices; dbo.devices.resolve_device('sim'); {_STATE}"
    assert _run(code) == ["True", "True", "True"]


@pytest.mark.timeout(150)
def test_the_default_device_is_the_simulator_loaded_on_first_use() -> None:
    code = f"import dbo; print(dbo.current_device().kind); {_STATE}"
    assert _run(code) == ["sim", "True", "True", "True"]
