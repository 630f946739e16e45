"""Expert routing and placement for a simulated EP group: which rank's experts get how many rows.

A `Routing` is, per MoE layer, the share of a token's top-k expert copies that each expert
receives (rows of `load` sum to 1). Every DP rank's tokens follow the same layer distribution,
so the rows rank p sends rank r are `tokens_p * top_k * share_of(r)`: the traffic matrix is an
outer product and a layer's whole all-to-all is described by one vector per layer.

Families (all seeded, all documented on their constructor):
- `balanced`: every expert the same share (today's one-rank formula).
- `zipf(s)`: expert popularity proportional to 1 / rank^s, the ranking shuffled per layer.
- `dirichlet(alpha)`: per layer a draw from a symmetric Dirichlet(alpha) (small alpha: skewed).
- `from_histogram(path)`: measured tokens per expert per layer (CSV or JSON).
- `routed_counts(routing, tokens, top_k)` / `assign_experts(counts, tokens, top_k)`: the
  whole rows per expert a batch routes under the shares (largest remainder), and a token-to-
  expert assignment realising them exactly (what rank processes route by in the cross-check).
- `sampled(routing, tokens)`: the counts a batch of `tokens` actually routes, each token
  drawing top_k distinct experts from the layer's shares (seeded): the statistical imbalance
  of a finite batch (DeepEP's benchmarks route random scores this way).

A token picks top_k *distinct* experts, so no expert can receive more than one copy of each
token: shares above 1 / top_k are capped and the excess spread over the others.

A `Placement` maps experts onto ranks: `contiguous` (expert e on rank e // (E / R)), or a
redundant-expert map (`eplb`: the hottest experts get extra replicas, replicas packed onto
ranks by load, as DeepSeek's EPLB does), whose replicas split an expert's rows evenly.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "Routing",
    "Placement",
    "balanced",
    "zipf",
    "dirichlet",
    "from_histogram",
    "sampled",
    "routed_counts",
    "assign_experts",
    "contiguous",
    "eplb",
    "cap_shares",
]


def cap_shares(shares: np.ndarray, top_k: int) -> np.ndarray:
    """Per-layer shares (rows sum to 1) with no expert above 1 / top_k, the excess moved to
    the uncapped experts in proportion (a token's k copies go to k distinct experts)."""
    out = np.array(shares, dtype=float)
    limit = 1.0 / max(int(top_k), 1)
    for _ in range(64):
        over = out > limit + 1e-12
        if not over.any():
            break
        excess = (out - limit).clip(min=0).sum(axis=1, keepdims=True)
        out = np.where(over, limit, out)
        free = np.where(over, 0.0, out)
        total = free.sum(axis=1, keepdims=True)
        out = out + np.where(total > 0, free / np.where(total > 0, total, 1) * excess, 0)
    return out


@dataclass(frozen=True)
class Routing:
    """Per MoE layer, each expert's share of the routed rows (`load`, layers x experts)."""

    load: np.ndarray
    label: str

    @property
    def num_layers(self) -> int:
        return int(self.load.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.load.shape[1])

    def layer(self, index: int) -> np.ndarray:
        """The shares of MoE layer `index` (a recording with more layers repeats the last)."""
        return self.load[min(index, self.num_layers - 1)]

    def imbalance(self) -> float:
        """Hottest expert's share over the mean share, averaged over layers (1 = balanced)."""
        return float((self.load.max(axis=1) * self.num_experts).mean())


def _routing(load: np.ndarray, top_k: int, label: str) -> Routing:
    load = np.asarray(load, dtype=float)
    load = load / load.sum(axis=1, keepdims=True)
    return Routing(cap_shares(load, top_k), label)


def balanced(num_layers: int, num_experts: int, top_k: int = 1) -> Routing:
    """Every expert the same share of every layer's rows."""
    return _routing(np.ones((num_layers, num_experts)), top_k, "balanced")


def zipf(num_layers: int, num_experts: int, s: float, *, top_k: int = 1, seed: int = 0) -> Routing:
    """Zipf(s): the i-th most popular expert gets a share proportional to 1 / i^s; which
    expert is i-th is a seeded random permutation per layer. s = 0 is balanced."""
    if s < 0:
        raise ValueError(f"zipf exponent s must be >= 0, got {s}")
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_experts + 1) ** s
    load = np.stack([weights[rng.permutation(num_experts)] for _ in range(num_layers)])
    return _routing(load, top_k, f"zipf(s={s:g}, seed={seed})")


