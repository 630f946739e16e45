"""What a `plan` answer says about where it stands: the crossover even when it lies outside
the given range, the replay's known error beside the gain, and memory, in text and JSON."""

from __future__ import annotations

import json

import pytest

from scenarios.cli import main


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_ep32_prefill_answer_is_the_crossover_not_the_range_edge(capsys):
    argv = ["plan", "--phase", "prefill", "--ep", "32", "--skew", "balanced"]
    assert main([*argv, "--ubatches", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (answer,) = doc["answers"]
    threshold = answer["pays_from"]
    assert threshold is not None and threshold < 2048  # the default range starts at 2048
    gains = {p["tokens"]: p["gain_pct"] for p in doc["points"] if p["num_ubatches"] == 2}
    assert gains[threshold // 2] <= 0 < gains[threshold]
    assert "range extended down from 2048" in answer["range_note"]
    assert f"--dbo-prefill-token-threshold {threshold}" in doc["flags"][0]


@pytest.fixture
def small_config(tmp_path):
    path = tmp_path / "small.json"
    path.write_text('{"num_layers": 4, "num_dense_layers": 1}')
    return str(path)


@pytest.mark.timeout(600)
def test_the_gain_is_printed_beside_the_replays_error_on_the_nearest_rows(small_config, capsys):
    argv = ["plan", "--config", small_config, "--ep", "64", "--phase", "decode"]
    assert main([*argv, "--tokens", "128,256", "--ubatches", "2", "--skew", "balanced"]) == 0
    out = capsys.readouterr().out
    assert "; replay off by up to " in out and "DeepEP LL" in out and " pp on SGLang" in out


@pytest.mark.timeout(600)
def test_json_answers_carry_their_range_memory_and_error_bars(small_config, capsys):
    argv = ["plan", "--config", small_config, "--ep", "64", "--phase", "decode", "--json"]
    assert main([*argv, "--tokens", "128,512", "--ubatches", "2", "--skew", "balanced"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (answer,) = doc["answers"]
    assert {"range_note", "unfit_tokens", "error_bars"} <= set(answer)
    assert [b["unit"] for b in answer["error_bars"]] == ["%", "pp"]
    assert all("fits" in p and p["memory_gb"] > 0 for p in doc["points"])
