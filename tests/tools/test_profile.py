"""The profiler's whole sequence on the simulated device, up to its CUDA calls: record a model's
ops through the interceptor, reduce them to distinct kernels, materialize real inputs, time
them (a virtual timer here), write a table the simulator loads; and host costs from traces."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from dbo.sim import SimDevice
from dbo.sim.cost import OpCall, add_op_observer, remove_op_observer
from dbo.sim.options import SimOptions
from dbo.sim.tables import load_table
from scenarios.cli import main as cli_main
from scenarios.lib.choices import DECODE_CONTEXT, PREFILL_REQUESTS
from scenarios.lib.configs import check_cases, plan_cases
from scenarios.model import Batch
from scenarios.tools import profile_run

pytestmark = pytest.mark.timeout(120)

CONFIG = check_cases(1)[0].config.with_(
    hidden=256, num_heads=4, head_dim=64, num_experts=8, top_k=2, moe_inter=128
)


def sim_timer(call: OpCall) -> float:
    """The virtual time of one call on a fresh simulated H200 (inputs materialized on the CPU)."""
    args, kwargs = profile_run.materialize(call, "cpu")
    device = SimDevice(SimOptions("h200", tensor_device="meta"))
    meta_args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    with device.thread_scope(None):
        call.func(
            *meta_args,
            **{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
        )
    return sum(r.dur_us for r in device.timeline)


@pytest.fixture(scope="module")
def calls() -> list[OpCall]:
    return profile_run.record_calls(CONFIG, Batch.prefill(2, 64), "ht") + profile_run.record_calls(
        CONFIG, Batch.decode(16, 64), "ll", num_ubatches=2
    )


def test_recording_sees_every_kernel_family_the_model_issues(calls: list[OpCall]) -> None:
    rows = [profile_run.table_row(c, 1.0) for c in profile_run.distinct_calls(calls)]
    ops = {r["op"] for r in rows}
    assert {
        "mm",
        "grouped_mm",
        "sdpa_causal",
        "sdpa_decode",
        "copy",
        "add",
        "index_select",
        "index_add",
    } <= ops
    assert "router_softmax_topk256" in ops  # the router's top-k and the sort of its experts


def test_distinct_calls_keep_one_call_per_shape(calls: list[OpCall]) -> None:
    distinct = profile_run.distinct_calls(calls)
    assert len(distinct) < len(calls)
    keys = [profile_run._key(c) for c in distinct]
    assert len(set(keys)) == len(keys)


def test_materialized_inputs_are_valid_for_the_op(calls: list[OpCall]) -> None:
    for call in profile_run.distinct_calls(calls):
        if call.name not in ("aten::index_select", "aten::index_add_", "aten::mm", "aten::copy_"):
            continue
        args, kwargs = profile_run.materialize(call, "cpu")
        assert all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))
        call.func(*args, **kwargs)  # indices in range, shapes consistent: it runs


def test_grouped_gemm_offsets_are_even_group_ends(calls: list[OpCall]) -> None:
    grouped = next(c for c in calls if c.name == "aten::_grouped_mm")
    args, _ = profile_run.materialize(grouped, "cpu")
    offs = args[2]
    rows, groups = grouped.ins[0].shape[0], grouped.ins[1].shape[0]
    assert offs.tolist() == [rows * (g + 1) // groups for g in range(groups)]


def test_a_written_table_loads_and_prices_the_profiled_shapes(
    calls: list[OpCall], tmp_path
) -> None:
    rows = profile_run.profile_calls(calls, sim_timer)
    path = profile_run.write_table(rows, tmp_path / "mine.csv")
    table = load_table(str(path))
    mm = next(r for r in rows if r["op"] == "mm")
    assert table.estimate("mm", m=mm["m"], n=mm["n"], k=mm["k"]) == pytest.approx(
        mm["us"], rel=1e-3
    )
    device = SimDevice(SimOptions(profile_from_table(str(path)), tensor_device="meta"))
    a = torch.empty(mm["m"], mm["k"], dtype=torch.bfloat16, device="meta")
    b = torch.empty(mm["k"], mm["n"], dtype=torch.bfloat16, device="meta")
    with device.thread_scope(None):
        a @ b
    assert device.timeline[0].args["cost"] == "table:mm"


def profile_from_table(path: str):
    from dataclasses import replace

    from dbo.sim import H100

    return replace(H100, name="mine", kernel_table=path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the profiler would run")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path, capsys) -> None:
    out = tmp_path / "x.csv"
    assert cli_main(["profile", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dbo-sim: no CUDA GPU present: nothing to time")
    assert not out.exists()


def _trace(path, events) -> str:
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def test_host_costs_from_traces_follow_the_stated_rules(tmp_path) -> None:
    def launch(ts: int, tid: int = 1) -> dict:
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": tid}

    def op(name: str, ts: int, dur: int) -> dict:
        return {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": 1}

    serial = [
        op("aten::add", 0, 20),
        launch(5),
        op("aten::view", 30, 4),  # a view: no launch, Python time
        op("aten::mm", 40, 60),
        launch(50),
        op("aten::add", 110, 20),
        launch(115),
    ]
    # two ubatch threads: same-thread launches 10 us apart, switches 50 us apart
    dbo_events = [
        launch(t, tid) for t, tid in ((0, 7), (10, 7), (60, 8), (70, 8), (120, 7), (130, 7))
    ]
    host = profile_run.host_costs_from_traces(
        [_trace(tmp_path / "s-serial.json.gz", serial)],
        [_trace(tmp_path / "s-dbo.json.gz", dbo_events)],
        bare_op_us=5.0,
    )
    factor = 5.0 / 20.0
    assert host["profiler_factor"] == pytest.approx(factor)
    assert host["launch_us"] == pytest.approx(factor * 20.0)
    assert host["host_op_scale"] == {"elementwise": 1.0, "gemm": 3.0}
    gaps = (30 - 20) + (40 - 34) + (110 - 100)
    assert host["python_us"] == pytest.approx((gaps + factor * 4) / 3, abs=0.01)
    assert host["handoff_us"] == pytest.approx(50 - 10)


def test_host_from_trace_needs_the_bare_op_time(tmp_path, capsys) -> None:
    assert (
        cli_main(
            [
                "profile",
                "--host-from-trace",
                str(tmp_path / "a.json.gz"),
                "--out",
                str(tmp_path / "t.csv"),
            ]
        )
        == 2
    )
    assert "--bare-op-us" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the profiler would run")
def test_dbo_sim_profile_passes_its_arguments_to_the_tool(tmp_path, capsys) -> None:
    assert cli_main(["profile", "--out", str(tmp_path / "x.csv"), "--layers", "1"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def _kernel(name: str, ts: float, dur: float, tid: int, grid=(1, 1, 1)) -> dict:
    return {
        "cat": "kernel",
        "name": name,
        "ts": ts,
        "dur": dur,
        "tid": tid,
        "args": {"grid": list(grid), "block": [128, 1, 1]},
    }


def test_overlap_rates_come_from_kernels_slowed_beside_another_stream(tmp_path) -> None:
    compute, comm = 7, 9  # the compute stream issues the most kernels
    events = [
        _kernel("gemm", 0, 100, compute),  # solo
        _kernel("add", 110, 5, compute),  # solo
        _kernel("gemm", 200, 150, compute),  # shares [250, 350] with the scatter
        _kernel("scatter", 250, 100, comm),
        _kernel("scatter", 500, 60, comm),  # solo
        _kernel("gemm", 600, 40, compute, grid=(2, 1, 1)),  # other grid: not the gemm's solo
        _kernel("gather", 620, 30, comm),  # no solo time of its own: left out
    ]
    rates = profile_run.overlap_rates_from_traces([_trace(tmp_path / "p-dbo.json.gz", events)])
    # gemm: 50 us over its 100 us solo time in 100 us shared -> 0.5; scatter: 40 over 60 -> 0.6
    assert rates["overlap_rates"] == {"compute": 0.5, "full_grid": 0.6}
    assert rates["overlap_kernels"] == 2


def test_overlap_rates_take_the_largest_solo_time_not_above_the_kernel(tmp_path) -> None:
    events = [
        _kernel("gemm", 0, 100, 7),
        _kernel("gemm", 110, 300, 7),  # two shapes, both solo
        _kernel("gemm", 500, 150, 7),
        _kernel("scatter", 550, 100, 9),  # shares 100 us
        _kernel("scatter", 700, 80, 9),
        _kernel("add", 800, 1, 7),
    ]
    rates = profile_run.overlap_rates_from_traces([_trace(tmp_path / "q-dbo.json.gz", events)])
    assert rates["overlap_rates"]["compute"] == pytest.approx(1 - (150 - 100) / 100)


def test_traces_without_kernels_side_by_side_give_no_overlap_rates(tmp_path) -> None:
    events = [_kernel("gemm", 0, 100, 7), _kernel("scatter", 100, 50, 9)]
    assert profile_run.overlap_rates_from_traces([_trace(tmp_path / "d-dbo.json.gz", events)]) == {}


# -- which model is recorded ------------------------------------------------------------------


def test_a_preset_is_recorded_with_the_overrides_given() -> None:
    (case,) = plan_cases("tiny", hidden=32, experts=16, top_k=2, layers=1, tokens=8, mode="decode")
    c = case.config
    assert (c.name, c.hidden, c.num_experts, c.top_k, c.num_layers) == ("tiny", 32, 16, 2, 1)
    assert c.dtype == torch.bfloat16  # tiny's float64 is for CPU value checks
    assert (case.mode, case.batch) == ("ll", Batch.decode(8, DECODE_CONTEXT))


def test_by_default_gpu_checks_model_and_batches_are_recorded() -> None:
    expected = [(c.mode, c.batch, c.config.with_(num_layers=1)) for c in check_cases(1)]
    assert [(c.mode, c.batch, c.config) for c in plan_cases()] == expected


def test_the_default_layers_reach_the_first_moe_layer() -> None:
    (case,) = plan_cases("deepseek-v3", mode="prefill", tokens=64)
    assert case.config.num_layers == case.config.num_dense_layers + 1
    assert case.batch == Batch.prefill(PREFILL_REQUESTS, 16)


def test_the_recorded_calls_follow_the_chosen_configuration() -> None:
    cases = plan_cases("tiny", hidden=32, experts=16, top_k=2, layers=1, tokens=8, mode="decode")
    rows = [
        profile_run.table_row(c, 1.0)
        for c in profile_run.distinct_calls(profile_run.model_calls(cases))
    ]
    rows = [r for r in rows if r is not None]
    ops = {r["op"] for r in rows}
    assert "sdpa_decode" in ops and "sdpa_causal" not in ops  # decode only
    grouped = [r for r in rows if r["op"] == "grouped_mm"]
    assert grouped and all(r["groups"] == 16 // 8 for r in grouped)  # experts per EP rank
    assert all(32 in (r["n"], r["k"]) for r in grouped)  # the hidden size given
    assert {r["dtype"] for r in rows if r["op"] == "mm"} == {"bf16"}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--config", "tiny2"], "unknown --config 'tiny2'; choose one of gpu-check, deepseek-v3"),
        (["--experts", "0"], "--experts must be >= 1"),
        (["--config", "tiny", "--top-k", "9"], "--top-k 9 exceeds the 8 experts"),
        (["--tokens", "6", "--mode", "prefill"], "multiple of 4"),
    ],
)
def test_bad_model_options_are_refused_before_any_work(argv, says, tmp_path, capsys) -> None:
    out = tmp_path / "x.csv"
    assert cli_main(["profile", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert says in err and "no CUDA GPU" not in err
    assert not out.exists()


def test_a_models_own_ops_observed_on_the_simulator_profile_into_rows() -> None:
    # The module docstring's recipe for a model that is not a ModelConfig.
    device = SimDevice(SimOptions("h200", tensor_device="meta"))
    x = torch.empty(64, 128, dtype=torch.bfloat16, device="meta")
    w = torch.empty(128, 256, dtype=torch.bfloat16, device="meta")
    calls: list[OpCall] = []
    add_op_observer(calls.append)
    try:
        with device.thread_scope(None):
            torch.relu(x @ w)
    finally:
        remove_op_observer(calls.append)
    rows = profile_run.profile_calls(calls, sim_timer)
    assert ("mm", 64, 256, 128) in [(r["op"], r["m"], r["n"], r["k"]) for r in rows]
