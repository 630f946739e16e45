"""The work of `dbo-sim gpu-check`: the model's steps on real CUDA streams and on the
simulated H200, timed, compared and written as one JSON report.

One job: say how far the simulator's step times are from a real GPU's, for the same model
code. Each case (a prefill and a decode configuration of a mid-size MoE stack, bf16, sized so
that one H200's time is GPU work rather than launch overhead) runs four ways: serial and DBO
(2 ubatches), each eagerly and as a CUDA graph replay (`device.graph()` +
`run_ubatches(..., graph=g)`). On the GPU every way is timed with CUDA events around the step,
after warm-up, several times (median, min, max); the same configuration then runs on
`SimDevice()` (an H200) with meta tensors. The table puts them side by side with sim/GPU ratios
and both devices' DBO gains; `--out` writes everything as JSON.

One GPU, so expert parallelism is in-process (ep_size 1): dispatch and combine are local
permutations (index_select / index_add on the GPU), which the simulator costs as HBM copies of
the bytes they move. With several GPUs the same model runs over NCCL (`dbo.comm`), which this
check does not do.

The simulated half also reports the host time each variant took to issue ("sim host ms"):
where it is below the simulated step, the simulated host stays ahead of the device and graph
replay (which removes the per-op launch and baton costs) cannot shorten the step, so eager
and replayed times coincide. A GPU whose eager step is much slower than its replay is
host-bound beyond the profile's host costs.

The GPU half is device-agnostic up to three CUDA calls (`dbo.CudaDevice()`, CUDA-event timing,
`torch.cuda.empty_cache`): `measure_case(..., device=SimDevice(), timer=virtual_timer(d))`
runs the same warm-up, lock, capture and replay sequence on a CPU, which the tests do.

    dbo-sim gpu-check [--out gpu_check.json] [--reps 10] [--warmup 3] [--layers 8]
    dbo-sim gpu-check --sim-only      # the simulated half alone (any machine)
    dbo-sim gpu-check --sim-only --against FILE   # vs a stored gpu_check JSON

Validation: with measured times (this GPU's, or a stored report's: `--against FILE`, and by
default under --sim-only the H200 report shipped in dbo/sim/tables when the layer count
matches it), every variant is scored against its target: the simulated step within 15% of
the measured one under graph replay and 25% eager, and the DBO gain's sign right wherever
the measured gain exceeds 3%. The H200 profile's constants come from kernel
microbenchmarks and per-op host figures, never from these step times.

Exit status: 0 measured (or --sim-only done); 2 no CUDA GPU present (nothing measured);
1 a measurement failed (the others are still reported).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

import dbo
from scenarios.lib.configs import CheckCase, check_cases
from scenarios.lib.simulate import simulate_step
from scenarios.lib.usage import UsageError, writable_file
from scenarios.model import MoEModel
from scenarios.steps import prepare, serial_step, ubatched_step
from workspace import reset_workspace_manager

__all__ = [
    "Timing",
    "CaseResult",
    "simulate_case",
    "measure_case",
    "virtual_timer",
    "format_case",
    "run",
]

NO_GPU_MESSAGE = "no CUDA GPU present: nothing to measure (the simulated half runs with --sim-only)"
VARIANTS = ("serial-eager", "dbo-eager", "serial-graph", "dbo-graph")
SIM_PROFILE = "h200"
# The stored H200 measurement (provenance in dbo/sim/tables/PROVENANCE.md).
H200_REFERENCE = Path(__file__).resolve().parents[2] / "dbo/sim/tables/h200-gpu_check.json"
TOLERANCE = {"graph": 0.15, "eager": 0.25}  # |sim / measured - 1| per variant kind
GAIN_SIGN_THRESHOLD_PCT = 3.0


@dataclass
class Timing:
    """One variant's step time: GPU samples (CUDA events, us) and/or the simulated time."""

    gpu_us: list[float] = field(default_factory=list)
    sim_us: float | None = None
    sim_host_us: float | None = None  # host time the simulated step took to issue
    sim_host_bound: float | None = None  # share of the simulated step with the device idle
    sim_fallback: float | None = None  # share of simulated device time priced by the roofline
    error: str | None = None

    @property
    def gpu_median_us(self) -> float | None:
        return statistics.median(self.gpu_us) if self.gpu_us else None

    @property
    def ratio(self) -> float | None:
        """simulated / measured (1.0: exact; < 1: the simulator is optimistic)."""
        gpu = self.gpu_median_us
        return self.sim_us / gpu if gpu and self.sim_us is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_us": self.gpu_us,
            "gpu_median_us": self.gpu_median_us,
            "gpu_min_us": min(self.gpu_us) if self.gpu_us else None,
            "gpu_max_us": max(self.gpu_us) if self.gpu_us else None,
            "sim_us": self.sim_us,
            "sim_host_us": self.sim_host_us,
            "sim_host_bound_fraction": self.sim_host_bound,
            "sim_fallback_fraction": self.sim_fallback,
            "sim_over_gpu": self.ratio,
            "error": self.error,
        }


