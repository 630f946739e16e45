"""The work of `dbo-sim profile`: record the model's kernels, time each distinct call on this
GPU, and write the table the simulator loads (or host costs from profiler traces).

One job: measure what the simulator's cost model needs from a real device. Two parts:

- Kernels. The ops a model configuration issues are recorded through the simulator's own
  interception (the model runs on `SimDevice` with meta tensors, serial and DBO, prefill and
  decode; every priced op is observed), reduced to distinct shapes, and each shape whose
  family the table format covers is timed on the GPU: a CUDA graph of 20 back-to-back calls,
  replayed after warm-up, timed with CUDA events (median of `--reps`, divided by 20, so launch
  overhead is excluded). Rows are written in the table format of `dbo.sim.tables`.
- Host costs (`--host-from-trace`): per-op-kind host time, Python time between ops and the
  baton pass between ubatch threads, derived from `torch.profiler` Chrome traces of eager
  serial and DBO steps, and how fast kernels on two streams progress side by side, from the
  kernels of the DBO traces, written as the table's `-host.json` (the rules:
  `dbo.analysis.calibration`).

    dbo-sim profile --out my-gpu.csv [--layers 2] [--reps 5]
    dbo-sim profile --config deepseek-v3 --mode decode --tokens 256 --out x.csv
    dbo-sim profile --host-from-trace a-serial.json.gz b-dbo.json.gz --out x.csv

Which model is recorded: `--config` names gpu_check's model (the default, with its prefill
and decode batches) or a `scenarios.model` preset; `--hidden`, `--layers`, `--experts`,
`--top-k`, `--tokens` and `--mode prefill|decode|both` override it, checked before any work.
With a model of your own, record its ops and time them from Python:

    calls = record_calls(my_config, Batch.prefill(4, 1024), "ht", num_ubatches=2)
    rows = profile_calls(calls, time_call_cuda)  # or any (OpCall) -> us timer
    write_table(rows, "my-gpu.csv")

`record_calls` runs `scenarios.model.MoEModel` for a `ModelConfig`; for another model, register
an observer (`dbo.sim.cost.add_op_observer(calls.append)`) around one step of it on a
`SimDevice` with meta tensors, and pass the observed calls to `profile_calls` the same way.

Without a CUDA GPU the kernel part says so on stderr and exits 2 before any work; everything
up to the CUDA calls (recording, shape reduction, materializing the inputs, the row format)
runs on the simulated device in the tests.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dbo.analysis.calibration import host_costs_from_traces, overlap_rates_from_traces
from dbo.sim import SimDevice
from dbo.sim.cost import OpCall, add_op_observer, remove_op_observer
from dbo.sim.families import op_family
from dbo.sim.options import SimOptions
from scenarios.lib.configs import (
    CheckCase,
    plan_cases,
)
from scenarios.lib.usage import UsageError
from scenarios.model import Batch, ModelConfig, MoEModel
from scenarios.steps import prepare, serial_step, ubatched_step
from workspace import reset_workspace_manager

__all__ = [
    "ShapeKey",
    "distinct_calls",
    "host_costs_from_traces",
    "materialize",
    "model_calls",
    "overlap_rates_from_traces",
    "profile_calls",
    "record_calls",
    "table_row",
    "time_call_cuda",
    "write_table",
    "run",
]

NO_GPU_MESSAGE = (
    "no CUDA GPU present: nothing to time (kernel tables are measured on the GPU they describe)"
)
CALLS_PER_GRAPH = 20
FIELDS = ("op", "m", "n", "k", "groups", "dtype", "us", "flops", "bytes", "tflops", "gbps")
# Table op that each simulator family is written as (dbo.sim.tables reads them back).
_TABLE_OP = {
    "mm": "mm",
    "grouped_mm": "grouped_mm",
    "sdpa_causal": "sdpa_causal",
    "sdpa_decode": "sdpa_decode",
    "copy": "copy",
    "elementwise": "add",
    "index_select": "index_select",
    "index_add": "index_add",
    "norm": "rms_norm",
    "sort_topk": "router_softmax_topk256",
}


# --------------------------------------------------------------------------------------------
# Recording (on the simulated device)


def record_calls(
    config: ModelConfig, batch: Batch, mode: str, *, num_ubatches: int | None = None
) -> list[OpCall]:
    """Every op one step of `config` issues, as the simulator's interceptor prices them (meta
    tensors; serial when `num_ubatches` is None, else DBO)."""
    config = config.with_(tensor_device="meta")
    device = SimDevice(SimOptions("h200", tensor_device="meta"))
    calls: list[OpCall] = []
    model = MoEModel(config, batch)
    x = model.inputs()
    if num_ubatches is None:
        step = serial_step(model, x, device, mode=mode)
    else:
        step = ubatched_step(model, x, device, mode=mode, num_ubatches=num_ubatches)
    add_op_observer(calls.append)
    try:
        prepare(device.torch_device, step.num_ubatches, [step])
    finally:
        remove_op_observer(calls.append)
        reset_workspace_manager()
    return calls


@dataclass(frozen=True)
class ShapeKey:
    """What makes two calls the same kernel: op, tensor shapes/strides/dtypes, other args."""

    name: str
    tensors: tuple
    scalars: str


def _key(call: OpCall) -> ShapeKey:
    tensors = tuple((tuple(t.shape), tuple(t.stride()), str(t.dtype)) for t in call.ins)
    scalars = repr([a for a in call.args if not isinstance(a, (torch.Tensor, list, tuple))]) + repr(
        sorted((k, v) for k, v in call.kwargs.items() if not isinstance(v, torch.Tensor))
    )
    return ShapeKey(call.name, tensors, scalars)


def distinct_calls(calls: Iterable[OpCall]) -> list[OpCall]:
    """One call per distinct kernel whose family a table row can hold, in first-seen order."""
    seen: dict[ShapeKey, OpCall] = {}
    for call in calls:
        if table_row(call, 1.0) is None:
            continue
        seen.setdefault(_key(call), call)
    return list(seen.values())


# --------------------------------------------------------------------------------------------
# Rows


def _family(call: OpCall) -> str | None:
    family = op_family(call.name)
    if family == "attention":
        if not call.ins or call.ins[0].dim() != 4:
            return None
        return "sdpa_decode" if call.ins[0].shape[-2] == 1 else "sdpa_causal"
    return family


def table_row(call: OpCall, us: float) -> dict | None:
    """The table row of `call` timed at `us`, in the format dbo.sim.tables reads, or None."""
    family = _family(call)
    if family is None or not call.ins:
        return None
    a = call.ins[0]
    m = n = k = groups = 1
    nbytes = call.nbytes
    if family in ("mm", "grouped_mm"):
        if call.dtype not in (torch.bfloat16, torch.float16) or len(call.ins) < 2:
            return None
        b = call.ins[1]
        if family == "mm" and a.dim() == 2 and b.dim() == 2:
            m, k, n = a.shape[0], a.shape[1], b.shape[1]
        elif family == "grouped_mm" and a.dim() == 2 and b.dim() == 3:
            m, groups, k, n = a.shape[0], b.shape[0], b.shape[1], b.shape[2]
        else:
            return None
    elif family in ("sdpa_causal", "sdpa_decode"):
        m, n, k, groups = a.shape[0], a.shape[1], call.ins[1].shape[-2], a.shape[-1]
        if family == "sdpa_decode":
            nbytes = (
                2 * call.nbytes
            )  # the table convention: keys and values counted as one tensor twice
    else:
        m = a.numel() if a.dim() < 2 else a.shape[0]
        n = 1 if a.dim() < 2 else a.numel() // a.shape[0]
    dtype = str(call.dtype).replace("torch.", "").replace("bfloat16", "bf16")
    return {
        "op": _TABLE_OP[family],
        "m": m,
        "n": n,
        "k": k,
        "groups": groups,
        "dtype": dtype,
        "us": round(us, 3),
        "flops": int(call.flops),
        "bytes": int(nbytes),
        "tflops": round(call.flops / us / 1e6, 2) if us > 0 else 0,
        "gbps": round(nbytes / us / 1e3, 1) if us > 0 else 0,
    }


def write_table(rows: Sequence[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return path


# --------------------------------------------------------------------------------------------
# Timing (the CUDA part)


def materialize(call: OpCall, device: str | torch.device) -> tuple[tuple, dict]:
    """The call's arguments as real tensors on `device`: floats random, integer tensors valid
    indices into the first dimension of the call's first floating input (so gathers and
    scatter-adds touch real rows), grouped-GEMM offsets as even group ends."""
    floats = [t for t in call.ins if t.is_floating_point()]
    rows = max(1, floats[0].shape[0]) if floats and floats[0].dim() else 1

    def real(t: torch.Tensor, position: int) -> torch.Tensor:
        if t.is_floating_point():
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            return out.normal_() if t.dtype.itemsize > 1 else out.zero_()
        if call.name == "aten::_grouped_mm" and position == 2:
            groups, total = t.numel(), call.ins[0].shape[0]
            return torch.tensor(
                [total * (g + 1) // groups for g in range(groups)], dtype=t.dtype, device=device
            )
        if t.dtype == torch.bool:
            return torch.ones(t.shape, dtype=t.dtype, device=device)
        return torch.randint(0, rows, tuple(t.shape), device=device).to(t.dtype)

    counter = iter(range(1 << 30))

    def convert(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return real(v, next(counter))
        if isinstance(v, (list, tuple)):
            return type(v)(convert(w) for w in v)
        return v

    return tuple(convert(a) for a in call.args), {k: convert(v) for k, v in call.kwargs.items()}


def time_call_cuda(call: OpCall, *, reps: int = 5, warmup: int = 3) -> float:
    """Microseconds of one call on the current CUDA device: a graph of CALLS_PER_GRAPH calls,
    replayed after `warmup`, CUDA-event timed `reps` times, median / CALLS_PER_GRAPH."""
    args, kwargs = materialize(call, "cuda")
    for _ in range(warmup):
        call.func(*args, **kwargs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(CALLS_PER_GRAPH):
            call.func(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(warmup):
        graph.replay()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / CALLS_PER_GRAPH)
    return statistics.median(samples)


Timer = Callable[[OpCall], float]


def profile_calls(
    calls: Sequence[OpCall], timer: Timer, *, on_row: Callable[[dict], None] | None = None
) -> list[dict]:
    """Time each distinct call with `timer` (time_call_cuda on a GPU) and return its rows; a
    call the device refuses is reported on stderr and left out."""
    rows = []
    for call in distinct_calls(calls):
        try:
            us = timer(call)
        except Exception as error:  # noqa: BLE001 - one unsupported shape must not end the run
            print(
                f"profile: {call.name} {[tuple(t.shape) for t in call.ins]}: "
                f"{type(error).__name__}: {error}",
                file=sys.stderr,
            )
            continue
        row = table_row(call, us)
        if row is not None:
            rows.append(row)
            if on_row:
                on_row(row)
    return rows


def model_calls(cases: Sequence[CheckCase]) -> list[OpCall]:
    """The ops of each case's step, serial and 2-ubatch DBO."""
    calls: list[OpCall] = []
    for case in cases:
        for ubatches in (None, 2):
            calls += record_calls(case.config, case.batch, case.mode, num_ubatches=ubatches)
    return calls


