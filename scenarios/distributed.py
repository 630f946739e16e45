"""Scenarios across processes: one rank per process, each a DBO step with real EP all-to-all.

`python -m scenarios run --ranks N ...` starts N local processes on 127.0.0.1 (this process
hosts the TCPStore they rendezvous through, on a port the OS picks) and prints one table;
`torchrun --nproc-per-node N -m scenarios run ...` starts them itself (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and rank 0 prints. Either way every rank runs `run_rank_scenarios`:
it joins a gloo process group (NCCL as well when every rank has a GPU and `--device cuda`),
runs each scenario's per-rank half on its own simulated device (`SimDevice(rank=r)`), and
publishes one `RankOutcome` per scenario to the store. The reporter merges them with
`merge_outcomes`: passed only if every rank passed, the slowest rank's step time, one Chrome
trace with a process per rank.

Per rank, an MoE scenario: every rank holds the same weights (same seed) and its own batch and
inputs (token counts differ by rank, so the DP padding matters). The ranks agree on ubatching
with `dbo.split.coordinate_ubatching` (split only if every rank can; cut at the largest padded
count), then run the step serially and with DBO over an `EPGroup` spanning the ranks, each step
opened by the EP handshake; both outputs must equal this rank's single-process run (every
expert local). Padding here places the cuts; the padded tokens themselves are not run.

`dp-disagreement` (negative): rank 0 would split its step alone and the others would not; the
EP handshake must stop every rank with an error naming each rank's ubatch count, promptly, and
the same step must then run once the ranks agree.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dbo.comm import EPGroup, EPStepMismatchError, use_ep_group
from dbo.sim import SimDevice
from dbo.sim.records import OpRecord, RaceReport
from dbo.sim.report import merge_traces, plot_timeline, summarize
from dbo.split import (
    UBatchSlice,
    UBatchThresholds,
    coordinate_ubatching,
    should_ubatch,
    split_batch,
)
from dbo.streams import CudaDevice, Device
from scenarios.harness import RunOptions, StepRun, measure, run_step
from scenarios.model import Batch, ModelConfig, MoEModel, preset
from scenarios.registry import SCENARIOS, RankHalf, ScenarioResult, across_ranks, rank_scenario
from scenarios.steps import prepare, serial_step, ubatched_step
from workspace import reset_workspace_manager

__all__ = [
    "RankEnv",
    "RankOutcome",
    "launched_by_torchrun",
    "init_rank",
    "run_rank_scenarios",
    "merge_outcomes",
    "run_local_ranks",
    "run_as_torchrun_rank",
    "run_rank_step",
]

# Set in the children of `run_local_ranks`: the parent hosts the store (as torchrun's agent does).
_HOSTED_ENV = "DBO_SIM_STORE_HOSTED"
_SPEC_ENV = "DBO_SIM_RANK_SPEC"
# The launcher's pid, in the children of `run_local_ranks`: a child whose parent is no longer
# that process was orphaned and exits (`_exit_with_launcher`).
_LAUNCHER_ENV = "DBO_SIM_LAUNCHER_PID"
_ORPHANED_EXIT = 4
# How often a child looks for its launcher, and the launcher for stopped children.
_WATCH_POLL_S = 0.1
# After a rank ends abnormally, how long its peers have to report before they are killed.
_PEER_GRACE_S = 2.0
# A child imports this module by name rather than running it as __main__: its outcomes then
# pickle under `scenarios.distributed`, and its scenarios register once.
_CHILD_ENTRY = "from scenarios.distributed import child_main; raise SystemExit(child_main())"
_TOLERANCE = 1e-9
# The tiny workload is far below the production thresholds (512 prefill tokens); these let it
# split while still refusing a split that would leave a ubatch empty.
_TINY_THRESHOLDS = UBatchThresholds(decode_min_tokens=2, prefill_min_tokens=2)


class RankSetupError(RuntimeError):
    """A rank could not join the group: unreachable store, group never formed, bad env."""


@dataclass
class RankEnv:
    """One rank's place in the run. `group` carries the EP all-to-all for CPU tensors (gloo);
    `cuda_group` is the NCCL group when every rank has a GPU; `cpu_group` the gloo group the
    DP agreement uses; `store` (namespaced) carries outcomes and EP aborts."""

    rank: int
    world: int
    local_rank: int
    store: Any
    group: Any
    cpu_group: Any
    cuda_group: Any = None


@dataclass
class RankOutcome:
    """One rank's half of one scenario, as sent to the reporter."""

    rank: int
    passed: bool
    error: str | None = None
    outputs_match: bool | None = None
    max_abs_diff: float | None = None
    races: list[RaceReport] = field(default_factory=list)
    serial_records: list[OpRecord] = field(default_factory=list)
    dbo_records: list[OpRecord] = field(default_factory=list)
    # Drawn in the trace when there are no dbo_records, never summarised as a step time: what
    # a negative scenario ran (dp-disagreement: the agreed step).
    trace_records: list[OpRecord] = field(default_factory=list)
    workspace_peak_bytes: int | None = None
    wall_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Joining the group


