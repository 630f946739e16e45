"""The simulator wraps torch's NVTX push and pop when a thread first enters a simulated
device's scope, not when it is imported or a device is made: `import dbo` (which loads the
simulator with the verify tools) leaves torch as it was. Each test runs in a fresh interpreter,
since the hooks are process-wide and this one has long entered a scope."""

import subprocess
import sys

import pytest

# Whether push is wrapped, and whether what it wraps is itself a wrapper (wrapped twice).
_HOOKED = (
    "import torch; push = torch.cuda.nvtx.range_push; inner = getattr(push, '__wrapped__', None); "
    "print(hasattr(push, '__wrapped__'), hasattr(inner, '__wrapped__'))"
)


def _run(code: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.split()


@pytest.mark.timeout(150)
def test_making_a_simulated_device_leaves_nvtx_as_torch_has_it() -> None:
    code = f"import dbo; dbo.devices.resolve_device('sim'); dbo.current_device(); {_HOOKED}"
    assert _run(code) == ["False", "False"]


@pytest.mark.timeout(150)
def test_entering_a_simulated_devices_scope_wraps_nvtx_once() -> None:
    code = (
        "import dbo; from dbo.sim import SimDevice\n"
        "for device in (SimDevice(), SimDevice()):\n"
        "    with device.thread_scope(None): pass\n"
        f"{_HOOKED}"
    )
    assert _run(code) == ["True", "False"]  # wrapped, and the wrapped one is torch's own