# --------------------------------------------------------------------------------------------
# Command line


def _check_args(args: argparse.Namespace) -> list[CheckCase]:
    """Every refusal before any work (the verb checked --reps); returns the cases to time."""
    try:
        cases = plan_cases(
            args.config,
            layers=args.layers,
            hidden=args.hidden,
            experts=args.experts,
            top_k=args.top_k,
            tokens=args.tokens,
            mode=args.mode,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.host_from_trace:
        if args.bare_op_us is None or args.bare_op_us <= 0:
            raise UsageError(
                "--host-from-trace needs --bare-op-us (calibrate_host's eager add_ time on that "
                "host)"
            )
        missing = [p for p in args.host_from_trace if not Path(p).is_file()]
        if missing:
            raise UsageError(f"no such trace: {', '.join(missing)}")
    elif not torch.cuda.is_available():
        raise UsageError(NO_GPU_MESSAGE)
    return cases


def _host_from_traces(args: argparse.Namespace, out: Path) -> int:
    """--host-from-trace: host costs (and overlap rates) from profiler traces, no GPU needed."""
    dbo_paths = [p for p in args.host_from_trace if "dbo" in Path(p).name]
    serial_paths = [p for p in args.host_from_trace if p not in dbo_paths]
    host = host_costs_from_traces(serial_paths, dbo_paths, bare_op_us=args.bare_op_us)
    if dbo_paths:
        host.update(overlap_rates_from_traces(dbo_paths))
    host_path = out.with_name(f"{out.stem}-host.json")
    host_path.write_text(json.dumps(host, indent=1) + "\n")
    print(json.dumps(host, indent=1))
    print(f"wrote {host_path}")
    return 0


def run(args: argparse.Namespace) -> int:
    """`dbo-sim profile`: time each distinct kernel on this GPU into a table (or, with
    --host-from-trace, derive host costs from traces)."""
    cases = _check_args(args)
    out = Path(args.out)
    if args.host_from_trace:
        return _host_from_traces(args, out)
    calls = model_calls(cases)
    print(
        f"profile: {len(distinct_calls(calls))} distinct kernels on {torch.cuda.get_device_name()}",
        flush=True,
    )
    rows = profile_calls(
        calls,
        lambda c: time_call_cuda(c, reps=args.reps),
        on_row=lambda r: print(
            f"  {r['op']} m={r['m']} n={r['n']} k={r['k']} g={r['groups']}: {r['us']} us",
            flush=True,
        ),
    )
    write_table(rows, out)
    print(
        f"wrote {out} ({len(rows)} rows; load it with HardwareProfile(kernel_table={str(out)!r}))"
    )
    return 0