def launched_by_torchrun() -> bool:
    """True in a process that torchrun (or an equivalent launcher) started as one of several."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    except ValueError:
        return False


def _env_int(name: str) -> int:
    text = os.environ.get(name)
    if text is None:
        raise RankSetupError(f"environment variable {name} is not set (torchrun sets it)")
    try:
        return int(text)
    except ValueError:
        raise RankSetupError(
            f"environment variable {name} must be an integer, got {text!r}"
        ) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def init_rank(opts: RunOptions) -> RankEnv:
    """Join the run described by RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if world < 1 or not 0 <= rank < world:
        raise RankSetupError(
            f"RANK ({rank}) must be in [0, WORLD_SIZE) with WORLD_SIZE ({world}) >= 1"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = _env_int("MASTER_PORT")
    # torchrun's agent (or our parent) already hosts the store; otherwise rank 0 hosts it.
    hosted = (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        or os.environ.get(_HOSTED_ENV) == "1"
    )
    timeout = timedelta(seconds=opts.timeout_s)
    try:
        raw = dist.TCPStore(
            addr, port, is_master=rank == 0 and not hosted, timeout=timeout, wait_for_workers=False
        )
    except Exception as error:
        raise RankSetupError(
            f"rank {rank} could not reach the rendezvous store at {addr}:{port} within "
            f"{opts.timeout_s:g} s: {_first_line(error)}"
        ) from error
    store = dist.PrefixStore("dbo-sim", raw)

    # NCCL only when every rank has its own GPU: each rank says, then all decide alike.
    has_gpu = (
        opts.device == "cuda"
        and torch.cuda.is_available()
        and local_rank < torch.cuda.device_count()
    )
    store.set(f"gpu/{rank}", "1" if has_gpu else "0")
    try:
        store.wait([f"gpu/{r}" for r in range(world)], timeout)
    except Exception as error:
        raise RankSetupError(_group_never_formed(rank, world, opts, error)) from error
    every_gpu = all(store.get(f"gpu/{r}") == b"1" for r in range(world))
    if opts.device == "cuda" and not every_gpu:
        lacking = [r for r in range(world) if store.get(f"gpu/{r}") != b"1"]
        raise RankSetupError(
            f"--device cuda needs a GPU per rank; rank(s) {lacking} have none (this machine has "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0})"
        )
    try:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("pg", store),
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
        cuda_group = None
        if every_gpu:
            torch.cuda.set_device(local_rank)
            cuda_group = dist.new_group(backend="nccl", timeout=timeout)
    except Exception as error:
        raise RankSetupError(_group_never_formed(rank, world, opts, error)) from error
    group = dist.group.WORLD
    return RankEnv(rank, world, local_rank, store, group, group, cuda_group)


def _group_never_formed(rank: int, world: int, opts: RunOptions, error: BaseException) -> str:
    return (
        f"rank {rank}: the process group of WORLD_SIZE={world} ranks did not form within "
        f"{opts.timeout_s:g} s (are all {world} ranks started, with the same MASTER_ADDR/PORT?): "
        f"{_first_line(error)}"
    )


# --------------------------------------------------------------------------------------------
# One rank's step


