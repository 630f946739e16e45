"""The scenarios' rank halves: what each rank runs of moe-*, three-ubatches and dp-disagreement."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from dbo.comm import EPStepMismatchError, use_ep_group
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from dbo.split import (
    UBatchDecision,
    UBatchSlice,
    UBatchThresholds,
    coordinate_ubatching,
    should_ubatch,
    split_batch,
)
from scenarios.harness import RunOptions, StepRun, run_step
from scenarios.model import Batch, ModelConfig, MoEModel, preset
from scenarios.ranks.records import RankEnv, RankOutcome
from scenarios.ranks.step import TOLERANCE, ep_group_for, rank_device, run_rank_step, tiny_config
from scenarios.registry import rank_scenario

__all__ = ["DISAGREEMENT_BOUND_S", "disagreement_checks"]

# The tiny workload is far below the production thresholds (512 prefill tokens); these let it
# split while still refusing a split that would leave a ubatch empty.
_TINY_THRESHOLDS = UBatchThresholds(decode_min_tokens=2, prefill_min_tokens=2)
# How soon the unagreed step must have stopped every rank: a real system would hang instead.
DISAGREEMENT_BOUND_S = 5.0


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()


# --------------------------------------------------------------------------------------------
# The MoE halves


def _rank_batch(rank: int, decode: bool) -> Batch:
    """Rank r's requests: the tiny workload with up to 3 x 8 tokens (4 requests) fewer, so the
    ranks' token counts differ and padding to the largest one moves the cuts."""
    shorter = rank % 4
    if decode:
        return Batch.decode(num_requests=64 - 4 * shorter, context_len=16)
    return Batch(query_start_loc=(0, 40, 70, 128, 160 - 8 * shorter), context_lens=(0, 0, 0, 0))


def _single_process_run(
    env: RankEnv, opts: RunOptions, config: ModelConfig, batch: Batch, x: torch.Tensor, mode: str
) -> StepRun:
    """This rank's batch in one process, every expert local: the values to reproduce."""
    device = (
        rank_device(env, opts)
        if config.tensor_device.startswith("cuda")
        else SimDevice(SimOptions(opts.profile))
    )
    return run_step(
        MoEModel(config, batch),
        x,
        device=device,
        num_ubatches=None,
        mode=mode,
        timeout_s=opts.timeout_s,
    )


def _agree_on_slices(
    env: RankEnv, batch: Batch, n: int
) -> tuple[UBatchDecision, list[UBatchSlice] | None]:
    """The ranks' common decision, and this rank's cuts at the largest padded count (or None)."""
    real = batch.num_tokens
    decision = coordinate_ubatching(
        should_ubatch(real, batch.is_decode, n, _TINY_THRESHOLDS),
        real,
        n,
        group=env.cpu_group,
        num_tokens=real,
    )
    if not decision.split:
        return decision, None
    return decision, split_batch(batch.query_start_loc, decision.num_tokens_padded, n)


def _moe_failures(
    rank: int, diff: float, serial: StepRun, ubatched: StepRun, decision: UBatchDecision
) -> list[str]:
    races = serial.races + ubatched.races
    allocations = serial.allocations_during_step + ubatched.allocations_during_step
    reasons = []
    if diff > TOLERANCE:
        reasons.append(
            f"rank {rank}: outputs differ from the single-process run (max abs diff {diff:.3g})"
        )
    if races:
        reasons.append(f"rank {rank}: {len(races)} race(s), first: {races[0].describe()}")
    if allocations:
        reasons.append(f"rank {rank}: {allocations} workspace allocation(s) after lock")
    if not decision.split:
        reasons.append(f"rank {rank}: the ranks agreed not to split ({decision.reason})")
    return reasons


def _moe_rank(
    env: RankEnv, opts: RunOptions, *, decode: bool, mode: str, num_ubatches: int | None = None
) -> RankOutcome:
    """Every rank holds the same weights (same seed) and its own batch and inputs (token counts
    differ by rank, so the DP padding matters). The ranks agree on ubatching (split only if
    every rank can; cut at the largest padded count), then run the step serially and with DBO
    over an `EPGroup` spanning the ranks; both outputs must equal this rank's single-process
    run. Padding here places the cuts; the padded tokens themselves are not run."""
    start = time.monotonic()
    n = num_ubatches or opts.num_ubatches
    config = tiny_config(env)
    batch = _rank_batch(env.rank, decode)
    x = MoEModel(config, batch).inputs(seed=1 + env.rank)
    reference = _single_process_run(env, opts, config, batch, x, mode)
    ep = ep_group_for(env, config, opts)
    decision, slices = _agree_on_slices(env, batch, n)
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
        _max_diff(serial.output, reference.output), _max_diff(ubatched.output, reference.output)
    )
    reasons = _moe_failures(env.rank, diff, serial, ubatched, decision)
    return RankOutcome(
        rank=env.rank,
        passed=not reasons,
        error="; ".join(reasons) or None,
        outputs_match=diff <= TOLERANCE,
        max_abs_diff=diff,
        races=serial.races + ubatched.races,
        serial_records=serial.records,
        dbo_records=ubatched.records,
        workspace_peak_bytes=ubatched.workspace_peak_bytes,
        wall_s=time.monotonic() - start,
        details={
            "mode": mode,
            "tokens": batch.num_tokens,
            "num_tokens_padded": decision.num_tokens_padded,
            "num_ubatches": n if decision.split else 1,
            "ubatch_tokens": [s.num_tokens for s in slices] if slices else [batch.num_tokens],
            "step_us_serial": serial.step_us,
            "step_us_dbo": ubatched.step_us,
        },
    )


