"""vLLM's own `CommonAttentionMetadata` (vllm.v1.attention.backend) read as dbo.split's.

dbo.split's record keeps `num_computed_tokens_cpu`, which vLLM 0.33's record no longer has:
it is derived here from the host-side sequence lengths minus the query lengths, which is what
it meant. vLLM is never imported: any object with vLLM's field names is accepted."""

from __future__ import annotations

from typing import Any

import torch

from dbo.split.metadata import CommonAttentionMetadata

__all__ = ["as_split_metadata"]

_REQUIRED = (
    "query_start_loc",
    "query_start_loc_cpu",
    "seq_lens",
    "num_reqs",
    "num_actual_tokens",
    "max_query_len",
    "max_seq_len",
    "block_table_tensor",
    "slot_mapping",
)


def as_split_metadata(metadata: Any) -> CommonAttentionMetadata:
    """`metadata` itself when it is dbo.split's record; vLLM's record (or any with its field
    names) converted; anything else refused with the fields it lacks."""
    if isinstance(metadata, CommonAttentionMetadata):
        return metadata
    missing = [name for name in _REQUIRED if not hasattr(metadata, name)]
    if missing:
        raise TypeError(
            f"common_attn_metadata must be a CommonAttentionMetadata (dbo.split's or vLLM's), "
            f"got {type(metadata).__name__} without {', '.join(missing)}"
        )
    qsl_cpu = metadata.query_start_loc_cpu
    upper = getattr(metadata, "seq_lens_cpu_upper_bound", None)
    host_seq_lens = upper if upper is not None else metadata.seq_lens.cpu()
    computed = getattr(metadata, "num_computed_tokens_cpu", None)
    if computed is None:
        computed = (host_seq_lens - (qsl_cpu[1:] - qsl_cpu[:-1])).to(torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=metadata.query_start_loc,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=metadata.seq_lens,
        num_computed_tokens_cpu=computed,
        block_table_tensor=metadata.block_table_tensor,
        slot_mapping=metadata.slot_mapping,
        num_reqs=int(metadata.num_reqs),
        num_actual_tokens=int(metadata.num_actual_tokens),
        max_query_len=int(metadata.max_query_len),
        max_seq_len=int(metadata.max_seq_len),
        positions=getattr(metadata, "positions", None),
        is_prefilling=getattr(metadata, "is_prefilling", None),
        seq_lens_cpu_upper_bound=upper,
    )
