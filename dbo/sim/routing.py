"""Expert routing and placement for a simulated EP group: which rank's tokens go to which
expert, and which rank serves each expert's rows.

A `Routing` is, per MoE layer and per source rank, the share of that rank's top-k expert
copies that each expert receives (`load[layer, source, expert]`, each source's row sums to
1). Rank p routes `tokens_p * top_k` copies; with a `Placement` they become the traffic
matrix of the layer, rank to rank (`Placement.traffic`). A family that routes every rank
alike in expectation has one source row, which every rank uses; a sampled batch or a
per-rank histogram has a row per rank, so an expert's load is a sum over ranks and its
relative spread shrinks as the group grows, as in a real group.

Families (all seeded, all documented on their constructor):
- `balanced`: every expert the same share (the one-rank formula's assumption).
- `zipf(s)`: expert popularity proportional to 1 / rank^s, the ranking shuffled per layer.
- `dirichlet(alpha)`: per layer a draw from a symmetric Dirichlet(alpha) (small alpha: skewed).
- `from_histogram(path)`: measured tokens per expert per layer (CSV or JSON), per rank where
  the file has it.
- `sampled(routing, tokens, top_k, ranks=R)`: what a batch routes when each of R ranks draws
  its own `tokens` tokens from the shares (seeded): the statistical imbalance of finite
  batches, rank by rank (DeepEP's benchmarks route random scores this way). With
  `ubatches=(t0, t1, ...)` each rank draws each ubatch's slice of its tokens on its own, and
  the batch is their union: a ubatched step routes each ubatch's tokens when that ubatch
  runs, so each of its collectives gates on its own busiest pair (the larger relative spread
  of a smaller sample), while the serial step routes the same tokens at once.
- `routed_counts(routing, tokens, top_k)` / `assign_experts(counts, tokens, top_k)`: the
  whole rows per expert a batch routes under the group's shares (largest remainder), and a
  token-to-expert assignment realising them exactly (what rank processes route by in the
  cross-check).

A token picks top_k *distinct* experts, so no expert can receive more than one copy of each
token: `cap_shares` holds every share to 1 / top_k and moves the excess to the next experts
in popularity order, so no row is ever dropped.

A `Placement` maps experts onto ranks, per layer or for all layers: `contiguous` (expert e on
rank e // (E / R)), or `eplb` (DeepSeek's EPLB, per layer: redundant replicas to the expert
with the most load per replica, then replicas packed heaviest first onto the least-loaded
rank with a free slot), whose replicas split an expert's rows evenly.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
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
    """`shares` (last axis: experts, each row summing to 1) with none above 1 / top_k: each
    capped expert's excess goes to the next experts in popularity order, each filled up to
    the cap (a token that cannot pick an expert twice takes its next choice), so every row
    still sums to 1: no row is dropped."""
    out = np.array(shares, dtype=float)
    k = max(int(top_k), 1)
    flat = out.reshape(-1, out.shape[-1])
    limit = 1.0 / k
    for row in flat:
        if row.max() <= limit + 1e-12:
            continue
        order = np.argsort(-row, kind="stable")
        ranked = row[order]
        excess = np.clip(ranked - limit, 0.0, None).sum()
        ranked = np.minimum(ranked, limit)
        room = np.cumsum(limit - ranked)  # what the experts up to each one can still take
        ranked += np.diff(np.minimum(room, excess), prepend=0.0)
        row[order] = ranked
    return out


@dataclass(frozen=True)
class Routing:
    """Per MoE layer and source rank, each expert's share of that rank's routed rows
    (`load`, layers x sources x experts; a layers x experts load is one source, used by every
    rank). `top_k` experts per token; `groups` = (n_group, topk_group) of group-limited
    routing (DeepSeek-V3's (8, 4)), which bounds the nodes a token reaches."""

    load: np.ndarray
    label: str
    top_k: int = 1
    groups: tuple[int, int] | None = None
    # Each ubatch's own routing (its slice of every rank's tokens; `load` is their union);
    # empty: every ubatch routes as the whole batch (expected shares split evenly).
    ubatches: tuple[Routing, ...] = ()

    def __post_init__(self) -> None:
        load = np.asarray(self.load, dtype=float)
        if load.ndim == 2:
            load = load[:, None, :]
        if load.ndim != 3:
            raise ValueError(f"routing load must be layers x [sources x] experts, got {load.shape}")
        object.__setattr__(self, "load", load)

    @property
    def num_layers(self) -> int:
        return int(self.load.shape[0])

    @property
    def num_sources(self) -> int:
        return int(self.load.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.load.shape[2])

    def of_ubatch(self, ubatch: int | None) -> Routing:
        """What ubatch `ubatch` routes (None, or a batch without ubatch draws: the whole)."""
        if ubatch is None or not self.ubatches:
            return self
        if not 0 <= ubatch < len(self.ubatches):
            raise ValueError(
                f"routing {self.label!r} was drawn for {len(self.ubatches)} ubatches, the step "
                f"runs ubatch {ubatch}; sample it with one token count per ubatch of the step"
            )
        part = self.ubatches[ubatch]
        # The batch's group-limited routing is its ubatches' (set on the batch after drawing).
        return part if part.groups == self.groups else replace(part, groups=self.groups)

    def layer(self, index: int) -> np.ndarray:
        """Sources x experts of MoE layer `index` (a recording with more layers repeats the
        last)."""
        return self.load[min(index, self.num_layers - 1)]

    def sources(self, index: int, ranks: int) -> np.ndarray:
        """Ranks x experts: each rank's shares in layer `index` (one source row: every rank's)."""
        rows = self.layer(index)
        if rows.shape[0] == 1:
            return np.broadcast_to(rows, (ranks, rows.shape[1]))
        if rows.shape[0] != ranks:
            raise ValueError(
                f"routing {self.label!r} has {rows.shape[0]} source ranks but the group has "
                f"{ranks}; give one row per rank or one for all"
            )
        return rows

    def expert_load(self) -> np.ndarray:
        """Layers x experts: the group's shares (every rank routing the same token count)."""
        return self.load.mean(axis=1)

    def imbalance(self) -> float:
        """Hottest expert's share of the group's rows over the mean share, averaged over
        layers (1 = balanced)."""
        return float((self.expert_load().max(axis=1) * self.num_experts).mean())


def _routing(load: np.ndarray, top_k: int, label: str) -> Routing:
    load = np.asarray(load, dtype=float)
    load = load / load.sum(axis=-1, keepdims=True)
    return Routing(cap_shares(load, top_k), label, int(top_k))


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


def _read_histogram(path: Path) -> np.ndarray:
    """The file's counts: layers x experts, or layers x ranks x experts."""
    if path.suffix.lower() == ".json":
        data = json.loads(path.read_text())
        rows = data.get("tokens") if isinstance(data, dict) else data
        return np.array(rows, dtype=float)
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header = rows[0] if rows and not _numeric(rows[0]) else None
    rows = rows[1:] if header else rows
    values = np.array([[float(v) for v in row] for row in rows], dtype=float)
    if header and [h.strip().lower() for h in header[:2]] == ["layer", "rank"]:
        layers, ranks = int(values[:, 0].max()) + 1, int(values[:, 1].max()) + 1
        out = np.zeros((layers, ranks, values.shape[1] - 2))
        out[values[:, 0].astype(int), values[:, 1].astype(int)] = values[:, 2:]
        return out
    return values


def from_histogram(path: str | Path, num_layers: int, num_experts: int, top_k: int = 1) -> Routing:
    """Measured tokens per expert per MoE layer. CSV: one row per layer, one column per
    expert (a header row is allowed), or with a `layer,rank,...` header one row per layer and
    source rank; JSON: a list of per-layer lists (or per-layer lists of per-rank lists), or
    {"tokens": that}. The layers must be the model's MoE layers (or one row for every layer)
    and the columns its experts; otherwise ValueError says which dimension is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"histogram {str(path)!r} does not exist")
    try:
        load = _read_histogram(path)
    except (TypeError, ValueError):
        raise ValueError(
            f"histogram {str(path)!r} must hold numbers: one row of token counts per layer"
        ) from None
    if load.ndim not in (2, 3) or load.shape[-1] != num_experts:
        cols = load.shape[-1] if load.ndim in (2, 3) else 0
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
    if (load < 0).any() or (load.sum(axis=-1) <= 0).any():
        raise ValueError(f"histogram {str(path)!r}: counts must be >= 0, each row's sum > 0")
    return _routing(load, top_k, f"histogram {path.name}")


def sampled(
    routing: Routing,
    tokens: int,
    top_k: int,
    *,
    ranks: int = 1,
    seed: int = 0,
    ubatches: Sequence[int] | None = None,
) -> Routing:
    """What `ranks` ranks of `tokens` tokens each route under `routing`'s shares, each rank
    drawing its own batch (seeded): per layer and rank, the counts per expert of a
    multinomial of tokens * top_k copies over the rank's shares, capped at `tokens` (a
    token's copies go to distinct experts; the multinomial ignores that within a token, a
    variance (E - 1) / (E - k) too large: 3% for 8 of 256 experts). `ubatches`: the token
    counts of the step's ubatches (summing to `tokens`); each rank draws each ubatch's slice
    on its own and the result is their union, carrying each ubatch's draw (`of_ubatch`)."""
    sizes = [int(tokens)] if ubatches is None else [int(t) for t in ubatches]
    if sum(sizes) != int(tokens) or min(sizes) < 1:
        raise ValueError(
            f"ubatch token counts {sizes} must be >= 1 each and sum to the batch's {tokens}"
        )
    if routing.num_sources not in (1, ranks):
        raise ValueError(f"routing has {routing.num_sources} sources, cannot sample {ranks}")
    rng = np.random.default_rng(seed)
    shares = cap_shares(routing.load, top_k)
    shares = np.broadcast_to(shares, (routing.num_layers, ranks, routing.num_experts))
    k = int(top_k)
    parts = [cap_shares(rng.multinomial(t * k, shares) / (t * k), top_k) for t in sizes]
    # The union's rows are the slices' rows: the serial step routes the very same tokens.
    load = parts[0] if len(parts) == 1 else sum(p * t for p, t in zip(parts, sizes)) / tokens
    label = f"{routing.label}, {tokens} tokens" + (f" on each of {ranks} ranks" * (ranks > 1))
    drawn = ()
    if ubatches is not None:
        drawn = tuple(
            Routing(part, f"{label}, ubatch {u} ({t} tokens)", k, routing.groups)
            for u, (part, t) in enumerate(zip(parts, sizes))
        )
        label += f", drawn per ubatch {'/'.join(map(str, sizes))}"
    return Routing(load, label, k, routing.groups, drawn)


