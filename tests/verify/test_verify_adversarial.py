"""`race_order="adversarial"` runs on the forwards users write: steps under `torch.no_grad()`
or `torch.inference_mode()` (each op is re-run under the modes it was captured under), experts
picked with boolean masks (a data-dependent shape: a race that changes it is a finding, not a
reason to give up), and Hugging Face transformers' own sparse MoE blocks."""

from __future__ import annotations

import pytest
import torch

import dbo
from workspace import reset_workspace_manager

HIDDEN, EXPERTS = 8, 4
_gen = torch.Generator().manual_seed(0)
GATE = torch.randn(HIDDEN, EXPERTS, generator=_gen)
EXPERT_W = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=_gen) * 0.3


def batch(rows: int = 16) -> torch.Tensor:
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def no_workspace():
    reset_workspace_manager()
    yield
    reset_workspace_manager()


def masked_experts(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for e in range(EXPERTS):
        picked = ids == e
        out[picked] = x[picked] @ EXPERT_W[e]  # rows of expert e: a data-dependent shape
    return out


def views_then_writes_in_place(x: torch.Tensor) -> torch.Tensor:
    h = x * 2
    first = h[:, :4]  # a view made in the mode the caller chose
    dbo.dbo_yield()
    h.add_(1)  # in place on the view's base
    return first * 3


@pytest.mark.timeout(60)
def test_a_step_under_no_grad_is_re_executed_under_no_grad():
    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return views_then_writes_in_place(x.requires_grad_())

    report = dbo.verify(forward, batch(), race_order="adversarial")
    assert report.adversarial.skipped is None, report.describe()
    assert report.ok and "benign here" in report.describe()


@pytest.mark.timeout(60)
def test_a_step_under_inference_mode_is_re_executed_in_inference_mode():
    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return views_then_writes_in_place(x)

    report = dbo.verify(forward, batch(), race_order="adversarial")
    assert report.adversarial.skipped is None, report.describe()
    assert report.ok and "benign here" in report.describe()


@pytest.mark.timeout(60)
def test_experts_picked_by_boolean_masks_are_reordered_and_benign_when_ordered():
    def forward(x: torch.Tensor) -> torch.Tensor:
        ids = (x @ GATE).argmax(dim=-1)
        dbo.dbo_yield_and_switch_from_compute_to_comm()  # comm waits for ids
        with dbo.current_device().comm_region("dispatch", nbytes=x.numel() * 4, ep_size=8):
            out = masked_experts(x, ids)
        dbo.dbo_switch_to_compute_sync()
        return out

    report = dbo.verify(forward, batch(), race_order="adversarial", atol=1e-5)
    assert report.ok, report.describe()
    assert report.adversarial.skipped is None and not report.adversarial.faults


@pytest.mark.timeout(60)
def test_a_race_on_boolean_mask_routing_shows_the_changed_shapes():
    def forward(x: torch.Tensor) -> torch.Tensor:
        ids = (x @ GATE).argmax(dim=-1)
        dbo.dbo_yield()
        dbo.dbo_switch_to_comm()  # the bug: the comm stream does not wait for ids
        with dbo.current_device().comm_region("dispatch", nbytes=x.numel() * 4, ep_size=8):
            out = masked_experts(x, ids)
        dbo.dbo_switch_to_compute_sync()
        return out

    report = dbo.verify(forward, batch(), race_order="adversarial", atol=1e-5)
    outcome = report.adversarial
    assert outcome.skipped is None and outcome.changed and not report.ok
    assert any("aten::index in comm::dispatch" in f and "gave shape" in f for f in outcome.faults)
    assert "the race changes values" in report.describe()


def _transformers_block(family: str) -> torch.nn.Module:
    """A tiny sparse MoE block of a transformers model family, random weights, no download."""
    pytest.importorskip("transformers", reason="transformers is not installed (the dev extra)")
    torch.manual_seed(0)
    if family == "mixtral":
        from transformers.models.mixtral import modeling_mixtral as m

        config = m.MixtralConfig(
            hidden_size=HIDDEN,
            intermediate_size=16,
            num_local_experts=EXPERTS,
            num_experts_per_tok=2,
        )
        return _seeded(m.MixtralSparseMoeBlock(config))
    from transformers.models.qwen2_moe import modeling_qwen2_moe as m

    config = m.Qwen2MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
    )
    return _seeded(m.Qwen2MoeSparseMoeBlock(config))


def _seeded(block: torch.nn.Module) -> torch.nn.Module:
    """transformers 5 allocates a bare block's expert weights with `torch.empty` (a model's
    `post_init` fills them): whatever the memory held, NaN and 1e38 included, would make the
    two runs' sums differ. Every weight gets seeded values instead."""
    with torch.no_grad():
        for weight in block.parameters():
            weight.normal_(0.0, 0.1)
    return block.eval()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_transformers_moe_block_runs_in_the_adversarial_order(family):
    block = _transformers_block(family)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # as a user wraps an inference step
            dbo.dbo_yield()
            out = block(x.unsqueeze(0))
            out = out[0] if isinstance(out, tuple) else out  # older releases add router logits
            dbo.dbo_yield()
            return out.squeeze(0)

    report = dbo.verify(forward, batch(), race_order="adversarial", atol=1e-5)
    assert report.adversarial.skipped is None, report.describe()
    assert report.ok and "benign here" in report.describe(), report.describe()
