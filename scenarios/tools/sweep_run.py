"""The work of `dbo-sim sweep`: each point run serially and under DBO on the simulated
device, the rows, sweep.csv as the points finish, and the PNG of where DBO pays.

Each point runs the DeepSeek-V3-size workload (`meta`, shapes only) serially and with DBO on
the simulated device and records the ratio of step times, and the DBO run's communication
against its compute time (`comm_compute_ratio`): the vLLM maintainers' rule is that DBO pays
only when communication outweighs the GEMMs it could hide under. Small decode batches are
host-launch and latency bound, so overlap cannot pay for its handoffs there; large prefill
batches move enough bytes for the comm stream to hide under compute. `pays_from` reads off
where a phase's gain turns positive; the PNG plots the gain against tokens per device (one
panel per phase) and against the comm/compute ratio.

Decode points are one-token requests over a `context_len`-token KV cache each, by default the
same context as the `dsv3-decode-ll` scenario, so the sweep's 256-token point is that
scenario's step; prefill points are 4096-token prompts (the last one shorter when the count is
not a multiple; a count below 4096 is one prompt), and `describe_prefill` says which for the
points a sweep runs. `CsvSink` writes each point as it finishes, so an interrupted sweep keeps the
points it computed; a point whose step fails (a step past `--timeout`, the serial one included)
is a FAILED row, and the sweep goes on to the next point.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO

from dbo.jsonsafe import finite_or_none
from scenarios.harness import RunOptions, compare_serial_dbo
from scenarios.lib.progress import emit, progress_bar
from scenarios.lib.usage import Interrupted, one_line, writable_dir
from scenarios.model import Batch, ModelConfig, preset
from scenarios.tools.common import run_options
from scenarios.tools.sweep_args import (
    DECODE_CONTEXT,
    DECODE_TOKENS,
    FULL_LAYERS,
    PREFILL_PROMPT,
    PREFILL_TOKENS,
    check_points,
)


@dataclass(frozen=True)
class SweepFailure:
    """A point whose step raised (a step past the timeout, say): reported, then skipped."""

    phase: str
    tokens_per_device: int
    error: str

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)


@dataclass(frozen=True)
class SweepPoint:
    phase: str  # "decode" | "prefill"
    tokens_per_device: int
    step_us_serial: float
    step_us_dbo: float
    speedup: float
    overlap_fraction: float
    exposed_comm_us: float
    comm_us: float
    compute_us: float
    context_len: int = 0  # KV-cache tokens per decode request (0 for prefill)

    @property
    def comm_compute_ratio(self) -> float:
        """Communication time over compute time in the DBO run (inf with no compute)."""
        return self.comm_us / self.compute_us if self.compute_us > 0 else float("inf")

    def to_dict(self) -> dict[str, float | int | str]:
        """One CSV row (and one `sweep --json` line): the fields and the comm/compute ratio."""
        ratio = self.comm_compute_ratio
        return {**asdict(self), "comm_compute_ratio": finite_or_none(ratio)}


def pays_from(points: Sequence[SweepPoint]) -> int | None:
    """The smallest token count from which DBO is faster at every larger point tried (None:
    it is slower at the largest point, or there are no points)."""
    start = None
    for p in sorted(points, key=lambda p: p.tokens_per_device, reverse=True):
        if p.speedup <= 1.0:
            break
        start = p.tokens_per_device
    return start


def prefill_prompts(tokens: int) -> list[int]:
    """Prompt lengths of a `tokens`-token prefill point: PREFILL_PROMPT-token prompts, the
    remainder as one shorter prompt."""
    lens = [PREFILL_PROMPT] * (tokens // PREFILL_PROMPT)
    if tokens % PREFILL_PROMPT:
        lens.append(tokens % PREFILL_PROMPT)
    return lens


def describe_prefill(prefill_tokens: Iterable[int]) -> str:
    """What the prefill points hold, in words true for exactly these token counts."""
    counts = sorted(set(prefill_tokens))
    single = [t for t in counts if len(prefill_prompts(t)) == 1]
    split = [t for t in counts if len(prefill_prompts(t)) > 1]
    parts = []
    if len(single) == 1:
        parts.append(f"one {single[0]}-token prompt")
    elif single:
        parts.append(f"one prompt per point at {_listed(single)}")
    if split:
        ragged = any(t % PREFILL_PROMPT for t in split)
        tail = " (the last one shorter where the count is not a multiple)" if ragged else ""
        parts.append(f"{PREFILL_PROMPT}-token prompts{tail} at {_listed(split)}")
    return "; ".join(parts) if parts else "no points"


def _listed(counts: Sequence[int]) -> str:
    return f"{', '.join(map(str, counts))} tokens"


def _batch(phase: str, tokens: int, context_len: int) -> Batch:
    if phase == "decode":
        return Batch.decode(num_requests=tokens, context_len=context_len)
    lens = prefill_prompts(tokens)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return Batch(tuple(starts), (0,) * len(lens))


def reduced(config: ModelConfig, num_layers: int) -> ModelConfig:
    """`config` with `num_layers` layers and its dense:MoE mix kept in proportion (DeepSeek-V3:
    3 dense of 61), so a few-layer sweep is not all dense layers with no communication."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    dense = round(config.num_dense_layers * num_layers / config.num_layers)
    return config.with_(num_layers=num_layers, num_dense_layers=min(dense, num_layers - 1))