def rank_device(env: RankEnv, opts: RunOptions, tensor_device: str = "cpu") -> Device:
    """This rank's device: a simulated GPU labelled with the rank, or its own CUDA device."""
    if opts.device == "sim":
        return SimDevice(opts.profile, rank=env.rank, tensor_device=tensor_device)
    return CudaDevice(env.local_rank)


def run_rank_step(
    model: MoEModel,
    x: torch.Tensor,
    *,
    device: Device,
    ep: EPGroup,
    slices: Sequence[UBatchSlice] | None,
    mode: str,
    timeout_s: float,
    warmups: int = 1,
) -> StepRun:
    """`harness.run_step` for one rank of several: warm up, lock the workspace, measure; each
    step opened by the EP handshake (`ep.step`), ubatched over `slices` (None: serially)."""
    if slices is None:
        run = serial_step(model, x, device, mode=mode)
    else:
        run = ubatched_step(model, x, device, mode=mode, slices=slices, timeout_s=timeout_s)

    def step() -> torch.Tensor:
        with ep.step(run.num_ubatches):
            return run.output()

    prepare(device.torch_device, run.num_ubatches, [step], rounds=warmups)
    return measure(step, device)


def _rank_batch(rank: int, decode: bool) -> Batch:
    """Rank r's requests: the tiny workload with up to 3 x 8 tokens (4 requests) fewer, so the
    ranks' token counts differ and padding to the largest one moves the cuts."""
    shorter = rank % 4
    if decode:
        return Batch.decode(num_requests=64 - 4 * shorter, context_len=16)
    return Batch(query_start_loc=(0, 40, 70, 128, 160 - 8 * shorter), context_lens=(0, 0, 0, 0))


def _tiny(env: RankEnv, opts: RunOptions) -> ModelConfig:
    # EP spans the ranks: each owns num_experts / world experts. Under --device cuda the
    # rank's tensors live on its own GPU, so the all-to-all runs over NCCL.
    config = preset("tiny", ep_size=env.world)
    if env.cuda_group is not None:
        config = config.with_(tensor_device=f"cuda:{env.local_rank}")
    return config


def _ep_group(env: RankEnv, config: ModelConfig, opts: RunOptions) -> EPGroup:
    # CUDA tensors travel over the NCCL group, CPU tensors over gloo.
    group = env.cuda_group if config.tensor_device.startswith("cuda") else env.group
    return EPGroup(group, num_experts=config.num_experts, store=env.store, timeout_s=opts.timeout_s)


def _moe_rank(
    env: RankEnv, opts: RunOptions, *, decode: bool, mode: str, num_ubatches: int | None = None
) -> RankOutcome:
    start = time.monotonic()
    n = num_ubatches or opts.num_ubatches
    config = _tiny(env, opts)
    batch = _rank_batch(env.rank, decode)
    x = MoEModel(config, batch).inputs(seed=1 + env.rank)
    # This rank's batch in one process, every expert local: the values to reproduce.
    reference_device = (
        rank_device(env, opts)
        if config.tensor_device.startswith("cuda")
        else SimDevice(opts.profile)
    )
    reference = run_step(
        MoEModel(config, batch),
        x,
        device=reference_device,
        num_ubatches=None,
        mode=mode,
        timeout_s=opts.timeout_s,
    )

    ep = _ep_group(env, config, opts)
    real = batch.num_tokens
    decision = coordinate_ubatching(
        should_ubatch(real, batch.is_decode, n, _TINY_THRESHOLDS),
        real,
        n,
        group=env.cpu_group,
        num_tokens=real,
    )
    slices = (
        split_batch(batch.query_start_loc, decision.num_tokens_padded, n)
        if decision.split
        else None
    )
    with use_ep_group(ep):
        serial, ubatched = (
            run_rank_step(
                MoEModel(config, batch),
                x,
                device=rank_device(env, opts),
                ep=ep,
                slices=cuts,
                mode=mode,
                timeout_s=opts.timeout_s,
            )
            for cuts in (None, slices)
        )

    diff = max(
        (serial.output.double() - reference.output.double()).abs().max().item(),
        (ubatched.output.double() - reference.output.double()).abs().max().item(),
    )
    races = serial.races + ubatched.races
    allocations = serial.allocations_during_step + ubatched.allocations_during_step
    reasons = []
    if diff > _TOLERANCE:
        reasons.append(
            f"rank {env.rank}: outputs differ from the single-process run (max abs diff {diff:.3g})"
        )
    if races:
        reasons.append(f"rank {env.rank}: {len(races)} race(s), first: {races[0].describe()}")
    if allocations:
        reasons.append(f"rank {env.rank}: {allocations} workspace allocation(s) after lock")
    if not decision.split:
        reasons.append(f"rank {env.rank}: the ranks agreed not to split ({decision.reason})")
    return RankOutcome(
        rank=env.rank,
        passed=not reasons,
        error="; ".join(reasons) or None,
        outputs_match=diff <= _TOLERANCE,
        max_abs_diff=diff,
        races=races,
        serial_records=serial.records,
        dbo_records=ubatched.records,
        workspace_peak_bytes=ubatched.workspace_peak_bytes,
        wall_s=time.monotonic() - start,
        details={
            "mode": mode,
            "tokens": real,
            "num_tokens_padded": decision.num_tokens_padded,
            "num_ubatches": n if decision.split else 1,
            "ubatch_tokens": [s.num_tokens for s in slices] if slices else [real],
            "step_us_serial": serial.step_us,
            "step_us_dbo": ubatched.step_us,
        },
    )


