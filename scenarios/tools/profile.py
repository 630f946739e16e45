"""Profile a GPU into a kernel table the simulator loads (`HardwareProfile(kernel_table=...)`).

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

The parser is here; the work, and torch with it, is `scenarios.tools.profile_run`, imported
by `run`, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse

from scenarios.lib.choices import CONFIG_NAMES, DECODE_CONTEXT, GPU_CHECK, PREFILL_REQUESTS

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        default="kernels.csv",
        help="table to write (default kernels.csv; host costs go to <stem>-host.json)",
    )
    p.add_argument(
        "--config",
        default=GPU_CHECK,
        help=f"model to record: {', '.join(CONFIG_NAMES)} (default {GPU_CHECK})",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="model layers to record (default: the dense layers and one MoE layer; distinct "
        "shapes repeat per layer)",
    )
    p.add_argument("--hidden", type=int, help="override the model's hidden size")
    p.add_argument("--experts", type=int, help="override the number of routed experts")
    p.add_argument("--top-k", type=int, help="override the experts each token is routed to")
    p.add_argument(
        "--tokens",
        type=int,
        help=f"tokens per step (prefill: {PREFILL_REQUESTS} equal prompts; decode: one per "
        f"request, {DECODE_CONTEXT} tokens of context); default: gpu_check's batches",
    )
    p.add_argument("--mode", default="both", choices=("prefill", "decode", "both"))
    p.add_argument("--reps", type=int, default=5, help="timed graph replays per shape (median)")
    p.add_argument(
        "--host-from-trace",
        nargs="+",
        metavar="TRACE",
        help="derive host costs from these profiler traces (names with 'dbo' are the DBO ones) "
        "instead of timing kernels",
    )
    p.add_argument(
        "--bare-op-us",
        type=float,
        default=None,
        help="unprofiled host time of one tiny eager op (calibrate_host), for --host-from-trace",
    )


def run(args: argparse.Namespace) -> int:
    from scenarios.tools import profile_run  # torch and the work: only now

    return profile_run.run(args)