@dataclass
class CaseResult:
    case: CheckCase
    timings: dict[str, Timing]
    wall_s: float = 0.0

    def gains(self) -> dict[str, dict[str, float | None]]:
        """DBO over serial, and graph replay over eager (DBO), on each device, in %."""

        def pct(a: float | None, b: float | None) -> float | None:
            return (a / b - 1.0) * 100.0 if a and b else None

        t = self.timings
        out: dict[str, dict[str, float | None]] = {}
        for label, slow, fast in (
            ("dbo_vs_serial_eager", "serial-eager", "dbo-eager"),
            ("dbo_vs_serial_graph", "serial-graph", "dbo-graph"),
            ("graph_vs_eager_dbo", "dbo-eager", "dbo-graph"),
        ):
            out[label] = {
                "gpu": pct(t[slow].gpu_median_us, t[fast].gpu_median_us),
                "sim": pct(t[slow].sim_us, t[fast].sim_us),
            }
        return out

    def to_dict(self) -> dict[str, Any]:
        c = self.case
        return {
            "case": c.name,
            "mode": c.mode,
            "tokens": c.batch.num_tokens,
            "context": c.batch.context_lens[0] if c.batch.context_lens else 0,
            "config": {
                k: (str(v) if isinstance(v, torch.dtype) else v)
                for k, v in asdict(c.config).items()
            },
            "timings": {k: v.to_dict() for k, v in self.timings.items()},
            "gains_pct": self.gains(),
            "wall_s": self.wall_s,
        }


# --------------------------------------------------------------------------------------------
# The simulated half


def simulate_case(case: CheckCase, profile: str = SIM_PROFILE) -> dict[str, Timing]:
    """The case's four variants on the simulated device (meta tensors, the same model code)."""
    config = case.config.with_(tensor_device="meta")
    out: dict[str, Timing] = {}
    for variant in VARIANTS:
        ubatches = 2 if variant.startswith("dbo") else None
        timing = Timing()
        try:
            times = simulate_step(
                config,
                case.batch,
                case.mode,
                profile=profile,
                num_ubatches=ubatches,
                graph=variant.endswith("graph"),
            )
            timing.sim_us = times.step_us
            timing.sim_host_us = times.host_us
            timing.sim_host_bound = times.host_bound_fraction
            timing.sim_fallback = times.fallback_fraction
        except Exception as error:  # noqa: BLE001 - reported in the table, the others still run
            timing.error = f"sim: {type(error).__name__}: {error}"
        out[variant] = timing
    return out


# --------------------------------------------------------------------------------------------
# The GPU half


def _time_us(fn: Callable[[], Any], reps: int) -> list[float]:
    """CUDA-event time of `fn` on the current stream, `reps` times (each synchronized)."""
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0)
    return samples


Timer = Callable[[Callable[[], Any], int], "list[float]"]


def virtual_timer(device: Any) -> Timer:
    """A `measure_case` timer on a `SimDevice`: each sample is the virtual time of one call,
    from the host's synchronized start to the end of the last work it issued."""

    def time_us(fn: Callable[[], Any], reps: int) -> list[float]:
        samples = []
        for _ in range(reps):
            device.synchronize()
            mark = device.mark()
            fn()
            device.synchronize()
            samples.append(device.elapsed_us(mark))
        return samples

    return time_us