_DISAGREEMENT_BOUND_S = 5.0


def disagreement_checks(
    caught: BaseException | None, world: int, stopped_s: float, diff: float
) -> dict[str, bool]:
    """The dp-disagreement verdict on one rank: the unagreed step must have stopped with
    `EPStepMismatchError` naming every rank's ubatch count, within the bound, and the agreed
    step must have matched the single-process run (max abs diff `diff`)."""
    message = str(caught) if caught is not None else ""
    return {
        "every rank stopped with EPStepMismatchError": isinstance(caught, EPStepMismatchError),
        "the error names every rank's ubatch count": all(
            f"rank {r}: " in message for r in range(world)
        ),
        f"stopped within {_DISAGREEMENT_BOUND_S:g} s": stopped_s < _DISAGREEMENT_BOUND_S,
        "agreed step matches the single-process run": diff <= _TOLERANCE,
    }


@rank_scenario("dp-disagreement", negative=True)
def _dp_disagreement_rank(env: RankEnv, opts: RunOptions) -> RankOutcome:
    start = time.monotonic()
    if env.world < 2:
        return RankOutcome(env.rank, passed=False, error="dp-disagreement needs at least 2 ranks")
    n = opts.num_ubatches
    # CPU tensors over gloo even under --device cuda: after the caught mismatch the group is
    # torn down, which gloo's host-side waits survive and NCCL's stream-side ones may not.
    config = preset("tiny", ep_size=env.world)
    # Alone, with a 128-token threshold, rank 0 (160 tokens) splits and the others (96) do not.
    if env.rank == 0:
        batch = Batch(query_start_loc=(0, 40, 70, 128, 160), context_lens=(0,) * 4)
    else:
        batch = Batch.prefill(3, 32)
    thresholds = UBatchThresholds(decode_min_tokens=32, prefill_min_tokens=128)
    alone = should_ubatch(batch.num_tokens, batch.is_decode, n, thresholds)
    x = MoEModel(config, batch).inputs(seed=1 + env.rank)
    ep = _ep_group(env, config, opts)

    def step(slices: Sequence[UBatchSlice] | None) -> StepRun:
        with use_ep_group(ep):
            return run_rank_step(
                MoEModel(config, batch),
                x,
                device=rank_device(env, opts),
                ep=ep,
                slices=slices,
                mode="ht",
                timeout_s=opts.timeout_s,
            )

    # Without agreement: each rank runs what it decided alone.
    caught: BaseException | None = None
    began = time.monotonic()
    try:
        step(split_batch(batch.query_start_loc, batch.num_tokens, n) if alone else None)
    except Exception as error:  # noqa: BLE001 - the fault under test; its type is checked below
        caught = error
    stopped_s = time.monotonic() - began

    # With agreement: the same step, and the same decision on every rank.
    decision = coordinate_ubatching(
        alone, batch.num_tokens, n, group=env.cpu_group, num_tokens=batch.num_tokens
    )
    agreed = step(
        split_batch(batch.query_start_loc, decision.num_tokens_padded, n)
        if decision.split
        else None
    )
    reference = run_step(
        MoEModel(config, batch),
        x,
        device=SimDevice(opts.profile),
        num_ubatches=None,
        mode="ht",
        timeout_s=opts.timeout_s,
    )
    diff = (agreed.output.double() - reference.output.double()).abs().max().item()

    checks = disagreement_checks(caught, env.world, stopped_s, diff)
    failed = [name for name, ok in checks.items() if not ok]
    caught_text = f"{type(caught).__name__}: {caught}" if caught is not None else None
    return RankOutcome(
        rank=env.rank,
        passed=not failed,
        error=None
        if not failed
        else (f"rank {env.rank} failed: {', '.join(failed)} (caught {caught_text or 'nothing'})"),
        outputs_match=diff <= _TOLERANCE,
        max_abs_diff=diff,
        races=agreed.races,
        trace_records=agreed.records,
        wall_s=time.monotonic() - start,
        details={
            "ubatches_alone": n if alone else 1,
            "caught": caught_text,
            "seconds_to_stop": round(stopped_s, 3),
            "agreed_split": decision.split,
            "agreed_reason": decision.reason,
            "checks": checks,
        },
    )


