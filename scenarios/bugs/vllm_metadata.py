"""vLLM bugs in how attention metadata follows a ubatch cut: each entry's buggy split is the
reported mistake, its fixed split `dbo.split.split_attn_metadata` (or a builder per ubatch);
`dbo.verify` runs the step and its ubatch-metadata checker names the field."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from dbo.split import CommonAttentionMetadata, maybe_create_ubatch_slices, split_attn_metadata
from scenarios.bugs.attention import (
    STEP_PROMPTS,
    STEP_QUERY,
    STEP_SEQ,
    PagedAttention,
    verify_verdict,
)
from scenarios.bugs.registry import Verdict, bug

BLOCK = 4


def _step() -> tuple[CommonAttentionMetadata, PagedAttention, list]:
    meta = CommonAttentionMetadata.make(
        STEP_QUERY, STEP_SEQ, block_size=BLOCK, prompt_lens=STEP_PROMPTS
    )
    slices, _ = maybe_create_ubatch_slices(
        True, STEP_QUERY, meta.num_actual_tokens, len(STEP_QUERY), 2
    )
    return meta, PagedAttention(meta, block_size=BLOCK), slices


def _verify_with(split_metadata) -> Verdict:
    """Verify the paged step with ubatch metadata from `split_metadata(meta, slices)`."""
    meta, model, slices = _step()

    def split(inputs: dict[str, Any], n: int) -> list[dict[str, Any]]:
        parts = split_metadata(inputs["attn"], slices)
        return [{"q": inputs["q"][s.token_slice], "attn": m} for s, m in zip(slices, parts)]

    return verify_verdict(model.forward, model.inputs(meta), split)


@bug(
    "vllm-48659-metadata-cache",
    engine="vLLM",
    ref="vllm#48659",
    cause="the attention-metadata cache is keyed without the ubatch id: ubatch 1 takes the "
    "block-table update path on ubatch 0's entry and keeps its cu_seqlens_q/seq_lens",
    caught_by="dbo.verify (ubatch-metadata checker)",
    evidence="block_table_tensor",
)
def metadata_cache(buggy: bool) -> Verdict:
    def build(meta: CommonAttentionMetadata, slices: list) -> list[CommonAttentionMetadata]:
        cache: dict[tuple, CommonAttentionMetadata] = {}
        built = []
        for ubid, part in enumerate(split_attn_metadata(slices, meta)):
            key = ("full_attention", "FlashAttentionMetadataBuilder")
            key = key if buggy else (*key, ubid)
            hit = cache.get(key)
            if hit is None:
                cache[key] = part
                built.append(part)
            else:  # the backend's update_block_table path: only these two are swapped in
                built.append(
                    replace(
                        hit,
                        block_table_tensor=part.block_table_tensor,
                        slot_mapping=part.slot_mapping,
                    )
                )
        return built

    return _verify_with(build)


@bug(
    "vllm-49542-dropped-fields",
    engine="vLLM",
    ref="vllm#49542 / vllm#43966",
    cause="the per-ubatch metadata is rebuilt from the fields the slicer knows, dropping "
    "positions (and is_prefilling), which DeepSeek V4's sparse attention reads",
    caught_by="dbo.verify (ubatch-metadata checker)",
    evidence="positions",
)
def dropped_fields(buggy: bool) -> Verdict:
    def build(meta: CommonAttentionMetadata, slices: list) -> list[CommonAttentionMetadata]:
        parts = split_attn_metadata(slices, meta)
        if buggy:
            parts = [replace(p, positions=None, is_prefilling=None) for p in parts]
        return parts

    return _verify_with(build)


@bug(
    "vllm-56031-continuation-computed",
    engine="vLLM",
    ref="vllm#56031",
    cause="the continuation slice of a request cut across ubatches keeps the parent's "
    "computed-token count instead of adding the tokens the earlier ubatch ran",
    caught_by="dbo.verify (ubatch-metadata checker)",
    evidence="num_computed_tokens_cpu",
)
def continuation_computed(buggy: bool) -> Verdict:
    def build(meta: CommonAttentionMetadata, slices: list) -> list[CommonAttentionMetadata]:
        parts = split_attn_metadata(slices, meta)
        if not buggy:
            return parts
        cu = meta.query_start_loc_cpu.tolist()
        kept = []
        for s, p in zip(slices, parts):
            if s.token_slice.start > cu[s.request_slice.start]:  # starts inside a request
                computed = p.num_computed_tokens_cpu.clone()
                computed[0] = meta.num_computed_tokens_cpu[s.request_slice.start]
                p = replace(p, num_computed_tokens_cpu=computed)
            kept.append(p)
        return kept

    return _verify_with(build)


# --------------------------------------------------------------------------------------------
# A metadata builder that keeps what it built on itself


class PrefillBuilder:
    """Plans a prefill and, like MLA's and FlashInfer's builders, keeps the plan on itself:
    `cu_seqlens_q` is a persistent buffer (so a captured graph can read it) that every
    `build()` overwrites in place, and the metadata it returns points into it."""

    def __init__(self, max_reqs: int) -> None:
        self.cu_seqlens_q = torch.zeros(max_reqs + 1, dtype=torch.int32)

    def build(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        n = common.num_reqs + 1
        self.cu_seqlens_q[:n].copy_(common.query_start_loc_cpu)
        return replace(common, query_start_loc=self.cu_seqlens_q[:n])


def _varlen_forward(model: PagedAttention):
    """The prefill forward: the varlen kernel takes its cu_seqlens_q from the builder's plan
    (the metadata's device `query_start_loc`), not from the host copy."""

    def forward(inputs: dict[str, Any]) -> torch.Tensor:
        m = inputs["attn"]
        planned = replace(m, query_start_loc_cpu=m.query_start_loc.to(torch.int64))
        return model.forward({"q": inputs["q"], "attn": planned})

    return forward


@bug(
    "vllm-50945-shared-builder",
    engine="vLLM",
    ref="vllm#50945 (review thread)",
    cause="one metadata builder is shared by the ubatches and stashes the prefill plan "
    "(cu_seqlens_q) on itself; ubatch 1's build() overwrites it before ubatch 0's forward "
    "reads it",
    caught_by="dbo.verify (ubatch-metadata checker)",
    evidence="ubatch 0, query_start_loc: differs from query_start_loc_cpu",
)
def shared_builder(buggy: bool) -> Verdict:
    meta, model, slices = _step()
    builders = [PrefillBuilder(meta.num_reqs) for _ in slices]

    def split(inputs: dict[str, Any], n: int) -> list[dict[str, Any]]:
        parts = split_attn_metadata(slices, inputs["attn"])
        # DBO builds every ubatch's metadata before any forward runs.
        built = [(builders[0] if buggy else builders[k]).build(p) for k, p in enumerate(parts)]
        return [{"q": inputs["q"][s.token_slice], "attn": b} for s, b in zip(slices, built)]

    # The serial step has its own builder: it never runs in the same step as the ubatches.
    whole = {"q": model.q, "attn": PrefillBuilder(meta.num_reqs).build(meta)}
    return verify_verdict(_varlen_forward(model), whole, split)
