"""PNG timeline: draw `OpRecord`s as one lane per (rank, stream), bars colored by ubatch.

Uses `matplotlib.figure.Figure` with the Agg canvas directly: no pyplot, no global backend
switch, no display needed, safe to call from any thread or a test.

Speed and honesty at scale: each lane is sampled on `_BINS` equal time bins (finer than the
figure's pixels). A bin is drawn when any op covers part of it, in the style of the
(ubatch, kind) that covers most of it; runs of equal bins become one bar, and each style is one
`broken_barh` collection. A lane thus holds at most `_BINS` bars whatever the op count, so a
61-layer step's tens of thousands of ops draw in well under a second, and two ubatches that
alternate faster than a pixel still both show instead of the last-drawn one hiding the other.
This is a drawing approximation only (an op shorter than a bin is widened to one bin); the
trace and the summary keep every op exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from dbo.sim.records import COMM, HANDOFF, SYNC, OpRecord
from dbo.sim.summary import Interval, check_records
from dbo.sim.trace import HOST_TRACK, track_of, track_order

__all__ = ["plot_timeline"]

Style = tuple[int | None, str]  # (ubatch, kind)

# Time bins per lane: above the ~1300 pixels the axes span, so bars are exact to the pixel.
_BINS = 2000
_NO_UBATCH_COLOR = "#8c8c8c"


def _ubatch_color(ubatch: int | None) -> str:
    if ubatch is None:
        return _NO_UBATCH_COLOR
    palette = (
        "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
        "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f",
    )  # fmt: skip
    return palette[ubatch % len(palette)]


def _bin_occupancy(intervals: list[Interval], t0: float, width: float, nbins: int) -> np.ndarray:
    """Time each bin [t0 + k*width, t0 + (k+1)*width) spends inside the given intervals.

    Partial first/last bins get their exact share; fully covered bins are counted through an
    integer difference array, so no large floating cumulative sum can leave residue in empty bins.
    """
    arr = np.asarray(intervals, dtype=np.float64)
    s, e = arr[:, 0] - t0, arr[:, 1] - t0
    bs = np.clip(np.floor(s / width).astype(np.int64), 0, nbins - 1)
    be = np.clip(np.floor(e / width).astype(np.int64), 0, nbins - 1)
    same = bs == be
    occ = np.zeros(nbins)
    occ += np.bincount(bs[same], weights=(e - s)[same], minlength=nbins)
    d = ~same
    occ += np.bincount(bs[d], weights=(bs[d] + 1) * width - s[d], minlength=nbins)
    occ += np.bincount(be[d], weights=e[d] - be[d] * width, minlength=nbins)
    full = np.zeros(nbins + 1, dtype=np.int64)
    np.add.at(full, bs[d] + 1, 1)
    np.add.at(full, be[d], -1)
    occ += np.cumsum(full[:-1]) * width
    return occ


def _lane_bars(
    groups: dict[Style, list[Interval]], t0: float, width: float, nbins: int
) -> dict[Style, list[tuple[float, float]]]:
    """Per style, the (start, width) bars of the bins it dominates (see module docstring)."""
    styles = sorted(groups, key=lambda k: (k[0] is None, k[0] or 0, k[1]))
    occ = np.stack([_bin_occupancy(groups[st], t0, width, nbins) for st in styles])
    # Rounding at bin edges can leave a few ulps in a bin no op reaches; a nano-bin is nothing.
    winner = np.where(occ.max(axis=0) > width * 1e-9, occ.argmax(axis=0), -1)
    # Runs of equal winners become one bar each.
    change = np.flatnonzero(np.diff(winner)) + 1
    run_starts = np.concatenate(([0], change))
    run_ends = np.concatenate((change, [len(winner)]))
    bars: dict[Style, list[tuple[float, float]]] = {}
    for a, b in zip(run_starts, run_ends):
        w = int(winner[a])
        if w >= 0:
            bars.setdefault(styles[w], []).append((t0 + a * width, float(b - a) * width))
    return bars


def plot_timeline(
    path: str | Path,
    records: Sequence[OpRecord],
    *,
    title: str | None = None,
) -> Path:
    """Draw the timeline of `records` (one or many ranks) to a PNG at `path`; returns the path."""
    # Imported here so importing dbo.sim never pays matplotlib's import cost.
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    records = list(records)
    check_records(records)
    path = Path(path)

    tracks = track_order(records)
    present = {(r.rank, track_of(r)) for r in records}
    ranks = sorted({r.rank for r in records})
    lanes = [(rank, t) for rank in ranks for t in tracks if (rank, t) in present]
    lane_index = {lane: i for i, lane in enumerate(lanes)}

    t0 = min((min(r.issue_us, r.start_us) for r in records), default=0.0)
    t1 = max((r.end_us for r in records), default=1.0)
    span = t1 - t0 if t1 > t0 else 1.0
    width = span / _BINS

    per_lane: list[dict[Style, list[Interval]]] = [{} for _ in lanes]
    for r in records:
        groups = per_lane[lane_index[(r.rank, track_of(r))]]
        groups.setdefault((r.ubatch, r.kind), []).append((r.start_us, r.end_us))

    height = max(2.5, 0.5 * len(lanes) + 1.6)
    fig = Figure(figsize=(14, height), dpi=100)
    ax = fig.add_subplot(1, 1, 1)

    for lane, groups in enumerate(per_lane):
        for (ubatch, kind), bars in _lane_bars(groups, t0, width, _BINS).items():
            color = _ubatch_color(ubatch)
            host = kind in (SYNC, HANDOFF)
            # Host-side work is drawn half height so it reads as "not device time".
            h = 0.4 if host else 0.8
            style: dict = {"facecolors": color, "linewidth": 0}
            if kind == COMM:
                style = {
                    "facecolors": "white",
                    "edgecolors": color,
                    "hatch": "////",
                    "linewidth": 0.6,
                }
            elif host:
                style["alpha"] = 0.6
            ax.broken_barh(bars, (lane - h / 2, h), **style)

    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {rank} · {t}" for rank, t in lanes])
    ax.set_ylim(len(lanes) - 0.5 if lanes else 0.5, -0.5)  # first lane on top
    ax.set_xlim(t0, t0 + span)
    ax.set_xlabel("time (us, virtual)")
    ax.grid(axis="x", alpha=0.3)
    if not records:
        ax.text(0.5, 0.5, "no ops", ha="center", va="center", transform=ax.transAxes)

    handles = [
        Patch(facecolor=_ubatch_color(u), label="no ubatch" if u is None else f"ubatch {u}")
        for u in sorted({r.ubatch for r in records}, key=lambda u: (u is None, u or 0))
    ]
    handles.append(Patch(facecolor="#cccccc", label="compute"))
    handles.append(Patch(facecolor="white", edgecolor="#555555", hatch="////", label="comm"))
    if any(t == HOST_TRACK for _, t in lanes):
        handles.append(
            Patch(facecolor="#cccccc", alpha=0.6, label="host sync / handoff (half height)")
        )
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False
    )

    ax.set_title(title if title is not None else f"DBO timeline: {span:.1f} us")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
