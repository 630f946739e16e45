"""Layers of a step, recognised from the kernels a model launches once per layer.

One job: where each layer of a step begins, and its figures. A profiler trace does not mark
layers unless the engine annotates them, but a transformer launches the same kernels in every
layer, so the rule (fixed before looking at any figure) is:

- Take the first ubatch's device ops (all of them in a serial step) in launch order.
- Count each kernel name; among the names seen at least twice, the most common count is the
  layer count L (ties: the smaller count, whose kernels are likelier once per layer). The
  first name seen L times is the anchor.
- Layer i starts at the op whose position in the launch order is the anchor's i-th position
  minus its first: the layers are the repeating unit, anchored at the step's first op. Layer
  i then runs from its start to the next layer's start (the last to the step's end).

A step whose kernels repeat fewer than twice has no recognisable layers (an empty list).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from dbo.sim.records import COMM, COMPUTE, OpRecord
from dbo.sim.summary import summarize

__all__ = ["LayerFigures", "layer_figures", "layer_starts"]


@dataclass(frozen=True)
class LayerFigures:
    index: int
    start_us: float
    end_us: float
    compute_us: float
    comm_us: float
    overlap_fraction: float
    host_bound_fraction: float

    @property
    def layer_us(self) -> float:
        return self.end_us - self.start_us

    def to_dict(self) -> dict:
        return {
            "layer": self.index,
            "start_us": round(self.start_us, 3),
            "layer_us": round(self.layer_us, 3),
            "compute_us": round(self.compute_us, 3),
            "comm_us": round(self.comm_us, 3),
            "overlap_fraction": round(self.overlap_fraction, 4),
            "host_bound_fraction": round(self.host_bound_fraction, 4),
        }


def layer_starts(records: Sequence[OpRecord]) -> list[float]:
    """The start time of each recognised layer (rules in the module docstring)."""
    device = [r for r in records if r.kind in (COMPUTE, COMM)]
    ubatches = sorted({r.ubatch for r in device if r.ubatch is not None})
    own = [r for r in device if not ubatches or r.ubatch == ubatches[0]]
    own.sort(key=lambda r: (r.issue_us, r.seq))
    names = [str(r.args.get("kernel", r.name)) for r in own]
    counts = Counter(names)
    repeated = Counter(n for n in counts.values() if n >= 2)
    if not repeated:
        return []
    layers = max(repeated, key=lambda n: (repeated[n], -n))
    anchor = next(name for name in names if counts[name] == layers)
    positions = [k for k, name in enumerate(names) if name == anchor]
    first = positions[0]
    return [own[p - first].start_us for p in positions]


def layer_figures(
    records: Sequence[OpRecord], start_us: float, end_us: float
) -> list[LayerFigures]:
    """Each recognised layer's window and figures, within the step [start_us, end_us]."""
    starts = layer_starts(records)
    out = []
    for i, lo in enumerate(starts):
        hi = starts[i + 1] if i + 1 < len(starts) else end_us
        if hi <= lo:
            continue
        inside = [r for r in records if r.end_us >= lo and r.start_us <= hi]
        s = summarize(inside, window=(lo, hi))
        out.append(
            LayerFigures(
                i, lo, hi, s.compute_us, s.comm_us, s.overlap_fraction, s.host_bound_fraction
            )
        )
    return out