rank_scenario("moe-prefill-ht")(partial(_moe_rank, decode=False, mode="ht"))
rank_scenario("moe-decode-ll")(partial(_moe_rank, decode=True, mode="ll"))
rank_scenario("three-ubatches")(partial(_moe_rank, decode=False, mode="ht", num_ubatches=3))


def run_rank_scenarios(env: RankEnv, names: Sequence[str], opts: RunOptions) -> list[RankOutcome]:
    """Run this rank's half of each scenario, in order, publishing each outcome to the store.

    A scenario that raises is a failed outcome, never a crash. If it left the group broken
    (an EP abort or timeout), the remaining scenarios are reported as not run: their
    collectives could pair with the broken one's.
    """
    outcomes = []
    broken: str | None = None
    for name in names:
        start = time.monotonic()
        if broken is not None:
            outcome = RankOutcome(env.rank, passed=False, error=f"not run: {broken}")
        else:
            try:
                outcome = _rank_half(name)(env, opts)
            except Exception as error:  # noqa: BLE001 - reported as the verdict
                outcome = RankOutcome(
                    env.rank,
                    passed=False,
                    error=f"rank {env.rank}: {type(error).__name__}: {error}",
                )
                if not isinstance(error, (ValueError, TypeError)):
                    broken = (
                        f"an earlier scenario ({name}) failed on rank {env.rank} and may have "
                        "left the group broken"
                    )
            finally:
                reset_workspace_manager()
        outcome.wall_s = outcome.wall_s or time.monotonic() - start
        env.store.set(f"outcome/{name}/{env.rank}", pickle.dumps(outcome))
        outcomes.append(outcome)
    env.store.set(f"done/{env.rank}", "1")
    return outcomes


# --------------------------------------------------------------------------------------------
# Merging the ranks' outcomes


def _rank_half(name: str) -> RankHalf:
    half = SCENARIOS[name].rank
    assert half is not None, f"{name} has no rank half; check_names lets only those through"
    return half


