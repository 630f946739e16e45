"""PNG timeline: draw `OpRecord`s as one lane per (rank, stream), bars colored by ubatch.

Several runs (a serial and a DBO step) stack one above the other on one time axis, split by a
rule; a race is a red cross on each of its two ops; a `Window` narrows the drawing to a time
range so a full-size step can be read; the legend explains the low-latency "link" track.

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

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dbo.sim.records import COMM, HANDOFF, SYNC, OpRecord, RaceReport
from dbo.sim.summary import Interval, check_records
from dbo.sim.trace import (
    HOST_TRACK,
    TraceRun,
    Window,
    race_sites,
    track_of,
    track_order,
    windowed,
)

__all__ = ["Lane", "legend_handles", "plot_lanes", "plot_runs", "plot_timeline"]

Style = tuple[int | None, str]  # (ubatch, kind)

# Time bins per lane: above the ~1300 pixels the axes span, so bars are exact to the pixel.
_BINS = 2000
_NO_UBATCH_COLOR = "#8c8c8c"
_RACE_COLOR = "#e41a1c"


_LINK_LABEL = (
    "link: low-latency transfers in flight,\nfrom the send kernel to arrival (no SMs held;\n"
    "the recv hook waits on it)"
)


def _ubatch_color(ubatch: int | None) -> str:
    if ubatch is None:
        return _NO_UBATCH_COLOR
    palette = (
        "#1f77b4",
        "#ff7f0e",
        "#2ca02c",
        "#d62728",
        "#9467bd",
        "#8c564b",
        "#e377c2",
        "#17becf",
        "#bcbd22",
        "#7f7f7f",
    )
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
    races: Sequence[RaceReport] = (),
    window: Window | None = None,
    failure: tuple[float, str] | None = None,
    clock: str = "virtual",
) -> Path:
    """Draw the timeline of `records` (one or many ranks) to a PNG at `path`; returns the path.
    `failure` (time in us, label) marks where a failed step stopped; `clock` names the time
    axis's clock ("virtual" for the simulator, the profiler's for a real trace)."""
    run = TraceRun(None, list(records), races)
    return plot_runs(path, [run], title=title, window=window, failure=failure, clock=clock)


def plot_runs(
    path: str | Path,
    runs: Sequence[TraceRun],
    *,
    title: str | None = None,
    window: Window | None = None,
    failure: tuple[float, str] | None = None,
    clock: str = "virtual",
) -> Path:
    """Draw several runs (a serial and a DBO one) one above the other on one time axis, races
    marked on both of their ops, and `failure` (time in us, label) as a red line where a
    failed step stopped; returns the path."""
    # Imported here so importing dbo.sim never pays matplotlib's import cost.
    from matplotlib.figure import Figure

    runs = [windowed(run, window) for run in runs]
    for run in runs:
        check_records(run.records)
    path = Path(path)
    lanes = plot_lanes(runs)
    everything = [r for run in runs for r in run.records]
    if window is not None:
        t0, span = window.start_us, window.end_us - window.start_us
    else:
        t0 = min((min(r.issue_us, r.start_us) for r in everything), default=0.0)
        t1 = max((r.end_us for r in everything), default=1.0)
        span = t1 - t0 if t1 > t0 else 1.0

    height = max(2.5, 0.5 * len(lanes) + 1.6)
    fig = Figure(figsize=(14, height), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    _draw_bars(ax, runs, lanes, t0, span / _BINS)
    _draw_races(ax, runs, lanes)
    _draw_run_separators(ax, lanes)
    failure_handles = []
    if failure is not None:
        line = ax.axvline(failure[0], color=_RACE_COLOR, linestyle="--", linewidth=1.5)
        line.set_label(failure[1])
        failure_handles.append(line)

    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([_lane_label(lane) for lane in lanes])
    ax.set_ylim(len(lanes) - 0.5 if lanes else 0.5, -0.5)  # first lane on top
    ax.set_xlim(t0, t0 + span)
    ax.set_xlabel(f"time (us, {clock})")
    ax.grid(axis="x", alpha=0.3)
    if not everything:
        ax.text(0.5, 0.5, "no ops", ha="center", va="center", transform=ax.transAxes)
    ax.legend(
        handles=legend_handles(runs, lanes) + failure_handles,
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
        frameon=False,
    )
    ax.set_title(title if title is not None else f"DBO timeline: {span:.1f} us")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


Lane = tuple[int, str | None, int, str]  # (run index, run label, rank, track)


def plot_lanes(runs: Sequence[TraceRun]) -> list[Lane]:
    """The rows of a PNG timeline, top to bottom: per run, per rank, its tracks in the trace's
    order (host first)."""
    tracks = track_order(r for run in runs for r in run.records)
    lanes: list[Lane] = []
    for k, run in enumerate(runs):
        present = {(r.rank, track_of(r)) for r in run.records}
        for rank in sorted({r.rank for r in run.records}):
            lanes += [(k, run.label, rank, t) for t in tracks if (rank, t) in present]
    return lanes


def _lane_label(lane: Lane) -> str:
    _, label, rank, track = lane
    return f"rank {rank} · {track}" if label is None else f"{label} · rank {rank} · {track}"


def _draw_bars(
    ax: Any, runs: Sequence[TraceRun], lanes: list[Lane], t0: float, width: float
) -> None:
    index = {(k, rank, track): i for i, (k, _, rank, track) in enumerate(lanes)}
    per_lane: list[dict[Style, list[Interval]]] = [{} for _ in lanes]
    for k, run in enumerate(runs):
        for r in run.records:
            groups = per_lane[index[(k, r.rank, track_of(r))]]
            groups.setdefault((r.ubatch, r.kind), []).append((r.start_us, r.end_us))
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


def _race_records(run: TraceRun) -> list[OpRecord]:
    """The ops at either end of each race, matched as the trace matches them."""
    return [r for race in run.races for r in race_sites(run.records, race) if r is not None]


def _draw_races(ax: Any, runs: Sequence[TraceRun], lanes: list[Lane]) -> None:
    index = {(k, rank, track): i for i, (k, _, rank, track) in enumerate(lanes)}
    for k, run in enumerate(runs):
        for r in _race_records(run):
            lane = index[(k, r.rank, track_of(r))]
            mid = (r.start_us + r.end_us) / 2
            ax.plot(
                [mid],
                [lane],
                marker="X",
                color=_RACE_COLOR,
                markersize=11,
                markeredgecolor="black",
                linestyle="none",
                zorder=5,
            )


def _draw_run_separators(ax: Any, lanes: list[Lane]) -> None:
    for i in range(1, len(lanes)):
        if lanes[i][0] != lanes[i - 1][0]:
            ax.axhline(i - 0.5, color="black", linewidth=1.0)


def legend_handles(runs: Sequence[TraceRun], lanes: list[Lane]) -> list[Any]:
    """The legend entries of a PNG timeline: a colour per ubatch present, then the marks
    (comm, syncs, races, the link track) that appear in it."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    records = [r for run in runs for r in run.records]
    handles: list[Any] = [
        Patch(facecolor=_ubatch_color(u), label="no ubatch" if u is None else f"ubatch {u}")
        for u in sorted({r.ubatch for r in records}, key=lambda u: (u is None, u or 0))
    ]
    handles.append(Patch(facecolor="#cccccc", label="compute"))
    handles.append(Patch(facecolor="white", edgecolor="#555555", hatch="////", label="comm"))
    if any(track == HOST_TRACK for *_, track in lanes):
        handles.append(
            Patch(facecolor="#cccccc", alpha=0.6, label="host sync / handoff (half height)")
        )
    if any(track.startswith("link") for *_, track in lanes):
        handles.append(
            Patch(
                facecolor="white",
                edgecolor="white",
                label=_LINK_LABEL,
            )
        )
    if any(run.races for run in runs):
        handles.append(
            Line2D(
                [],
                [],
                marker="X",
                color=_RACE_COLOR,
                markeredgecolor="black",
                linestyle="none",
                label="race: the two unordered ops",
            )
        )
    return handles
