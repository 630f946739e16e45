"""A data-parallel step for `dbo.verify_ranks`: the DP ranks agree on the padded token count,
then gather every rank's padded rows (an EP-style exchange) and keep their own.

Rank 0 holds 6 tokens and rank 1 none: an idle rank runs the engine's dummy batch of 0 tokens
and must still take part in every collective. `skips_when_idle` is the classic mistake: the
idle rank returns before the step's collectives.

    dbo-sim verify examples.dp_ranks:step --inputs examples.dp_ranks:batches --ranks 2
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import dbo
from dbo.split import coordinate_ubatching

HIDDEN = 4


def batches(rank: int, world_size: int) -> torch.Tensor:
    """Rank 0: 6 tokens; every other rank: the idle rank's 0-token dummy batch."""
    rows = 6 if rank == 0 else 0
    return torch.arange(rows * HIDDEN, dtype=torch.float32).reshape(rows, HIDDEN)


def step(batch: torch.Tensor) -> torch.Tensor:
    num_tokens = batch.shape[0]
    padded = coordinate_ubatching(False, num_tokens, 2).num_tokens_padded  # the DP agreement
    hidden = torch.zeros(padded, HIDDEN)
    hidden[:num_tokens] = batch
    rows = [torch.empty_like(hidden) for _ in range(dist.get_world_size())]
    with dbo.collective_kind("moe gather"):  # names what this exchange means
        dist.all_gather(rows, hidden)
    return rows[dist.get_rank()][:num_tokens] * 2


def skips_when_idle(batch: torch.Tensor) -> torch.Tensor:
    if batch.shape[0] == 0:
        return batch  # the bug: an idle rank skips the step's collectives
    return step(batch)
