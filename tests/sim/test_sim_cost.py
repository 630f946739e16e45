"""Cost model: roofline per op, comm time, SM sharing, and how interception places ops."""

from __future__ import annotations

import resource
import threading
from dataclasses import replace

import pytest
import torch

from dbo.sim import COMM, COMPUTE, H200, H800, SYNC, SimDevice, comm_time_us, compute_time_us
from dbo.sim.cost import algo_factor, comm_link
from dbo.sim.options import SimOptions
from dbo.sim.state import PlannedOp

# 1 PFLOP/s bf16 (1e9 FLOP/us), 1 TB/s HBM (1e6 B/us), 100 SMs, efficiencies 1: exact numbers.
ROUND = replace(
    H200,
    name="round",
    num_sms=100,
    peak_tflops={"fp32": 500.0, "bf16": 1000.0, "fp8": 2000.0},
    hbm_gbps=1000.0,
    nvlink_total_gbps=200.0,  # 100 GB/s one way = 1e5 B/us
    rdma_gbps=10.0,  # 1e4 B/us
    compute_efficiency=1.0,
    compute_efficiency_fp8=1.0,
    memory_efficiency=1.0,
    memory_efficiency_fp8=1.0,
    launch_us=1.0,
    kernel_fixed_us=2.0,
    handoff_us=10.0,
    nvlink_latency_us=3.0,
    rdma_latency_us=7.0,
    ll_send_us=1.0,
    ll_latency_us=4.0,
    nvlink_efficiency=1.0,  # the real profiles carry DeepEP-measured efficiencies; pin them
    rdma_efficiency=1.0,
    ll_rdma_efficiency=1.0,
    comm_sms=50,
    kernel_table=None,  # the roofline itself, not the H200's measured kernels
    host_op_scale={},
)


def placed(device: SimDevice) -> list:
    return [r for r in device.timeline if r.kind in (COMPUTE, COMM)]


def test_mm_roofline_compute_bound_on_meta() -> None:
    d = SimDevice(SimOptions(ROUND, tensor_device="meta"))
    m, k, n = 4096, 4096, 4096
    a = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    b = torch.empty(k, n, dtype=torch.bfloat16, device="meta")
    with d.thread_scope(None):
        c = a @ b
    assert c.device.type == "meta"
    (op,) = placed(d)
    assert op.name == "aten::mm" and op.flops == 2 * m * n * k
    nbytes = (m * k + k * n + m * n) * 2
    assert op.bytes == nbytes
    expected = max(2 * m * n * k / 1e9, nbytes / 1e6) + 2.0
    assert op.dur_us == pytest.approx(expected)
    assert expected == pytest.approx(2 * m * n * k / 1e9 + 2.0)  # compute bound indeed


def test_fp8_peak_is_twice_bf16() -> None:
    flops = 1e12
    bf16 = compute_time_us(ROUND, flops, 0, torch.bfloat16) - ROUND.kernel_fixed_us
    fp8 = compute_time_us(ROUND, flops, 0, torch.float8_e4m3fn) - ROUND.kernel_fixed_us
    assert bf16 == pytest.approx(1000.0) and fp8 == pytest.approx(500.0)


def test_elementwise_is_memory_bound() -> None:
    d = SimDevice(SimOptions(ROUND))
    x = torch.ones(1000, 250)  # 1e6 bytes of fp32
    with d.thread_scope(None):
        y = x + x
    (op,) = placed(d)
    assert op.flops == 0 and op.bytes == 3_000_000
    assert op.dur_us == pytest.approx(3.0 + 2.0)
    assert torch.equal(y, torch.full((1000, 250), 2.0))  # real values on cpu


def test_views_and_metadata_are_free() -> None:
    d = SimDevice(SimOptions(ROUND))
    x = torch.randn(4, 6)
    with d.thread_scope(0):
        v = x.view(6, 4).t().transpose(0, 1).detach()
        v = v.expand(2, 6, 4)[1, 2:4].select(0, 1).reshape(4)
        x.size(), x.stride(), x.shape, x.numel()
        list(x.split(2))
        x.unsqueeze(0).squeeze(0).narrow(0, 1, 2)
    assert placed(d) == [] and d.host_time_us == 0.0


