"""Each `plan` answer carries the replay's measured error on the published rows nearest it."""

from __future__ import annotations

from scenarios.lib.fidelity_rows import FIDELITY_JSON, load_rows
from scenarios.tools.plan_errors import error_bars
from scenarios.tools.plan_output import PhaseAnswer, error_text


def _row(key: str, delta: float, unit: str = "%") -> dict:
    return {"key": key, "delta": delta, "delta_unit": unit, "what": key, "calibration": False}


ROWS = [
    _row("scale-deepep-ll-dispatch-ep8", 5.0),
    _row("scale-deepep-ll-combine-ep64", 96.0),
    _row("scale-deepep-ll-dispatch-ep64", -12.0),
    _row("scale-deepep-ll-combine-ep256", 215.0),
    _row("scale-sglang-decode-ep72-32", 27.0, "pp"),
    _row("scale-sglang-prefill-ep32", 13.0, "pp"),
    _row("deepep-ll-combine-ep64", 1.0),  # a one-rank row: not the replay plan runs
]


def test_a_decode_answer_gets_the_largest_miss_at_the_nearest_ep_size():
    kernels, gain = error_bars("decode", 100, ROWS)
    assert (kernels.row, kernels.delta, kernels.unit) == ("scale-deepep-ll-combine-ep64", 96.0, "%")
    assert (gain.row, gain.unit) == ("scale-sglang-decode-ep72-32", "pp")


def test_a_prefill_answer_gets_the_prefill_rows_only():
    assert [b.row for b in error_bars("prefill", 32, ROWS)] == ["scale-sglang-prefill-ep32"]


def test_without_a_stored_fidelity_run_the_answer_says_its_error_is_unknown(tmp_path):
    assert load_rows(tmp_path / "missing.json") == []
    a = PhaseAnswer("decode", 64, "balanced", 128, 2, 30.0, 512)
    assert "replay error unknown" in error_text(a)


def test_the_stored_fidelity_run_gives_both_phases_a_kernel_and_a_gain_error():
    rows = load_rows(FIDELITY_JSON)
    for phase in ("decode", "prefill"):
        assert [b.unit for b in error_bars(phase, 32, rows)] == ["%", "pp"]