def merge_outcomes(
    name: str, outcomes: Sequence[RankOutcome | None], opts: RunOptions, *, missing: str = ""
) -> ScenarioResult:
    """One `ScenarioResult` from every rank's outcome (None: the rank reported nothing)."""
    present = [o for o in outcomes if o is not None]
    absent = [r for r, o in enumerate(outcomes) if o is None]
    errors = [o.error for o in present if o.error]
    if absent:
        errors.insert(0, f"rank(s) {absent} reported nothing{': ' + missing if missing else ''}")
    passed = not absent and all(o.passed for o in present)
    serial_records = [r for o in present for r in o.serial_records]
    dbo_records = [r for o in present for r in o.dbo_records]
    races = [race for o in present for race in o.races]
    serial = summarize(serial_records) if serial_records else None
    ubatched = summarize(dbo_records, races=races) if dbo_records else None
    matches = [o.outputs_match for o in present if o.outputs_match is not None]
    diffs = [o.max_abs_diff for o in present if o.max_abs_diff is not None]
    peaks = [o.workspace_peak_bytes for o in present if o.workspace_peak_bytes is not None]
    result = ScenarioResult(
        scenario=name,
        passed=passed,
        negative=SCENARIOS[name].negative,
        outputs_match=(all(matches) and not absent) if matches else None,
        max_abs_diff=max(diffs) if diffs else None,
        races=len(races),
        error="; ".join(errors) or None,
        step_us_serial=serial.step_us if serial else None,
        step_us_dbo=ubatched.step_us if ubatched else None,
        speedup=serial.step_us / ubatched.step_us
        if serial and ubatched and ubatched.step_us > 0
        else None,
        overlap_fraction=ubatched.overlap_fraction if ubatched else None,
        exposed_comm_us=ubatched.exposed_comm_us if ubatched else None,
        workspace_peak_bytes=max(peaks) if peaks else None,
        details={
            "ranks": len(outcomes),
            "slowest_rank": ubatched.slowest_rank if ubatched else None,
            "per_rank": [
                {"rank": o.rank, "passed": o.passed, "wall_s": round(o.wall_s, 3), **o.details}
                for o in present
            ],
        },
    )
    traced = [o.dbo_records or o.trace_records for o in present]
    traced = [records for records in traced if records]
    if opts.out_dir is not None and traced:
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        trace = merge_traces(
            traced, races=races, metadata={"scenario": name, "ranks": len(outcomes)}
        )
        stem = opts.out_dir / opts.artifact_stem(name, ranks=len(outcomes))
        path = Path(f"{stem}.trace.json")
        path.write_text(json.dumps(trace, allow_nan=False, separators=(",", ":")), encoding="utf-8")
        result.trace = str(path)
        what = "DBO" if dbo_records else "what ran"
        result.timeline_png = str(
            plot_timeline(
                Path(f"{stem}.png"),
                [r for records in traced for r in records],
                title=f"{name} ({what}, {len(outcomes)} ranks)",
            )
        )
    return result


def _collect(store: Any, names: Sequence[str], world: int) -> dict[str, list[RankOutcome | None]]:
    table: dict[str, list[RankOutcome | None]] = {}
    for name in names:
        row: list[RankOutcome | None] = []
        for rank in range(world):
            key = f"outcome/{name}/{rank}"
            row.append(pickle.loads(store.get(key)) if store.check([key]) else None)
        table[name] = row
    return table


# --------------------------------------------------------------------------------------------
# Launchers


def _opts_to_json(opts: RunOptions) -> dict[str, Any]:
    return {
        "num_ubatches": opts.num_ubatches,
        "device": opts.device,
        "profile": opts.profile,
        "timeout_s": opts.timeout_s,
    }


def check_names(names: Sequence[str]) -> list[str]:
    """The names that cannot run across ranks (empty when all can)."""
    return [n for n in names if n not in across_ranks()]


def check_world_size(world: int) -> str | None:
    """Why the rank scenarios cannot run on `world` ranks (None when they can): EP spans every
    rank and shards the tiny model's experts evenly, so the rank count must divide them."""
    experts = preset("tiny").num_experts
    if world < 1 or experts % world:
        fits = ", ".join(str(w) for w in range(1, experts + 1) if experts % w == 0)
        return (
            f"the tiny model's {experts} experts are sharded evenly over the EP ranks (EP spans "
            f"every rank), so the world size must divide {experts}: {fits}"
        )
    return None