def run_sweep(
    opts: RunOptions,
    *,
    decode_tokens: Sequence[int] = DECODE_TOKENS,
    prefill_tokens: Sequence[int] = PREFILL_TOKENS,
    num_layers: int | None = None,
    context_len: int = DECODE_CONTEXT,
    on_point: Callable[[SweepPoint], None] | None = None,
    on_failure: Callable[[SweepFailure], None] | None = None,
) -> list[SweepPoint]:
    """One point per token count; `on_point` hears each as it finishes. A point whose step
    raises is passed to `on_failure` and skipped (without `on_failure`, the error propagates).
    Raises ValueError before any work for counts the ubatches cannot split or a context
    below 1."""
    problem = check_points(decode_tokens, prefill_tokens, opts.num_ubatches)
    if problem is None and context_len < 1:
        problem = f"context_len must be >= 1, got {context_len}"
    if problem is not None:
        raise ValueError(problem)
    config = preset("deepseek-v3")
    if num_layers is not None:
        config = reduced(config, num_layers)
    no_artifacts = replace(opts, out_dir=None)
    points = []
    for phase, tokens_list in (("decode", decode_tokens), ("prefill", prefill_tokens)):
        mode = "ll" if phase == "decode" else "ht"
        for tokens in tokens_list:
            try:
                point = _point(config, phase, mode, tokens, context_len, no_artifacts)
            except Exception as error:  # noqa: BLE001 - a failed point is reported, as `run` does
                if on_failure is None:
                    raise
                on_failure(SweepFailure(phase, tokens, f"{type(error).__name__}: {error}"))
                continue
            points.append(point)
            if on_point is not None:
                on_point(point)
    return points


def _point(
    config: ModelConfig, phase: str, mode: str, tokens: int, context_len: int, opts: RunOptions
) -> SweepPoint:
    batch = _batch(phase, tokens, context_len)
    # Decode replays a captured graph, as an engine runs it (and dsv3-decode-ll does).
    c = compare_serial_dbo(
        f"sweep-{phase}-{tokens}", config, batch, mode, opts, graph=phase == "decode"
    )
    s = c.dbo.summary
    return SweepPoint(
        phase=phase,
        tokens_per_device=tokens,
        step_us_serial=c.serial.step_us,
        step_us_dbo=c.dbo.step_us,
        speedup=c.speedup,
        overlap_fraction=s.overlap_fraction,
        exposed_comm_us=s.exposed_comm_us,
        comm_us=s.comm_us,
        compute_us=s.compute_us,
        context_len=context_len if phase == "decode" else 0,
    )


