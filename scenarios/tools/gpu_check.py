"""GPU check: one MoE step measured on real CUDA streams and simulated on the H200 profile.

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

The parser is here; the work, and torch with it, is `scenarios.tools.gpu_check_run`, imported
by `run`, so `--help` and a refused option answer at once.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out", default="out/gpu_check.json", help="JSON report path (default out/gpu_check.json)"
    )
    p.add_argument(
        "--reps", type=int, default=10, help="timed repetitions per variant (median reported)"
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed runs before timing")
    p.add_argument("--layers", type=int, default=8, help="model layers (default 8)")
    p.add_argument("--only", choices=["prefill", "decode"], help="run one case")
    p.add_argument(
        "--sim-only", action="store_true", help="the simulated half alone (no GPU needed)"
    )
    p.add_argument(
        "--against",
        metavar="FILE",
        help="score the simulation against a stored gpu_check JSON (default with --sim-only: "
        "the shipped H200 one, when --layers matches)",
    )


def run(args: argparse.Namespace) -> int:
    from scenarios.tools import gpu_check_run  # torch and the work: only now

    return gpu_check_run.run(args)
