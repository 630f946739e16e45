"""Verify a step across real ranks: `dbo.verify` on each of N gloo processes, one report.

`verify_ranks(forward, inputs, num_ranks=2)` forks N rank processes
(`dbo.verification.rank_processes`) that join one gloo process group. Rank r takes its own batch,
`inputs(r, num_ranks)` (or `inputs[r]`): uneven counts, and an idle rank's dummy batch of 0 tokens,
are what DP ranks see. Each rank runs `dbo.verify` on it: serial steps and ubatched steps,
compared. Every collective the step issues goes through the rank's `CollectiveTracker`
(`dbo.fingerprint`), which checks it against the other ranks' before it runs, with PyTorch's DETAIL
check beneath; each `verify` run (the serial and the ubatched steps, warm-ups included) is a step
of the tracker, so a rank that skips a collective or a whole step is named on every rank. Past
`timeout` every rank is asked where it stands, killed and reaped, and the report explains the hang
from every rank's collective log (`dbo.verification.rank_history`).

With `graphs` (a `dbo.verification.graph_runner.CUDAGraphRunner`, or `graphs(rank, world_size)`
that builds and captures one in the rank, as each engine process captures its own), each rank first
makes the DP agreement on the real group (`coordinate_ubatching`: every rank's token count, padded
to the largest where graphs run), hands the agreed counts to its runner (`num_tokens_across_dp`)
and then serves its step through it: a rank that replays a graph of another size than the one its
peers agreed on is named by the runner's DP size check, with nothing passed by hand.

The default split cuts as `dbo.verify` does, except that a rank with fewer rows than ubatches
(the idle rank's dummy batch) gets empty ubatches: it must still run every ubatch's
collectives, as vLLM's dummy run does.
"""

from __future__ import annotations

import inspect
import json
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dbo.checks import as_int
from dbo.collective_calls import CollectiveMismatchError
from dbo.fingerprint import CollectiveTracker
from dbo.graph_dispatch import CUDAGraphMode
from dbo.split import coordinate_ubatching
from dbo.ubatching import dbo_enabled
from dbo.verification.driver import verify
from dbo.verification.graph_runner import CUDAGraphRunner, describe_batch
from dbo.verification.inputs import split_inputs
from dbo.verification.rank_history import explain_hang, read_histories
from dbo.verification.rank_processes import RankContext, RanksRun, run_ranks
from dbo.verification.ranks_report import RanksReport, RankVerdict, VerifyRanksError
from dbo.verification.report import error_text

__all__ = [
    "RanksReport",
    "RankVerdict",
    "VerifyRanksError",
    "agree_graph_counts",
    "rank_split",
    "verify_ranks",
]

Graphs = CUDAGraphRunner | Callable[[int, int], CUDAGraphRunner]


# A rank stopped by PyTorch's own collective check exits with this: its peers may be left in
# the collective it refused, and the launcher ends them after a grace period.
BACKEND_MISMATCH_EXIT = 3
_DETAIL_RANK = re.compile(
    r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
    r"OpType=(\w+), TensorShape=\[([^\]]*)\]"
)


def backend_mismatch(text: str) -> str | None:
    """PyTorch's DETAIL error ("Detected mismatch between collectives on ranks"), found in a
    rank's error text, in the tool's words; None when there is none."""
    if "Detected mismatch between collectives on ranks" not in text:
        return None
    ranks = {
        int(r): f"rank {r}: {op.lower()}, shape [{shape}], its collective #{int(seq) + 1} on "
        f"the group"
        for r, seq, op, shape in _DETAIL_RANK.findall(text)
    }
    return "\n".join(
        [
            "ranks out of step, found by PyTorch's check (TORCH_DISTRIBUTED_DEBUG=DETAIL) on "
            "a collective that bypassed the tracker (a reference to torch.distributed's "
            "function taken before the run): a rank skipped or reordered a collective",
            *(ranks[r] for r in sorted(ranks)),
        ]
    )


