"""`plan` end to end: one answer from a fresh process, with no recording on disk (cold) and
with the recordings of the cold run (warm).

One answer is what a user waits for: a phase, its default token counts, 2-4 ubatches, one
skew, DeepSeek-V3 on an H800: decode at EP 64, and prefill at EP 32, whose range search
grows the default range down to 256 tokens and so records the most steps (the quick run: a
4-layer model, decode only, at three counts and 2 ubatches). Each sample is a new `python -m
scenarios plan` process, so imports, the first recording and the process pool's start are in
it. Cold: an empty cache folder; target 15 s of wall time on the machine that runs it. Warm:
the same command again; its ratio to the cold run is what the disk cache saves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scenarios.tools.bench.figures import Figure, Stats, Target
from scenarios.tools.bench.registry import Plan, benchmark

ROOT = Path(__file__).resolve().parents[3]
COLD_TARGET_MS = 15_000.0
SMALL_MODEL = '{"num_layers": 4, "num_dense_layers": 1}'


def _argv(plan: Plan, folder: Path, phase: str, ep: int) -> list[str]:
    argv = [sys.executable, "-m", "scenarios", "plan", "--ep", str(ep), "--phase", phase]
    argv += ["--skew", "balanced", "--json"]
    if not plan.quick:
        return argv
    config = folder / "small.json"
    config.write_text(SMALL_MODEL)
    return [*argv, "--config", str(config), "--tokens", "16,256,512", "--ubatches", "2"]


def _run_ms(argv: list[str], cache: Path) -> float:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "DBO_SIM_CACHE": str(cache), "PYTHONPATH": path}
    start = time.perf_counter_ns()
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, timeout=900)
    elapsed = (time.perf_counter_ns() - start) / 1e6
    if done.returncode != 0:
        raise RuntimeError(f"plan exited {done.returncode}: {done.stderr.decode()[-800:]}")
    return elapsed


def _answer_figures(plan: Plan, phase: str, ep: int, name: str) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="dbo-sim-bench-") as tmp:
        folder = Path(tmp)
        argv = _argv(plan, folder, phase, ep)
        cold = _run_ms(argv, folder / "cache")
        warm = _run_ms(argv, folder / "cache")
    what = f"one plan answer ({phase}, EP {ep}, balanced) from a fresh process"
    if plan.quick:
        what += ", 4-layer model, 3 token counts, 2 ubatches"
    else:
        what += ", DeepSeek-V3, default token counts, 2-4 ubatches"
    return [
        Figure(
            bench="plan.answer",
            name=f"{name}.cold",
            what=f"{what}, no recording on disk",
            unit="ms",
            ours=Stats.of([cold]),
            baseline=Stats.of([warm]),
            baseline_what="the same command with the cold run's recordings on disk",
            targets=[Target("ours", "<=", COLD_TARGET_MS, "<= 15 s wall")],
            extra={"cores": os.cpu_count()},
        ),
        Figure(
            bench="plan.answer",
            name=f"{name}.warm",
            what=f"{what}, recordings on disk",
            unit="ms",
            ours=Stats.of([warm]),
            baseline=Stats.of([cold]),
            baseline_what="the same command with no recording on disk",
            targets=[Target("ratio", "<=", 0.5, "<= 0.5 of cold")],
        ),
    ]


@benchmark("plan: one answer, cold and warm", "plan.answer")
def bench_plan_answer(plan: Plan) -> list[Figure]:
    figures = _answer_figures(plan, "decode", 64, "plan.answer")
    if not plan.quick:
        figures += _answer_figures(plan, "prefill", 32, "plan.answer.prefill")
    return figures
