"""Data-parallel bugs, run on a real two-rank gloo group: each entry forks two rank processes
(`dbo.verification.rank_processes`) that agree with `coordinate_batch_across_dp`, then confirm with
`check_dp_padding` the token counts they are about to run, the fixed way and the buggy way
in one group, and report what each rank saw.

vLLM #26209: a rank in a dummy run skipped DP padding and ran its own token count, so its
peers' collectives, sized by the agreement, never completed. SGLang #13082: the ubatches'
child batches were built without their own global token counts (they kept the parent
batch's), so each ubatch's DP gather was sized for the whole batch.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from dbo.split import (
    DBOConfig,
    UBatchAgreementError,
    check_dp_padding,
    coordinate_batch_across_dp,
    maybe_create_ubatch_slices,
)
from dbo.verification.rank_processes import RankContext, run_ranks
from scenarios.bugs.registry import Verdict, bug_pair

WORLD = 2
DEADLINE_S = 60.0
CONFIG = DBOConfig(num_ubatches=2, dbo_decode_token_threshold=32, dbo_prefill_token_threshold=512)


def _dummy_run_padding(rank: int, buggy: bool) -> int:
    """Rank 0 runs 600 real tokens; rank 1 has no request and runs a 1-token dummy batch.
    Both run FULL CUDA graphs, so the agreement pads every rank to the largest count."""
    tokens = 600 if rank == 0 else 1
    _, across, _ = coordinate_batch_across_dp(
        tokens, True, CONFIG, uniform_decode=False, cudagraph_mode=2
    )
    runs = tokens if (buggy and rank == 1) else int(across[rank])
    check_dp_padding(runs, across)
    hidden = torch.zeros(runs, 4)
    gathered = [torch.empty_like(hidden) for _ in range(WORLD)]
    dist.all_gather(gathered, hidden)  # the step's fixed-size DP collective
    return runs


def _child_global_counts(rank: int, buggy: bool) -> int:
    """Both ranks split a prefill; each ubatch (child batch) gathers its tokens across DP
    ranks and needs every rank's token count for that ubatch."""
    tokens = 1000 if rank == 0 else 800
    split, across, _ = coordinate_batch_across_dp(
        tokens, True, CONFIG, uniform_decode=False, cudagraph_mode=0
    )
    assert split, "both ranks clear the prefill threshold"
    padded = int(across[rank])
    _, slices = maybe_create_ubatch_slices(True, [tokens], padded, 1, CONFIG.num_ubatches)
    for child in slices:
        # Every rank is padded to the same count, so ubatch k holds the same count on each.
        child_global = across if buggy else torch.full_like(across, child.num_tokens)
        check_dp_padding(child.num_tokens, child_global)
    return padded


SCENARIOS = {"dummy-run-padding": _dummy_run_padding, "child-global-counts": _child_global_counts}


def _rank_body(name: str) -> Callable[[RankContext], None]:
    """One rank's part: both variants in one group, the buggy one last (an error ends nothing
    after it), each rank's results written to its file."""

    def body(ctx: RankContext) -> None:
        results = {}
        for variant in ("fixed", "buggy"):
            try:
                tokens = SCENARIOS[name](ctx.rank, variant == "buggy")
                results[variant] = {"ok": True, "tokens": tokens}
            except UBatchAgreementError as error:
                results[variant] = {"ok": False, "error": f"UBatchAgreementError: {error}"}
        ctx.path("result.json").write_text(json.dumps(results))

    return body


def run_group(name: str) -> list[dict]:
    """Run scenario `name` on a fresh two-rank gloo group; every rank's results. The ranks are
    ended past the deadline, so nothing outlives the call."""
    with tempfile.TemporaryDirectory() as tmp:
        run = run_ranks(_rank_body(name), WORLD, DEADLINE_S, Path(tmp))
        failed = [r for r, code in enumerate(run.exit_codes) if code != 0]
        if run.hung or failed:
            out = Path(tmp) / f"rank{failed[0] if failed else 0}.out"
            tail = out.read_text(errors="replace")[-600:] if out.exists() else ""
            why = run.why_ended or f"DP rank {failed[0]} exited with {run.exit_codes[failed[0]]}"
            raise RuntimeError(f"the DP ranks of {name!r}: {why}: {tail}")
        return [json.loads((Path(tmp) / f"rank{r}.result.json").read_text()) for r in range(WORLD)]


def _verdicts(name: str) -> tuple[Verdict, Verdict]:
    """(buggy, fixed) from one group run: caught when any rank was refused."""
    ranks = run_group(name)
    verdicts = []
    for variant in ("buggy", "fixed"):
        errors = [r[variant]["error"] for r in ranks if not r[variant]["ok"]]
        message = errors[0] if errors else "ok"
        verdicts.append(Verdict(bool(errors), "the DP agreement (check_dp_padding)", message))
    return verdicts[0], verdicts[1]


@bug_pair(
    "vllm-26209-dummy-run-dp-padding",
    engine="vLLM",
    ref="vllm#26209",
    cause="a rank in a dummy run skips DP padding and runs its own token count, so the ranks "
    "disagree and hang in the step's collectives",
    caught_by="the DP agreement over gloo (check_dp_padding)",
    ranks=2,
    evidence="rank 1 runs 1 (agreed 600)",
)
def dummy_run_padding() -> tuple[Verdict, Verdict]:
    return _verdicts("dummy-run-padding")


@bug_pair(
    "sglang-13082-child-global-counts",
    engine="SGLang",
    ref="sglang#13082",
    cause="the ubatches' child batches are built without their own global token counts and "
    "keep the parent batch's, so each ubatch's DP gather is sized for the whole batch",
    caught_by="the DP agreement over gloo (check_dp_padding)",
    ranks=2,
    evidence="runs 500 (agreed 1000)",
)
def child_global_counts() -> tuple[Verdict, Verdict]:
    return _verdicts("child-global-counts")