@pytest.mark.timeout(30)
def test_ops_attributed_to_thread_ubatch_and_stream() -> None:
    d = SimDevice(SimOptions(ROUND))
    streams = [d.Stream("compute"), d.Stream("comm")]
    x = torch.randn(8, 8)

    def work(i: int) -> None:
        with d.thread_scope(i):
            d.set_stream(streams[i])
            (x @ x).relu_()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
        t.join()
    assert [(r.name, r.ubatch, r.stream) for r in placed(d)] == [
        ("aten::mm", 0, "compute"),
        ("aten::relu_", 0, "compute"),
        ("aten::mm", 1, "comm"),
        ("aten::relu_", 1, "comm"),
    ]
    x + x  # outside any thread_scope: not placed
    assert len(placed(d)) == 4


def test_host_reads_sync_to_current_stream() -> None:
    d = SimDevice(SimOptions(ROUND))
    s = d.Stream("compute")
    x = torch.ones(1000, 250)
    reads = [
        lambda t: t.tolist(),
        lambda t: t.cpu(),
        lambda t: t.numpy(),
        lambda t: t.sum().item(),
        lambda t: t.to("cpu"),
        lambda t: bool(t.sum() > 0),
    ]
    for read in reads:
        d.reset()
        with d.thread_scope(None):
            d.set_stream(s)
            y = x * 2
            read(y)
        syncs = [r for r in d.timeline if r.kind == SYNC]
        # the host waited exactly until the stream's work issued before the read was done
        assert syncs and syncs[-1].end_us == max(
            r.end_us for r in placed(d) if r.seq < syncs[-1].seq
        )
        assert d.host_time_us >= placed(d)[0].end_us


def test_comm_time_formula() -> None:
    nb = 1_000_000
    assert comm_time_us(ROUND, "dispatch", nb, 8) == pytest.approx(3.0 + nb / 1e5)
    # ll pays its own fixed time; EP 16 over 2 nodes: 7 of 15 peers on NVLink, 8 over RDMA,
    # the links in parallel (RDMA is the slower here)
    assert comm_time_us(ROUND, "combine", nb, 16, "ll") == pytest.approx(4.0 + nb * 8 / 15 / 1e4)
    assert comm_time_us(ROUND, "combine", nb, 16, rdma_bytes=nb / 4) == pytest.approx(
        7.0 + nb / 4 / 1e4
    )
    # an EP group of one: a local copy at the HBM roofline (1e6 B/us) plus the kernel time
    assert comm_time_us(ROUND, "dispatch", nb, 1) == pytest.approx(nb / 1e6 + 2.0)
    assert comm_time_us(ROUND, "dispatch", nb, 2, link="rdma") == pytest.approx(7.0 + nb / 1e4)
    assert comm_time_us(ROUND, "all_reduce", nb, 4) == pytest.approx(3.0 + 1.5 * nb / 1e5)
    assert algo_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert comm_link(H800, 8) == "nvlink" and comm_link(H800, 9) == "rdma"
    # H800 NVLink: 400 GB/s total, 200 GB/s one way, at DeepEP's measured efficiency
    assert comm_time_us(H800, "dispatch", 200_000, 8) == pytest.approx(
        H800.nvlink_latency_us + 1.0 / H800.nvlink_efficiency
    )
    with pytest.raises(ValueError, match="mode"):
        comm_time_us(ROUND, "dispatch", nb, 8, "fast")
    with pytest.raises(ValueError, match="link"):
        comm_time_us(ROUND, "dispatch", nb, 8, link="pcie")