def run_local_ranks(
    names: Sequence[str], opts: RunOptions, ranks: int, *, deadline_s: float | None = None
) -> list[ScenarioResult]:
    """Start `ranks` processes on this machine, run `names` on each, merge, and return one
    `ScenarioResult` per name. Every process is ended by the deadline; none is left behind.

    The rank processes die with this one, however it ends (SIGKILL included: see
    `_spawn_rank`). A rank stopped (SIGSTOP, a debugger) for longer than `opts.timeout_s` is
    killed: by then every wait of its peers has expired, so nothing it could still do would
    count. Its peers' steps end by their own bounded waits (`timeout_s`) or, once it is
    killed, at once (or are ended `_PEER_GRACE_S` later), so a frozen rank ends the run within
    `timeout_s` + `_PEER_GRACE_S` plus the launcher's polls of the freeze, not at the deadline
    (see `_wait_for_ranks`)."""
    unknown = check_names(names)
    if unknown:
        raise ValueError(
            f"scenario(s) {unknown} run in one process; across ranks: {sorted(across_ranks())}"
        )
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    bad_world = check_world_size(ranks)
    if bad_world:
        raise ValueError(f"ranks={ranks}: {bad_world}")
    timeout = timedelta(seconds=opts.timeout_s)
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    store = dist.PrefixStore("dbo-sim", raw)
    deadline_s = deadline_s if deadline_s is not None else 60.0 + opts.timeout_s * (len(names) + 1)
    env = dict(os.environ)
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's data connections on loopback too
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(raw.port),
        WORLD_SIZE=str(ranks),
        **{
            _HOSTED_ENV: "1",
            _SPEC_ENV: json.dumps({"names": list(names), "opts": _opts_to_json(opts)}),
        },
    )
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    procs: list[subprocess.Popen] = []
    ended: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="dbo-ranks-") as logdir:
        logs = [Path(logdir) / f"rank{r}.log" for r in range(ranks)]
        try:
            for rank in range(ranks):
                with open(logs[rank], "wb") as log:
                    procs.append(
                        _spawn_rank(
                            [sys.executable, "-c", _CHILD_ENTRY],
                            {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                            log,
                        )
                    )
            ended = _wait_for_ranks(procs, opts.timeout_s, deadline_s)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        missing = "; ".join(
            f"rank {r} {ended.get(r, f'exited with {p.returncode}')}: {_tail(logs[r])}"
            for r, p in enumerate(procs)
            if p.returncode != 0
        )
        table = _collect(store, names, ranks)
    return [merge_outcomes(name, table[name], opts, missing=missing) for name in names]


def _spawn_rank(argv: list[str], env: dict[str, str], log: Any) -> subprocess.Popen:
    """Start one rank process, tied to this one: on Linux the kernel SIGKILLs it when this
    process (the thread calling here, which waits for it) dies, whatever killed it; everywhere
    its `child_main` also watches for the launcher to go (`_exit_with_launcher`)."""
    return subprocess.Popen(
        argv,
        env={**env, _LAUNCHER_ENV: str(os.getpid())},
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=_parent_death_hook(os.getpid()),  # noqa: PLW1509 - see _parent_death_hook
    )


_PR_SET_PDEATHSIG = 1


def _parent_death_hook(launcher_pid: int) -> Callable[[], None] | None:
    """A `preexec_fn` (run in the child between fork and exec) asking Linux to SIGKILL the
    child when its parent dies; None where prctl is unavailable. libc is looked up here, in
    the parent: the child runs only the call, on already-built arguments."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    option, sig = ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(int(signal.SIGKILL))

    def tie_to_launcher() -> None:
        prctl(option, sig)
        if os.getppid() != launcher_pid:  # the launcher died before the call: no signal comes
            os._exit(_ORPHANED_EXIT)

    return tie_to_launcher


def _exit_with_launcher(launcher_pid: int, poll_s: float = _WATCH_POLL_S) -> threading.Thread:
    """In a rank process: end it (exit code `_ORPHANED_EXIT`) as soon as its parent is no
    longer `launcher_pid`. The portable half of `_spawn_rank`'s tie (prctl is Linux-only): a
    rank whose launcher was killed would otherwise run on, holding its peers and the port."""

    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(poll_s)
        os._exit(_ORPHANED_EXIT)

    if os.getppid() != launcher_pid:
        os._exit(_ORPHANED_EXIT)
    watcher = threading.Thread(target=watch, name="dbo-launcher-watch", daemon=True)
    watcher.start()
    return watcher


def _is_stopped(pid: int) -> bool:
    """True while process `pid` is stopped (SIGSTOP, a debugger), as Linux's /proc shows it;
    False where /proc is missing: the deadline alone bounds a stopped rank there."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last.
    return text[text.rfind(b")") + 2 : text.rfind(b")") + 3] in (b"T", b"t")


def _wait_for_ranks(
    procs: Sequence[subprocess.Popen], timeout_s: float, deadline_s: float
) -> dict[int, str]:
    """Wait for every rank to exit; returns why each rank it killed was killed, by rank.

    It kills a rank stopped (SIGSTOP, a debugger) for longer than `timeout_s`: by then every
    wait of its peers has expired. Once a rank has ended abnormally (killed, a nonzero exit),
    the others get `_PEER_GRACE_S` to report and exit, then are killed: their group is broken,
    so all they can still do is report (one in a gloo collective errors at once; one waiting on
    the store would wait out its own timeout). At the deadline every rank left is killed.

    Stopped time counts only while this launcher runs: a launcher stopped along with its ranks
    (Ctrl-Z on the whole job) finds them all stopped on resuming, and must not kill them for it.
    """
    killed: dict[int, str] = {}
    stopped_since: dict[int, float] = {}
    broken: tuple[float, str] | None = None  # when a rank first ended abnormally, and which
    end = time.monotonic() + deadline_s
    last = time.monotonic()
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if now - last > 1.0:  # this process was not running: the ranks' clocks start again
            stopped_since.clear()
            broken = (now, broken[1]) if broken else None
        last = now
        for rank, p in enumerate(procs):
            code = p.poll()
            if code is not None:
                stopped_since.pop(rank, None)
                if code != 0 and broken is None:
                    broken = (now, f"rank {rank} ended abnormally (exit {code})")
                continue
            stopped = _is_stopped(p.pid)
            if not stopped:
                stopped_since.pop(rank, None)
            reason = None
            if now >= end:
                reason = f"was still running at the {deadline_s:g} s deadline: killed"
            elif stopped and now - stopped_since.setdefault(rank, now) > timeout_s:
                reason = (
                    f"was stopped (SIGSTOP or a debugger) for longer than the {timeout_s:g} s "
                    f"timeout: killed"
                )
            elif broken is not None and now - broken[0] > _PEER_GRACE_S:
                reason = f"was still running {_PEER_GRACE_S:g} s after {broken[1]}: killed"
            if reason is not None:
                killed[rank] = reason
                p.kill()
        time.sleep(_WATCH_POLL_S)
    return killed


def _tail(path: Path, limit: int = 1500) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("frame #")]
    return "\n".join(lines)[-limit:] or "(no output)"