def rank_split(inputs: Any, num_ubatches: int) -> list[Any]:
    """`dbo.verify`'s default split, except that fewer rows than ubatches (an idle rank's
    dummy batch) give ubatches of one row and then empty ones."""
    rows = _rows(inputs)
    if rows is None or rows >= num_ubatches:
        return split_inputs(inputs, num_ubatches)
    bounds = [min(i, rows) for i in range(num_ubatches + 1)]
    return [_cut(inputs, slice(a, b)) for a, b in zip(bounds, bounds[1:])]


def _rows(inputs: Any) -> int | None:
    leaves = list(inputs.values()) if isinstance(inputs, Mapping) else inputs
    if isinstance(leaves, torch.Tensor):
        leaves = [leaves]
    if not isinstance(leaves, (list, tuple)) or not leaves:
        return None
    first = leaves[0]
    return first.shape[0] if isinstance(first, torch.Tensor) and first.dim() > 0 else None


def _cut(inputs: Any, s: slice) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs[s]
    if isinstance(inputs, Mapping):
        return {k: v[s] for k, v in inputs.items()}
    return type(inputs)(v[s] for v in inputs)


def _check_args(
    forward: Any, inputs: Any, num_ranks: Any, timeout: Any, device: Any, graphs: Any
) -> None:
    if graphs is not None and not callable(graphs) and not isinstance(graphs, CUDAGraphRunner):
        raise TypeError(
            f"graphs must be a CUDAGraphRunner or graphs(rank, world_size) -> CUDAGraphRunner, "
            f"got {type(graphs).__name__}"
        )
    if not callable(forward):
        raise TypeError(
            f"forward must be callable (forward(batch) -> output), got {type(forward).__name__}"
        )
    as_int("num_ranks (ranks to start)", num_ranks, minimum=2)
    if not callable(inputs) and not (
        isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes))
    ):
        raise TypeError(
            f"inputs must be inputs(rank, world_size) -> batch, or one batch per rank, got "
            f"{type(inputs).__name__}"
        )
    if callable(inputs):
        try:
            inspect.signature(inputs).bind(0, num_ranks)
        except TypeError:
            raise TypeError(
                "inputs must take (rank, world_size) and return that rank's batch"
            ) from None
        except ValueError:
            pass  # a builtin without a signature: called as it is
    elif len(inputs) != num_ranks:
        raise ValueError(
            f"inputs holds {len(inputs)} batches for num_ranks={num_ranks}; give one per rank"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if device != "sim":
        raise ValueError(
            f"verify_ranks runs each rank on the simulated device over gloo; device={device!r} "
            f"is not supported yet (NCCL ranks need a GPU each)"
        )
    if dist.is_initialized():
        raise RuntimeError(
            "verify_ranks forks its own rank processes and their group: call it from a process "
            "that has not initialised torch.distributed"
        )


def verify_ranks(
    forward: Callable[[Any], Any],
    inputs: Callable[[int, int], Any] | Sequence[Any],
    *,
    num_ranks: int = 2,
    num_ubatches: int = 2,
    device: str = "sim",
    split: Callable[[Any, int], Sequence[Any]] | None = None,
    merge: Callable[[list[Any]], Any] | None = None,
    warmup: int = 1,
    atol: float = 0.0,
    rtol: float = 0.0,
    timeout: float = 60.0,
    graphs: Graphs | None = None,
) -> RanksReport:
    """Run `dbo.verify(forward, batch_r)` on each of `num_ranks` gloo rank processes, with
    every collective checked across ranks before it runs, and return one `RanksReport`.

    `inputs(rank, world_size) -> batch` (or a sequence of one batch per rank) gives each
    rank its batch. `timeout` bounds the whole group: past it every rank is dumped, killed
    and reaped, and the report names where the ranks diverged. `graphs`: each rank's
    CUDA graphs (a captured `CUDAGraphRunner`, which each forked rank gets a copy of, or
    `graphs(rank, world_size)` building one in the rank); each rank serves its step through
    them, checked against the counts the ranks agree on (`agree_graph_counts`). The other
    arguments are `dbo.verify`'s. Bad arguments raise before any process starts."""
    _check_args(forward, inputs, num_ranks, timeout, device, graphs)
    # Each rank's own step timeout lies past the group's: the launcher ends a hung group
    # first, with every rank's history; a step ended inside a rank would leave its thread in
    # a collective that the rank's next one would pair with.
    options = dict(
        num_ubatches=num_ubatches,
        merge=merge,
        warmup=warmup,
        atol=atol,
        rtol=rtol,
        timeout=2 * timeout + 10.0,
    )
    body = _RankBody(forward, inputs, split or rank_split, options, graphs)
    with tempfile.TemporaryDirectory(prefix="dbo-verify-ranks-") as folder:
        workdir = Path(folder)
        run = run_ranks(body, num_ranks, timeout, workdir)
        return _group_report(run, workdir, num_ranks, num_ubatches, timeout)


class _RankBody:
    """What each rank runs: its batch, `verify` with the tracker's step boundaries, and its
    result written to `rank<r>.result.json`."""

    def __init__(
        self, forward: Callable, inputs: Any, split: Callable, options: dict, graphs: Any
    ) -> None:
        self.forward, self.inputs, self.split, self.options = forward, inputs, split, options
        self.graphs = graphs

    def __call__(self, ctx: RankContext) -> int:
        """Run the rank; its exit code: 0, or `BACKEND_MISMATCH_EXIT` when PyTorch's own check
        stopped it (its peers may wait in that collective: the launcher ends them)."""
        tracker = CollectiveTracker(ctx.rank, ctx.path("log.jsonl")).install()
        inputs = self.inputs
        batch = inputs(ctx.rank, ctx.world_size) if callable(inputs) else inputs[ctx.rank]
        result: dict[str, Any] = {"tokens": _rows(batch)}
        runner = None
        try:
            runner = self._runner(ctx, batch)
            report = verify(
                self._forward(tracker),
                batch,
                split=self._split(tracker),
                graphs=runner,
                **self.options,
            )
            result.update(ok=report.ok, text=report.describe(), report=report.to_dict())
        except Exception as error:  # noqa: BLE001 - the serial step failed: the rank's verdict
            text = f"the serial step raised {error_text(error)}"
            if self.graphs is not None and runner is None:
                text = f"its CUDA graphs were not ready: {error_text(error)}"
            if _out_of_step(error):
                text = "its serial step stopped: its collectives are out of step (above)"
            result.update(ok=False, text=f"{text}\n{error}", error=text)
        detail = backend_mismatch(result["text"])
        if detail is not None and result.get("error"):
            result["error"] = (
                "its step stopped: PyTorch's collective check found the ranks out of step (above)"
            )
        if detail is None:
            tracker.finish()
        result["out_of_step"] = detail or (None if tracker.broken is None else str(tracker.broken))
        tmp = ctx.path("result.json.tmp")
        tmp.write_text(json.dumps(result, default=str))
        tmp.replace(ctx.path("result.json"))
        return 0 if detail is None else BACKEND_MISMATCH_EXIT

    def _runner(self, ctx: RankContext, batch: Any) -> CUDAGraphRunner | None:
        """This rank's graph runner (built here from a factory), given the DP-agreed counts."""
        if self.graphs is None:
            return None
        graphs = self.graphs
        runner = graphs if isinstance(graphs, CUDAGraphRunner) else graphs(ctx.rank, ctx.world_size)
        if not isinstance(runner, CUDAGraphRunner):
            raise TypeError(
                f"graphs(rank, world_size) must return a CUDAGraphRunner, got "
                f"{type(runner).__name__}"
            )
        runner.num_tokens_across_dp = agree_graph_counts(
            runner, batch, self.options["num_ubatches"]
        )
        return runner

    def _forward(self, tracker: CollectiveTracker) -> Callable[[Any], Any]:
        def forward_in_steps(batch: Any) -> Any:
            if not dbo_enabled():  # a serial step: one forward call is the whole step
                tracker.begin_step("serial")
            return self.forward(batch)

        return forward_in_steps

    def _split(self, tracker: CollectiveTracker) -> Callable[[Any, int], Sequence[Any]]:
        calls = [0]

        def split_in_steps(batch: Any, num_ubatches: int) -> Sequence[Any]:
            calls[0] += 1
            if calls[0] > 1:  # the first call is verify's check of the split, before any step
                tracker.begin_step("DBO")
            return self.split(batch, num_ubatches)

        return split_in_steps


def agree_graph_counts(runner: CUDAGraphRunner, batch: Any, num_ubatches: int) -> list[int]:
    """The DP agreement a graph step starts with, made on the real group (vLLM's
    `coordinate_batch_across_dp`): every rank's token count, as its batch's attention metadata
    (or dim 0) gives it; where the runner runs graphs, every rank is padded to the largest,
    which each replayed graph's size is then checked against."""
    q = runner.dispatcher.uniform_decode_query_len
    tokens = describe_batch(batch, uniform_decode_query_len=q).num_tokens
    graphs_on = runner.dispatcher.cudagraph_mode != CUDAGraphMode.NONE
    decision = coordinate_ubatching(False, tokens, num_ubatches, cudagraph_mode=int(graphs_on))
    return list(decision.num_tokens_across_dp)


def _out_of_step(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from, is the tracker's mismatch (a runtime
    layer such as `EPGroup` wraps the errors of its collectives in its own)."""
    while error is not None:
        if isinstance(error, CollectiveMismatchError):
            return True
        error = error.__cause__ or error.__context__
    return False


def _group_report(
    run: RanksRun, workdir: Path, num_ranks: int, num_ubatches: int, timeout: float
) -> RanksReport:
    """Every rank's result file (or why it has none), and the group's verdict."""
    verdicts = [_verdict(run, rank, workdir) for rank in range(num_ranks)]
    results = [workdir / f"rank{rank}.result.json" for rank in range(num_ranks)]
    found = [json.loads(p.read_text()).get("out_of_step") for p in results if p.exists()]
    out_of_step = next((text for text in found if text), None)
    stopped = _stopped(run, workdir)
    return RanksReport(
        ok=all(v.ok for v in verdicts) and out_of_step is None and stopped is None,
        num_ranks=num_ranks,
        num_ubatches=num_ubatches,
        device="sim",
        backend="gloo",
        ranks=verdicts,
        out_of_step=out_of_step,
        hang=stopped,
        pids=run.pids,
        timeout=timeout,
    )


def _verdict(run: RanksRun, rank: int, workdir: Path) -> RankVerdict:
    path = workdir / f"rank{rank}.result.json"
    if not path.exists():
        why = _no_result(run, rank, workdir)
        return RankVerdict(rank, None, False, why, None, why)
    result = json.loads(path.read_text())
    return RankVerdict(
        rank,
        result["tokens"],
        result["ok"],
        result["text"],
        result.get("report"),
        result.get("error"),
    )


def _stopped(run: RanksRun, workdir: Path) -> list[str] | None:
    """Why the group was ended (a timeout, a rank that died) and every rank's history
    compared; None when every rank ended by itself."""
    died = [
        (rank, code)
        for rank, code in enumerate(run.exit_codes)
        if code not in (0, None, BACKEND_MISMATCH_EXIT)
    ]
    if not (run.hung or died):
        return None
    histories = read_histories(workdir, run.exit_codes, run.dumps)
    why = run.why_ended or f"rank {died[0][0]} exited with {died[0][1]} mid-run"
    return [why, *explain_hang(histories)]


def _no_result(run: RanksRun, rank: int, workdir: Path) -> str:
    code = run.exit_codes[rank] if rank < len(run.exit_codes) else None
    if code is None:
        return "did not finish: killed when the group was ended (see the hang)"
    out = workdir / f"rank{rank}.out"
    tail = out.read_text(errors="replace").strip().splitlines()[-1:] if out.exists() else []
    return f"exited with {code} before reporting: {tail[0] if tail else 'no output'}"