def measure_case(
    case: CheckCase, *, reps: int, warmup: int, device: Any = None, timer: Timer | None = None
) -> dict[str, Timing]:
    """The case's four variants on the GPU. The engine's life cycle: eager warm-up of both
    schedules (the workspace grows to its largest need), lock, then time; graphs are captured
    after the lock and replayed. `device` (default `dbo.CudaDevice()`) and `timer` (default
    CUDA events) exist so the same sequence can run on a `SimDevice` without a GPU."""
    device = dbo.CudaDevice() if device is None else device
    timer = _time_us if timer is None else timer
    model = MoEModel(case.config, case.batch)
    x = model.inputs()
    serial = serial_step(model, x, device, mode=case.mode)
    ubatched = ubatched_step(model, x, device, mode=case.mode, num_ubatches=2)
    timings = {v: Timing() for v in VARIANTS}

    try:
        prepare(device.torch_device, 2, [serial, ubatched], rounds=max(warmup, 1))
        device.synchronize()
        for variant, fn in (("serial-eager", serial), ("dbo-eager", ubatched)):
            _run(timings[variant], lambda fn=fn: timer(fn, reps))
        _run(
            timings["serial-graph"],
            # a side stream on every device: the simulated device runs the CUDA sequence
            lambda: _time_graph(
                device, partial(serial.capture, side_stream=True), reps, warmup, timer
            ),
        )
        _run(timings["dbo-graph"], lambda: _time_graph(device, ubatched, reps, warmup, timer))
    finally:
        reset_workspace_manager()
        del model, x
        if device.torch_device.type == "cuda":
            torch.cuda.empty_cache()
    return timings


def _run(timing: Timing, fn: Callable[[], list[float]]) -> None:
    try:
        timing.gpu_us = fn()
    except Exception as error:  # noqa: BLE001 - one failed variant must not hide the others
        timing.error = f"gpu: {type(error).__name__}: {error}"
        traceback.print_exc(file=sys.stderr)


def _time_graph(
    device: Any, capture: Callable[[Any], None], reps: int, warmup: int, timer: Timer = _time_us
) -> list[float]:
    """Capture one step into a CUDA graph (`capture(graph)`: the DBO step passes it to
    `run_ubatches(graph=...)`), then time replays of it."""
    graph = device.graph()
    capture(graph)
    device.synchronize()
    for _ in range(max(warmup, 1)):
        graph.replay()
    return timer(graph.replay, reps)


# --------------------------------------------------------------------------------------------
# Validation against measured times


def load_reference(path: str | Path, layers: int) -> dict[str, dict[str, list[float]]]:
    """case -> variant -> measured samples (us) from a stored gpu_check JSON. Raises
    ValueError when the file is not one, or was measured with another layer count."""
    try:
        report = json.loads(Path(path).read_text())
        cases_ = {c["case"]: c for c in report["cases"]}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--against {path}: not a gpu_check report ({error})") from None
    for name, case in cases_.items():
        got = case.get("config", {}).get("num_layers")
        if got != layers:
            raise ValueError(
                f"--against {path}: case {name!r} was measured with {got} layers, not --layers "
                f"{layers}"
            )
    return {
        name: {v: list(case["timings"][v]["gpu_us"]) for v in VARIANTS if v in case["timings"]}
        for name, case in cases_.items()
    }


def validate(result: CaseResult) -> list[tuple[str, bool, str]]:
    """(check, met, detail) per variant time and per DBO gain whose measured size exceeds the
    sign threshold; nothing for variants without a measured time."""
    checks = []
    for v in VARIANTS:
        ratio = result.timings[v].ratio
        if ratio is None:
            continue
        tol = TOLERANCE["graph" if v.endswith("graph") else "eager"]
        detail = f"sim/measured {ratio:.2f}, target within {tol:.0%}"
        checks.append((f"{v} time", abs(ratio - 1) <= tol, detail))
    for label, g in result.gains().items():
        gpu, sim = g["gpu"], g["sim"]
        if not label.startswith("dbo") or gpu is None or sim is None:
            continue
        if abs(gpu) > GAIN_SIGN_THRESHOLD_PCT:
            detail = f"measured {gpu:+.1f}%, sim {sim:+.1f}%"
            checks.append((f"{label.replace('_', ' ')} sign", (gpu > 0) == (sim > 0), detail))
    return checks


def _validation(result: CaseResult) -> list[dict[str, Any]]:
    return [{"check": c, "met": m, "detail": d} for c, m, d in validate(result)]


# --------------------------------------------------------------------------------------------
# Output


def _ms(us: float | None) -> str:
    return "-" if us is None or not math.isfinite(us) else f"{us / 1e3:.3f}"