def routed_counts(routing: Routing, tokens: int, top_k: int) -> np.ndarray:
    """Rows per expert per layer (layers x experts, integers) that `tokens` tokens with `top_k`
    experts each route under the group's shares: shares times tokens * top_k, rounded by
    largest remainder (each layer sums to tokens * top_k; with capped shares none exceeds
    tokens)."""
    want = routing.expert_load() * (tokens * top_k)
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
    """`share[e, r]` (or `share[layer, e, r]`, per MoE layer): the part of expert e's rows
    that rank r serves (each expert's row sums to 1)."""

    share: np.ndarray
    label: str

    @property
    def num_ranks(self) -> int:
        return int(self.share.shape[-1])

    @property
    def num_experts(self) -> int:
        return int(self.share.shape[-2])

    def layer(self, index: int) -> np.ndarray:
        """Experts x ranks of MoE layer `index` (the last layer's beyond the placed ones)."""
        if self.share.ndim == 2:
            return self.share
        return self.share[min(index, self.share.shape[0] - 1)]

    def rank_shares(self, expert_shares: np.ndarray, layer: int = 0) -> np.ndarray:
        """Each rank's share of a layer's rows, from the experts' shares (last axis)."""
        return np.einsum("...e,er->...r", expert_shares, self.layer(layer))


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


