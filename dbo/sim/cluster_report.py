"""What a replayed EP group tells its reader: per-rank figures, the gating of each collective,
the critical path, and the timeline as records (one process per rank) for the Chrome trace
and PNG writers of `dbo.sim.trace` and `dbo.sim.plot`.

The critical path walks back from the slowest rank's last op: through whichever dependency
ended when the op started, and across ranks wherever a collective ended on a peer's rows
(the peer's late start or large send), until it reaches an op the host started.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dbo.sim.cluster import ClusterResult
from dbo.sim.cluster_program import HOST, HOST_SYNC, OP
from dbo.sim.plot import plot_timeline
from dbo.sim.records import OpRecord
from dbo.sim.trace import Window, write_chrome_trace
from dbo.sim.window import layer_starts

__all__ = [
    "RankFigures",
    "PathSegment",
    "rank_figures",
    "gating_table",
    "critical_path",
    "path_summary",
    "rank_records",
    "write_cluster_trace",
    "plot_cluster",
    "shown_window",
]

# A deep model's whole step (61 layers x 3 ranks) in one figure's width is a smear of slivers:
# the PNG shows this many steady-state MoE layers and says which; the trace keeps every op.
SHOWN_LAYERS = 2


@dataclass(frozen=True)
class RankFigures:
    """One rank's step: its time, compute busy, comm no compute hides, time waiting for peers."""

    rank: int
    step_us: float
    compute_busy_us: float
    exposed_comm_us: float
    peer_wait_us: float
    expert_rows: float  # mean over layers of its rows relative to balanced


def rank_figures(result: ClusterResult) -> list[RankFigures]:
    step, busy = result.step_us, result.compute_busy_us
    exposed, wait = result.exposed_comm_us, result.peer_wait_us
    rows = result.expert_factor.mean(axis=0)
    return [
        RankFigures(
            r, float(step[r]), float(busy[r]), float(exposed[r]), float(wait[r]), float(rows[r])
        )
        for r in range(result.num_ranks)
    ]


def gating_table(result: ClusterResult, top: int = 5) -> list[str]:
    """The `top` collectives that kept ranks waiting longest: which rank gated, and why."""
    lines = []
    ranked = sorted(result.collectives, key=lambda c: -float(c.peer_wait_us.max()))
    ranked = [c for c in ranked if c.peer_wait_us.max() > 0]
    if not ranked:
        return ["no collective waited for a peer: every rank's own link set its time"]
    for c in ranked[:top]:
        waiter = int(np.argmax(c.peer_wait_us))
        gate = int(c.gate[waiter])
        why = c.why(waiter, result.start[c.op])
        ub = "" if c.ubatch is None else f" ubatch {c.ubatch}"
        lines.append(
            f"layer {c.layer}{ub} {c.kind}: rank {gate} gates (rank {waiter} waits "
            f"{c.peer_wait_us[waiter]:.1f} us): {why}"
        )
    return lines


@dataclass(frozen=True)
class PathSegment:
    rank: int
    op: int
    name: str
    start_us: float
    end_us: float
    what: str  # "compute" | "comm" | "peer" (a collective held by another rank) | "host"


def _predecessor(result: ClusterResult, i: int, r: int) -> int | None:
    start = result.start[i, r]
    best = None
    for d in result.program.deps[i]:
        if abs(result.end[d, r] - start) < 1e-6 and (best is None or d > best):
            best = d
    return best


def critical_path(result: ClusterResult, limit: int = 100_000) -> list[PathSegment]:
    """The chain of ops, across ranks, that set the slowest rank's step time (first op first)."""
    prog = result.program
    if not prog.num_ops:
        return []
    r = int(np.argmax(result.step_us))
    device = np.flatnonzero(~np.isin(prog.klass, (HOST, HOST_SYNC)))
    i = int(device[np.argmax(result.end[device, r])])
    gates = {c.op: c for c in result.collectives}
    path: list[PathSegment] = []
    for _ in range(limit):
        what = "compute" if prog.klass[i] == OP else "comm"
        c = gates.get(i)
        if c is not None and int(c.gate[r]) != r:
            path.append(
                PathSegment(r, i, prog.names[i], result.start[i, r], result.end[i, r], "peer")
            )
            r = int(c.gate[r])
            continue
        path.append(PathSegment(r, i, prog.names[i], result.start[i, r], result.end[i, r], what))
        j = _predecessor(result, i, r)
        if j is None:
            break
        i = j
    return path[::-1]


def path_summary(path: list[PathSegment]) -> dict[str, float]:
    """Time on the critical path by kind, and how many ranks it crosses."""
    out: dict[str, float] = {"compute": 0.0, "comm": 0.0, "peer": 0.0}
    for s in path:
        if s.what != "peer":
            out[s.what] = out.get(s.what, 0.0) + (s.end_us - s.start_us)
    out["ranks"] = float(len({s.rank for s in path}))
    return out


def rank_records(result: ClusterResult, ranks: list[int] | None = None) -> list[OpRecord]:
    """The replayed timeline of `ranks` (default `result.ranks_to_show()`) as OpRecords, each
    carrying its rank, for the trace and plot writers."""
    ranks = result.ranks_to_show() if ranks is None else ranks
    prog = result.program
    gates = {c.op: c for c in result.collectives}
    out = []
    for r in ranks:
        for i, rec in enumerate(prog.records):
            args = dict(rec.args or {})
            c = gates.get(i)
            if c is not None:
                args.update(gated_by=int(c.gate[r]), peer_wait_us=float(c.peer_wait_us[r]))
            out.append(
                replace(
                    rec,
                    seq=i,
                    rank=r,
                    start_us=float(result.start[i, r]),
                    end_us=float(result.end[i, r]),
                    issue_us=float(result.start[i, r]),
                    args=args,
                )
            )
    return out


def write_cluster_trace(result: ClusterResult, path: str | Path, **metadata: object) -> Path:
    """A Chrome trace with a process per shown rank (every rank up to 16, else the slowest,
    median and fastest)."""
    shown = result.ranks_to_show()
    meta = {"ranks": result.num_ranks, "shown_ranks": shown, **metadata}
    return write_chrome_trace(path, rank_records(result, shown), metadata=meta)


def shown_window(records: list[OpRecord]) -> tuple[Window | None, str]:
    """The window the timeline PNG draws and the words that name it: SHOWN_LAYERS MoE layers
    from the middle of the step (past the start-up, before the drain), counted on the first
    rank drawn; the whole step when it has too few layers to cut."""
    first_rank = min((r.rank for r in records), default=0)
    starts = layer_starts([r for r in records if r.rank == first_rank])
    if len(starts) <= SHOWN_LAYERS + 1:
        return None, f"the whole step ({len(starts)} MoE layers)"
    first = min(len(starts) // 2, len(starts) - SHOWN_LAYERS - 1)
    stop = first + SHOWN_LAYERS
    window = Window(starts[first], starts[stop])
    return window, (
        f"MoE layers {first}-{stop - 1} of {len(starts)} (the .trace.json holds every layer)"
    )


def plot_cluster(result: ClusterResult, path: str | Path, title: str | None = None) -> Path:
    """The shown ranks' timelines, one above the other, as a PNG of a few layers
    (`shown_window`), named in the title."""
    records = rank_records(result)
    window, shown = shown_window(records)
    ranks = sorted({r.rank for r in records})
    heading = f"ranks {', '.join(map(str, ranks))}: {shown}"
    heading = f"{title}, {heading}" if title else heading
    return plot_timeline(path, records, title=heading, window=window)
