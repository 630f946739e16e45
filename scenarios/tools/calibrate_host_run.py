"""The work of `dbo-sim calibrate-host`: time this host's launches and ubatch handoffs and
write them as a profile's host costs.

`dbo-sim calibrate-host` times, on the machine it runs on (a CUDA GPU by default; `--device sim`
measures the handoff alone, on any machine):
- `launch_us`: host time of one eager torch op from Python (a tiny elementwise kernel and a
  small cuBLAS matmul; the profile's value is a typical model op between the two);
- `handoff_us`: host time of one `dbo_yield` between two ubatch threads, through
  `dbo.run_ubatches` on the given device.

On a GPU it uses `dbo.CudaDevice`; without one it can still measure the handoff on the
simulated device (`--device sim`), which has no real launches to time (its launch rows say
so). The H200 profile's host costs came from this measurement on an H200 host (the values are
in `dbo.sim.hardware`). The result is written as JSON to `--out` (default
`out/host-costs.json`, checked writable before anything is measured); use it with
`dataclasses.replace(profile, launch_us=..., handoff_us=...)` or a device's
`SimOptions(overrides=ProfileOverrides(launch_us=..., handoff_us=...))`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import dbo
from dbo.devices import resolve_device
from dbo.streams import Device
from scenarios.lib.usage import UsageError, writable_file

NOT_MEASURED = "not measured: the simulated device prices launches from its profile"
NO_GPU_MESSAGE = (
    "no CUDA GPU present: nothing to measure (`--device sim` measures the handoff alone)"
)


@dataclass(frozen=True)
class HostCosts:
    device: str
    elementwise_launch_us: float | None  # None where there is no real device to launch on
    matmul_launch_us: float | None
    handoff_us: float


def _median_us_per_call(fn: Callable[[], None], calls: int, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def measure_launch_us(device: Device, *, calls: int = 5000, reps: int = 3) -> tuple[float, float]:
    """Host microseconds per eager op: a 16-element add_ and a 64x64 matmul, on `device`."""
    x = torch.ones(16, device=device.torch_device)
    a = torch.randn(64, 64, device=device.torch_device)
    device.synchronize()
    add = _median_us_per_call(lambda: x.add_(1), calls, reps)
    mm = _median_us_per_call(lambda: torch.mm(a, a), calls, reps)
    device.synchronize()
    return add, mm


def measure_handoff_us(device: Device, *, yields: int = 2000, reps: int = 3) -> float:
    """Host microseconds per baton pass: two ubatch threads each yield `yields` times."""

    def ping_pong(_: int) -> None:
        for _ in range(yields):
            dbo.dbo_yield()

    dbo.run_ubatches(ping_pong, [0, 1], device=device)  # warm the worker threads
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        dbo.run_ubatches(ping_pong, [0, 1], device=device)
        samples.append((time.perf_counter() - start) / (2 * yields) * 1e6)
    return statistics.median(samples)


def calibrate(device_name: str, *, quick: bool = False) -> HostCosts:
    device = resolve_device(device_name)
    scale = 10 if quick else 1
    if device.kind == "cuda":
        add, mm = measure_launch_us(device, calls=5000 // scale)
    else:
        add = mm = None  # the simulated device charges launches; there is nothing real to time
    handoff = measure_handoff_us(device, yields=2000 // scale)
    return HostCosts(
        device=str(device.torch_device) if device.kind == "cuda" else "sim",
        elementwise_launch_us=add,
        matmul_launch_us=mm,
        handoff_us=handoff,
    )


def run(args: argparse.Namespace) -> int:
    """`dbo-sim calibrate-host`: measure and print; refuses before any work without a GPU."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(NO_GPU_MESSAGE)
    out = Path(args.out)
    writable_file(out)
    costs = calibrate(args.device, quick=args.quick)
    out.write_text(json.dumps(asdict(costs), indent=1) + "\n")
    if args.json:
        print(json.dumps(asdict(costs)))
        return 0

    def fmt(value: float | None) -> str:
        return NOT_MEASURED if value is None else f"{value:.2f} us"

    print(f"host costs on {costs.device}:")
    print(f"  eager launch, tiny elementwise op: {fmt(costs.elementwise_launch_us)}")
    print(f"  eager launch, 64x64 matmul:        {fmt(costs.matmul_launch_us)}")
    print(f"  dbo_yield handoff:                 {fmt(costs.handoff_us)}")
    print(
        f"wrote {out}; give a profile these costs with dataclasses.replace(profile, "
        "launch_us=..., handoff_us=...)"
    )
    return 0