def _replicas(load: np.ndarray, num_redundant: int) -> np.ndarray:
    """DeepSeek's EPLB replication: each redundant replica, one at a time, to the expert with
    the highest load per replica."""
    replicas = np.ones(load.size, dtype=int)
    for _ in range(int(num_redundant)):
        replicas[int(np.argmax(load / replicas))] += 1
    return replicas


def _pack(load: np.ndarray, replicas: np.ndarray, num_ranks: int) -> np.ndarray:
    """DeepSeek's EPLB balanced packing: replicas, heaviest first, each onto the least-loaded
    rank with a free slot (slots per rank: replicas / ranks). Returns experts x ranks."""
    per_rank = int(replicas.sum()) // num_ranks
    piece = load / replicas
    items = np.repeat(np.arange(load.size), replicas)
    items = items[np.argsort(-piece[items], kind="stable")]
    rank_load, rank_used = np.zeros(num_ranks), np.zeros(num_ranks, dtype=int)
    share = np.zeros((load.size, num_ranks))
    for e in items:
        r = int(np.argmin(np.where(rank_used < per_rank, rank_load, np.inf)))
        rank_load[r] += piece[e]
        rank_used[r] += 1
        share[e, r] += 1.0 / replicas[e]
    return share


def eplb(load: np.ndarray, num_ranks: int, num_redundant: int) -> Placement:
    """A redundant-expert map as DeepSeek's EPLB computes it, per MoE layer from that layer's
    load (`load`: layers x experts, or one layer's experts): replicas by `_replicas`, packed
    by `_pack`. Where the experts divide over the ranks, a layer whose packing leaves its
    most-loaded rank heavier than contiguous placement of the same load (greedy packing can)
    takes the contiguous placement instead, so EPLB is never the worse of the two."""
    load = np.atleast_2d(np.asarray(load, dtype=float))
    num_experts = load.shape[1]
    slots = num_experts + int(num_redundant)
    if slots % num_ranks:
        raise ValueError(
            f"{num_experts} experts + {num_redundant} redundant = {slots} slots do not divide "
            f"over EP {num_ranks}"
        )
    plain = contiguous(num_experts, num_ranks).share if num_experts % num_ranks == 0 else None
    shares = []
    for row in load:
        share = _pack(row, _replicas(row, num_redundant), num_ranks)
        if plain is not None and row.dot(share).max() > row.dot(plain).max() + 1e-12:
            share = plain
        shares.append(share)
    share = shares[0] if len(shares) == 1 else np.stack(shares)
    return Placement(share, f"eplb(+{num_redundant} redundant, per layer)")
