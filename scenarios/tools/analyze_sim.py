"""`dbo-sim analyze --against-sim`: the same configuration simulated beside the real trace.

One job: simulate the step a real trace shows (the model configuration the user names, the
layer count and ubatch count the trace shows, the profile of the trace's GPU) and set the two
side by side per stream and per kernel class, the largest disagreement first.

A configuration is `gpu-check` (the model of `dbo-sim gpu-check`, which made the shipped H200
traces), a `scenarios.model` preset, or a JSON file: `{"base": "gpu-check", "hidden": 2048,
...}`, a base configuration and `ModelConfig` fields to change (dtype as a string:
"bfloat16").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dbo.analysis import StepReport, TraceReport
from dbo.analysis.kernels import class_of_sim_op
from dbo.sim import PROFILES, SimDevice
from dbo.sim.options import SimOptions
from dbo.sim.records import COMM, COMPUTE, OpRecord
from dbo.sim.summary import summarize
from scenarios.lib.configs import GPU_CHECK, CheckCase, config_names, plan_cases
from scenarios.lib.usage import UsageError, read_json_file
from scenarios.model import MoEModel
from scenarios.model_config import config_changes
from scenarios.model_presets import torch_dtypes
from scenarios.steps import prepare, serial_step, ubatched_step
from workspace import reset_workspace_manager

__all__ = ["Row", "SimRequest", "compare", "format_rows", "plan", "profile_for", "simulate"]


@dataclass(frozen=True)
class SimRequest:
    """What to simulate: a configuration (name or JSON file) and the step's kind."""

    config: str
    mode: str  # "prefill" or "decode"
    tokens: int | None = None
    profile: str | None = None


@dataclass(frozen=True)
class Row:
    """One figure, real against simulated (microseconds, or a fraction for shares)."""

    what: str
    real: float
    sim: float
    unit: str = "us"

    @property
    def delta(self) -> float:
        return self.sim - self.real


def check_request(request: SimRequest) -> None:
    """Refuse a configuration that names nothing, before any trace is read (ValueError)."""
    if request.config not in config_names() and not Path(request.config).is_file():
        known = ", ".join(config_names())
        raise ValueError(
            f"--against-sim {request.config!r}: neither a configuration ({known}) nor a file"
        )
    if request.profile is not None and request.profile not in PROFILES:
        raise ValueError(f"--sim-profile: unknown profile {request.profile!r}")


def profile_for(device_name: str | None, requested: str | None = None) -> str:
    """The simulator profile of the trace's GPU ("NVIDIA H200" -> "h200"); h200 when the
    name matches none."""
    if requested:
        return requested
    name = (device_name or "").lower().replace(" ", "")
    return next((p for p in PROFILES if p in name), "h200")


def _overrides(path: Path) -> tuple[str, dict[str, Any]]:
    try:
        data = read_json_file(path, "--against-sim")
    except UsageError as error:
        raise ValueError(str(error)) from None
    if not isinstance(data, dict):
        raise ValueError(f"--against-sim {path}: expected a JSON object of ModelConfig fields")
    base = str(data.pop("base", GPU_CHECK))
    try:
        return base, torch_dtypes(config_changes(data))
    except ValueError as error:
        raise ValueError(f"--against-sim {path}: {error}") from None


def plan(request: SimRequest, layers: int | None) -> CheckCase:
    """The case to simulate: the configuration with the trace's layer count."""
    base, changes = request.config, {}
    if Path(request.config).is_file() and request.config not in config_names():
        base, changes = _overrides(Path(request.config))
    (case,) = plan_cases(base, layers=layers, tokens=request.tokens, mode=request.mode)
    if changes:
        case = CheckCase(case.name, case.config.with_(**changes), case.batch, case.mode)
    return case


def simulate(case: CheckCase, profile: str, num_ubatches: int | None) -> list[OpRecord]:
    """One eager step of the case on a fresh simulated device (meta tensors), after a warm-up
    and the workspace lock, as the traces were taken; its records."""
    config = case.config.with_(tensor_device="meta")
    device = SimDevice(SimOptions(profile, tensor_device="meta"))
    model = MoEModel(config, case.batch)
    x = model.inputs()
    if num_ubatches is None:
        step = serial_step(model, x, device, mode=case.mode)
    else:
        step = ubatched_step(model, x, device, mode=case.mode, num_ubatches=num_ubatches)
    try:
        prepare(device.torch_device, step.num_ubatches, [step])
        device.synchronize()
        device.reset()
        step()
        device.synchronize()
        return list(device.timeline)
    finally:
        reset_workspace_manager()


def _class_us(records: list[OpRecord], sim: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in records:
        if r.kind not in (COMPUTE, COMM):
            continue
        # Work on a comm stream is communication on both sides, whatever kernel carries it.
        if r.kind == COMM:
            cls = "comm"
        else:
            cls = class_of_sim_op(r.name, r.kind) if sim else str(r.args.get("class"))
        out[cls] = out.get(cls, 0.0) + r.dur_us
    return out


def compare(report: TraceReport, step: StepReport, sim_records: list[OpRecord]) -> list[Row]:
    """Real against simulated: step time and busy time per stream, then kernel time per
    class, sorted by the size of the disagreement; shares (overlap, host-bound) last."""
    real = step.figures.summary
    sim = summarize(sim_records)
    rows = [Row("step", real.step_us, sim.step_us)]
    streams = dict.fromkeys([*real.busy_us_per_stream, *sim.busy_us_per_stream])
    for stream in streams:
        if stream != "host":
            rows.append(
                Row(
                    f"stream {stream} busy",
                    real.busy_us_per_stream.get(stream, 0.0),
                    sim.busy_us_per_stream.get(stream, 0.0),
                )
            )
    real_records = [r for r in report.timeline.step_records(_step_of(report, step))]
    real_cls, sim_cls = _class_us(real_records, sim=False), _class_us(sim_records, sim=True)
    for cls in dict.fromkeys([*real_cls, *sim_cls]):
        rows.append(Row(f"class {cls}", real_cls.get(cls, 0.0), sim_cls.get(cls, 0.0)))
    rows.sort(key=lambda r: -abs(r.delta))
    rows.append(Row("overlap", real.overlap_fraction, sim.overlap_fraction, "share"))
    rows.append(Row("host-bound", real.host_bound_fraction, sim.host_bound_fraction, "share"))
    return rows


def _step_of(report: TraceReport, step: StepReport):
    return next(s for s in report.timeline.steps if s.label == step.figures.label)


def format_rows(rows: list[Row], title: str) -> str:
    lines = [
        title,
        f"  {'figure':<24}{'real':>12}{'simulated':>12}{'sim - real':>12}{'sim/real':>10}",
    ]
    for r in rows:
        if r.unit == "share":
            lines.append(
                f"  {r.what:<24}{100 * r.real:>11.1f}%{100 * r.sim:>11.1f}%"
                f"{100 * r.delta:>+10.1f}pp{'':>10}"
            )
        else:
            ratio = f"{r.sim / r.real:.2f}" if r.real > 0 else "-"
            lines.append(f"  {r.what:<24}{r.real:>12.1f}{r.sim:>12.1f}{r.delta:>+12.1f}{ratio:>10}")
    return "\n".join(lines)
