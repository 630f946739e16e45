"""Fidelity: DeepEP kernel times from the cost model, the reproduction table, the MLA model
path, and the GPU check's CPU half."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dbo.sim import H800, SimDevice
from dbo.sim.cost import aliased_input_bytes, flop_formula, node_dedup_share
from dbo.sim.options import SimOptions
from scenarios.catalog import TINY_DECODE, TINY_PREFILL
from scenarios.cli import build_parser
from scenarios.cli import main as cli_main
from scenarios.harness import RunOptions, compare_serial_dbo
from scenarios.lib.configs import CheckCase, check_cases
from scenarios.lib.simulate import simulate_step
from scenarios.model import Batch, MoEModel, preset
from scenarios.tools import fidelity_run, gpu_check_run
from scenarios.tools.fidelity_kernels import DEEPEP_BYTES
from scenarios.tools.fidelity_scale import deepep_normal_cluster_gbps
from workspace import init_workspace_manager, reset_workspace_manager

# Long-running (the fidelity rows): `make test-slow` (and CI) runs these.
pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

TINY_MLA = dict(
    attention="mla", q_lora_rank=32, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=4, v_head_dim=8
)


# -- DeepEP kernels: pure cost-model arithmetic (H800 profile) ---------------------------------


# DeepEP's EP 128 combine (369 us) sits above its EP 256 one (360 us), and the model, whose
# times grow with the group, already reads the EP 256 combine low: past the target at EP 128.
# Strict: the mark goes the day the miss does.
ABOVE_THE_LARGER_GROUP = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="DeepEP's EP 128 combine is above its EP 256 combine, which the model reads low",
)
LL_FIGURES = [
    pytest.param(kind, ep, marks=ABOVE_THE_LARGER_GROUP if (kind, ep) == ("combine", 128) else ())
    for ep in sorted(fidelity_run.DEEPEP_LL_PUBLISHED)
    for kind in ("dispatch", "combine")
]


@pytest.mark.parametrize(("kind", "ep"), LL_FIGURES)
def test_deepep_low_latency_times_within_10_percent(kind: str, ep: int) -> None:
    published = fidelity_run.DEEPEP_LL_PUBLISHED[ep][0 if kind == "dispatch" else 1]
    simulated = fidelity_run.deepep_ll_us(kind, ep, H800)
    assert simulated == pytest.approx(published, rel=0.10), (kind, ep, simulated, published)


def test_deepep_low_latency_time_is_latency_plus_bytes_over_the_right_link() -> None:
    # EP 8: one node, NVLink only; EP 64: 56 of 63 peers over RDMA, the slower link decides.
    copies = 128 * 8 * (7168 + 7168 // 128 * 4)
    nvl = H800.nvlink_gbps * 1e3 * H800.nvlink_efficiency
    rdma = H800.rdma_bytes_per_us("ll")
    assert fidelity_run.deepep_ll_us("dispatch", 8) == pytest.approx(
        H800.ll_latency_us + copies * 7 / 8 / nvl
    )
    assert fidelity_run.deepep_ll_us("dispatch", 64) == pytest.approx(
        H800.ll_latency_us + copies * 63 / 64 * 56 / 63 / rdma
    )


@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_deepep_normal_nvlink_bandwidth_within_10_percent(kind: str) -> None:
    simulated, _ = fidelity_run.normal_bandwidth_gbps(kind, 8, H800)
    assert simulated == pytest.approx(fidelity_run.DEEPEP_NVLINK_PUBLISHED[kind], rel=0.10)


@pytest.mark.parametrize("ep", [16, 32, 64])
def test_the_one_rank_rdma_bandwidth_counts_the_own_node_as_deepep_s_test_does(ep) -> None:
    # DeepEP counts one copy per (token, node), its own node included; so does the replay.
    # Over two nodes a token reaches both: leaving the own node out would read half.
    formula, counted = fidelity_run.normal_bandwidth_gbps("dispatch", ep, H800)
    # the formula's routing reaches every one of a token's top-4 node groups
    assert counted == pytest.approx(4096 * DEEPEP_BYTES["dispatch"] * min(ep // 8, 4))
    replay = deepep_normal_cluster_gbps("dispatch", ep, random=False)
    assert formula == pytest.approx(replay, rel=0.05)


def test_an_internode_figure_needs_whole_nodes() -> None:
    with pytest.raises(ValueError, match="whole number of 8-GPU nodes"):
        fidelity_run.normal_bandwidth_gbps("dispatch", 12, H800)


def test_node_dedup_share_for_deepseek_routing() -> None:
    # EP 32 = 4 nodes of 2 groups; top-4 of 8 groups: 1 - C(6,4)/C(8,4) of the nodes are reached
    # (3.14 of 4), 2.36 of them remote, against 6 remote expert copies.
    assert node_dedup_share(8, 32, 8, 8, 4) == pytest.approx(4 * (1 - 15 / 70) * 3 / 4 / 6)
    assert node_dedup_share(8, 8, 8) == 1.0  # one node: nothing to de-duplicate
    assert 0 < node_dedup_share(8, 72, 8, 8, 4) < 1


def test_comm_region_of_one_rank_is_its_own_ops_priced_like_any_op() -> None:
    d = SimDevice(SimOptions("h200"))
    x = torch.ones(1000, 250)  # 1e6 bytes
    with d.thread_scope(0):
        plain = x.clone()
        with d.comm_region("dispatch", nbytes=0, ep_size=1):
            y = x.clone()  # reads 1e6, writes 1e6
    clone, region = [r for r in d.timeline if r.name in ("aten::clone", "comm::dispatch")]
    assert region.bytes == clone.bytes == 2_000_000
    assert region.dur_us == pytest.approx(clone.dur_us)
    assert region.args["link"] == "local" and torch.equal(y, plain)


# -- cost-model details the MLA path relies on --------------------------------------------------


def test_causal_flash_attention_counts_the_triangle_and_mla_latent_once() -> None:
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k, v = (torch.empty(1, 4, 256, 64, **meta) for _ in range(3))
    func = torch.ops.aten._scaled_dot_product_flash_attention.default
    full = flop_formula(func)(q, k, v, 0.0, False, out_val=None)
    causal = flop_formula(func)(q, k, v, 0.0, True, out_val=None)
    assert causal == pytest.approx(full * 257 / 512)
    latent = torch.empty(2, 1, 100, 576, **meta)  # MLA: V is the first 512 of K's 576
    assert aliased_input_bytes(func, [q, latent, latent[..., :512]]) == 2 * 100 * 512 * 2
    assert aliased_input_bytes(func, [q, k, v]) == 0


def test_grouped_mm_has_a_flop_formula() -> None:
    a = torch.empty(96, 64, device="meta", dtype=torch.bfloat16)
    b = torch.empty(4, 64, 32, device="meta", dtype=torch.bfloat16)
    assert (
        flop_formula(torch.ops.aten._grouped_mm.default)(
            a, b, out_val=torch.empty(96, 32, device="meta")
        )
        == 2 * 96 * 64 * 32
    )


# -- the model: MLA, shared expert, dense layers --------------------------------------------------


def test_deepseek_preset_is_mla_with_a_latent_cache() -> None:
    c = preset("deepseek-v3")
    assert (c.attention, c.q_lora_rank, c.kv_lora_rank, c.qk_rope_dim, c.v_head_dim) == (
        "mla",
        1536,
        512,
        64,
        128,
    )
    assert (c.num_shared_experts, c.num_dense_layers, c.dense_inter) == (1, 3, 18432)
    model = MoEModel(c.with_(num_layers=4), Batch.decode(8, 100))
    assert model.kv[0].shape == (8 * 101, 512 + 64)  # one latent + rope key per token, all heads
    assert (
        "w_gate_up" in model.layers[0]
        and "router" in model.layers[3]
        and "ws_gate_up" in model.layers[3]
    )


def test_mla_absorbed_decode_equals_the_expanded_form() -> None:
    class Expanded(Batch):
        @property
        def is_decode(self) -> bool:
            return False

    config = preset("tiny", **TINY_MLA)
    batch = Batch.decode(5, 6)
    reset_workspace_manager()
    init_workspace_manager("cpu", 1)
    try:
        outs = []
        for b in (batch, Expanded(batch.query_start_loc, batch.context_lens)):
            model = MoEModel(config, b)
            outs.append(model._mla(0, model.layers[0], model.inputs(), 0).clone())
    finally:
        reset_workspace_manager()
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "batch,mode",
    [(TINY_PREFILL, "ht"), (TINY_DECODE, "ll"), (Batch((0, 50, 90), (7, 3)), "ht")],
    ids=["prefill-cut-requests", "decode", "prefill-with-context"],
)
def test_mla_shared_expert_and_dense_layers_match_serial_under_dbo(batch: Batch, mode: str) -> None:
    config = preset("tiny", **TINY_MLA, num_shared_experts=1, num_dense_layers=1, dense_inter=64)
    c = compare_serial_dbo("mla", config, batch, mode, RunOptions())
    assert c.outputs_match, c.max_abs_diff
    assert not c.dbo.races and not c.serial.races


# -- the reproduction table ----------------------------------------------------------------------


LL_EPS = (8, 16, 32, 64, 128, 256)  # DeepEP's whole low-latency table
RDMA_ROWS = tuple(
    f"deepep-normal-rdma-{k}-ep{ep}" for k in ("dispatch", "combine") for ep in (16, 32, 64)
)
SCALE_NORMAL_ROWS = (
    "scale-deepep-normal-nvlink-dispatch",
    "scale-deepep-normal-nvlink-combine",
    *(f"scale-{key}" for key in RDMA_ROWS),
)
EXPECTED_ROWS = {
    *(f"deepep-ll-{k}-ep{ep}" for k in ("dispatch", "combine") for ep in LL_EPS),
    "deepep-normal-nvlink-dispatch",
    "deepep-normal-nvlink-combine",
    *RDMA_ROWS,
    "sglang-prefill-8192",
    "sglang-prefill-16384",
    "sglang-decode-32",
    "sglang-decode-256",
    "vllm-eager-host-bound",
    "vllm-gain-vs-comm",
    # the same publications on the virtual EP group (every rank replayed)
    "scale-sglang-prefill-ep32",
    "scale-sglang-decode-ep72-32",
    "scale-sglang-decode-ep72-256",
    *(f"scale-deepep-ll-{k}-ep{ep}" for k in ("dispatch", "combine") for ep in LL_EPS),
    *SCALE_NORMAL_ROWS,
}
# Rows whose constant was read (even in part) off the figure they are scored against.
CALIBRATION_ROWS = {
    "deepep-ll-dispatch-ep8",  # ll_latency_us
    *(
        f"deepep-ll-{k}-ep{ep}" for k in ("dispatch", "combine") for ep in (64, 256)
    ),  # ll_rdma_efficiency
    "deepep-normal-nvlink-dispatch",  # nvlink_efficiency
    "deepep-normal-nvlink-combine",
    *RDMA_ROWS,  # rdma_efficiency
    # the scale rows keep the marks of the constants read off their figures
    "scale-deepep-ll-dispatch-ep8",
    *(f"scale-deepep-ll-{k}-ep{ep}" for k in ("dispatch", "combine") for ep in (64, 256)),
    *SCALE_NORMAL_ROWS,  # nvlink_efficiency, rdma_efficiency
}


@pytest.fixture(scope="module")
def quick_report() -> fidelity_run.FidelityReport:
    return fidelity_run.run_fidelity(quick=True)


def test_quick_reproduction_has_every_row(quick_report: fidelity_run.FidelityReport) -> None:
    rows = {r.key: r for r in quick_report.rows}
    assert set(rows) == EXPECTED_ROWS
    for r in quick_report.rows:
        assert math.isfinite(r.simulated), r
        assert r.assumptions in quick_report.assumptions and r.source
        if not r.met:
            assert r.note, f"{r.key} misses its target without saying why"
    missed = {k for k in EXPECTED_ROWS if "deepep" in k and not rows[k].hit}
    missed -= CALIBRATION_ROWS
    assert missed == {"deepep-ll-combine-ep128", "scale-deepep-ll-combine-ep128"}
    assert all("above the EP 256 one" in rows[k].note for k in missed)
    # the signs the published results have
    assert rows["sglang-prefill-8192"].simulated > 0 and rows["sglang-prefill-16384"].simulated > 0
    assert rows["sglang-decode-256"].simulated > 0
    assert rows["sglang-decode-32"].simulated < 0
    assert rows["vllm-gain-vs-comm"].met


def test_every_all_ranks_row_names_the_one_rank_row_of_its_figure(
    quick_report: fidelity_run.FidelityReport,
) -> None:
    rows = {r.key: r for r in quick_report.rows}
    for key, row in rows.items():
        if not key.startswith("scale-"):
            continue
        twin = rows[row.twin]
        assert (twin.published, twin.calibration) == (row.published, row.calibration), key
    pairs = quick_report.extra["all_ranks_vs_one_rank"]
    assert [p["key"] for p in pairs] == [k for k, r in rows.items() if r.twin and not r.calibration]
    assert all(p["no_worse"] == (abs(p["all_ranks"]) <= abs(p["one_rank"])) for p in pairs)


def test_calibration_rows_are_marked_and_never_counted_as_hits(
    quick_report: fidelity_run.FidelityReport,
) -> None:
    rows = {r.key: r for r in quick_report.rows}
    assert {k for k, r in rows.items() if r.calibration} == CALIBRATION_ROWS
    for key in CALIBRATION_ROWS:
        assert not rows[key].hit and rows[key].note.startswith("calibration")
    checked = [r for r in quick_report.rows if not r.calibration]
    counted = f"{sum(r.hit for r in checked)} of {len(checked)} checked figures"
    assert counted in fidelity_run.format_table(quick_report)


def test_table_prints_every_row_with_its_assumptions(
    quick_report: fidelity_run.FidelityReport,
) -> None:
    text = fidelity_run.format_table(quick_report)
    for r in quick_report.rows:
        assert r.what in text and r.published in text
    for key, assumptions in quick_report.assumptions.items():
        assert f"[{key}]" in text and "SMs" in assumptions


def test_cli_fidelity_quick_json(capsys) -> None:
    assert cli_main(["fidelity", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quick"] is True
    assert {r["key"] for r in report["rows"]} == EXPECTED_ROWS
    for r in report["rows"]:
        assert {
            "what",
            "published",
            "simulated",
            "delta",
            "target",
            "met",
            "assumptions",
            "source",
        } <= set(r)


def test_a_launch_bound_eager_step_is_host_bound_and_its_replay_is_not() -> None:
    """The vLLM observation's second effect on a step whose kernels are shorter than their
    launches: eager DBO decode is host-bound, the same step replayed as a graph is not."""
    config = check_cases(2)[1].config.with_(
        hidden=256, num_heads=4, head_dim=64, num_experts=8, top_k=2, moe_inter=128
    )
    batch = Batch.decode(16, 64)
    eager = simulate_step(config, batch, "ll", profile="h200", num_ubatches=2, graph=False)
    replayed = simulate_step(config, batch, "ll", profile="h200", num_ubatches=2, graph=True)
    assert eager.host_bound_fraction > 0.5 and eager.host_us == pytest.approx(eager.step_us)
    assert (
        replayed.host_bound_fraction < 0.1
        and replayed.host_us == SimDevice(SimOptions("h200")).profile.graph_launch_us
    )
    assert replayed.step_us < eager.step_us / 2
    assert replayed.num_ops == eager.num_ops  # the same kernels, without their launches


def test_quick_report_shows_graphs_removing_the_eager_host_bound_time(
    quick_report: fidelity_run.FidelityReport,
) -> None:
    eager, replayed = quick_report.extra["eager"], quick_report.extra["replayed"]
    assert eager["host_bound_fraction"] > 0.1 > replayed["host_bound_fraction"]
    assert replayed["step_us"] < eager["step_us"]


# -- the GPU check's CPU half ----------------------------------------------------------------------


def test_gpu_check_sim_half_and_report(tmp_path, capsys) -> None:
    out = tmp_path / "gpu_check.json"
    assert (
        cli_main(["gpu-check", "--sim-only", "--layers", "2", "--reps", "2", "--out", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    assert [c["case"] for c in report["cases"]] == ["prefill", "decode"]
    for case in report["cases"]:
        assert set(case["timings"]) == set(gpu_check_run.VARIANTS)
        for timing in case["timings"].values():
            assert timing["sim_us"] > 0 and timing["gpu_us"] == [] and timing["error"] is None
        assert case["gains_pct"]["dbo_vs_serial_eager"]["sim"] is not None
    text = capsys.readouterr().out
    assert "sim ms" in text and "dbo-graph" in text


def test_gpu_check_configs_and_arguments() -> None:
    prefill, decode = check_cases(8)
    assert prefill.config.tensor_device == "cuda" and prefill.config.dtype == torch.bfloat16
    assert (
        prefill.config.ep_size == 1 and prefill.batch.num_tokens == 4096 and decode.batch.is_decode
    )
    args = build_parser().parse_args(
        ["gpu-check", "--reps", "5", "--only", "decode", "--out", "x.json"]
    )
    assert (args.reps, args.only, args.out, args.sim_only) == (5, "decode", "x.json", False)
    assert cli_main(["gpu-check", "--reps", "0", "--sim-only"]) == 2


@pytest.mark.parametrize("mode", ["ht", "ll"])
def test_gpu_check_measurement_sequence_runs_on_the_simulated_device(mode: str) -> None:
    """The GPU half up to its CUDA calls: warm-up, lock, eager timing, capture of the serial
    step on a side stream and of the ubatched step through run_ubatches, replays."""
    batch = TINY_PREFILL if mode == "ht" else TINY_DECODE
    case = CheckCase(mode, preset("tiny"), batch, mode)
    d = SimDevice(SimOptions("h200"))
    timings = gpu_check_run.measure_case(
        case, reps=2, warmup=1, device=d, timer=gpu_check_run.virtual_timer(d)
    )
    assert set(timings) == set(gpu_check_run.VARIANTS)
    for variant, t in timings.items():
        assert t.error is None and len(t.gpu_us) == 2 and min(t.gpu_us) > 0, (variant, t)
    # a tiny step is launch bound on the simulated host: a replay (no launches, no handoffs)
    # is faster than the same step run eagerly
    assert timings["serial-graph"].gpu_median_us < timings["serial-eager"].gpu_median_us
    assert timings["dbo-graph"].gpu_median_us < timings["dbo-eager"].gpu_median_us
    assert d.races == []


def test_gpu_check_reports_the_simulated_host_time_and_says_when_it_stays_ahead(
    tmp_path, capsys
) -> None:
    out = tmp_path / "gpu_check.json"
    assert (
        cli_main(
            ["gpu-check", "--sim-only", "--layers", "1", "--only", "decode", "--out", str(out)]
        )
        == 0
    )
    timings = json.loads(out.read_text())["cases"][0]["timings"]
    for variant in ("serial-graph", "dbo-graph"):  # a replay costs the host one graph launch
        assert (
            timings[variant]["sim_host_us"] == SimDevice(SimOptions("h200")).profile.graph_launch_us
        )
    serial, ubatched = timings["serial-eager"], timings["dbo-eager"]
    # the serial step's host issues faster than the device runs: eager pays little over a
    # replay (the first ops' issue, exposed once in a one-layer step)
    assert serial["sim_host_us"] < serial["sim_us"] < 1.15 * timings["serial-graph"]["sim_us"]
    # two ubatch threads issue twice the ops plus the baton passes: the eager DBO step is
    # host-bound, and its replay is much shorter
    assert ubatched["sim_host_us"] == pytest.approx(ubatched["sim_us"], rel=0.01)
    assert ubatched["sim_us"] > 1.2 * timings["dbo-graph"]["sim_us"]
    assert "simulated host stays ahead of the device" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the check would run")
def test_gpu_check_says_no_gpu_and_exits_2(capsys, tmp_path) -> None:
    assert cli_main(["gpu-check", "--out", str(tmp_path / "x.json")]) == 2
    assert "no CUDA GPU present" in capsys.readouterr().err  # on stderr, as calibrate_host says it
    assert not (tmp_path / "x.json").exists()


def _stored_run(tmp_path, layers: int, scale: float = 1.0):
    """The shipped H200 report, relabelled to `layers` and its times scaled."""
    report = json.loads(gpu_check_run.H200_REFERENCE.read_text())
    for case in report["cases"]:
        case["config"]["num_layers"] = layers
        for timing in case["timings"].values():
            timing["gpu_us"] = [t * scale for t in timing["gpu_us"]]
    path = tmp_path / "stored.json"
    path.write_text(json.dumps(report))
    return path


def test_gpu_check_scores_the_simulation_against_a_stored_run(tmp_path, capsys) -> None:
    stored = _stored_run(tmp_path, 1, scale=1 / 8)  # one layer of the measured eight
    out = tmp_path / "gpu_check.json"
    assert (
        cli_main(
            [
                "gpu-check",
                "--sim-only",
                "--layers",
                "1",
                "--only",
                "decode",
                "--against",
                str(stored),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    (case,) = json.loads(out.read_text())["cases"]
    checks = {v["check"]: v for v in case["validation"]}
    assert set(checks) >= {f"{v} time" for v in gpu_check_run.VARIANTS}
    assert "dbo vs serial graph sign" in checks  # the measured decode loss exceeds 3%
    assert all(t["sim_fallback_fraction"] == 0.0 for t in case["timings"].values())  # all measured
    text = capsys.readouterr().out
    assert "stored: stored.json, not rerun" in text and "target within 15%" in text


def test_gpu_check_refuses_a_stored_run_of_another_size(tmp_path, capsys) -> None:
    stored = _stored_run(tmp_path, 8)
    assert (
        cli_main(
            [
                "gpu-check",
                "--sim-only",
                "--layers",
                "2",
                "--against",
                str(stored),
                "--out",
                str(tmp_path / "x.json"),
            ]
        )
        == 2
    )
    assert "measured with 8 layers" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