def test_ht_comm_region_is_one_op_and_slows_overlapping_compute() -> None:
    d = SimDevice(SimOptions(ROUND))
    compute, comm = d.Stream("compute"), d.Stream("comm")
    x = torch.ones(1000, 250)  # add: 3e6 bytes -> 3 us + 2 fixed = 5 us alone
    with d.thread_scope(0):
        d.set_stream(comm)
        with d.comm_region("dispatch", nbytes=10_000_000, ep_size=8) as handle:
            recv = x.clone()  # the block's data movement: not costed itself
            recv.mul_(1.0)
        d.set_stream(compute)
        x + x
    c, a = placed(d)
    assert (c.name, c.kind, c.stream) == ("comm::dispatch", COMM, "comm")
    assert (c.start_us, c.end_us) == (1.0, 1.0 + 3.0 + 100.0)
    assert handle.event.time_us == c.end_us and c.args["sm_share"] == 0.5
    # compute overlapping the comm kernel runs on half the SMs: twice as long
    assert a.start_us == 2.0 and a.dur_us == pytest.approx(10.0)
    assert a.args["sm_slowdown_us"] == pytest.approx(5.0)


def test_partial_overlap_slows_only_overlapping_part() -> None:
    d = SimDevice(SimOptions(ROUND))
    s1, s2 = d.Stream("compute"), d.Stream("comm")
    d.place_op(PlannedOp("comm", 4.0, kind=COMM, track=s2.track, sm_share=0.5))  # [1, 5)
    op = d.place_op(
        PlannedOp("mm", 10.0, track=s1.track)
    )  # starts at 2: 3 us at half rate, then full
    assert op.start_us == 2.0 and op.end_us == pytest.approx(5.0 + (10.0 - 1.5))


def test_compute_issued_before_an_ht_comm_kernel_pays_its_sms_before_its_stream_s_next_op():
    # Under DBO the other ubatch's compute is issued before this ubatch's dispatch: the
    # dispatch still takes its SMs from it, charged where its stream goes on.
    d = SimDevice(SimOptions(ROUND))
    s1, s2 = d.Stream("compute"), d.Stream("comm")
    first = d.place_op(PlannedOp("mm", 10.0, track=s1.track))  # [1, 11)
    # [2, 6): 4 us on half the SMs
    d.place_op(PlannedOp("comm", 4.0, kind=COMM, track=s2.track, sm_share=0.5))
    after = d.place_op(PlannedOp("mm", 1.0, track=s1.track))
    assert (first.start_us, first.end_us) == (1.0, 11.0)  # its record stays as placed
    assert after.start_us == pytest.approx(15.0) and after.args["sm_taken_us"] == pytest.approx(4.0)


def test_ll_comm_region_uses_link_track() -> None:
    d = SimDevice(SimOptions(ROUND))
    compute = d.Stream("compute")
    x = torch.ones(10)
    with d.thread_scope(0):
        d.set_stream(compute)
        with d.comm_region("combine", nbytes=100_000, mode="ll", ep_size=8) as handle:
            x.clone()
        x + x
    send, transfer, add = placed(d)
    assert (send.name, send.stream, send.start_us, send.end_us) == (
        "comm::combine.send",
        "compute",
        1.0,
        2.0,
    )
    assert (transfer.stream, transfer.start_us, transfer.end_us) == ("link", 2.0, 2.0 + 4.0 + 1.0)
    assert handle.event.time_us == transfer.end_us
    assert add.start_us == 2.0 and "sm_slowdown_us" not in add.args  # ll holds no SMs


def test_comm_region_validates() -> None:
    d = SimDevice(SimOptions(ROUND))
    with pytest.raises(ValueError, match="mode"):
        with d.comm_region("dispatch", nbytes=1, mode="x"):
            pass
    with pytest.raises(ValueError, match="nbytes"):
        with d.comm_region("dispatch", nbytes=-1):
            pass
    with pytest.raises(RuntimeError, match="inside"):
        with d.comm_region("dispatch", nbytes=1):
            with d.comm_region("combine", nbytes=1):
                pass