class CsvSink:
    """`sweep.csv` written a row at a time and flushed, so the rows survive an interrupt."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] = path.open("w", newline="")
        self._writer: csv.DictWriter | None = None

    def write(self, point: SweepPoint) -> None:
        row = point.to_dict()
        if self._writer is None:
            self._writer = csv.DictWriter(self._file, fieldnames=list(row))
            self._writer.writeheader()
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_csv(path: Path, points: Sequence[SweepPoint]) -> Path:
    sink = CsvSink(path)
    try:
        for p in points:
            sink.write(p)
    finally:
        sink.close()
    return path


def plot_sweep(path: Path, points: Sequence[SweepPoint]) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4))
    phases = (("decode", "low-latency"), ("prefill", "high-throughput"))
    for i, (phase, style) in enumerate(phases):
        ax = fig.add_subplot(1, 3, i + 1)
        pts = [p for p in points if p.phase == phase]
        if not pts:
            continue
        ax.plot(
            [p.tokens_per_device for p in pts], [(p.speedup - 1) * 100 for p in pts], marker="o"
        )
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per device")
        ax.set_ylabel("DBO gain over serial (%)")
        ax.set_title(f"{phase} ({style} EP)")
    ax = fig.add_subplot(1, 3, 3)
    for phase, _ in phases:
        pts = [p for p in points if p.phase == phase and p.compute_us > 0]
        if pts:
            ax.plot(
                [p.comm_compute_ratio for p in pts],
                [(p.speedup - 1) * 100 for p in pts],
                "o",
                label=phase,
            )
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("comm time / compute time (DBO run)")
    ax.set_ylabel("DBO gain over serial (%)")
    ax.set_title("gain against comm/compute")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


# --------------------------------------------------------------------------------------------
# The verb: `dbo-sim sweep`

_COLUMNS = (
    f"{'phase':8} {'tokens':>7} {'serial us':>10} {'dbo us':>10} {'gain':>7} "
    f"{'overlap':>8} {'comm/compute':>13}"
)


def run(args: argparse.Namespace) -> int:
    """`dbo-sim sweep`: one row per point, then where DBO pays; writes sweep.csv and
    sweep.png. 0 when every point ran, 1 when one failed."""
    decode = args.decode or DECODE_TOKENS
    prefill = args.prefill or PREFILL_TOKENS  # checked by the verb: `sweep_args.check_points`
    opts = run_options(args)
    out = Path(args.out)
    writable_dir(out)
    if not args.json:
        print(_header(args, prefill))
        print(_COLUMNS)
    sink = CsvSink(out / "sweep.csv")
    failures: list[SweepFailure] = []
    points: list[SweepPoint] = []
    try:
        points = _run_points(args, opts, decode, prefill, sink, failures)
    except KeyboardInterrupt:
        raise Interrupted(f"the sweep points that finished are above and in {sink.path}") from None
    finally:
        sink.close()
    png_path = plot_sweep(out / "sweep.png", points)
    if not args.json:
        _print_summary(points, failures, sink.path, png_path)
    return 1 if failures else 0


def _header(args: argparse.Namespace, prefill: Sequence[int]) -> str:
    layers = f"{args.layers} of {FULL_LAYERS} layers" if args.layers else f"{FULL_LAYERS} layers"
    return (
        f"DeepSeek-V3 ({layers}), {args.ubatches} ubatches; decode: one-token requests over a "
        f"{args.context}-token context each (--context); prefill: {describe_prefill(prefill)}"
    )


def _run_points(
    args: argparse.Namespace,
    opts: RunOptions,
    decode: Sequence[int],
    prefill: Sequence[int],
    sink: CsvSink,
    failures: list[SweepFailure],
) -> list[SweepPoint]:
    """Every point, each row printed (and each point written to `sink`) as it finishes."""
    bar = progress_bar(len(decode) + len(prefill), "sweep", quiet=args.json, unit="point")

    def on_point(p: SweepPoint) -> None:
        sink.write(p)
        emit(json.dumps(p.to_dict()) if args.json else _row(p))
        bar.update()

    def on_failure(f: SweepFailure) -> None:
        failures.append(f)
        emit(json.dumps(f.to_dict()) if args.json else _failed_row(f))
        bar.update()

    with bar:
        return run_sweep(
            opts,
            decode_tokens=decode,
            prefill_tokens=prefill,
            num_layers=args.layers,
            context_len=args.context,
            on_point=on_point,
            on_failure=on_failure,
        )


def _row(p: SweepPoint) -> str:
    return (
        f"{p.phase:8} {p.tokens_per_device:7d} {p.step_us_serial:10.1f} {p.step_us_dbo:10.1f} "
        f"{(p.speedup - 1) * 100:6.1f}% {p.overlap_fraction * 100:7.0f}% "
        f"{p.comm_compute_ratio:13.2f}"
    )


def _failed_row(f: SweepFailure) -> str:
    return f"{f.phase:8} {f.tokens_per_device:7d} FAILED: {one_line(f.error, 300)}"


def _print_summary(
    points: Sequence[SweepPoint], failures: Sequence[SweepFailure], csv_path: Path, png: Path
) -> None:
    print()
    for phase in ("decode", "prefill"):
        phase_points = [p for p in points if p.phase == phase]
        if phase_points:
            start = pays_from(phase_points)
            where = "at no point tried" if start is None else f"from {start} tokens per device"
            print(f"{phase}: DBO pays {where}")
    if failures:
        print(f"{len(failures)} point(s) FAILED (above); they are not in the CSV or the plot")
    print(f"\nwrote {csv_path} and {png}")
