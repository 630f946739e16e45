"""The hostile inputs to `dbo-sim plan` and `dbo-sim analyze`, as data: argv, the files the
argv names, and what must happen (refused with exit 2, or answered with exit 0).

`{dir}` in an argv item is the case's own temporary folder, where its files are written.
A case marked `heavy` gets past the checks that need no torch (the model, the profile, a
trace's contents), so its process imports torch; every other case must be refused before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from malformed_trace import MALFORMED, trace_text  # tests/, on the path through its conftest

REFUSED, ANSWERED = 2, 0


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    status: int = REFUSED
    files: dict[str, str] = field(default_factory=dict)
    heavy: bool = False
    says: str = ""  # a phrase the answer (exit 0: stdout) or refusal (stderr) must hold


_NESTED = 200_000
_DEEP_JSON = "[" * _NESTED + "]" * _NESTED


def _plan(case_id: str, *argv: str, files: dict[str, str] | None = None, **kw: Any) -> Case:
    return Case(f"plan-{case_id}", ("plan", *argv), files=files or {}, **kw)


def _analyze(case_id: str, *argv: str, files: dict[str, str] | None = None, **kw: Any) -> Case:
    return Case(f"analyze-{case_id}", ("analyze", *argv), files=files or {}, **kw)


_SKEWS = [
    "zipf:nan",
    "zipf:inf",
    "zipf:-inf",
    "zipf:-1",
    "zipf:1e308",
    "zipf:",
    "zipf",
    "zipf:0x10",
    "zipf:1_0",
    "zipf:\u0661",
    "zipf:NaN",
    "zipf:Infinity",
    "dirichlet:inf",
    "dirichlet:nan",
    "dirichlet:0",
    "dirichlet:-1",
    "dirichlet:1e400",
    "balanced:1",
    ",",
    ",,",
    "balanced,",
    " ",
    "",
    "pareto:1",
    "ZIPF:1",
]
_TOKENS = [
    "0:10",
    "0",
    "-1",
    "1e3",
    "16:8",
    "16:",
    ":16",
    "16:32:64",
    "123456789012345678901234567890",
    "nan",
    "inf",
    "16,,32",
    ",",
    "",
    "\u00b2",
    "\u0661\u0666",
    "16.5",
    "1:2000000",
    "2000000",
    ",".join(str(16 + i) for i in range(40)),
]
_EPS = ["1", "0", "-8", ",", "", "nan", "8,", "5000", "\u00b2", "64.0"]
_UBATCHES = ["5", "1", "0", ",", "2,,3", "nan", "\u00b2"]
_PLACEMENTS = [
    "eplb:",
    "eplb:\u00b2",
    "eplb:-1",
    "eplb:99999999999999",
    "eplb:1e3",
    "eplb:nan",
    "round-robin",
    "eplb",
    "contiguous:1",
    "eplb:\u0663",
]
_SEEDS = ["-1", "nan", "1e3", "99999999999999999999", "\u00b2"]
_SPREADS = ["nan", "inf", "-0.1", "1", "1e308", "x", "-inf"]
_GPUS = ["0", "-1", "nan", "1e9"]

_HISTOGRAMS = {
    "nan-csv": ("h.csv", "nan,1,2,3\n"),
    "inf-csv": ("h.csv", "inf,1,2,3\n"),
    "1e308-csv": ("h.csv", "1e308,1e308,1e308\n"),
    "negative-csv": ("h.csv", "-1,2,3\n"),
    "words-csv": ("h.csv", "a,b\nc,d\n"),
    "ragged-csv": ("h.csv", "1,2,3\n1,2\n"),
    "empty-csv": ("h.csv", ""),
    "zero-row-csv": ("h.csv", "0,0,0\n"),
    "nested-json": ("h.json", _DEEP_JSON),
    "object-json": ("h.json", '{"counts": [[1, 2]]}'),
    "tokens-string-json": ("h.json", '{"tokens": "abc"}'),
    "number-json": ("h.json", "7"),
    "nan-json": ("h.json", "[[NaN, 1, 2]]"),
    "infinity-json": ("h.json", "[[Infinity, 1, 2]]"),
    "huge-json": ("h.json", "[[1e16, 1, 2]]"),
    "bools-json": ("h.json", "[[true, false]]"),
    "not-json": ("h.json", "[[1, 2"),
}
_CONFIGS = {
    "num-experts-0": '{"num_experts": 0}',
    "hidden-0": '{"hidden": 0}',
    "top-k-0": '{"top_k": 0}',
    "unknown-key": '{"num_expert": 64}',
    "hidden-string": '{"hidden": "big"}',
    "hidden-float": '{"hidden": 1.5}',
    "hidden-true": '{"hidden": true}',
    "hidden-null": '{"hidden": null}',
    "hidden-1e9": '{"hidden": 1000000000}',
    "layers-negative": '{"num_layers": -1}',
    "layers-a-million": '{"num_layers": 1048576}',
    "experts-a-million": '{"num_experts": 1048576, "top_k": 1}',
    "dtype-unknown": '{"dtype": "bfloat17"}',
    "dtype-number": '{"dtype": 5}',
    "bytes-nan": '{"dispatch_bytes_per_elem": NaN}',
    "bytes-infinity": '{"combine_bytes_per_elem": Infinity}',
    "attention-gqa": '{"attention": "gqa"}',
    "a-list": "[1, 2]",
    "nested": _DEEP_JSON,
    "not-json": "{num_experts: 8}",
    "empty": "",
}


def plan_cases() -> list[Case]:
    cases = [_plan(f"skew-{i}", "--skew", s) for i, s in enumerate(_SKEWS)]
    cases += [_plan(f"tokens-{i}", "--tokens", t) for i, t in enumerate(_TOKENS)]
    cases += [_plan(f"ep-{i}", "--ep", e) for i, e in enumerate(_EPS)]
    cases += [_plan(f"ubatches-{i}", "--ubatches", u) for i, u in enumerate(_UBATCHES)]
    cases += [_plan(f"placement-{i}", "--placement", p) for i, p in enumerate(_PLACEMENTS)]
    cases += [_plan(f"seed-{i}", "--seed", s, "--dp-spread", "0.5") for i, s in enumerate(_SEEDS)]
    cases += [_plan(f"dp-spread-{i}", "--dp-spread", s) for i, s in enumerate(_SPREADS)]
    cases += [_plan(f"gpus-{i}", "--gpus-per-node", g) for i, g in enumerate(_GPUS)]
    cases += [
        _plan(f"histogram-{k}", "--histogram", f"{{dir}}/{name}", files={name: text})
        for k, (name, text) in _HISTOGRAMS.items()
    ]
    cases += [
        _plan(f"config-{k}", "--config", "{dir}/c.json", files={"c.json": text})
        for k, text in _CONFIGS.items()
    ]
    cases += [
        _plan("histogram-missing", "--histogram", "{dir}/nope.csv"),
        _plan("histogram-folder", "--histogram", "{dir}"),
        _plan("config-missing", "--config", "{dir}/nope.json"),
        _plan("dp-3", "--dp", "3"),
        _plan("dp-nan", "--dp", "nan"),
        _plan("phase-train", "--phase", "train"),
        _plan("out-under-proc", "--out", "/proc/dbo-sim-plan"),
        _plan("out-a-file", "--out", "{dir}/f", files={"f": "x"}),
        _plan(
            "too-many-points",
            "--ep",
            "8,16,32,64",
            "--skew",
            "balanced,zipf:0.1,zipf:0.2,zipf:0.3,zipf:0.4,zipf:0.5",
            "--tokens",
            "1:1048576",
        ),
    ]
    return cases + _plan_heavy_cases()


_TINY = ("--preset", "tiny", "--ep", "2", "--phase", "decode", "--tokens", "4", "--ubatches", "2")


def _plan_heavy_cases() -> list[Case]:
    return [
        _plan("ep-not-dividing", "--ep", "72", heavy=True, says="does not divide"),
        _plan("preset-unknown", "--preset", "gpt-9", heavy=True, says="unknown preset"),
        _plan("profile-unknown", "--profile", "h999", heavy=True, says="profile"),
        _plan(
            "config-top-k-above-experts",
            "--config",
            "{dir}/c.json",
            files={"c.json": '{"top_k": 300}'},
            heavy=True,
            says="top_k",
        ),
        _plan(
            "config-one-moe-layer",
            "--config",
            "{dir}/c.json",
            files={"c.json": '{"num_layers": 4}'},
            heavy=True,
            says="MoE layer",
        ),
        _plan(
            "histogram-wrong-shape",
            "--histogram",
            "{dir}/h.csv",
            files={"h.csv": "1,2,3\n"},
            heavy=True,
            says="experts per row",
        ),
        _plan("tiny-float64-refused", *_TINY, heavy=True, says="cannot be recorded on meta"),
        _plan(
            "tiny-json-answered",
            *_TINY,
            "--skew",
            "balanced,zipf:0.5",
            "--json",
            "--out",
            "{dir}/o",
            "--config",
            "{dir}/c.json",
            files={"c.json": '{"dtype": "bfloat16"}'},
            status=ANSWERED,
            heavy=True,
            says='"flags"',
        ),
    ]


def analyze_cases() -> list[Case]:
    trace = {"t.json": trace_text()}
    cases = [
        _analyze("missing-file", "{dir}/nope.json"),
        _analyze("a-folder", "{dir}"),
        _analyze("steps-0", "{dir}/t.json", "--steps", "0", files=trace),
        _analyze("steps-negative", "{dir}/t.json", "--steps", "-1", files=trace),
        _analyze("steps-huge", "{dir}/t.json", "--steps", "100000000", files=trace),
        _analyze("steps-nan", "{dir}/t.json", "--steps", "nan", files=trace),
        _analyze("step-word", "{dir}/t.json", "--step", "last", files=trace),
        _analyze("out-under-proc", "{dir}/t.json", "--out", "/proc/dbo-sim-x", files=trace),
        _analyze("against-missing", "{dir}/t.json", "--against", "{dir}/s.json", files=trace),
        _analyze("against-sim-no-mode", "{dir}/t.json", "--against-sim", "gpu-check", files=trace),
        _analyze("sim-tokens-0", "{dir}/t.json", "--sim-tokens", "0", files=trace),
        _analyze("sim-tokens-nan", "{dir}/t.json", "--sim-tokens", "nan", files=trace),
        _analyze("no-trace-argument"),
    ]
    return cases + _analyze_heavy_cases()


def _analyze_heavy_cases() -> list[Case]:
    every = {"t.json": trace_text(*MALFORMED.values())}
    deep = {
        "t.json": trace_text().replace(
            '"traceEvents": [', '"traceEvents": [' + "[" * 100_000 + "]" * 100_000 + ","
        )
    }
    return [
        _analyze(
            "every-malformed-event",
            "{dir}/t.json",
            "--no-artifacts",
            files=every,
            status=ANSWERED,
            heavy=True,
            says=f"skipped {len(MALFORMED)} malformed",
        ),
        _analyze(
            "nested-100000",
            "{dir}/t.json",
            "--no-artifacts",
            files=deep,
            heavy=True,
            says="nested too deeply",
        ),
        _analyze(
            "steps-above-ops",
            "{dir}/t.json",
            "--steps",
            "50",
            "--no-artifacts",
            files={"t.json": trace_text()},
            heavy=True,
            says="cannot cut",
        ),
        _analyze(
            "window-garbage",
            "{dir}/t.json",
            "--window",
            "a:b",
            "--no-artifacts",
            files={"t.json": trace_text()},
            heavy=True,
            says="--window",
        ),
        _analyze(
            "tiny-json-answered",
            "{dir}/t.json",
            "--json",
            "--out",
            "{dir}/o",
            files={"t.json": trace_text()},
            status=ANSWERED,
            heavy=True,
            says='"steps"',
        ),
    ]


CASES = plan_cases() + analyze_cases()
