"""The sweep's header describes the prefill points it actually runs."""

from __future__ import annotations

import pytest

from scenarios.cli import main
from scenarios.tools import sweep_run


@pytest.fixture
def no_points(monkeypatch):
    """The header is printed before any point runs; skip the points themselves."""
    monkeypatch.setattr(sweep_run, "run_sweep", lambda *args, **kwargs: [])


def _header(capsys) -> str:
    return capsys.readouterr().out.splitlines()[0]


def test_the_sweep_header_says_a_small_prefill_point_is_one_prompt_of_its_tokens(
    capsys, tmp_path, no_points
):
    assert main(["sweep", "--prefill", "2", "--out", str(tmp_path)]) == 0
    header = _header(capsys)
    assert "prefill: one 2-token prompt" in header and "4096-token" not in header


def test_the_sweep_header_tells_single_prompt_points_from_split_ones(capsys, tmp_path, no_points):
    assert main(["sweep", "--prefill", "2048", "8192", "--out", str(tmp_path)]) == 0
    assert _header(capsys).endswith(
        "prefill: one 2048-token prompt; 4096-token prompts at 8192 tokens"
    )


def test_the_prefill_description_matches_the_prompts_each_point_holds():
    assert sweep_run.prefill_prompts(2) == [2]
    assert sweep_run.prefill_prompts(5000) == [4096, 904]
    assert sweep_run.describe_prefill([1024, 2048]) == "one prompt per point at 1024, 2048 tokens"
    assert sweep_run.describe_prefill([5000]) == (
        "4096-token prompts (the last one shorter where the count is not a multiple) at 5000 tokens"
    )
    starts = sweep_run._batch("prefill", 5000, 0).query_start_loc
    assert [starts[i + 1] - starts[i] for i in range(len(starts) - 1)] == [4096, 904]