def dirichlet(
    num_layers: int, num_experts: int, alpha: float, *, top_k: int = 1, seed: int = 0
) -> Routing:
    """Per layer, shares drawn from a symmetric Dirichlet(alpha), seeded: large alpha is
    near balanced, alpha ~1 is strongly skewed."""
    if alpha <= 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha}")
    rng = np.random.default_rng(seed)
    load = rng.dirichlet(np.full(num_experts, float(alpha)), size=num_layers)
    return _routing(load + 1e-12, top_k, f"dirichlet(alpha={alpha:g}, seed={seed})")


def from_histogram(path: str | Path, num_layers: int, num_experts: int, top_k: int = 1) -> Routing:
    """Measured tokens per expert per MoE layer. CSV: one row per layer, one column per
    expert (a header row is allowed); JSON: a list of per-layer lists, or {"tokens": that}.
    The shape must be (num_layers, num_experts) of the model, or one row used for every
    layer; otherwise ValueError says which dimension is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"histogram file {str(path)!r} does not exist")
    if path.suffix.lower() == ".json":
        data = json.loads(path.read_text())
        rows = data.get("tokens") if isinstance(data, dict) else data
    else:
        with open(path, newline="") as f:
            rows = [r for r in csv.reader(f) if r]
        if rows and not _numeric(rows[0]):
            rows = rows[1:]
    try:
        load = np.array([[float(v) for v in row] for row in rows], dtype=float)
    except (TypeError, ValueError):
        raise ValueError(
            f"histogram {str(path)!r} must hold numbers: one row of token counts per layer"
        ) from None
    if load.ndim != 2 or load.shape[1] != num_experts:
        cols = load.shape[1] if load.ndim == 2 else 0
        raise ValueError(
            f"histogram {str(path)!r} has {cols} experts per row but the model has "
            f"{num_experts}; give one column per expert"
        )
    if load.shape[0] == 1:
        load = np.repeat(load, num_layers, axis=0)
    if load.shape[0] != num_layers:
        raise ValueError(
            f"histogram {str(path)!r} has {load.shape[0]} layers but the model has "
            f"{num_layers} MoE layers; give one row per MoE layer (or a single row)"
        )
    if (load < 0).any() or (load.sum(axis=1) <= 0).any():
        raise ValueError(f"histogram {str(path)!r}: counts must be >= 0, each layer's sum > 0")
    return _routing(load, top_k, f"histogram {path.name}")


def sampled(routing: Routing, tokens: int, top_k: int, *, seed: int = 0) -> Routing:
    """What `tokens` tokens route under `routing`'s shares: per layer, each token picks
    `top_k` distinct experts (Gumbel top-k of the log shares, seeded); the result is the
    counts' shares."""
    rng = np.random.default_rng(seed)
    e = routing.num_experts
    counts = np.zeros((routing.num_layers, e))
    for j in range(routing.num_layers):
        keys = np.log(np.maximum(routing.load[j], 1e-300)) + rng.gumbel(size=(tokens, e))
        picks = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
        counts[j] = np.bincount(picks.reshape(-1), minlength=e)
    return Routing(counts / counts.sum(axis=1, keepdims=True), f"{routing.label}, {tokens} tokens")