rank_scenario("moe-prefill-ht")(partial(_moe_rank, decode=False, mode="ht"))
rank_scenario("moe-decode-ll")(partial(_moe_rank, decode=True, mode="ll"))
rank_scenario("three-ubatches")(partial(_moe_rank, decode=False, mode="ht", num_ubatches=3))


# --------------------------------------------------------------------------------------------
# dp-disagreement


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
        f"stopped within {DISAGREEMENT_BOUND_S:g} s": stopped_s < DISAGREEMENT_BOUND_S,
        "agreed step matches the single-process run": diff <= TOLERANCE,
    }


def _disagreement_batch(rank: int) -> Batch:
    """Alone, with a 128-token threshold, rank 0 (160 tokens) splits and the others (96) do not."""
    if rank == 0:
        return Batch(query_start_loc=(0, 40, 70, 128, 160), context_lens=(0,) * 4)
    return Batch.prefill(3, 32)


def _unagreed_step(
    step: Callable[[Sequence[UBatchSlice] | None], StepRun], batch: Batch, n: int, alone: bool
) -> tuple[BaseException | None, float]:
    """Each rank runs what it decided alone: what it caught, and how long until it stopped."""
    caught: BaseException | None = None
    began = time.monotonic()
    try:
        step(split_batch(batch.query_start_loc, batch.num_tokens, n) if alone else None)
    except Exception as error:  # noqa: BLE001 - the fault under test; its type is checked later
        caught = error
    return caught, time.monotonic() - began


def _agreed_step(
    step: Callable[[Sequence[UBatchSlice] | None], StepRun],
    env: RankEnv,
    batch: Batch,
    n: int,
    alone: bool,
) -> tuple[UBatchDecision, StepRun]:
    """The same step, and the same decision on every rank."""
    decision = coordinate_ubatching(
        alone, batch.num_tokens, n, group=env.cpu_group, num_tokens=batch.num_tokens
    )
    cuts = (
        split_batch(batch.query_start_loc, decision.num_tokens_padded, n)
        if decision.split
        else None
    )
    return decision, step(cuts)


@rank_scenario("dp-disagreement", negative=True)
def _dp_disagreement_rank(env: RankEnv, opts: RunOptions) -> RankOutcome:
    """Rank 0 would split its step alone and the others would not: the EP handshake must stop
    every rank with an error naming each rank's ubatch count, promptly, and the same step must
    then run once the ranks agree."""
    start = time.monotonic()
    if env.world < 2:
        return RankOutcome(env.rank, passed=False, error="dp-disagreement needs at least 2 ranks")
    n = opts.num_ubatches
    # CPU tensors over gloo even under --device cuda: after the caught mismatch the group is
    # torn down, which gloo's host-side waits survive and NCCL's stream-side ones may not.
    config = preset("tiny", ep_size=env.world)
    batch = _disagreement_batch(env.rank)
    thresholds = UBatchThresholds(decode_min_tokens=32, prefill_min_tokens=128)
    alone = should_ubatch(batch.num_tokens, batch.is_decode, n, thresholds)
    x = MoEModel(config, batch).inputs(seed=1 + env.rank)
    ep = ep_group_for(env, config, opts)

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

    caught, stopped_s = _unagreed_step(step, batch, n, alone)
    decision, agreed = _agreed_step(step, env, batch, n, alone)
    reference = run_step(
        MoEModel(config, batch),
        x,
        device=SimDevice(SimOptions(opts.profile)),
        num_ubatches=None,
        mode="ht",
        timeout_s=opts.timeout_s,
    )
    diff = _max_diff(agreed.output, reference.output)
    return _disagreement_outcome(
        env,
        caught=caught,
        stopped_s=stopped_s,
        diff=diff,
        agreed=agreed,
        decision=decision,
        ubatches_alone=n if alone else 1,
        start=start,
    )


def _disagreement_outcome(
    env: RankEnv,
    *,
    caught: BaseException | None,
    stopped_s: float,
    diff: float,
    agreed: StepRun,
    decision: UBatchDecision,
    ubatches_alone: int,
    start: float,
) -> RankOutcome:
    checks = disagreement_checks(caught, env.world, stopped_s, diff)
    failed = [name for name, ok in checks.items() if not ok]
    caught_text = f"{type(caught).__name__}: {caught}" if caught is not None else None
    return RankOutcome(
        rank=env.rank,
        passed=not failed,
        error=None
        if not failed
        else (f"rank {env.rank} failed: {', '.join(failed)} (caught {caught_text or 'nothing'})"),
        outputs_match=diff <= TOLERANCE,
        max_abs_diff=diff,
        races=agreed.races,
        trace_records=agreed.records,
        wall_s=time.monotonic() - start,
        details={
            "ubatches_alone": ubatches_alone,
            "caught": caught_text,
            "seconds_to_stop": round(stopped_s, 3),
            "agreed_split": decision.split,
            "agreed_reason": decision.reason,
            "checks": checks,
        },
    )