def format_case(result: CaseResult, gpu_name: str) -> str:
    c = result.case
    what = (
        f"{c.name}: {c.batch.num_tokens} tokens"
        + (f", context {c.batch.context_lens[0]}" if c.batch.is_decode else "")
        + f", mode {c.mode}, {c.config.num_layers} layers"
    )
    lines = [f"{what} -- {gpu_name} vs simulated {SIM_PROFILE}"]
    header = ("variant", "GPU ms (median)", "GPU min-max", "n", "sim ms", "sim host ms", "sim/GPU")
    rows = [header]
    for v in VARIANTS:
        t = result.timings[v]
        spread = f"{_ms(min(t.gpu_us))}-{_ms(max(t.gpu_us))}" if t.gpu_us else "-"
        rows.append(
            (
                v,
                _ms(t.gpu_median_us),
                spread,
                str(len(t.gpu_us)),
                _ms(t.sim_us),
                _ms(t.sim_host_us),
                "-" if t.ratio is None else f"{t.ratio:.2f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows]
    for label, g in result.gains().items():
        lines.append(f"  {label.replace('_', ' ')}: GPU {_pct(g['gpu'])}, sim {_pct(g['sim'])}")
    ahead = [v for v in ("serial-eager", "dbo-eager") if _device_bound(result.timings[v])]
    if ahead:
        lines.append(
            f"  sim: {' and '.join(ahead)} issued within the simulated step (host ms < sim ms): "
            "the "
            f"simulated host stays ahead of the device, so replay has no launch time to remove"
        )
    fallback = [t.sim_fallback for t in result.timings.values() if t.sim_fallback is not None]
    if fallback:
        lines.append(
            f"  sim: {max(fallback):.1%} of device time priced by the roofline (the rest measured)"
        )
    for check, met, detail in validate(result):
        lines.append(f"  {'met ' if met else 'MISS'} {check}: {detail}")
    for v in VARIANTS:
        if result.timings[v].error:
            lines.append(f"  {v}: {result.timings[v].error}")
    return "\n".join(lines)


def _device_bound(t: Timing) -> bool:
    return t.sim_us is not None and t.sim_host_us is not None and t.sim_host_us < t.sim_us


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def _check_args(args: argparse.Namespace) -> None:
    """The refusals that need torch, before any work (the verb checked the counts and
    --against): no GPU, --out."""
    on_gpu = not args.sim_only
    if on_gpu and not torch.cuda.is_available():
        raise UsageError(NO_GPU_MESSAGE)
    writable_file(Path(args.out))


def run(args: argparse.Namespace) -> int:
    """`dbo-sim gpu-check`: simulate (and on a GPU measure) each case, print, write the JSON."""
    _check_args(args)
    on_gpu = not args.sim_only
    gpu_name = torch.cuda.get_device_name() if on_gpu else "no GPU (--sim-only)"
    reference: dict[str, dict[str, list[float]]] = {}
    against = args.against or (str(H200_REFERENCE) if args.sim_only and args.layers == 8 else None)
    if against:
        try:
            reference = load_reference(against, args.layers)
        except ValueError as error:
            raise UsageError(str(error)) from None
        stored = json.loads(Path(against).read_text()).get("gpu", "GPU")
        gpu_name = f"{stored} (stored: {Path(against).name}, not rerun)"
    chosen = [c for c in check_cases(args.layers) if args.only in (None, c.name)]
    results = []
    failed = False
    for case in chosen:
        start = time.monotonic()
        timings = simulate_case(case)
        for v, samples in reference.get(case.name, {}).items():
            timings[v].gpu_us = samples
        if on_gpu:
            try:
                measured = measure_case(case, reps=args.reps, warmup=args.warmup)
            except Exception as error:  # noqa: BLE001 - e.g. out of memory: report and go on
                traceback.print_exc(file=sys.stderr)
                measured = {
                    v: Timing(error=f"gpu: {type(error).__name__}: {error}") for v in VARIANTS
                }
            for v in VARIANTS:
                timings[v].gpu_us = measured[v].gpu_us
                timings[v].error = (
                    "; ".join(e for e in (timings[v].error, measured[v].error) if e) or None
                )
        result = CaseResult(case, timings, time.monotonic() - start)
        failed |= any(t.error for t in timings.values())
        results.append(result)
        print(format_case(result, gpu_name), flush=True)
        print()
    report = {
        "gpu": gpu_name,
        "sim_profile": SIM_PROFILE,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "reps": args.reps,
        "warmup": args.warmup,
        "measured_from": against or ("this GPU" if on_gpu else None),
        "cases": [r.to_dict() | {"validation": _validation(r)} for r in results],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 1 if failed else 0