@pytest.mark.timeout(60)
def test_deepseek_size_step_on_meta_is_fast_and_allocates_nothing() -> None:
    """61 layers, hidden 7168, 256 experts top-8 (EP 8: 32 local experts), 2 ubatches of
    256 tokens: hundreds of GB of logical tensors, none of it real."""
    d = SimDevice(SimOptions("h200", tensor_device="meta"))
    meta = dict(device="meta", dtype=torch.bfloat16)
    hidden, inter, experts, local, topk, tokens = 7168, 2048, 256, 32, 8, 256
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    compute, comm = d.Stream("compute"), d.Stream("comm")
    with d.thread_scope(0):
        d.set_stream(compute)
        for _layer in range(61):
            w_qkv = torch.empty(hidden, 3 * hidden, **meta)
            w_o = torch.empty(hidden, hidden, **meta)
            gate = torch.empty(hidden, experts, **meta)
            w_up = torch.empty(local, hidden, 2 * inter, **meta)
            w_down = torch.empty(local, inter, hidden, **meta)
            for _ub in range(2):
                x = torch.empty(tokens, hidden, **meta)
                qkv = x @ w_qkv
                q, k, v = qkv.split(hidden, dim=1)
                attn = torch.softmax(q @ k.t() / 8.0, dim=-1) @ v
                x = x + attn @ w_o
                scores = torch.softmax(x @ gate, dim=-1)
                _, ids = torch.topk(scores, topk, dim=-1)
                e = d.Event()
                e.record(compute)
                d.set_stream(comm)
                comm.wait_event(e)
                per_expert = tokens * topk // local
                with d.comm_region("dispatch", nbytes=tokens * topk * hidden, ep_size=8):
                    recv = x.new_empty(local, per_expert, hidden)
                d.set_stream(compute)
                h = torch.bmm(recv, w_up)
                h = torch.nn.functional.silu(h[..., :inter]) * h[..., inter:]
                out = torch.bmm(h, w_down)
                x = x + out.reshape(-1, hidden)[:tokens]
                assert x.device.type == "meta"
    ops = placed(d)
    total_bytes = sum(r.bytes for r in ops)
    assert len(ops) > 61 * 2 * 10 and total_bytes > 100e9
    assert all(r.flops > 0 for r in ops if r.name in ("aten::mm", "aten::bmm"))
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    assert (rss_after - rss_before) < 300 * 1024


def _cpu_allocation_sizes(fn) -> list[int]:
    """Bytes of every CPU allocation made by the calling thread while `fn` runs (the
    profiler's memory events: an op's own allocations, and "[memory]" outside any op)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    return [
        e.self_cpu_memory_usage if e.self_cpu_memory_usage > 0 else e.cpu_memory_usage
        for e in prof.events()
        if e.self_cpu_memory_usage > 0 or (e.name == "[memory]" and e.cpu_memory_usage > 0)
    ]


@pytest.mark.timeout(60)
def test_deepseek_v3_model_step_on_meta_allocates_no_tensor_memory() -> None:
    """The model's own forward (MLA, dense and MoE layers, FP8 linears, LL dispatch/combine)
    on the simulated device with meta tensors: gigabytes of placed traffic, and no CPU
    allocation larger than the 8-byte scalars torch wraps Python numbers in."""
    from dbo.devices import use_device
    from scenarios.model import Batch, MoEModel, preset
    from workspace import init_workspace_manager, reset_workspace_manager

    assert max(_cpu_allocation_sizes(lambda: torch.ones(1000) + 1)) >= 4000  # the probe works
    d = SimDevice(SimOptions("h200", tensor_device="meta"))
    model = MoEModel(preset("deepseek-v3", num_layers=5), Batch.decode(64, 128))
    x = model.inputs()
    reset_workspace_manager()
    init_workspace_manager("meta", 1)
    try:

        def forward() -> None:
            with use_device(d), d.thread_scope(None):
                model.forward(x, None, mode="ll")

        sizes = _cpu_allocation_sizes(forward)
    finally:
        reset_workspace_manager()
    assert sum(r.bytes for r in placed(d)) > 1e9
    assert max(sizes, default=0) <= 8, sorted(sizes)[-5:]
