"""UBatchRunner with model runner V2's contract (prepare, run, begin_capturable_run,
abort_pending_run) on dbo-sim's runtime: overlapped ubatches, merged output, never a hang."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import dbo
from dbo.split import CommonAttentionMetadata, DBOConfig
from dbo.ubatch_runner import UBatchRunner, UBatchState
from dbo.ubatching import current_forward_context

pytestmark = pytest.mark.timeout(60)

QUERY = [3, 4, 5]
BATCH = SimpleNamespace(
    num_scheduled_tokens=QUERY, num_tokens_after_padding=12, num_reqs_after_padding=3
)


def _inputs() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(12.0), "positions": torch.arange(12)}


def _model(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    hidden = input_ids * 2
    dbo.dbo_yield()  # hand over mid-forward, as a model does at its all-to-all
    return hidden + positions


def _runner(device, **kwargs) -> UBatchRunner:
    return UBatchRunner(DBOConfig(), device, timeout=10, **kwargs)


def test_run_returns_what_the_model_returns_on_the_whole_batch(device):
    runner = _runner(device)
    out = runner.run(_model, _inputs(), runner.prepare(BATCH))
    assert torch.equal(out, _inputs()["input_ids"] * 2 + _inputs()["positions"])


def test_each_ubatch_sees_its_forward_context_and_token_offset(device):
    seen = {}

    def model(input_ids, positions):
        context = current_forward_context()
        seen[dbo.dbo_current_ubatch_id()] = (
            context.num_tokens,
            dbo.dbo_current_ubatch_token_offset(),
        )
        return input_ids

    runner = _runner(device)
    runner.run(model, _inputs(), runner.prepare(BATCH))
    assert seen == {0: (6, 0), 1: (6, 6)}


def test_prepare_splits_the_attention_metadata_per_ubatch(device):
    meta = CommonAttentionMetadata.make(QUERY, [3, 9, 5])
    state = _runner(device).prepare(BATCH, meta)
    assert [c.attn_metadata.query_start_loc_cpu.tolist() for c in state.forward_contexts] == [
        [0, 3, 6],
        [0, 1, 6],
    ]


def test_a_failing_ubatch_ends_the_run_with_vllms_words_and_no_hang(device):
    def model(input_ids, positions):
        if dbo.dbo_current_ubatch_id() == 1:
            raise KeyError("expert 7")
        dbo.dbo_yield()
        return input_ids

    runner = _runner(device)
    with pytest.raises(RuntimeError, match="Microbatch 1 of 2 failed"):
        runner.run(model, _inputs(), runner.prepare(BATCH))


def test_the_compute_sms_are_reserved_only_while_the_run_lasts(device):
    seen = []
    runner = _runner(device, comm_sms=32)
    runner.run(
        lambda input_ids, positions: seen.append(device.dbo_gemm_sms) or input_ids,
        _inputs(),
        runner.prepare(BATCH),
    )
    assert seen == [device.profile.num_sms - 32] * 2 and device.dbo_gemm_sms is None


def test_abort_pending_run_gives_back_the_sms_and_a_new_run_works(device):
    runner = _runner(device, comm_sms=32)
    state = runner.prepare(BATCH)
    runner.begin_capturable_run(_model, _inputs(), state, for_capture=True)
    runner.abort_pending_run()
    assert device.dbo_gemm_sms is None
    assert runner.run(_model, _inputs(), state).shape == (12,)


def test_a_finished_runs_callback_refuses_a_second_call(device):
    runner = _runner(device)
    finish = runner.begin_capturable_run(_model, _inputs(), runner.prepare(BATCH))
    finish()
    with pytest.raises(RuntimeError, match="already finished or was aborted"):
        finish()


def test_a_second_run_is_refused_while_one_is_pending(device):
    runner = _runner(device)
    state = runner.prepare(BATCH)
    runner.begin_capturable_run(_model, _inputs(), state)
    with pytest.raises(RuntimeError, match="a run is still pending"):
        runner.begin_capturable_run(_model, _inputs(), state)
    runner.abort_pending_run()


def test_a_capture_run_issues_on_the_capture_stream(device):
    streams = []
    runner = _runner(device)
    finish = runner.begin_capturable_run(
        lambda input_ids, positions: streams.append(dbo.current_stream()) or input_ids,
        _inputs(),
        runner.prepare(BATCH),
        for_capture=True,
    )
    finish()
    assert streams == [runner.capture_stream] * 2


def test_a_state_for_another_ubatch_count_is_refused(device):
    runner = _runner(device)
    state = runner.prepare(BATCH)
    with pytest.raises(ValueError, match="this runner runs 2"):
        runner.run(_model, _inputs(), UBatchState(state.slices * 2, state.forward_contexts * 2))


def test_a_config_with_ubatching_off_is_refused(device):
    with pytest.raises(ValueError, match="needs ubatching on"):
        UBatchRunner(DBOConfig(use_ubatching=False), device)
