"""`dbo-sim plan`'s command line checked whole before torch loads: every number finite and in
range, no empty list item, bounded ranges and counts, configuration and histogram files read
field by field; and what the verb prints with --json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dbo.sim import H200
from scenarios.cli import build_parser
from scenarios.lib.usage import UsageError
from scenarios.model_config import config_changes
from scenarios.tools.plan_args import check_histogram, parse_args, parse_tokens
from scenarios.tools.plan_output import PhaseAnswer, report

ROOT = Path(__file__).resolve().parents[2]


def plan_args(*argv: str):
    return parse_args(build_parser(["plan"]).parse_args(["plan", *argv]))


def refusal(*argv: str) -> str:
    with pytest.raises(UsageError) as refused:
        plan_args(*argv)
    return str(refused.value)


@pytest.mark.parametrize("skew", ["zipf:nan", "zipf:inf", "dirichlet:inf", "dirichlet:nan"])
def test_a_non_finite_skew_is_refused(skew):
    assert "expected a number" in refusal("--skew", skew)


@pytest.mark.parametrize("count", ["nan", "inf", "1e308"])
def test_a_histogram_with_a_non_finite_or_huge_count_is_refused(tmp_path, count):
    path = tmp_path / "h.csv"
    path.write_text(f"{count},1,2\n")
    with pytest.raises(UsageError, match="is not a token count"):
        check_histogram(path)


@pytest.mark.parametrize("flag", ["--skew", "--ep", "--ubatches", "--tokens"])
def test_an_empty_item_in_a_comma_list_is_refused(flag):
    assert "an empty item" in refusal(flag, ",")


def test_a_token_range_from_zero_is_refused():
    assert "--tokens '0:10'" in refusal("--tokens", "0:10")


def test_a_token_range_doubles_to_a_bounded_count():
    assert len(parse_tokens("1:1048576")) == 21


def test_a_redundant_expert_count_is_bounded_up_front():
    assert "N in 0..4096" in refusal("--placement", "eplb:99999999999999")


@pytest.mark.parametrize("argv", [("--placement", "eplb:\u00b2"), ("--tokens", "\u0661\u0666")])
def test_digits_of_other_scripts_are_not_numbers(argv):
    assert "give" in refusal(*argv)


def test_a_thirty_digit_token_count_is_refused():
    assert "1..1048576" in refusal("--tokens", "1" * 30)


def test_a_negative_seed_is_refused(capsys):
    with pytest.raises(SystemExit):
        plan_args("--seed", "-1", "--dp-spread", "0.5")
    assert "--seed: must be between 0" in capsys.readouterr().err


def test_an_ep_group_of_one_rank_is_refused_saying_why():
    assert "one rank has no all-to-all" in refusal("--ep", "1")


@pytest.mark.parametrize("field", ["num_experts", "hidden", "top_k"])
def test_a_config_size_of_zero_is_refused_naming_the_field(field):
    with pytest.raises(ValueError, match=f"field '{field}': give a whole number in 1.."):
        config_changes({field: 0})


def test_an_unknown_config_field_is_named_without_python_internals():
    with pytest.raises(ValueError) as refused:
        config_changes({"num_expert": 64})
    assert "unknown field(s) 'num_expert'" in str(refused.value)
    assert "__init__" not in str(refused.value)


def test_a_dtype_given_as_a_name_is_accepted():
    import torch

    from scenarios.model_presets import preset, torch_dtypes

    changes = config_changes({"dtype": "bfloat16", "weight_dtype": "torch.float16"})
    config = preset("tiny", **torch_dtypes(changes))
    assert config.dtype is torch.bfloat16 and config.weight_dtype is torch.float16


def test_a_histogram_nested_200000_deep_is_refused(tmp_path):
    path = tmp_path / "h.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(UsageError, match="nested too deeply"):
        check_histogram(path)


def test_json_flags_are_the_answers_not_the_last_skews():
    answers = [
        PhaseAnswer("decode", 8, "balanced", None, None, -5.0, 16),
        PhaseAnswer("decode", 8, "zipf:0.5", 64, 2, 12.0, 64),
    ]
    inputs = SimpleNamespace(eps=[8], skews=["balanced", "zipf:0.5"], profile=H200)
    document = json.loads(report(inputs, answers, [], {}, as_json=True))
    assert "leave it off" in document["flags"][0]


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.timeout(90)
def test_plan_help_and_a_refusal_do_not_import_torch():
    code = (
        "import sys\nfrom scenarios.cli import main\n"
        "assert main(['plan', '--ep', '1']) == 2\n"
        "try:\n    main(['plan', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    done = _fresh_python(code)
    assert done.stdout.strip().splitlines()[-1] == "False", done.stderr


def test_plan_help_says_its_whole_first_paragraph_and_what_phase_is(capsys):
    with pytest.raises(SystemExit):
        build_parser(["plan"]).parse_args(["plan", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "how does the answer move with expert- load skew?" in shown
    assert "--phase {decode,prefill,both} decode (DeepEP low-latency" in shown


def test_every_model_config_field_has_one_rule_for_configuration_files():
    from dataclasses import fields

    from scenarios import model_config as mc

    rules = [*mc.POSITIVE_SIZES, *mc.OPTIONAL_SIZES, *mc.BYTE_WIDTHS, *mc.NAMES, *mc.DTYPE_FIELDS]
    assert sorted(rules) == sorted(f.name for f in fields(mc.ModelConfig))