def run_as_torchrun_rank(names: Sequence[str], opts: RunOptions) -> list[ScenarioResult] | None:
    """This process's part of a torchrun launch: run every rank's half; rank 0 then waits for
    the others' outcomes and returns the merged results, the other ranks return None."""
    unknown = check_names(names)
    if unknown:
        raise ValueError(
            f"scenario(s) {unknown} run in one process; across ranks: {sorted(across_ranks())}"
        )
    bad_world = check_world_size(_env_int("WORLD_SIZE"))
    if bad_world:
        raise RankSetupError(f"WORLD_SIZE={os.environ['WORLD_SIZE']}: {bad_world}")
    env = init_rank(opts)
    run_rank_scenarios(env, names, opts)
    if env.rank != 0:
        return None
    missing = ""
    try:
        env.store.wait(
            [f"done/{r}" for r in range(env.world)],
            timedelta(seconds=opts.timeout_s * (len(names) + 1)),
        )
    except Exception as error:  # noqa: BLE001 - the missing ranks are reported below
        missing = _first_line(error)
    table = _collect(env.store, names, env.world)
    return [merge_outcomes(name, table[name], opts, missing=missing) for name in names]


def child_main() -> int:
    """Entry of a process started by `run_local_ranks`."""
    if _LAUNCHER_ENV in os.environ:
        _exit_with_launcher(int(os.environ[_LAUNCHER_ENV]))
    spec = json.loads(os.environ[_SPEC_ENV])
    opts = RunOptions(**spec["opts"])
    try:
        env = init_rank(opts)
    except RankSetupError as error:
        print(f"dbo-sim: {error}", file=sys.stderr, flush=True)
        os._exit(3)
    run_rank_scenarios(env, spec["names"], opts)
    sys.stdout.flush()
    sys.stderr.flush()
    # No teardown: after a failed scenario a collective may be left half-done in gloo's
    # threads, and destroying the group would wait for it. The outcomes are in the store.
    os._exit(0)