def routed_counts(routing: Routing, tokens: int, top_k: int) -> np.ndarray:
    """Rows per expert per layer (layers x experts, integers) that `tokens` tokens with `top_k`
    experts each route under `routing`: its shares times tokens * top_k, rounded by largest
    remainder (each layer sums to tokens * top_k; with capped shares none exceeds tokens)."""
    want = routing.load * (tokens * top_k)
    counts = np.floor(want + 1e-9)
    short = (tokens * top_k - counts.sum(axis=1)).astype(int)
    for j in range(routing.num_layers):
        order = np.argsort(-(want[j] - counts[j]), kind="stable")
        counts[j, order[: short[j]]] += 1
    return counts.astype(int)


def assign_experts(counts: np.ndarray, tokens: int, top_k: int) -> np.ndarray:
    """A (tokens, top_k) expert id per token slot such that expert e receives exactly
    `counts[e]` rows and no token picks an expert twice: experts in order, each repeated
    counts[e] times, laid out slot by slot (a run of at most `tokens` ids never wraps onto
    the same token). ValueError when the counts do not sum to tokens * top_k or one exceeds
    tokens."""
    counts = np.asarray(counts, dtype=int)
    if counts.sum() != tokens * top_k or (counts > tokens).any() or (counts < 0).any():
        raise ValueError(
            f"expert counts must be in [0, {tokens}] and sum to {tokens} x {top_k} rows, "
            f"got sum {counts.sum()}, max {counts.max()}"
        )
    ids = np.repeat(np.arange(counts.size), counts)
    return ids.reshape(top_k, tokens).T.copy()


def _numeric(row: list[str]) -> bool:
    try:
        [float(v) for v in row]
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Placement:
    """`share[e, r]`: the part of expert e's rows that rank r serves (rows sum to 1)."""

    share: np.ndarray
    label: str

    @property
    def num_ranks(self) -> int:
        return int(self.share.shape[1])

    def rank_shares(self, expert_shares: np.ndarray) -> np.ndarray:
        """Each rank's share of a layer's rows, from the experts' shares."""
        return expert_shares @ self.share


def contiguous(num_experts: int, num_ranks: int) -> Placement:
    """Expert e on rank e // (num_experts / num_ranks), one copy each."""
    if num_experts % num_ranks:
        raise ValueError(
            f"EP size {num_ranks} does not divide the {num_experts} experts; choose an EP size "
            "that does (or a redundant-expert placement)"
        )
    share = np.zeros((num_experts, num_ranks))
    share[np.arange(num_experts), np.arange(num_experts) // (num_experts // num_ranks)] = 1.0
    return Placement(share, "contiguous")


def eplb(load: np.ndarray, num_ranks: int, num_redundant: int) -> Placement:
    """A redundant-expert map in the manner of DeepSeek's EPLB: `num_redundant` extra replicas
    go one at a time to the expert with the highest load per replica; then the replicas,
    heaviest first, each go to the least-loaded rank with a free slot (slots per rank:
    (experts + redundant) / ranks). `load` is the expert shares (one layer, or the mean)."""
    load = np.asarray(load, dtype=float).reshape(-1)
    num_experts = load.size
    slots = num_experts + int(num_redundant)
    if slots % num_ranks:
        raise ValueError(
            f"{num_experts} experts + {num_redundant} redundant = {slots} slots do not divide "
            f"over EP {num_ranks}"
        )
    replicas = np.ones(num_experts, dtype=int)
    for _ in range(int(num_redundant)):
        replicas[int(np.argmax(load / replicas))] += 1
    pieces = sorted(
        ((load[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])),
        reverse=True,
    )
    per_rank = slots // num_ranks
    rank_load, rank_used = np.zeros(num_ranks), np.zeros(num_ranks, dtype=int)
    share = np.zeros((num_experts, num_ranks))
    for piece, e in pieces:
        free = np.where(rank_used < per_rank, rank_load, np.inf)
        r = int(np.argmin(free))
        rank_load[r] += piece
        rank_used[r] += 1
        share[e, r] += 1.0 / replicas[e]
    return Placement(share, f"eplb(+{num_redundant} redundant)")
