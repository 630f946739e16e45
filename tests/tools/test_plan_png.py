"""plan.png shows the answer, not only the curves: the chosen threshold marked on its phase,
a note where DBO never pays, and the setup planned for in the title."""

from __future__ import annotations

from scenarios.tools.plan_output import PhaseAnswer, PlanPoint, gain_figure

SETUP = "deepseek-v3 on h800 (kernels: derived), EP 64 (8 node(s) of 8), placement contiguous"


def point(phase: str, tokens: int, n: int, gain: float) -> PlanPoint:
    return PlanPoint(phase, 64, "balanced", tokens, n, 1000.0, gain, 0, 0.0, 0.0, tokens, 0.0, True)


POINTS = [
    point(phase, t, n, gain)
    for phase, gains in (("decode", (-5.0, 3.0, 12.0)), ("prefill", (-9.0, -4.0, -1.0)))
    for t, gain in zip((64, 128, 256), gains)
    for n, gain in ((1, 0.0), (2, gain))
]
ANSWERS = [
    PhaseAnswer("decode", 64, "balanced", 128, 2, 12.0, 256),
    PhaseAnswer("prefill", 64, "balanced", None, None, -1.0, 256),
]


def panel(fig, phase: str):
    return next(ax for ax in fig.axes if ax.get_title() == phase)


def test_the_title_names_the_setup():
    fig = gain_figure(POINTS, ANSWERS, SETUP)
    assert " ".join(fig.get_suptitle().split()) == SETUP


def test_the_chosen_threshold_is_marked_on_its_phase():
    ax = panel(gain_figure(POINTS, ANSWERS, SETUP), "decode")
    marks = [line for line in ax.lines if "threshold" in line.get_label()]
    assert len(marks) == 1
    assert list(marks[0].get_xdata()) == [128, 128]
    assert "128 tokens, 2 ubatches" in marks[0].get_label()


def test_a_phase_where_dbo_never_pays_says_so():
    ax = panel(gain_figure(POINTS, ANSWERS, SETUP), "prefill")
    assert not [line for line in ax.lines if "threshold" in line.get_label()]
    assert any("does not pay" in text.get_text() for text in ax.texts)
