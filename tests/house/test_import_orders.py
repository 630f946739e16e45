"""The packages import in any order, and importing them leaves torch as it was.

An import cycle between packages shows only in the order that enters it (`workspace` first
once failed where `dbo` first worked), so each order runs in a fresh interpreter of its own.
(`dbo.sim` first and the pytest plugin first are every test run's own order.)
After its imports each one reads every public name of `dbo` and `workspace` and says whether
torch's NVTX functions are still torch's own: the simulator wraps them when a simulated device
is first used, never on import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

ORDERS = {
    "workspace first": ["workspace", "dbo"],
    "dbo first": ["dbo", "workspace"],
    "dbo.ubatching first": ["dbo.ubatching", "workspace"],
    "dbo.verification first": ["dbo.verification", "workspace"],
}

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
import dbo, torch, workspace
missing = [f"{m.__name__}.{n}" for m in (dbo, workspace) for n in m.__all__ if not hasattr(m, n)]
nvtx = torch.cuda.nvtx
hooked = hasattr(nvtx.range_push, "__wrapped__") or hasattr(nvtx.range_pop, "__wrapped__")
print(json.dumps({"missing": missing, "nvtx_hooked": hooked}))
"""


def import_in_a_fresh_interpreter(names: list[str]) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *names],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, f"importing {names} in this order failed:\n{done.stderr}"
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", list(ORDERS))
def test_the_packages_import_in_this_order_with_every_public_name(order):
    found = import_in_a_fresh_interpreter(ORDERS[order])
    assert found["missing"] == []
    assert found["nvtx_hooked"] is False
